"""The preprocess Ray Data job: raw videos + annotations -> WebDataset shards + a Parquet manifest.

    python -m preprocess.job --config cluster/configs/default.yaml --set data.video_root=... \
        --annotations train=/data/longvale_train.json --annotations test=/data/longvale_test.json \
        --out /data/shards            # or s3://bucket/prefix for any of these

Flow: annotations are read on the driver (bad records become error rows), each
video is matched to a file under the video root, and the videos to do are cut into
chunks. One Ray Data actor pool (`ActorPoolStrategy`) serves the whole job: each actor
builds its encoders once, and per chunk decodes + encodes its videos, validates each
sample against `pipeline.schema`, writes the ok samples as WebDataset tars under
`shards/<chunk>/` itself and returns one manifest row per video (ok or error, with the
reason); only those rows reach the driver, which commits each chunk as it finishes
(see `preprocess/manifest.py`), so a
re-run skips videos already `ok` for the same feature config and the same annotation
(its hash; edited captions, times or splits redo the video) and a killed run resumes
without duplicates.

`wrap_stage(stage, cls) -> cls`: the one hook into the job, called on the driver with
("preprocess", FeaturizeVideos) before Ray Data runs the class; it returns the class to run
(a subclass that observes it, e.g. the node-loss tests' in-flight markers). Default: as is.
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from typing import Any

import numpy as np
import ray

from pipeline import storage
from pipeline.cluster import featurize_gpus, init_ray, placement
from pipeline.config import Config, ConfigError, load_config, section_hash
from pipeline.schema import KEY, Event, encode
from preprocess import manifest as mf
from preprocess.annotations import VideoAnnotation, read_annotations


class FeaturizeVideos:
    """Ray Data actor: one chunk of videos in, its shards written, its manifest rows out.

    Heavy set-up (encoders, possibly on GPU) happens once in `__init__`, and the actor lives for
    the whole job (one pool, every chunk). `__call__` takes a batch of chunks, each
    {"chunk": name, "videos": JSON list of the plan's rows}, featurizes every video, writes the ok
    samples with `manifest.write_chunk_shards` under `shards/<chunk>/` and returns only manifest
    rows: sample bytes never travel to the driver. `featurize` is the per-video function a unit
    test can call on a plan row.
    """

    def __init__(self, cfg_json: str, out_dir: str):
        from preprocess.featurize import Featurizer

        self.cfg = Config.from_json(cfg_json)
        self.out_dir = out_dir
        self.featurizer = Featurizer(self.cfg)
        self.feature_hash = section_hash(self.cfg.features)

    def featurize(self, video: dict[str, Any], chunk: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """One plan row -> (its manifest row, its encoded sample or None when it failed)."""
        t0 = time.perf_counter()
        ann = VideoAnnotation(video_id=str(video["video_id"]), duration=float(video["duration"]),
                              events=[Event(**e) for e in json.loads(video["events"])], split=str(video["split"]),
                              source=str(video["source"]), clipped=int(video["clipped_events"]))
        row = mf.empty_row(video_id=ann.video_id, uri=str(video["uri"]), split=ann.split, source=ann.source,
                           feature_hash=self.feature_hash, chunk=chunk, annotation_hash=str(video["annotation_hash"]),
                           clipped_events=ann.clipped, num_events=len(ann.events), duration=ann.duration)
        try:
            sample = self.featurizer(row["uri"], ann)
            fields = encode(sample)
            row.update(status="ok", error="", key=fields[KEY], num_segments=sample.num_segments,
                       duration=float(sample.duration), num_events=len(sample.events))
        except Exception as e:  # every failure becomes an explained manifest row
            row.update(status="error", error=f"{type(e).__name__}: {e}")
            fields = None  # a sample encoded before a later failure is not kept
        row["seconds"] = time.perf_counter() - t0
        return row, fields

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {c: [] for c in mf.COLUMNS}
        for chunk, videos in zip(batch["chunk"], batch["videos"]):
            chunk = str(chunk)
            done = [self.featurize(v, chunk) for v in json.loads(videos)]
            ok = [(row["split"], fields) for row, fields in done if fields is not None]
            where = mf.write_chunk_shards(self.out_dir, chunk, ok, self.cfg.data.shard_target_bytes) if ok else {}
            for row, fields in done:
                if fields is not None:
                    row["shard"] = where[fields[KEY]]
                for c in mf.COLUMNS:
                    out[c].append(row[c])
        return out


def _resolve_videos(video_root: str, extensions: list[str]) -> dict[str, str]:
    """{video id: uri} for every video file under the root (id = file name without extension)."""
    found: dict[str, str] = {}
    for uri in storage.list_files(video_root, tuple(extensions)):
        name = uri.rsplit("/", 1)[-1]
        found.setdefault(name.rsplit(".", 1)[0], uri)
        found.setdefault(name, uri)
    return found


def _plan(cfg: Config, annotations: dict[str, tuple[str, str]], video_root: str, done_ok: dict[str, str], feature_hash: str):
    """Rows to featurize and error rows known before any decoding.

    done_ok: {video id: annotation hash} of the videos already ok with `feature_hash` (the
    config's features); one is redone when its annotation hash changed. Returns (rows to
    featurize, error rows, ids skipped as done, every video id the annotations name)."""
    videos = _resolve_videos(video_root, cfg.data.video_extensions)
    todo: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    named: set[str] = set()
    skipped: list[str] = []
    for split, (path, fmt) in sorted(annotations.items()):
        anns, bad = read_annotations(path, fmt, split)
        named.update(r.video_id for r in (*bad, *anns))
        error_row = partial(mf.empty_row, split=split, source=fmt, status="error", feature_hash=feature_hash, seconds=0.0)
        errors.extend(error_row(video_id=err.video_id, error=f"annotation: {err.reason}") for err in bad)
        for ann in anns:
            if ann.video_id in seen:
                errors.append(error_row(video_id=ann.video_id, error=mf.DUPLICATE_ID_ERROR))
                continue
            seen.add(ann.video_id)
            events = [asdict(e) for e in ann.events]
            ann_hash = mf.annotation_hash(split, fmt, ann.duration, events)
            if done_ok.get(ann.video_id) == ann_hash:
                skipped.append(ann.video_id)
                continue
            uri = videos.get(ann.video_id)
            if uri is None:
                errors.append(error_row(video_id=ann.video_id, error=f"media: no video file for this id under {video_root}",
                                        annotation_hash=ann_hash, num_events=len(ann.events), duration=ann.duration))
                continue
            todo.append({"video_id": ann.video_id, "uri": uri, "split": split, "source": fmt,
                         "duration": float(ann.duration), "clipped_events": int(ann.clipped),
                         "annotation_hash": ann_hash, "events": json.dumps(events, ensure_ascii=False)})
    return todo, errors, skipped, named


CHUNK_VIDEOS = 64


def chunk_size(todo: int, actors: int, most: int = CHUNK_VIDEOS) -> int:
    """Videos per chunk when none is asked for: at most `most`, and small enough that every actor
    gets about 4 chunks (a chunk is one actor's unit of work and one commit), so a short job
    still spreads evenly over the pool."""
    return max(1, min(most, -(-todo // (4 * max(1, actors)))))


StageWrapper = Callable[[str, type], type]  # (stage name, stage class) -> the class Ray Data runs (module doc)


def stage_as_is(stage: str, cls: type) -> type:
    """The default `wrap_stage` of this job and of offline captioning (infer/offline/job.py): the class itself."""
    return cls


def _featurized_chunks(cfg: Config, chunks: list[dict[str, Any]], out_dir: str, wrap_stage: StageWrapper = stage_as_is):
    """Featurize and write `chunks` ({"chunk", "videos"}) on one actor pool for the whole job ->
    an iterator over each finished chunk's manifest rows, in the order they finish."""
    actors = max(1, cfg.cluster.preprocess_actors)
    ds = ray.data.from_items(chunks, override_num_blocks=len(chunks))
    ds = ds.map_batches(
        wrap_stage("preprocess", FeaturizeVideos),
        fn_constructor_kwargs={"cfg_json": cfg.to_json(indent=None), "out_dir": out_dir},
        batch_size=1,
        compute=ray.data.ActorPoolStrategy(min_size=1, max_size=min(actors, len(chunks))),
        **placement(cfg.cluster, cfg.cluster.preprocess_cpus_per_actor, featurize_gpus(cfg)),
        runtime_env={"env_vars": storage.forwarded_env()},
    )
    for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
        by_chunk: dict[str, list[dict[str, Any]]] = {}
        for r in batch.to_pylist():
            by_chunk.setdefault(r["chunk"], []).append(r)
        yield from by_chunk.items()


def run_preprocess(cfg: Config, annotations: dict[str, tuple[str, str]], video_root: str, out_dir: str,
                   chunk_videos: int | None = None, max_chunks: int | None = None,
                   wrap_stage: StageWrapper = stage_as_is) -> dict[str, Any]:
    """The whole job. `annotations` maps split -> (path, format). Returns a summary dict.

    `chunk_videos`: videos per chunk (default `chunk_size`'s). `max_chunks` stops early (used to
    simulate a run killed midway in tests). `wrap_stage`: the module doc's hook.
    """
    t0 = time.perf_counter()
    feature_hash = section_hash(cfg.features)
    parts = mf.committed_parts(out_dir)
    removed = mf.remove_uncommitted(out_dir, set(parts))
    if removed:
        print(f"[preprocess] removed {len(removed)} uncommitted chunk(s) of an interrupted run: {removed}", flush=True)
    done_ok = mf.done_videos(parts, feature_hash)
    todo, early_errors, skipped, named = _plan(cfg, annotations, video_root, done_ok, feature_hash)
    print(f"[preprocess] {len(todo)} videos to process, {len(skipped)} already done, "
          f"{len(early_errors)} failed before decoding", flush=True)
    dropped = mf.removed_videos(parts, named)
    if dropped:
        shown = ", ".join(dropped[:5]) + (f" and {len(dropped) - 5} more" if len(dropped) > 5 else "")
        print(f"[preprocess] dropped {len(dropped)} videos no longer in the annotations from the manifest: {shown}",
              flush=True)

    run_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"
    if early_errors:
        mf.write_table(storage.join(mf.manifest_dir(out_dir), f"{run_id}-plan.parquet"), early_errors)
    size = chunk_videos or chunk_size(len(todo), cfg.cluster.preprocess_actors)
    chunks = [{"chunk": f"{run_id}-{i // size:05d}", "videos": json.dumps(todo[i:i + size])}
              for i in range(0, len(todo), size)]
    if max_chunks is not None:
        chunks = chunks[:max_chunks]
    for i, (name, result) in enumerate(_featurized_chunks(cfg, chunks, out_dir, wrap_stage) if chunks else ()):
        mf.write_table(storage.join(mf.manifest_dir(out_dir), f"{name}.parquet"), result)  # commit
        n_ok = sum(r["status"] == "ok" for r in result)
        print(f"[preprocess] chunk {i + 1}/{len(chunks)}: {n_ok} ok, {len(result) - n_ok} failed", flush=True)

    rows = mf.consolidate(out_dir, keep=named)
    storage.write_json(storage.join(out_dir, "config.json"), cfg.to_dict())
    n_ok = sum(r["status"] == "ok" for r in rows)
    n_err = len(rows) - n_ok
    print(f"[preprocess] {n_ok} ok, {n_err} failed; shards under {mf.shards_dir(out_dir)}, "
          f"manifest {mf.manifest_path(out_dir)}", flush=True)
    splits = {s: sum(1 for r in rows if r["status"] == "ok" and r["split"] == s) for s in sorted({r["split"] for r in rows})}
    return {"ok": n_ok, "failed": n_err, "dropped": len(dropped), "splits": splits, "manifest": mf.manifest_path(out_dir),
            "seconds": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--annotations", action="append", default=[], metavar="SPLIT=PATH",
                    help="annotation file per split (default: data.annotations of the config)")
    ap.add_argument("--format", default=None, help="annotation format (default: data.dataset)")
    ap.add_argument("--videos", default=None, help="video root (default: data.video_root)")
    ap.add_argument("--out", required=True, help="output dir or s3:// prefix")
    ap.add_argument("--chunk-videos", type=int, default=None,
                    help=f"videos per chunk (default: at most {CHUNK_VIDEOS}, about 4 chunks per actor)")
    args = ap.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    fmt = args.format or ("longvale" if cfg.data.dataset == "synthetic" else cfg.data.dataset)
    pairs = dict(a.split("=", 1) for a in args.annotations) or cfg.data.annotations
    if not pairs:
        raise SystemExit("no annotations: pass --annotations SPLIT=PATH or set data.annotations")
    video_root = args.videos or cfg.data.video_root
    if not video_root:
        raise SystemExit("no video root: pass --videos or set data.video_root")
    try:  # where the featurize actors go is checked before Ray starts
        featurize_gpus(cfg)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    init_ray(cfg)
    summary = run_preprocess(cfg, {s: (p, fmt) for s, p in pairs.items()}, video_root, args.out, args.chunk_videos)
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
