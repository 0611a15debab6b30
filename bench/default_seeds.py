"""A one-process stand-in for the default's training, per seed, with the learning probes.

    .venv/bin/python -m bench.default_seeds --seeds 0 1 --jobs 2 # -> bench/results/default_seeds_standin.json
    .venv/bin/python -m bench.default_seeds --seeds 0 --steps 800 --probe-every 50 --tag probe

Not the run users get: one rank carries the global batch of the default's 2 Ray Train workers,
so its numbers differ from the train stage's (on one box, seed 0: colour 0.86 here against 0.41 in
the stage). bench/default_study.py measures the stage itself; this script is for the probes below.

Reads the shards `make run` wrote (`--run-dir`, default runs/default: synth + preprocess are run
first when they are missing, `pipeline/run.py --stages synth,preprocess`). Each seed is the
train stage's loop (train/loop.py) in one process with one torch thread: the embedded default
config (cluster/configs/default.yaml, `--set` overrides on top), its steps, its training rows
in key order, and one rank taking the global batch of the default's 2 Ray Train workers
(num_workers x batch_size samples per step), seeded by `train.seed`. The held-out videos are
then decoded free-running by the parallel engine (bench/ablation_run.py) and scored with the
evaluate stage's metrics (pipeline.metrics, padcaptioner protocol: F1, CIDEr, ...).

Per seed, bench/attr_probe.py records every `--probe-every` steps the per-group gradient
norms, each branch token's attention mass on its own anchor, and the branch loss split into
attribute-word and grammar tokens; with the periodic teacher-forced validation they make the
learning curves in `<out>/default_seeds_standin<tag>.png`; `--linear-probe N` adds how linearly
readable each attribute still is in the anchors' aggregated features (probe_lin_*). Written: `<out>/default_seeds_standin<tag>.json` (`--name`: another stem)
with `seeds` ({seed: colour, shape, sound, motion, planning, f1, cider, ...}), the spread
(max - min) of each number and the targets of issue #27. Seeds run in `--jobs` processes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

KEYS = {"colour": "colour_acc", "shape": "shape_acc", "sound": "sound_acc", "motion": "motion_acc",
        "planning": "planning_acc", "f1": "grounding_f1@0.5"}
TARGETS = {"min_colour": 0.6, "min_shape": 0.6, "min_sound": 0.6, "min_cider": 2.0, "max_spread_attr": 0.15}
ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def default_config(seed: int, steps: int = 0, overrides: list[str] | None = None):
    """The embedded default with `train.seed`, one rank carrying the default's global batch."""
    from pipeline.config import load_config

    cfg = load_config(ROOT / "cluster/configs/default.yaml", list(overrides or []))
    tc = cfg.train
    tc.batch_size, tc.num_workers = tc.batch_size * tc.num_workers, 1
    tc.seed, tc.torch_threads = seed, 1
    if steps:
        tc.max_steps = steps
    return cfg


def ensure_shards(run_dir: Path) -> Path:
    shards = run_dir / "preprocess"
    if not (shards / "manifest.parquet").exists():
        cmd = [sys.executable, "-m", "pipeline.run", "--stages", "synth,preprocess", "--set", f"run_dir={run_dir}"]
        subprocess.run(cmd, check=True, cwd=str(ROOT))
    return shards


def load_data(shards: Path, cfg) -> tuple[list, list]:
    """(training records in key order, held-out samples in key order), as the train stage reads them."""
    from preprocess import manifest as mf
    from train.data import read_keyed_records, read_samples

    rows = mf.read_table(mf.manifest_path(str(shards)))
    train_keys = mf.current_keys(rows, cfg.train.train_split)
    found = {}
    for path, keys in train_keys.items():
        found.update(read_keyed_records(path, keys))
    return [found[k] for k in sorted(found)], read_samples(mf.current_keys(rows, cfg.train.val_split))


def run_seed(seed: int, args) -> dict:
    """One seed in this process -> the ablation-format record (with the probe's history)."""
    import torch

    from bench.ablation_run import run_variant
    from bench.attr_probe import AttributeProbe
    from train.evaluate import caption_parser

    torch.set_num_threads(1)
    cfg = default_config(seed, args.steps, args.set)
    data = load_data(Path(args.run_dir) / "preprocess", cfg)
    linear = None
    if args.linear_probe:
        from train.data import decode_record

        linear = ([decode_record(r) for r in data[0][:args.linear_probe]], data[1])
    probe = AttributeProbe(data[1], caption_parser(cfg), every=args.probe_every, linear=linear,
                           linear_layers=tuple(args.linear_probe_layers))
    out = Path(args.work) / f"seed{seed}{args.tag}"
    t0 = time.perf_counter()
    record = run_variant(cfg, None, out, data=data, probe=probe)
    record["wall_s"] = round(time.perf_counter() - t0, 1)
    (out / "run.json").write_text(json.dumps(record, indent=1))
    return record


