"""The preprocess Ray Data job: raw videos + annotations -> WebDataset shards + a Parquet manifest.

    python -m preprocess.job --config cluster/configs/default.yaml --set data.video_root=... \
        --annotations train=/data/longvale_train.json --annotations test=/data/longvale_test.json \
        --out /data/shards            # or s3://bucket/prefix for any of these

Flow: annotations are read on the driver (bad records become error rows), each
video is matched to a file under the video root, then Ray Data runs
decode + encode in an actor pool (`ActorPoolStrategy`, encoders built once per
actor), validates each sample against `pipeline.schema`, writes the ok samples
with `write_webdataset` and one manifest row per video (ok or error, with the
reason). Work is committed chunk by chunk (see `preprocess/manifest.py`), so a
re-run skips videos already `ok` for the same feature config and the same annotation
(its hash; edited captions, times or splits redo the video) and a killed run resumes
without duplicates.
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from dataclasses import asdict
from typing import Any

import numpy as np
import ray

from pipeline import faults, storage
from pipeline.cluster import init_ray, node_id, placement
from pipeline.config import Config, load_config, section_hash
from pipeline.schema import FIELDS, KEY, encode
from preprocess import manifest as mf
from preprocess.annotations import read_annotations

WEBDATASET_COLUMNS = [KEY, *FIELDS]


class FeaturizeVideos:
    """Ray Data actor: one row per video in, one row out with the encoded sample or the error.

    Heavy set-up (encoders, possibly on GPU) happens once in `__init__`;
    `__call__` is a pure batch -> batch function a unit test can call on a dict.
    """

    def __init__(self, cfg_json: str):
        from preprocess.featurize import Featurizer

        self.cfg = Config.from_json(cfg_json)
        self.featurizer = Featurizer(self.cfg)
        self.feature_hash = section_hash(self.cfg.features)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list[Any]]:
        from preprocess.annotations import VideoAnnotation
        from pipeline.schema import Event

        out: dict[str, list[Any]] = {c: [] for c in [*WEBDATASET_COLUMNS, *mf.COLUMNS]}
        for i in range(len(batch["video_id"])):
            t0 = time.perf_counter()
            ann = VideoAnnotation(
                video_id=str(batch["video_id"][i]),
                duration=float(batch["duration"][i]),
                events=[Event(**e) for e in json.loads(batch["events"][i])],
                split=str(batch["split"][i]),
                source=str(batch["source"][i]),
                clipped=int(batch["clipped_events"][i]),
            )
            row = mf.empty_row(video_id=ann.video_id, uri=str(batch["uri"][i]), split=ann.split,
                               source=ann.source, feature_hash=self.feature_hash, chunk=str(batch["chunk"][i]),
                               annotation_hash=str(batch["annotation_hash"][i]),
                               clipped_events=ann.clipped, num_events=len(ann.events), duration=ann.duration)
            fields: dict[str, Any] = {KEY: "", **{c: b"" for c in FIELDS}}  # typed empties for error rows
            try:
                with faults.in_flight("preprocess", [ann.video_id], node_id()):
                    sample = self.featurizer(row["uri"], ann)
                    fields = encode(sample)
                row.update(status="ok", error="", key=fields[KEY], num_segments=sample.num_segments,
                           duration=float(sample.duration), num_events=len(sample.events))
            except Exception as e:  # every failure becomes an explained manifest row
                row.update(status="error", error=f"{type(e).__name__}: {e}")
            row["seconds"] = time.perf_counter() - t0
            for c in WEBDATASET_COLUMNS:
                out[c].append(fields[c])
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


def _plan(cfg: Config, annotations: dict[str, tuple[str, str]], video_root: str, done_ok: dict[str, str]):
    """Rows to featurize and error rows known before any decoding.

    done_ok: {video id: annotation hash} of the videos already ok; one is redone when its
    annotation hash changed. Returns (rows to featurize, error rows, ids skipped as done,
    every video id the annotations name)."""
    videos = _resolve_videos(video_root, cfg.data.video_extensions)
    feature_hash = section_hash(cfg.features)
    todo: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    named: set[str] = set()
    skipped: list[str] = []
    for split, (path, fmt) in sorted(annotations.items()):
        anns, bad = read_annotations(path, fmt, split)
        named.update(err.video_id for err in bad)
        named.update(ann.video_id for ann in anns)
        for err in bad:
            errors.append(mf.empty_row(video_id=err.video_id, split=split, source=fmt, status="error",
                                       error=f"annotation: {err.reason}", feature_hash=feature_hash, seconds=0.0))
        for ann in anns:
            if ann.video_id in seen:
                errors.append(mf.empty_row(video_id=ann.video_id, split=split, source=fmt, status="error",
                                           error=mf.DUPLICATE_ID_ERROR, feature_hash=feature_hash, seconds=0.0))
                continue
            seen.add(ann.video_id)
            events = [asdict(e) for e in ann.events]
            ann_hash = mf.annotation_hash(split, fmt, ann.duration, events)
            if done_ok.get(ann.video_id) == ann_hash:
                skipped.append(ann.video_id)
                continue
            uri = videos.get(ann.video_id)
            if uri is None:
                errors.append(mf.empty_row(video_id=ann.video_id, split=split, source=fmt, status="error",
                                           error=f"media: no video file for this id under {video_root}",
                                           feature_hash=feature_hash, annotation_hash=ann_hash, num_events=len(ann.events),
                                           duration=ann.duration, seconds=0.0))
                continue
            todo.append({"video_id": ann.video_id, "uri": uri, "split": split, "source": fmt,
                         "duration": float(ann.duration), "clipped_events": int(ann.clipped),
                         "annotation_hash": ann_hash, "events": json.dumps(events, ensure_ascii=False)})
    return todo, errors, skipped, named


def _pyarrow_fs(path: str):
    """A pyarrow filesystem over our fsspec one, so Ray writes where storage.py reads."""
    from pyarrow.fs import FSSpecHandler, PyFileSystem

    fs, inner = storage.filesystem(path)
    return PyFileSystem(FSSpecHandler(fs)), inner


def _run_chunk(cfg: Config, rows: list[dict[str, Any]], chunk: str, out_dir: str) -> list[dict[str, Any]]:
    """Featurize one chunk on the actor pool, write its shards, return its manifest rows."""
    for r in rows:
        r["chunk"] = chunk
    ds = ray.data.from_items(rows, override_num_blocks=max(1, min(len(rows), 4 * cfg.cluster.preprocess_actors)))
    ds = ds.map_batches(
        FeaturizeVideos,
        fn_constructor_kwargs={"cfg_json": cfg.to_json(indent=None)},
        batch_size=1,
        compute=ray.data.ActorPoolStrategy(min_size=1, max_size=max(1, cfg.cluster.preprocess_actors)),
        **placement(cfg.cluster, cfg.cluster.preprocess_cpus_per_actor, 1.0 if cfg.features.device == "cuda" else 0.0),
        runtime_env={"env_vars": {**storage.forwarded_env(), **faults.forwarded_env()}},
    ).materialize()
    manifest_rows = ds.select_columns(list(mf.COLUMNS)).take_all()

    ok = ds.filter(expr="status == 'ok'")
    n_ok = sum(1 for r in manifest_rows if r["status"] == "ok")
    if n_ok:
        bytes_per_sample = max(1, ds.size_bytes() // max(1, len(manifest_rows)))
        rows_per_shard = max(1, cfg.data.shard_target_bytes // bytes_per_sample)
        for split in sorted({r["split"] for r in manifest_rows if r["status"] == "ok"}):
            target = storage.join(mf.shards_dir(out_dir), chunk, split)
            fs, inner = _pyarrow_fs(target)
            part = ok.filter(expr=f"split == {split!r}").select_columns(WEBDATASET_COLUMNS)
            part = part.repartition(max(1, -(-part.count() // rows_per_shard)))
            part.write_webdataset(inner, filesystem=fs, encoder=None, min_rows_per_file=1,
                                  ray_remote_args={"runtime_env": {"env_vars": storage.forwarded_env()}})
            proto = target.split("://", 1)[0] + "://" if storage.is_remote(target) else ""
            key_to_shard = {}
            for shard in storage.list_files(target, (".tar",)):
                for key in mf.shard_keys(shard):
                    key_to_shard[key] = shard if shard.startswith(proto) else proto + shard
            for r in manifest_rows:
                if r["status"] == "ok" and r["split"] == split:
                    r["shard"] = key_to_shard.get(r["key"])
                    if r["shard"] is None:
                        r.update(status="error", error="write: sample missing from the written shards")
    return manifest_rows


def run_preprocess(cfg: Config, annotations: dict[str, tuple[str, str]], video_root: str, out_dir: str,
                   chunk_videos: int = 64, max_chunks: int | None = None) -> dict[str, Any]:
    """The whole job. `annotations` maps split -> (path, format). Returns a summary dict.

    `max_chunks` stops early (used to simulate a run killed midway in tests).
    """
    t0 = time.perf_counter()
    feature_hash = section_hash(cfg.features)
    parts = mf.committed_parts(out_dir)
    removed = mf.remove_uncommitted(out_dir, set(parts))
    if removed:
        print(f"[preprocess] removed {len(removed)} uncommitted chunk(s) of an interrupted run: {removed}", flush=True)
    done_ok = mf.done_videos(parts, feature_hash)
    todo, early_errors, skipped, named = _plan(cfg, annotations, video_root, done_ok)
    print(f"[preprocess] {len(todo)} videos to process, {len(skipped)} already done, "
          f"{len(early_errors)} failed before decoding", flush=True)
    dropped = mf.removed_videos(parts, named)
    if dropped:
        shown = ", ".join(dropped[:5]) + (f" and {len(dropped) - 5} more" if len(dropped) > 5 else "")
        print(f"[preprocess] dropped {len(dropped)} videos no longer in the annotations from the manifest: {shown}",
              flush=True)

    chunks = [todo[i:i + chunk_videos] for i in range(0, len(todo), chunk_videos)]
    if early_errors:
        name = f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}-plan"
        mf.write_table(storage.join(mf.manifest_dir(out_dir), f"{name}.parquet"), early_errors)
    for i, rows in enumerate(chunks):
        if max_chunks is not None and i >= max_chunks:
            break
        name = f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"
        result = _run_chunk(cfg, rows, name, out_dir)
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
    ap.add_argument("--chunk-videos", type=int, default=64)
    args = ap.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    fmt = args.format or ("longvale" if cfg.data.dataset == "synthetic" else cfg.data.dataset)
    pairs = dict(a.split("=", 1) for a in args.annotations) or cfg.data.annotations
    if not pairs:
        raise SystemExit("no annotations: pass --annotations SPLIT=PATH or set data.annotations")
    video_root = args.videos or cfg.data.video_root
    if not video_root:
        raise SystemExit("no video root: pass --videos or set data.video_root")
    init_ray(cfg)
    summary = run_preprocess(cfg, {s: (p, fmt) for s, p in pairs.items()}, video_root, args.out, args.chunk_videos)
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
