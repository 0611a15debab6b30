"""The run users get, over seeds and perturbations: `make run`'s train, caption and evaluate stages.

    .venv/bin/python -m bench.default_study                          # seeds 0-4 + both perturbations
    .venv/bin/python -m bench.default_study --seeds 0 --perturb      # one seed, no perturbation
    .venv/bin/python -m bench.default_study --reuse                  # re-read finished runs

Each run is `pipeline/run.py --stages train,caption,evaluate` on the embedded default
(cluster/configs/default.yaml): Ray Train with its 2 workers, their data order, the stage's own
held-out scoring and the evaluate stage's metrics, in `<work>/<run>/` with make run's synth and
preprocess outputs linked in (they are made first when missing or stale). Per run only `train.seed`
changes, plus for the perturbed runs (stand-ins for another machine's rounding, at seed 0):
`threads` (2 torch threads per worker instead of 1) and `jitter` (`train.init_jitter=1e-7`: every
initial weight moved by about one fp32 ulp). `threads` runs with `OMP_WAIT_POLICY=PASSIVE`, as the
train stage sets it for workers with more threads than CPUs (waiting threads sleep: it trains in ~13 min
instead of ~56, with the same losses). The periodic validation runs every `--val-every`
steps on all held-out videos (`train.val_samples=0`); it only reads the model, so the training
records are those of make run (a 200-step run with and without it: identical).

Written: `<out>/default_seeds.json` (`--name`: another stem) with `seeds` and `perturbed`
({run: free-running colour, shape, sound, motion, planning, f1 (grounding F1@0.5), cider, meteor,
soda_c, caption_f1 (the evaluate stage's), teacher-forced numbers, `colour_transition_step` (the
first validation step with teacher-forced colour >= 0.5; null if never) and the same for shape and
sound}), the spread (max - min over every run) and the targets; curves in `<stem>.png`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEYS = {"colour": "colour_acc", "shape": "shape_acc", "sound": "sound_acc", "motion": "motion_acc",
        "planning": "planning_acc", "f1": "grounding_f1@0.5"}
ATTRS = ("colour", "shape", "sound")
PERTURBATIONS = {"threads": ["train.torch_threads=2"], "jitter": ["train.init_jitter=1e-7"]}
TARGETS = {"min_attr": 0.65, "min_cider": 2.0, "max_spread_attr": 0.15, "max_colour_transition_step": 2000}


def transition_step(history: list[dict], key: str, level: float = 0.5) -> int | None:
    """The first step whose validation `key` is at least `level` (None if none).

    >>> transition_step([{"step": 1}, {"step": 2, "v": 0.4}, {"step": 3, "v": 0.5}], "v")
    3
    """
    return next((h["step"] for h in history if h.get(key, -1.0) >= level), None)


def run_row(run_dir: Path) -> dict:
    """One finished run's numbers (module doc)."""
    summary = json.loads((run_dir / "train" / "summary.json").read_text())
    history = json.loads((run_dir / "train" / "history.json").read_text())
    metrics = json.loads((run_dir / "evaluate" / "result.json").read_text())["metrics"]
    free, forced = summary["heldout"]["free_running"], summary["heldout"]["teacher_forced"]
    row = {k: round(free[v], 4) for k, v in KEYS.items()}
    row.update(cider=round(metrics["CIDEr"], 4), meteor=round(metrics["METEOR"], 4), soda_c=round(metrics["SODA_c"], 4),
               caption_f1=round(metrics["F1"], 4), teacher_forced={k: round(forced[v], 4) for k, v in KEYS.items()},
               colour_transition_step=transition_step(history, "val_colour_acc"),
               transition_steps={a: transition_step(history, f"val_{a}_acc") for a in ATTRS},
               loss_total=round(history[-1]["total"], 4), train_seconds=round(summary["train_seconds"], 1))
    return row


def ensure_inputs(run_dir: Path) -> None:
    """make run's synth + preprocess outputs, current for this code (a no-op when they are)."""
    cmd = [sys.executable, "-m", "pipeline.run", "--stages", "synth,preprocess", "--set", f"run_dir={run_dir}"]
    subprocess.run(cmd, check=True, cwd=str(ROOT), stdout=subprocess.DEVNULL)


