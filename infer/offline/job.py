"""Offline mass captioning of a video archive with Ray Data.

    python -m infer.offline.job --videos /data/archive            --model runs/default/train/model --out /data/captions
    python -m infer.offline.job --videos 's3://bucket/videos/*.mp4' --model DIR --out s3://bucket/captions
    python -m infer.offline.job --videos runs/default/preprocess/manifest.parquet --model DIR --out DIR

Ray Data lists the videos, decodes and encodes them in an actor pool
(`preprocess.featurize.Featurizer`; on CPUs, or with `features.device=cuda` on
`cluster.preprocess_gpus_per_actor` GPUs each: pipeline/cluster.py `featurize_gpus`), captions them in an engine actor pool
(`infer.engine.core.CaptionEngine`, `infer.videos_per_call` videos per call and several calls
per actor at once, all fed into the actor's one engine as it has room, so it does not drain
between batches: `CaptionVideos`; GPUs per actor from `cluster.caption_gpus_per_actor`; with
the release encoders in online mode the CPU actors run only the release's media preparation and
the engine actor encodes with its own model, see `engine_input`), and writes one row per video (id, uri,
duration, events, timings, model id, config hash) as JSONL and Parquet, plus an
error row with its reason (`error`) and kind (`error_kind`) for every video that failed.

Exit status (`main`, and `pipeline/run.py`'s caption stage through `judge`): 0 when every
failure is such a per-video row and they are at most `infer.max_failed_fraction` of the
videos (default 5%: one corrupt upload does not fail an archive run); 1 when more failed,
or when the engine raised on every video it was given (a broken model, not bad files); a
crashed actor pool raises out of `run_caption` as before. After a CUDA error the caption actor is
not reused: it exits, Ray restarts it and retries its calls; the videos that were in the engine are
retried alone, and a video in the engine at two device faults is an error row ("engine", saying so)
(`CaptionVideos`, infer/offline/strikes.py; the records live under `<out>/faults/<run>/` until the run ends).

Work is committed in chunks (`parts/<chunk>.parquet`, written last): every `chunk_videos` rows as
they come out of one Ray Data pipeline for the whole job (each actor loads its encoders or model
once per job, not once per chunk; a row's timings name the processes that featurized and captioned
it, `featurize_pid` / `caption_pid`). A re-run skips videos already captioned with the same model
and config, and a run killed midway and restarted ends with every video exactly once (infer/offline/results.py). `captions.jsonl` and
`captions.parquet` are the consolidation of all parts, for the videos listed this run.

`wrap_stage(stage, cls) -> cls`: the one hook into the job, called on the driver with
("caption-featurize", FeaturizeForCaption) and ("caption", CaptionVideos) before Ray Data runs
them; it returns the class to run (a subclass that observes it, e.g. the node-loss tests'
in-flight markers). Default: as is.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid
from typing import Any

import numpy as np
import ray

from infer.offline.results import OncePerVideo, consolidate, judge, parts_dir, read_parts, write_parquet
from infer.offline.strikes import DeviceStrikes, refusal
from infer.results import RESULT_COLUMNS, CaptionResult, caption_config_hash, video_ids
from pipeline import storage
from pipeline.cluster import featurize_gpus, init_ray, placement
from pipeline.config import Config, ConfigError, InferConfig, load_config
from pipeline.schema import FIELDS, KEY, decode, encode
from preprocess import manifest as mf
from preprocess.job import StageWrapper, stage_as_is

SAMPLE_COLUMNS = [KEY, *FIELDS]
RELEASE_INPUTS = "release_inputs"  # online release encoders: the media preparation's output (ReleaseInputs.to_bytes)


# ----------------------------------------------------------------------------- listing


def _listing_root(spec: str) -> str:
    """The folder a directory or glob listing lies under, spelled as the listed URIs are."""
    cut = min((spec.index(ch) for ch in "*?[" if ch in spec), default=len(spec))
    root = spec[:cut] if cut == len(spec) else spec[:cut].rsplit("/", 1)[0]
    if not storage.is_remote(root):
        root = os.path.abspath(root[len("file://"):] if root.startswith("file://") else root)
    return root.rstrip("/")


def list_videos(spec: str, extensions: list[str]) -> list[dict[str, str]]:
    """[{video_id, uri}] for a directory, a glob, an s3:// prefix or a preprocess manifest.

    The id is the file's stem; when that is taken, its file name; when that is taken too
    (the same name in several folders: cam1/0001.mp4, cam2/0001.mp4), its path under the
    listed folder, so every video keeps its own row. A directory or prefix that does not
    exist, or a glob that matches nothing, is a FileNotFoundError naming `spec`: a typo
    must not pass for an empty archive.
    """
    if spec.endswith(".parquet"):
        rows = mf.read_table(spec)
        return [{"video_id": r["video_id"], "uri": r["uri"] or ""} for r in rows]
    if any(ch in spec for ch in "*?["):
        fs, inner = storage.filesystem(spec)
        proto = spec.split("://", 1)[0] + "://" if storage.is_remote(spec) else ""
        uris = sorted(proto + p if proto and not p.startswith(proto) else p for p in fs.glob(inner))
        if not uris:
            raise FileNotFoundError(f"--videos {spec!r}: the pattern matches no files")
    else:
        if not storage.exists(spec):
            raise FileNotFoundError(f"--videos {spec!r}: no such directory or prefix")
        uris = storage.list_files(spec, tuple(extensions))
    root = _listing_root(spec)
    return [{"video_id": vid, "uri": uri} for vid, uri in zip(video_ids(uris, root), uris)]


# ----------------------------------------------------------------------------- Ray Data stages


class FeaturizeForCaption:
    """Featurize actor: uri -> encoded sample fields (or an error), encoders built once (module doc: where)."""

    def __init__(self, cfg_json: str):
        from preprocess.featurize import Featurizer

        self.featurizer = Featurizer(Config.from_json(cfg_json))
        self.pid = os.getpid()
        release = self.featurizer.release  # online release encoders: only the media preparation runs here
        self.front_end = release.inputs if release is not None and release.online else None

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list[Any]]:
        from preprocess.featurize import Unannotated

        rows = []
        for i in range(len(batch["video_id"])):
            vid, uri = str(batch["video_id"][i]), str(batch["uri"][i])
            t0 = time.perf_counter()
            fields: dict[str, Any] = {KEY: "", **{c: b"" for c in FIELDS}, RELEASE_INPUTS: b""}
            status, error = "ok", ""
            try:
                if not uri:
                    raise FileNotFoundError("no uri for this video")
                if self.front_end is not None:  # encoded by the caption actor's model (engine_input)
                    fields[RELEASE_INPUTS] = self.front_end(uri).to_bytes()
                else:
                    fields.update(encode(self.featurizer(uri, Unannotated(video_id=vid))))
            except Exception as e:  # explained, never fatal
                status, error = "error", f"{type(e).__name__}: {e}"
            rows.append({**fields, "video_id": vid, "uri": uri, "status": status, "error": error,
                         "seconds": time.perf_counter() - t0, "featurize_pid": self.pid})
        columns = ["video_id", "uri", "status", "error", "seconds", "featurize_pid", *SAMPLE_COLUMNS, RELEASE_INPUTS]
        return {c: [r[c] for r in rows] for c in columns}


def engine_input(fields: dict[str, Any], video_id: str):
    """One featurized row -> what the engine captions: a decoded Sample (a stored schema-2 sample of the
    release encoders too: the engine takes its tokens), or a ReleaseVideo of the release's media preparation output
    (online release encoders), which the engine encodes with its own model."""
    if fields.get(RELEASE_INPUTS):
        from preprocess.release_encoders import inputs_video
        from preprocess.release_media import ReleaseInputs

        return inputs_video(ReleaseInputs.from_bytes(fields[RELEASE_INPUTS]), video_id)
    return decode({c: fields[c] for c in SAMPLE_COLUMNS})


def featurizers_encode(cfg: Config) -> bool:
    """Whether the featurize actors run the encoders: not with the release encoders online, where they only
    prepare the media and the caption actor encodes (`FeaturizeForCaption`, `engine_input`)."""
    return not (cfg.features.visual_encoder == "release" and cfg.features.release_features == "online")


def caption_calls(infer: InferConfig) -> int:
    """Ray Data calls (batches) one caption actor runs at once: enough videos to fill its engine's slots and
    its encoder stage's look-ahead (2 x infer.max_batch_videos), plus one batch more, so the next videos are
    in the actor while the last ones of a batch decode."""
    return -(-2 * max(1, infer.max_batch_videos) // max(1, infer.videos_per_call)) + 1


class CaptionVideos:
    """Engine actor: decoded samples -> caption rows. The model is loaded and its engine built once per actor,
    in the constructor (on CUDA its graphs are captured there: infer/engine/graphs.py), before any batch.

    Ray Data runs several calls of an actor at once (`caption_calls`); every call's videos go into the
    actor's one engine through infer/serving/engine_loop.py's EngineBatcher, the loop the Serve replicas
    use: the engine takes new videos at each step boundary while it has room, so the videos of the next
    batch join while the last ones of the previous batch decode (no drain per batch). A video the engine
    raises on is retried alone (only it gets the error row). After a device fault (a CUDA error,
    infer/engine/faults.py) nothing more runs in this process: the videos in the engine get a strike
    (infer/offline/strikes.py) and the process exits, so Ray restarts the actor and retries its calls; a
    video with a strike is captioned alone, and one with two gets an error row."""

    def __init__(self, cfg_json: str, model_dir: str, faults_dir: str = ""):
        """faults_dir: the run's strike records (infer/offline/strikes.py); "" = none kept (a device fault still
        ends the process)."""
        from infer.loading import load_model
        from infer.oracles.ablation import caption_engine
        from infer.serving.engine_loop import EngineBatcher

        cfg = Config.from_json(cfg_json)
        model, card, cfg = load_model(cfg, model_dir)
        self.engine = caption_engine(model, cfg.infer)
        # what decoded the rows: the step's attention kernel, or HF's forward for the single chain
        self.kernel = self.engine.kernel.name if cfg.infer.decoder == "parallel" else "hf-forward (monolithic)"
        self.model_id = card.model_id
        self.config_hash = caption_config_hash(cfg)
        self.pid = os.getpid()
        # in the engine at once: its slots and its encoder stage's look-ahead (infer/engine/encoding.py)
        self.batcher = EngineBatcher(2 * max(1, cfg.infer.max_batch_videos))
        self.strikes = DeviceStrikes(faults_dir) if faults_dir else None
        self._submitted: dict[int, str] = {}  # id(sample) -> video id, for the videos a device fault held

    async def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list[Any]]:
        """One CaptionResult row per video of `batch`: the engine's captions, or the reason it gave none."""
        fields = {"model_id": self.model_id, "config_hash": self.config_hash}
        items = batch_items(batch, fields)
        todo = [item[0] for item in items if not isinstance(item, CaptionResult)]
        records = self.strikes.of(todo) if self.strikes is not None and todo else {}

        async def one(item: tuple[str, str, Any] | CaptionResult) -> CaptionResult:
            if isinstance(item, CaptionResult):  # failed before the engine
                return item
            return await self._caption(*item, records.get(item[0], {}), fields)

        results = await asyncio.gather(*(one(item) for item in items))
        for i, result in enumerate(results):
            if result.ok:  # captioned by the engine
                result.timings.update(featurize_s=float(batch["seconds"][i]), kernel=self.kernel, caption_pid=self.pid,
                                      featurize_pid=int(batch.get("featurize_pid", [0] * len(results))[i]))
        rows = [r.to_row() for r in results]
        return {c: [r[c] for r in rows] for c in RESULT_COLUMNS}

    async def _caption(self, video_id: str, uri: str, sample: Any, record: dict[str, Any],
                       fields: dict[str, Any]) -> CaptionResult:
        """One video through the actor's engine (the class doc): its result, or its error row."""
        refused = refusal(record)
        if refused is not None:
            return CaptionResult.failed(video_id, uri, "engine", refused, **fields)
        key = ENGINE_KEY if not record else ("alone", video_id)  # a video with a strike shares no run
        self._submitted[id(sample)] = video_id
        try:
            decoded = await self.batcher.submit(key, self.engine, sample)
        except Exception as e:  # noqa: BLE001 - the video's error row, or a restart after a device fault
            if self.batcher.fault is not None:
                self._restart()
            return CaptionResult.failed(video_id, uri, "engine", f"{type(e).__name__}: {e}", **fields)
        finally:
            self._submitted.pop(id(sample), None)
        return CaptionResult.from_decoded(decoded, video_id, uri, **fields)

    def _restart(self) -> None:
        """After a device fault: a strike for each video the failing run held, then the process exits (no
        clean-up: its CUDA context is poisoned) and Ray restarts the actor and retries its calls."""
        fault = self.batcher.fault
        held = [self._submitted[id(s)] for s in fault.samples if id(s) in self._submitted]
        print(f"[caption] device fault with {len(held)} video(s) in the engine ({fault.describe()}): "
              f"the actor exits and Ray restarts it", file=sys.stderr, flush=True)
        if self.strikes is not None:
            self.strikes.strike(held, fault.describe())
        os._exit(DEVICE_FAULT_EXIT)


