"""The job driver: synth -> preprocess -> train -> caption -> evaluate.

    python -m pipeline.run                                   # embedded default, local Ray
    python -m pipeline.run --config cluster/configs/gpu-1.yaml --set train.max_steps=100
    python -m pipeline.run --stages preprocess,train --force
    ray job submit --working-dir . -- python -m pipeline.run --config ...

Every stage writes under one run directory (local or s3://) and leaves a stamp
`<stage>/_STAGE.json` with the hash of the config it depends on (its own
sections plus everything upstream) and a token naming that execution; a stage whose
stamp matches is skipped (`--force` redoes it). The upstream part of the hash carries
the upstream stage's token, so a redone stage (forced, or after a change) also redoes
every stage that read its outputs. A stage's stamp is removed before it runs: outputs
a failed run left half-written never pass for those of an earlier config. With
RAY_ADDRESS set (as under `ray job submit`) the Ray stages use that cluster, otherwise
a local instance.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline import storage
from pipeline.cluster import featurize_gpus, init_ray
from pipeline.config import Config, load_config

ROOT = Path(__file__).resolve().parents[1]

DEFAULT_CONFIG = ROOT / "cluster" / "configs" / "default.yaml"


@dataclass(frozen=True)
class RunPaths:
    """Where each stage reads and writes, under one run directory."""

    run_dir: str

    def stage_dir(self, stage: str) -> str:
        return storage.join(self.run_dir, stage)

    @property
    def synth(self) -> str:
        return self.stage_dir("synth")

    @property
    def shards(self) -> str:
        return self.stage_dir("preprocess")

    @property
    def train(self) -> str:
        return self.stage_dir("train")

    @property
    def model(self) -> str:
        return storage.join(self.train, "model")

    @property
    def captions(self) -> str:
        return self.stage_dir("caption")

    @property
    def eval(self) -> str:
        return self.stage_dir("evaluate")


@dataclass(frozen=True)
class Stage:
    """One step of the job: the config sections it depends on and what it runs."""

    name: str
    sections: tuple[str, ...]
    fn: Callable[[Config, RunPaths], dict[str, Any]]
    uses_ray: bool = False
    # versions of the code that shapes the outputs beyond the config (generator, encoders):
    # part of the hash, so outputs of an older version are redone
    code: Callable[[Config], dict[str, Any]] | None = None


# ----------------------------------------------------------------------------- stages


def stage_synth(cfg: Config, paths: RunPaths) -> dict[str, Any]:
    from preprocess.synthetic import generate_corpus

    if cfg.data.dataset != "synthetic":
        return {"skipped": f"dataset is {cfg.data.dataset}"}
    local = paths.synth
    if storage.is_remote(local):  # generate locally, then upload
        local = str(ROOT / "runs" / ".synth-cache")
    info = generate_corpus(local, cfg.data.synthetic)
    if local != paths.synth:
        storage.upload_dir(local, paths.synth)
    return {"videos": info.num_videos, "train": info.num_train, "test": info.num_test, "out": paths.synth}


def preprocess_inputs(cfg: Config, paths: RunPaths) -> tuple[dict[str, tuple[str, str]], str]:
    """(split -> (annotation file, format), video root) for the configured dataset."""
    if cfg.data.dataset == "synthetic":
        anns = {split: (storage.join(paths.synth, f"longvale_{split}.json"), "longvale") for split in ("train", "test")}
        return anns, cfg.data.video_root or storage.join(paths.synth, "videos")
    if not cfg.data.annotations or not cfg.data.video_root:
        raise SystemExit(f"dataset {cfg.data.dataset}: set data.annotations (split -> file) and data.video_root")
    return {s: (p, cfg.data.dataset) for s, p in cfg.data.annotations.items()}, cfg.data.video_root


def stage_preprocess(cfg: Config, paths: RunPaths) -> dict[str, Any]:
    from preprocess.job import run_preprocess

    annotations, video_root = preprocess_inputs(cfg, paths)
    summary = run_preprocess(cfg, annotations, video_root, paths.shards)
    summary.pop("seconds", None)
    return summary


def stage_train(cfg: Config, paths: RunPaths) -> dict[str, Any]:
    from pipeline.release.checkpoint import is_release_dir
    from train.trainer import run_train

    summary = run_train(cfg, paths.shards, paths.train)
    # The features the model was trained on travel with it (infer/ and serving read them); a fine-tuned
    # release model keeps its HF config.json and carries the run's config as run_config.json.
    name = "run_config.json" if is_release_dir(cfg.model.backbone) else "config.json"
    storage.write_json(storage.join(paths.model, name), cfg.to_dict())
    return summary


def _test_videos(paths: RunPaths) -> list[dict[str, str]]:
    from preprocess import manifest as mf

    rows = mf.read_table(mf.manifest_path(paths.shards))
    return [{"video_id": r["video_id"], "uri": r["uri"]} for r in rows if r["split"] == "test" and r["uri"]]


def _test_samples(paths: RunPaths, limit: int) -> list:
    """Up to `limit` decoded test samples from the preprocess shards (the manifest's current
    sample per video, by key)."""
    from preprocess import manifest as mf
    from train.data import read_samples

    rows = mf.read_table(mf.manifest_path(paths.shards))
    return read_samples(mf.current_keys(rows, "test"), limit=limit)


def stage_caption(cfg: Config, paths: RunPaths) -> dict[str, Any]:
    from infer.loading import load_model, release_dir
    from infer.offline.job import run_caption
    from infer.oracles.speedup import measure_speedup

    summary = run_caption(cfg, _test_videos(paths), paths.model, paths.captions)
    if "failure" in summary:  # per-video errors within infer.max_failed_fraction are not one
        raise SystemExit(f"caption: {summary['failure']}")
    samples = _test_samples(paths, limit=3)
    if samples and release_dir(paths.model) is not None:  # no single-chain decoder to race: not loaded here
        summary["decode_speedup_vs_monolithic"] = "n/a (release model)"
    elif samples:
        model, _, resolved = load_model(cfg, paths.model)
        speed = measure_speedup(model, samples, resolved.infer)
        storage.write_json(storage.join(paths.captions, "speedup.json"), speed)
        summary["decode_speedup_vs_monolithic"] = round(speed["speedup"], 2)
        summary["speedup_videos"] = speed["videos"]
    return summary


def reference_annotations(cfg: Config, paths: RunPaths) -> tuple[str, str]:
    """(test annotation file, its format) that the evaluate stage scores against."""
    anns, _ = preprocess_inputs(cfg, paths)
    if "test" not in anns:
        raise SystemExit(f"caption/evaluate: no `test` split in data.annotations (splits: {sorted(anns)}); "
                         "they caption and score the videos of the split named `test`")
    return anns["test"]


def stage_evaluate(cfg: Config, paths: RunPaths) -> dict[str, Any]:
    from pipeline.evaluate import evaluate_run

    ref, ref_format = reference_annotations(cfg, paths)
    return evaluate_run(cfg, paths.captions, ref, ref_format, paths.eval)


def _synth_code(cfg: Config) -> dict[str, Any]:
    from preprocess.synthetic import GENERATOR_VERSION

    return {"generator": GENERATOR_VERSION}


def _preprocess_code(cfg: Config) -> dict[str, Any]:
    from preprocess.encoders import encoder_versions

    return encoder_versions(cfg.features)


def _available_stages() -> list[Stage]:
    return [
        Stage("synth", ("data",), stage_synth, code=_synth_code),
        Stage("preprocess", ("data", "features"), stage_preprocess, uses_ray=True, code=_preprocess_code),
        Stage("train", ("model", "train"), stage_train, uses_ray=True),
        Stage("caption", ("infer",), stage_caption, uses_ray=True),
        Stage("evaluate", ("eval",), stage_evaluate),
    ]


STAGE_ORDER = ("synth", "preprocess", "train", "caption", "evaluate")


# ----------------------------------------------------------------------------- driver


def stage_hash(cfg: Config, stage: Stage, upstream: str) -> str:
    parts = {name: dataclasses.asdict(getattr(cfg, name)) for name in stage.sections}
    doc = {"up": upstream, "stage": stage.name, "cfg": parts}
    if stage.code is not None:
        doc["code"] = stage.code(cfg)
    blob = json.dumps(doc, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def output_id(stage_hash_: str, stamp: dict[str, Any] | None) -> str:
    """What the next stage's hash takes as `upstream`: the config hash, plus the token of the
    execution that made the outputs (stamps without one, from older versions, chain as before)."""
    token = (stamp or {}).get("token")
    if not token:
        return stage_hash_
    return hashlib.sha256(f"{stage_hash_}:{token}".encode()).hexdigest()[:16]


def run(cfg: Config, stages: list[str] | None = None, force: bool = False, console=None) -> dict[str, dict[str, Any]]:
    """Run the selected stages in order; returns {stage: summary}. `console`: a
    pipeline.console.QuietConsole that draws each stage's bar (None: plain prints only)."""
    paths = RunPaths(cfg.run_dir)
    available = {s.name: s for s in _available_stages()}
    wanted = [s for s in STAGE_ORDER if stages is None or s in stages]
    if stages:
        unknown = [s for s in stages if s not in STAGE_ORDER]
        if unknown:
            raise SystemExit(f"unknown stage(s) {unknown}; stages are {list(STAGE_ORDER)}")
    # settings only the last stages read fail here, not after hours of preprocess and train
    if "preprocess" in wanted or "caption" in wanted:
        featurize_gpus(cfg)  # where the featurize actors go (cluster.preprocess_gpus_per_actor)
    if "caption" in wanted or "evaluate" in wanted:
        reference_annotations(cfg, paths)  # they caption and score the `test` split
    if "evaluate" in wanted:
        from pipeline.evaluate import missing_policy

        missing_policy(cfg)
    storage.makedirs(cfg.run_dir)
    storage.write_json(storage.join(cfg.run_dir, "config.json"), cfg.to_dict())

    results: dict[str, dict[str, Any]] = {}
    upstream = ""
    for name in STAGE_ORDER:
        stage = available[name]
        h = stage_hash(cfg, stage, upstream)
        stamp = storage.join(paths.stage_dir(name), "_STAGE.json")
        done = storage.read_json(stamp) if storage.exists(stamp) else None
        if done is not None and done.get("hash") != h:
            done = None  # outputs of another config (or of older upstream outputs)
        if name not in wanted or (done is not None and not force):
            upstream = output_id(h, done)
            if name in wanted:
                results[name] = {**done["summary"], "seconds": done["seconds"], "cached": True}
                print(f"[run] {name}: outputs exist for this config, skipped (--force redoes it)", flush=True)
                if console is not None:
                    console.print(f"{name:<10} skipped: outputs exist for this config (--force redoes it)")
            continue
        if stage.uses_ray:
            init_ray(cfg)
        storage.remove(stamp)  # from here until the new stamp the outputs belong to no config
        print(f"[run] {name}: starting", flush=True)
        if console is not None:
            console.stage_start(name)
        t0 = time.perf_counter()
        try:
            summary = stage.fn(cfg, paths)
        except BaseException:
            if console is not None:
                console.stage_end("failed")
            raise
        seconds = time.perf_counter() - t0
        if console is not None:
            console.stage_end()
        done = {"stage": name, "hash": h, "token": uuid.uuid4().hex, "summary": summary, "seconds": seconds}
        storage.write_json(stamp, done)
        upstream = output_id(h, done)
        results[name] = {**summary, "seconds": seconds, "cached": False}
        print(f"[run] {name}: done in {seconds:.1f}s", flush=True)
    return results


