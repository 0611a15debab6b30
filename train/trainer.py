"""The training stage on Ray Train: shards -> TorchTrainer(train_loop) -> model + learning curve.

    summary = run_train(cfg, shards_dir="runs/default/preprocess", out_dir="runs/default/train")
    python -m train.trainer --shards runs/default/preprocess --out runs/default/train [--set k=v ...]

Data: the manifest's current (shard, key) per video of `train.train_split` (a redone
video's older sample stays in its old tar) are sorted by key and cut into blocks of a fixed
row count on the driver (`block_plan`); Ray Data read tasks fetch each block's records
(raw bytes per field; local paths or s3://, AWS_* forwarded to the read tasks), which are
materialised once, in that order, and split across workers (`get_dataset_shard("train")`, locality off)
so every run on the same manifest gives each worker the same rows in the same order,
however Ray Data happened to write the shards; each worker shuffles its stream with a
seeded buffer per epoch and decodes/collates it with train/data.py. Held-out samples
(`train.val_split`) are read by every worker directly, the same way (current keys, sorted).

Ray Train: `TorchTrainer` with `ScalingConfig` from train.num_workers / use_gpu /
cpus_per_worker / gpus_per_worker, `RunConfig(storage_path=out_dir/ray)` (local or
s3://), `FailureConfig(max_failures)`, `CheckpointConfig(num_to_keep)`. The run is named
after a hash of the config sections training depends on and of the manifest rows it
reads, so re-running an interrupted run resumes its latest checkpoint, and changed
config or shards start fresh; a run that finished is started again from step 0. A worker that
dies is restarted by Ray Train from the latest checkpoint.

`on_step(ctx, step)`: the one hook into the workers (`run_train` / `build_trainer`), a picklable
callable that every rank calls after each optimizer step with its `RayContext` (rank, world size,
`last_checkpoint`); default none. The kill-restart tests pass one that kills or pauses a worker at
a step (tests/support/train_faults.py).

After training (driver): the final checkpoint's model/ -> `<out>/model` (loadable by
`PadCaptioner.from_pretrained`; a release fine-tune's checkpoints hold only the trained
tensors, so its merged release-format directory is written here, once: train/export.py), history.json + learning_curve.png (train/plots.py), and
the held-out evaluation (train/heldout.py) whose numbers are printed and returned.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import ray
import ray.train
import torch
from ray.train import Checkpoint, CheckpointConfig, DataConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer, get_device

from pipeline import storage
from pipeline.cluster import init_ray, train_resources
from pipeline.config import Config, load_config, section_hash
from pipeline.schema import FIELDS, KEY
from preprocess import manifest as mf
from preprocess.encoders import encoder_versions
from train import checkpoint as ckpt
from train.data import DataStats, read_keyed_records, read_samples, shuffle_buffer
from train.deepspeed_config import check_zero_stage
from train.evaluate import caption_parser
from train.export import export_model
from train.loop import LOSS_KEYS, resolve_backend, torch_threads, train_loop
from train.losses import check_attribute_weight

ROOT = Path(__file__).resolve().parents[1]

FORWARDED_ENV = ("DS_ACCELERATOR", "TORCH_EXTENSIONS_DIR", "PADCAP_CACHE", "XDG_CACHE_HOME", "OMP_WAIT_POLICY")
StepHook = Callable[["RayContext", int], None]  # (the rank's context, the step just taken): the module doc's hook


# --------------------------------------------------------------------------- worker side


class RayContext:
    """The loop's context inside a Ray Train worker. last_checkpoint: the directory name of the last
    checkpoint this rank reported (None before the first)."""

    def __init__(self, on_step: StepHook | None = None):
        c = ray.train.get_context()
        self.rank = c.get_world_rank()
        self.world_size = c.get_world_size()
        self.local_rank = c.get_local_rank()
        self.device = get_device()
        self._restored: tempfile.TemporaryDirectory | None = None
        self.last_checkpoint: str | None = None
        self._on_step = on_step

    def report(self, metrics: dict[str, Any], checkpoint_dir: str | None) -> None:
        if checkpoint_dir:
            self.last_checkpoint = f"checkpoint_{int(metrics['step']):07d}"
            ray.train.report(metrics, checkpoint=Checkpoint.from_directory(checkpoint_dir),
                             checkpoint_dir_name=self.last_checkpoint)
        else:
            ray.train.report(metrics)

    def latest_checkpoint(self) -> str | None:
        found = ray.train.get_checkpoint()
        if found is None:
            return None
        self._restored = tempfile.TemporaryDirectory(prefix="padcap-restore-")
        return found.to_directory(self._restored.name)

    def release_checkpoint(self) -> None:
        """Delete the local copy `latest_checkpoint` made, once loaded: a worker that is killed later (a
        crash, a preemption) runs no finalizer, and each restart would leave a checkpoint-sized copy in /tmp."""
        if self._restored is not None:
            self._restored.cleanup()
            self._restored = None

    def on_step(self, step: int) -> None:
        """The run's step hook (module doc), if it has one."""
        if self._on_step is not None:
            self._on_step(self, step)