ENGINE_KEY = "engine"  # the batcher key of the videos that share the engine's runs
DEVICE_FAULT_EXIT = 3  # the caption actor's exit status after a device fault


def batch_items(batch: dict[str, np.ndarray], fields: dict[str, Any]) -> list[tuple[str, str, Any] | CaptionResult]:
    """A featurized batch -> per video (video_id, uri, engine input), or its error row when it has no input
    (the featurize actor's error, or a row that does not decode)."""
    items: list[tuple[str, str, Any] | CaptionResult] = []
    for i in range(len(batch["video_id"])):
        video_id, uri = str(batch["video_id"][i]), str(batch["uri"][i])
        if str(batch["status"][i]) != "ok":  # the featurize actor's verdict
            items.append(CaptionResult.failed(video_id, uri, "input", str(batch["error"][i]), **fields))
            continue
        try:
            sample = engine_input({c: batch[c][i] for c in (*SAMPLE_COLUMNS, RELEASE_INPUTS) if c in batch}, video_id)
        except Exception as e:
            items.append(CaptionResult.failed(video_id, uri, "input", f"{type(e).__name__}: {e}", **fields))
        else:
            items.append((video_id, uri, sample))
    return items


def run_caption(cfg: Config, videos: str | list[dict[str, str]], model_dir: str, out: str,
                chunk_videos: int = 64, max_chunks: int | None = None,
                wrap_stage: StageWrapper = stage_as_is) -> dict[str, Any]:
    """Caption every listed video not yet captioned with this model+config. Returns a summary,
    with `judge`'s verdict in it (`failure` is set when the job failed). `wrap_stage`: the module doc's hook."""
    judge([], [], cfg.infer.max_failed_fraction, out)  # a threshold out of range fails before any work
    t_start = time.perf_counter()
    items = list_videos(videos, cfg.data.video_extensions) if isinstance(videos, str) else list(videos)
    from infer.loading import resolve_model

    model_id, resolved = resolve_model(cfg, model_dir)  # the features the model was trained on; no weights here
    config_hash = caption_config_hash(resolved)
    feature_gpus = featurize_gpus(resolved, featurizers_encode(resolved))
    done = {r["video_id"] for r in read_parts(out)
            if r["status"] == "ok" and r["model_id"] == model_id and r["config_hash"] == config_hash}
    todo = [v for v in items if v["video_id"] not in done]
    print(f"[caption] {len(items)} videos, {len(done)} already captioned with {model_id}, {len(todo)} to do", flush=True)
    env = {"env_vars": storage.forwarded_env()}
    chunk_videos = max(1, int(chunk_videos))
    once = OncePerVideo()  # video id -> the row committed (or about to be) for it this run
    run_id = uuid.uuid4().hex[:6]
    strikes = DeviceStrikes(storage.join(out, "faults", run_id))  # device faults of this run (CaptionVideos)
    if todo:  # one pipeline for the whole job: each actor loads its encoders / model once, not once per chunk
        block = max(1, min(chunk_videos, cfg.infer.videos_per_call))  # results stream back a block at a time
        ds = ray.data.from_items(todo, override_num_blocks=-(-len(todo) // block))
        cfg_json = resolved.to_json(indent=None)
        ds = ds.map_batches(wrap_stage("caption-featurize", FeaturizeForCaption), fn_constructor_kwargs={"cfg_json": cfg_json},
                            batch_size=1, runtime_env=env,
                            **placement(cfg.cluster, cfg.cluster.preprocess_cpus_per_actor, feature_gpus),
                            compute=ray.data.ActorPoolStrategy(min_size=1, max_size=max(1, cfg.cluster.preprocess_actors)))
        ds = ds.map_batches(wrap_stage("caption", CaptionVideos),
                            fn_constructor_kwargs={"cfg_json": cfg_json, "model_dir": model_dir, "faults_dir": strikes.root},
                            batch_size=max(1, cfg.infer.videos_per_call), runtime_env=env,
                            **placement(cfg.cluster, cfg.cluster.caption_cpus_per_actor, cfg.cluster.caption_gpus_per_actor),
                            compute=ray.data.ActorPoolStrategy(min_size=1, max_size=max(1, cfg.cluster.caption_actors),
                                                               max_concurrent_calls_per_actor=caption_calls(resolved.infer)))
        total, t0 = -(-len(todo) // chunk_videos), time.perf_counter()
        pending: list[dict[str, Any]] = []
        parts = 0

        def commit() -> None:  # every chunk_videos rows as they come back, and the last few
            nonlocal parts
            parts += 1  # names sort in commit order: a row that replaces an earlier part's is read last
            chunk = f"{time.strftime('%Y%m%dT%H%M%S')}-{run_id}-{parts:05d}"
            for r in pending:
                r["chunk"] = chunk
            write_parquet(storage.join(parts_dir(out), f"{chunk}.parquet"), pending)  # the commit
            ok = sum(r["status"] == "ok" for r in pending)
            print(f"[caption] chunk {parts}/{total}: {ok} done, {len(pending) - ok} failed, "
                  f"{60.0 * len(once.kept) / (time.perf_counter() - t0):.1f} videos/min", flush=True)
            pending.clear()

        results, stopped = iter(ds.iter_rows()), False
        for item in results:
            row = dict(item)
            verdict = once.take(row)
            if verdict == "dropped":
                continue
            if verdict == "replaces":  # an ok row after the video's error row: here, or in a later part
                pending[:] = [r for r in pending if r["video_id"] != row["video_id"]]
            pending.append(row)
            if len(pending) == chunk_videos:
                commit()
                if max_chunks is not None and parts >= max_chunks:
                    getattr(results, "close", lambda: None)()  # stop the pipeline; the rest is redone next run
                    stopped = True
                    break
        if pending:
            commit()
        if once.dropped:
            print(f"[caption] {once.dropped} duplicate row(s) of retried work dropped", flush=True)
        strikes.report()
        if not stopped:  # what came back is committed; a re-run redoes any video without a row
            once.check([v["video_id"] for v in todo])
    this_run = [{"status": r["status"], "error_kind": r.get("error_kind")} for r in once.kept.values()]
    n_ok = sum(r["status"] == "ok" for r in this_run)
    rows = consolidate(out, keep={v["video_id"] for v in items})
    total_ok = sum(r["status"] == "ok" for r in rows)
    seconds = time.perf_counter() - t_start
    print(f"[caption] {total_ok} captioned, {len(rows) - total_ok} failed; results in "
          f"{storage.join(out, 'captions.jsonl')} and captions.parquet", flush=True)
    verdict = judge(rows, this_run, cfg.infer.max_failed_fraction, out)
    if "failure" in verdict:
        print(f"[caption] the job failed: {verdict['failure']}", flush=True)
    return {"captioned": total_ok, **verdict, "this_run_ok": n_ok, "this_run_failed": len(this_run) - n_ok,
            "duplicates_dropped": once.dropped, "model_id": model_id, "out": out,
            "videos_per_min": 60.0 * len(this_run) / seconds if seconds else 0.0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--videos", required=True, help="dir | glob | s3://prefix | manifest.parquet")
    model = ap.add_mutually_exclusive_group(required=True)
    model.add_argument("--model", default=None, help="a trained model dir or a release checkpoint dir")
    model.add_argument("--random-model", action="store_true",
                       help="caption with a random tiny model (smoke test: captions are noise, rows say tiny-random)")
    ap.add_argument("--out", required=True, help="output dir or s3:// prefix")
    ap.add_argument("--config", default=None)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--chunk-videos", type=int, default=64)
    args = ap.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    from infer.loading import RANDOM_MODEL, resolve_model

    try:  # the model, the placement and the videos are checked before Ray starts
        _, resolved = resolve_model(cfg, RANDOM_MODEL if args.random_model else args.model)
        featurize_gpus(resolved, featurizers_encode(resolved))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:  # list first: a wrong --videos is reported before Ray starts
        videos = list_videos(args.videos, cfg.data.video_extensions)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    init_ray(cfg)  # the cluster section (address, num_cpus), as `pipeline/run.py` starts Ray
    summary = run_caption(cfg, videos, RANDOM_MODEL if args.random_model else args.model, args.out, args.chunk_videos)
    print(json.dumps(summary, indent=2))
    if "failure" in summary:
        print(f"error: {summary['failure']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