def _child(seed: int, args, argv: list[str]) -> dict:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    log = work / f"seed{seed}{args.tag}.log"
    cmd = [sys.executable, "-m", "bench.default_seeds", *argv, "--one", str(seed)]
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **ENV}, cwd=str(ROOT)).returncode
    if rc != 0:
        raise RuntimeError(f"seed {seed} failed (exit {rc}); see {log}:\n" + log.read_text()[-2000:])
    return json.loads((work / f"seed{seed}{args.tag}" / "run.json").read_text())


def per_seed(scored: list[dict], records: dict[int, dict]) -> dict[str, dict]:
    out = {}
    for numbers in scored:
        seed = numbers["seed"]
        rec = records[seed]
        row = {k: round(numbers[v], 4) for k, v in KEYS.items()}
        row.update(cider=round(numbers["CIDEr"], 4), meteor=round(numbers.get("METEOR", float("nan")), 4),
                   soda_c=round(numbers.get("SODA_c", float("nan")), 4), train_seconds=rec["train"]["seconds"],
                   wall_s=rec.get("wall_s"), loss_last=rec["train"]["loss_last"])
        out[str(seed)] = row
    return out


def spread(rows: dict[str, dict]) -> dict[str, float]:
    keys = (*KEYS, "cider")
    return {k: round(max(r[k] for r in rows.values()) - min(r[k] for r in rows.values()), 4) for k in keys}


def verdict(rows: dict[str, dict], sp: dict[str, float]) -> dict[str, bool]:
    return {
        "every_seed_colour_shape_sound_ge_0.6": all(min(r["colour"], r["shape"], r["sound"]) >= 0.6 for r in rows.values()),
        "every_seed_cider_ge_2.0": all(r["cider"] >= 2.0 for r in rows.values()),
        "attr_spread_le_0.15": all(sp[k] <= 0.15 for k in ("colour", "shape", "sound")),
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=0, help="0 = the default's train.max_steps")
    ap.add_argument("--set", action="append", default=[], help="config override (section.key=value), repeatable")
    ap.add_argument("--run-dir", default=str(ROOT / "runs" / "default"), help="where make run's shards are")
    ap.add_argument("--work", default=str(ROOT / "runs" / "default_seeds"))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--tag", default="", help="suffix of the per-seed work dirs (and of the output names unless --name)")
    ap.add_argument("--name", default="", help="stem of the output files (default: default_seeds<tag>)")
    ap.add_argument("--probe-every", type=int, default=100)
    ap.add_argument("--linear-probe", type=int, default=0, metavar="N",
                    help="also fit a linear read-out of the anchors' attributes on the first N training videos "
                         "at every probe step, scored on the held-out videos (probe_lin_*)")
    ap.add_argument("--linear-probe-layers", type=int, nargs="*", default=[], metavar="L",
                    help="with --linear-probe: also read the attributes out of layer L's aggregated input states "
                         "(0 = the input embeddings), keys probe_lin_<attr>_l<L>")
    ap.add_argument("--jobs", type=int, default=1, help="seeds at a time (one process each)")
    ap.add_argument("--reuse", action="store_true", help="score the seeds already trained under --work (no training)")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one is not None:
        run_seed(args.one, args)
        return 0
    t0 = time.perf_counter()
    ensure_shards(Path(args.run_dir))
    if args.reuse:
        records = {s: json.loads((Path(args.work) / f"seed{s}{args.tag}" / "run.json").read_text()) for s in args.seeds}
    else:
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            futures = {s: pool.submit(_child, s, args, argv) for s in args.seeds}
            records = {s: f.result() for s, f in futures.items()}

    from bench.ablation import score
    from bench.default_seeds_plot import plot_seeds
    cfg = default_config(0, args.steps, args.set)
    refs = load_data(Path(args.run_dir) / "preprocess", cfg)[1]
    scored = score({("default", s): r for s, r in records.items()}, refs)["default"]
    rows = per_seed(scored, records)
    sp = spread(rows)
    result = {
        "command": "bench/default_seeds.py " + " ".join(argv),
        "config": {"steps": cfg.train.max_steps, "overrides": args.set, "global_batch": cfg.train.batch_size},
        "seeds": rows,
        "spread": sp,
        "targets": TARGETS,
        "met": verdict(rows, sp),
        "timing_s": {"total": round(time.perf_counter() - t0, 1), "jobs": args.jobs},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = args.name or f"default_seeds_standin{args.tag}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    plot_seeds({s: r.get("history", []) for s, r in records.items()}, rows, out / f"{stem}.png")
    print(json.dumps({k: result[k] for k in ("seeds", "spread", "met", "timing_s")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