def format_summary(results: dict[str, dict[str, Any]], run_dir: str) -> str:
    """What the driver prints at the end: a blank line, a row per stage, the run directory."""
    lines = ["", f"{'stage':<11} {'time':>8}  result", "-" * 72]
    for name, summary in results.items():
        secs = f"{summary.get('seconds', 0.0):7.1f}s" + ("*" if summary.get("cached") else " ")
        rest = ", ".join(f"{k}={v}" for k, v in summary.items() if k not in ("seconds", "cached", "table"))
        lines.append(f"{name:<11} {secs:>8}  {rest}")
        for row in summary.get("table", []):
            lines.append(f"{'':<21}{row}")
    lines += ["(* = skipped: outputs existed for the same config)", "", f"run directory: {run_dir}"]
    return "\n".join(lines)


def _run_quietly(cfg: Config, stages: list[str] | None, force: bool) -> None:
    """`run` with the quiet console: bars and the summary on the terminal, all else in the log."""
    import traceback

    from pipeline.console import QuietConsole

    def finish() -> None:
        # Ray forwards the workers' last lines until it shuts down: let them go to the log.
        import ray

        if ray.is_initialized():
            ray.shutdown()
        console.close()

    console = QuietConsole(cfg.run_dir, cfg.train.max_steps)
    console.print(f"log (Ray and the stages' own output): {console.log_path}")
    try:
        results = run(cfg, stages, force=force, console=console)
    except SystemExit:
        finish()
        raise
    except BaseException:
        traceback.print_exc()  # into the log; its last line also reaches the terminal
        time.sleep(0.2)
        console.print(f"the run failed: the whole traceback is in {console.log_path}")
        finish()
        raise SystemExit(1)
    console.print(format_summary(results, cfg.run_dir))
    finish()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(DEFAULT_CONFIG), help="YAML preset (default: the embedded default)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config value, e.g. --set train.max_steps=10 (repeatable)")
    ap.add_argument("--stages", default="", help=f"comma-separated subset of {','.join(STAGE_ORDER)}")
    ap.add_argument("--force", action="store_true", help="redo stages even when their outputs exist")
    ap.add_argument("--verbose", action="store_true",
                    help="show Ray's and the stages' own output live (default: one bar per stage, the rest in <run_dir>/logs/)")
    args = ap.parse_args(argv)

    cfg = load_config(args.config, args.overrides)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()] or None
    if args.verbose:
        results = run(cfg, stages, force=args.force)
        print(format_summary(results, cfg.run_dir))
    else:
        _run_quietly(cfg, stages, args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