def train_and_score(name: str, seed: int, extra: list[str], args) -> Path:
    """`<work>/<name>`: the default's train, caption and evaluate stages with `train.seed=seed` and `extra`."""
    run_dir = Path(args.work).resolve() / name
    run_dir.mkdir(parents=True, exist_ok=True)
    for stage in ("synth", "preprocess"):
        link = run_dir / stage
        if not link.is_symlink():
            link.symlink_to(Path(args.run_dir).resolve() / stage)
    sets = [f"run_dir={run_dir}", f"train.seed={seed}", f"train.val_every={args.val_every}", "train.val_samples=0",
            *args.set, *extra]
    cmd = [sys.executable, "-m", "pipeline.run", "--stages", "train,caption,evaluate", *(x for s in sets for x in ("--set", s))]
    with open(run_dir / "study.log", "w") as log:
        rc = subprocess.run(cmd, cwd=str(ROOT), stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise RuntimeError(f"{name} failed (exit {rc}); see {run_dir / 'study.log'}")
    return run_dir


def spread(rows: dict[str, dict]) -> dict[str, float]:
    return {k: round(max(r[k] for r in rows.values()) - min(r[k] for r in rows.values()), 4) for k in (*KEYS, "cider")}


def verdict(rows: dict[str, dict], sp: dict[str, float]) -> dict[str, bool]:
    steps = [r["colour_transition_step"] for r in rows.values()]
    return {
        "every_run_colour_shape_sound_ge_0.65": all(min(r[a] for a in ATTRS) >= TARGETS["min_attr"] for r in rows.values()),
        "every_run_cider_ge_2.0": all(r["cider"] >= TARGETS["min_cider"] for r in rows.values()),
        "attr_spread_le_0.15": all(sp[a] <= TARGETS["max_spread_attr"] for a in ATTRS),
        "colour_transition_le_2000": all(s is not None and s <= TARGETS["max_colour_transition_step"] for s in steps),
    }


def write_result(rows: dict[str, dict], args, argv: list[str], seconds: float) -> dict:
    """`<out>/<name>.json` and `.png` for the runs finished so far."""
    sp = spread(rows)
    result = {
        "command": "bench/default_study.py " + " ".join(argv),
        "date": time.strftime("%Y-%m-%d"),
        "config": {"val_every": args.val_every, "overrides": args.set,
                   "perturbations": {p: PERTURBATIONS[p] for p in args.perturb}},
        "seeds": {name.removeprefix("seed"): r for name, r in rows.items() if name.startswith("seed")},
        "perturbed": {name: r for name, r in rows.items() if not name.startswith("seed")},
        "spread": sp,
        "targets": TARGETS,
        "met": verdict(rows, sp),
        "timing_s": {"total": round(seconds, 1), "cpus": os.cpu_count()},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    from bench.default_seeds_plot import plot_seeds

    histories = {n: json.loads((Path(args.work).resolve() / n / "train" / "history.json").read_text()) for n in rows}
    plot_seeds(histories, rows, out / f"{args.name}.png", title="the default run (train stage) per seed / perturbation")
    return result


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2, 3, 4])
    ap.add_argument("--perturb", nargs="*", default=list(PERTURBATIONS), choices=list(PERTURBATIONS),
                    help="perturbed runs at seed 0 (none: --perturb with no names)")
    ap.add_argument("--val-every", type=int, default=100, help="steps between validations (the transition's resolution)")
    ap.add_argument("--run-dir", default=str(ROOT / "runs" / "default"), help="make run's directory (synth, preprocess)")
    ap.add_argument("--work", default=str(ROOT / "runs" / "default_study"))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--name", default="default_seeds", help="stem of the output files")
    ap.add_argument("--reuse", action="store_true", help="only re-read the runs already finished under --work")
    ap.add_argument("--set", action="append", default=[], help="config override for every run (a smoke test's short budget)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    seeds = [f"seed{s}" for s in args.seeds]
    order = seeds[:1] + list(args.perturb) + seeds[1:]  # seed 0's perturbations early: a cut-short study still has them
    runs = {f"seed{s}": (s, []) for s in args.seeds} | {p: (0, PERTURBATIONS[p]) for p in args.perturb}
    if not args.reuse:
        ensure_inputs(Path(args.run_dir))
    rows = {}
    for name in order:
        seed, extra = runs[name]
        run_dir = Path(args.work).resolve() / name if args.reuse else train_and_score(name, seed, extra, args)
        rows[name] = run_row(run_dir)
        print(name, json.dumps({k: rows[name][k] for k in (*ATTRS, "cider", "colour_transition_step")}), flush=True)
        result = write_result(rows, args, argv, time.perf_counter() - t0)  # after every run
    print(json.dumps({k: result[k] for k in ("spread", "met", "timing_s")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