class RayEpochs:
    """Epochs over this worker's Ray Data shard, shuffled by a seeded buffer per epoch."""

    def __init__(self, iterator, seed: int, buffer: int, rank: int):
        self.iterator, self.seed, self.buffer, self.rank = iterator, seed, buffer, rank

    def epoch(self, index: int):
        rng = random.Random((self.seed * 1_000_003 + index) * 1009 + self.rank)
        return shuffle_buffer(self.iterator.iter_rows(), self.buffer, rng)


def train_worker(config: dict[str, Any]) -> None:
    """train_loop_per_worker: everything a worker does."""
    cfg = Config.from_json(config["cfg"])
    ctx = RayContext(config.get("on_step"))
    # DeepSpeed reads the usual launcher variables; Ray Train's process group has them implicitly
    os.environ.setdefault("RANK", str(ctx.rank))
    os.environ.setdefault("WORLD_SIZE", str(ctx.world_size))
    os.environ.setdefault("LOCAL_RANK", str(ctx.local_rank))
    stats = DataStats()
    val = read_samples(config["val_keys"], limit=cfg.train.val_samples, stats=stats)
    if config["val_keys"] and not val:  # the periodic validation would be silently empty
        raise RuntimeError(f"no readable held-out sample for the periodic validation: {stats.as_dict()['skip_reasons']}")
    data = RayEpochs(ray.train.get_dataset_shard("train"), cfg.train.seed, cfg.train.shuffle_buffer, ctx.rank)
    train_loop(cfg, ctx, data, val, visual_dim=config["visual_dim"], audio_dim=config["audio_dim"],
               parse=caption_parser(cfg))


# --------------------------------------------------------------------------- driver side


def _pyarrow_fs(path: str):
    """(pyarrow filesystem or None, path for it): s3:// goes through our fsspec filesystem
    (so AWS_ENDPOINT_URL reaches it), carrying the driver's AWS credentials (the Ray Train
    controller that writes the checkpoints runs with the raylet's environment); local paths need none."""
    if not storage.is_remote(path):
        return None, os.path.abspath(path)
    from pyarrow.fs import FSSpecHandler, PyFileSystem

    fs, inner = storage.filesystem(path, carry_credentials=True)
    return PyFileSystem(FSSpecHandler(fs)), inner


def training_data_id(cfg: Config, rows: list[dict[str, Any]]) -> str:
    """Fingerprint of the manifest rows training reads (ok samples of the train and held-out
    splits): shards made again (preprocess forced, annotations changed) give another one."""
    used = [r for r in rows if r["status"] == "ok" and r["split"] in (cfg.train.train_split, cfg.train.val_split)]
    used.sort(key=lambda r: (r["split"] or "", r["video_id"] or ""))
    return section_hash(used)  # manifest columns are strings and numbers: JSON as they are


def train_run_name(cfg: Config, data_id: str = "") -> str:
    """The Ray Train run name: a hash of what the trained weights depend on (incl. the feature
    encoders' versions and `training_data_id` of the shards), so a run never resumes from
    checkpoints trained on other features or other shards."""
    parts = {k: dataclasses.asdict(getattr(cfg, k)) for k in ("data", "features", "model", "train")}
    return "padcap-" + section_hash({**parts, "encoders": encoder_versions(cfg.features), "shards": data_id})


FINISHED_FILE = "padcap_finished.json"


def mark_finished(ray_dir: str, name: str, info: dict[str, Any]) -> None:
    """Record that run `name` under `ray_dir` trained to the end (see `clear_finished_run`)."""
    storage.write_json(storage.join(ray_dir, name, FINISHED_FILE), info)


def clear_finished_run(ray_dir: str, name: str) -> bool:
    """Before fitting: Ray Train resumes a run of the same name from its latest checkpoint. That
    is wanted for a run that was cut short, but a finished run would "resume" at max_steps and
    train nothing, so training again (`--force`) removes it and starts fresh. True if removed."""
    run_dir = storage.join(ray_dir, name)
    if not storage.exists(storage.join(run_dir, FINISHED_FILE)):
        return False
    print(f"[train] {run_dir} finished before: training again from step 0", flush=True)
    storage.remove(run_dir, recursive=True)
    return True


ROWS_PER_BLOCK = 32  # training blocks hold this many rows (the last fewer): a layout fixed by the data alone


def block_plan(keys: dict[str, list[str]]) -> list[str]:
    """The training blocks, fixed by the manifest's current keys alone: every (shard, key) sorted by
    key and cut every ROWS_PER_BLOCK rows; each block as a JSON list of [shard, key]."""
    pairs = sorted((k, p) for p, ks in keys.items() for k in ks)
    return [json.dumps([[p, k] for k, p in pairs[i:i + ROWS_PER_BLOCK]]) for i in range(0, len(pairs), ROWS_PER_BLOCK)]


def _read_blocks(batch: pa.Table) -> pa.Table:
    """Ray Data: block plans -> their records (raw bytes per field), in the plan's order."""
    rows: list[dict[str, Any]] = []
    for plan in batch.column("plan").to_pylist():
        pairs = json.loads(plan)
        by_shard: dict[str, list[str]] = {}
        for path, key in pairs:
            by_shard.setdefault(path, []).append(key)
        found = {(path, key): rec for path, ks in by_shard.items() for key, rec in read_keyed_records(path, ks).items()}
        rows.extend(found[(path, key)] for path, key in pairs if (path, key) in found)
    columns = {KEY: pa.array([r[KEY] for r in rows], pa.string())}
    columns.update({f: pa.array([r.get(f) for r in rows], pa.binary()) for f in FIELDS})
    return pa.table(columns)


def read_train_dataset(keys: dict[str, list[str]]):
    """Ray Data: raw WebDataset records (bytes per field) of the manifest's current keys per
    shard (`preprocess.manifest.current_keys`), sorted by key in fixed-size blocks, materialised.

    One pass: the blocks are planned on the driver from the keys (`block_plan`), and each read
    task reads just its block's records from the tars (seeking over the rest), so the data is
    read once and materialised once, already in order (no sort, no repartition: those held
    the whole set in the object store twice)."""
    plan = block_plan(keys)
    ds = ray.data.from_items([{"plan": p} for p in plan], override_num_blocks=max(1, len(plan)))
    ds = ds.map_batches(_read_blocks, batch_size=1, batch_format="pyarrow", num_cpus=0.25,
                        runtime_env={"env_vars": storage.forwarded_env()})
    ds.context.execution_options.preserve_order = True  # blocks in plan order, whatever finishes first
    ds = ds.materialize()
    ds.context.enable_progress_bars = False  # no bar per epoch from the workers' split coordinator
    return ds


def _absolute(keys: dict[str, list[str]]) -> dict[str, list[str]]:
    """{shard: keys} with local shard paths made absolute (s3:// URIs as they are)."""
    return {(p if storage.is_remote(p) else os.path.abspath(p)): k for p, k in keys.items()}


def worker_env(cfg: Config) -> dict[str, str]:
    """The environment variables of each training worker: the storage credentials and FORWARDED_ENV as the
    driver has them, DeepSpeed's on that backend, OMP_NUM_THREADS = the worker's torch threads, and
    OMP_WAIT_POLICY=PASSIVE when those threads outnumber its CPUs (a value set on the driver wins)."""
    env = {**storage.forwarded_env(), **{k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}}
    if resolve_backend(cfg.train, cfg.train.use_gpu) == "deepspeed":
        if not cfg.train.use_gpu:
            env.setdefault("DS_ACCELERATOR", "cpu")
        env.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/torch_extensions"))
    threads = torch_threads(cfg.train)
    env.setdefault("OMP_NUM_THREADS", str(threads))
    if threads > cfg.train.cpus_per_worker:
        # more threads than the CPUs Ray reserves for the worker: OpenMP threads that spin while they wait
        # take cores from the other workers (2 workers x 2 threads on 2 cores trained 3.9x slower);
        # sleeping instead splits the work the same way, so every sum is the same (docs/benchmarks.md)
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")  # the loop prints once per line, not twice
    return env


def build_trainer(cfg: Config, shards_dir: str, out_dir: str, name: str | None = None,
                  rows: list[dict[str, Any]] | None = None, on_step: StepHook | None = None) -> TorchTrainer:
    """The TorchTrainer of run `name` (default: `train_run_name` of the config and the shards);
    `rows`: the manifest of `shards_dir` when the caller has read it already; `on_step`: the module doc's hook."""
    tc = cfg.train
    if resolve_backend(tc, tc.use_gpu) == "deepspeed":
        check_zero_stage(tc)  # refused here, on the driver, not in every worker after start-up
    rows = mf.read_table(mf.manifest_path(shards_dir)) if rows is None else rows
    # absolute shard paths: a Ray Train worker runs in its own directory, not the driver's
    train_keys, val_keys = (_absolute(mf.current_keys(rows, split)) for split in (tc.train_split, tc.val_split))
    train_paths = list(train_keys)
    if not train_paths:
        raise SystemExit(f"no ok shards of split {tc.train_split!r} in {mf.manifest_path(shards_dir)}")
    probe = read_samples(train_paths[:1], limit=1)
    if not probe:
        raise SystemExit(f"{train_paths[0]}: no readable sample")
    dv, da = probe[0].visual.shape[-1], probe[0].audio.shape[-1]  # [T, V, D]; ragged audio (schema 2) is [A, D]
    use_gpu, resources, accelerator = train_resources(cfg.cluster, tc.cpus_per_worker, tc.gpus_per_worker, tc.use_gpu)
    ray_dir = storage.join(out_dir, "ray")
    fs, path = _pyarrow_fs(ray_dir)
    if fs is None:
        os.makedirs(path, exist_ok=True)
    return TorchTrainer(
        train_worker,
        train_loop_config={"cfg": cfg.to_json(indent=None), "val_keys": val_keys, "visual_dim": int(dv),
                           "audio_dim": int(da), "on_step": on_step},
        scaling_config=ScalingConfig(num_workers=tc.num_workers, use_gpu=use_gpu, resources_per_worker=resources,
                                     accelerator_type=accelerator),
        run_config=RunConfig(name=name or train_run_name(cfg, training_data_id(cfg, rows)), storage_path=path, storage_filesystem=fs,
                             failure_config=FailureConfig(max_failures=tc.max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=max(1, tc.keep_checkpoints)),
                             worker_runtime_env={"env_vars": worker_env(cfg)}),
        datasets={"train": read_train_dataset(train_keys)},
        dataset_config=DataConfig(enable_shard_locality=False),  # block -> worker by rows only: reproducible
    )


def _publish(local_dir: Path, dest: str) -> str:
    """Copy a local directory to `dest` (local or s3://), replacing what was there."""
    if storage.is_remote(dest):
        storage.upload_dir(str(local_dir), dest)
        return dest
    if os.path.exists(dest):
        shutil.rmtree(dest)
    shutil.copytree(local_dir, dest)
    return os.path.abspath(dest)


def heldout_table(heldout: dict[str, Any]) -> list[str]:
    """Rows for the driver's final table: the held-out numbers, both decoding modes."""
    rows = []
    for mode in ("free_running", "teacher_forced"):
        d = heldout.get(mode) or {}
        if "unavailable" in d:
            rows.append(f"held-out {mode}: unavailable ({d['unavailable']})")
        elif d:
            rows.append(f"held-out {mode} ({heldout.get('videos', 0)} videos): planning {d['planning_acc']:.2f}  "
                        f"F1@0.5 {d['grounding_f1@0.5']:.2f}  colour {d['colour_acc']:.2f}  shape {d['shape_acc']:.2f}  "
                        f"sound {d['sound_acc']:.2f}  motion {d['motion_acc']:.2f}")
    return rows


def run_train(cfg: Config, shards_dir: str, out_dir: str, on_step: StepHook | None = None) -> dict[str, Any]:
    """The `train` stage: train on Ray, publish the model, plot, evaluate held-out. -> summary.
    `on_step`: the module doc's hook."""
    from train.heldout import evaluate_heldout
    from train.plots import learning_curve

    check_attribute_weight(cfg)  # a config error before any worker starts
    t0 = time.perf_counter()
    storage.makedirs(out_dir)
    rows = mf.read_table(mf.manifest_path(shards_dir))
    name = train_run_name(cfg, training_data_id(cfg, rows))
    ray_dir = storage.join(out_dir, "ray")
    clear_finished_run(ray_dir, name)
    trainer = build_trainer(cfg, shards_dir, out_dir, name, rows, on_step)
    result = trainer.fit()
    if result.checkpoint is None:
        raise RuntimeError(f"training ended without a checkpoint ({result.error})")
    mark_finished(ray_dir, name, {"checkpoint": result.checkpoint.path})
    train_seconds = time.perf_counter() - t0
    with tempfile.TemporaryDirectory(prefix="padcap-final-") as tmp:
        local = Path(result.checkpoint.to_directory(os.path.join(tmp, "ckpt")))
        history = ckpt.read_history(local)
        state = torch.load(local / ckpt.STATE_FILE, map_location="cpu", weights_only=False)
        model_dir = local / ckpt.MODEL_DIR
        if not model_dir.is_dir():  # a checkpoint of trained tensors only (release fine-tune): merge once, now
            model_dir = export_model(local, Path(tmp) / "model")
        model_path = _publish(model_dir, storage.join(out_dir, "model"))
        plot_local = Path(tmp) / "learning_curve.png"
        learning_curve(history, plot_local, title=f"PadCaptioner training ({cfg.model.backbone}, mask={cfg.model.mask})")
        storage.write_bytes(storage.join(out_dir, "learning_curve.png"), plot_local.read_bytes())
        storage.write_json(storage.join(out_dir, "history.json"), history)
        heldout = evaluate_heldout(cfg, model_dir, mf.current_keys(rows, cfg.train.val_split))
    last = history[-1] if history else {}
    vals = [h for h in history if "val_grounding_f1@0.5" in h]
    val = {k[4:]: round(v, 4) for k, v in (vals[-1] if vals else {}).items() if k.startswith("val_")}
    details = {
        "steps": state["step"],
        "backend": resolve_backend(cfg.train, cfg.train.use_gpu),
        "workers": cfg.train.num_workers,
        "resumes": state.get("resumes", 0),
        "final_loss": {k: round(last.get(k, float("nan")), 4) for k in LOSS_KEYS},
        "val": val,
        "heldout": heldout,
        "train_seconds": round(train_seconds, 1),
        "seconds": round(time.perf_counter() - t0, 1),
        "data": state.get("data_stats", {}),
        "model": model_path,
        "plot": storage.join(out_dir, "learning_curve.png"),
        "checkpoint": result.checkpoint.path,
    }
    storage.write_json(storage.join(out_dir, "summary.json"), details)
    summary = {k: details[k] for k in ("steps", "backend", "workers", "train_seconds", "model", "plot")}
    summary.update({f"loss_{k}": v for k, v in details["final_loss"].items()})
    summary.update({f"val_{k}": val[k] for k in ("planning_acc", "grounding_f1@0.5", "token_acc", "attr_acc") if k in val})
    summary["heldout_mode"] = heldout.get("headline", "none")
    summary.update({f"heldout_{k}": heldout[k] for k in ("planning_acc", "grounding_f1@0.5", "colour_acc", "shape_acc",
                                                          "sound_acc", "attr_acc") if k in heldout})
    summary["table"] = heldout_table(heldout)
    summary["details"] = storage.join(out_dir, "summary.json")
    for row in summary["table"]:
        print(f"[train] {row}", flush=True)
    print(f"[train] model {model_path}; learning curve {summary['plot']}; details {summary['details']}", flush=True)
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "cluster/configs/default.yaml"))
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--shards", required=True, help="preprocess output dir (manifest.parquet + shards/)")
    ap.add_argument("--out", required=True, help="training output dir (local or s3://)")
    args = ap.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    init_ray(cfg)  # the driver's rule: RAY_ADDRESS / cluster.address, else a private local instance
    summary = run_train(cfg, args.shards, args.out)
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
