"""The paper's ablation, reproduced on data this repo generates: every variant, same budget, one table.

    .venv/bin/python -m bench.ablation                 # the full table (64 min, two runs at a time on a loaded 2-core box: docs/benchmarks.md)
    .venv/bin/python -m bench.ablation --smoke         # a tiny budget, every variant (CI: tests/test_ablation.py)
    .venv/bin/python -m bench.ablation --budget hard   # the hard synthetic regime (preprocess/synthetic_hard.py), 3 seeds

Variants (the rows of the paper's ChronusAV ablation; `model.*` settings on the embedded
default config, cluster/configs/default.yaml):
  sequential          model.layout=sequential: every event as "<s>-<e> seconds: caption" in one
                      causal chain, plain LM loss, decoded by the single text chain
  textual_planning    model.layout=textual_planning: the boundaries as text first, then the captions
  latent_sequential   model.layout=chain: latent planning (<G>s, grounding, anchors), the events
                      then written one after another in one causal chain (decoded by `monolithic`)
  full                PadCaptioner: factorized mask, parallel branches, attention aggregation
  causal_mask         model.mask=causal on the parallel layout (decoded in that layout)
  own_g               model.g_visibility=own: branch i sees only its own <G>
  agg_none / agg_mean / agg_scoring_head   model.aggregation (attention = full)
Every variant trains with the paper's three losses (the default's training aid,
model.attribute_token_weight, set to 1: off) on the same shards (bench/ablation_data.py), with the same steps,
optimiser settings and seeds (seed s sets train.seed and model.backbone_seed), one
process per run without Ray (`--jobs` at a time, `nice`; the decode ms are wall clock with
`--jobs` runs sharing the box, latencies only with `--jobs 1` on an idle one), and is evaluated on the same
held-out videos with the same decoder settings (bench/ablation_run.py). The parent then
scores every run with one `Scorers` (pipeline.metrics, protocol padcaptioner: F1 / Sim
E.T.Bench, SODA_c, CIDEr, METEOR; a text output is parsed by pipeline/textual.py, an
unparsable one counted as E.T.Bench counts it) and writes `ablation.json`, `ablation.md`
and `ablation.png` under --out (mean and sample sd over seeds).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from bench.ablation_data import prepare_shards
from bench.ablation_report import HELD_SPLIT, summarize, write_markdown, write_plot
from pipeline.config import Config, load_config

ROOT = Path(__file__).resolve().parents[1]

DEFAULT_CONFIG = ROOT / "cluster" / "configs" / "default.yaml"

VARIANTS: dict[str, list[str]] = {
    "sequential": ["model.layout=sequential"],
    "textual_planning": ["model.layout=textual_planning"],
    "latent_sequential": ["model.layout=chain", "model.mask=causal"],
    "full": [],
    "causal_mask": ["model.mask=causal"],
    "own_g": ["model.g_visibility=own"],
    "agg_none": ["model.aggregation=none"],
    "agg_mean": ["model.aggregation=mean"],
    "agg_scoring_head": ["model.aggregation=scoring_head"],
}
# the paper's table (ChronusAV, 3B model, 12K training videos): (F1, Sim)
ROWS = [
    {"label": "standard sequential (text timestamps)", "variant": "sequential", "paper": (32.7, 17.6)},
    {"label": "+ textual planning", "variant": "textual_planning", "paper": (37.4, 19.4)},
    {"label": "+ latent planning (one chain)", "variant": "latent_sequential", "paper": (61.5, 38.4)},
    {"label": "++ parallel decoding (full)", "variant": "full", "paper": (61.8, 38.8)},
    {"label": "factorized mask -> causal", "variant": "causal_mask", "paper": (38.7, 19.9)},
    {"label": "own <G> only (no global <G>s)", "variant": "own_g", "paper": (59.8, 37.6)},
    {"label": "aggregation: none", "variant": "agg_none", "paper": (47.7, 24.3)},
    {"label": "aggregation: mean pooling", "variant": "agg_mean", "paper": (58.5, 35.7)},
    {"label": "aggregation: scoring head", "variant": "agg_scoring_head", "paper": (61.4, 38.2)},
    {"label": "aggregation: attention (= full)", "variant": "full", "paper": (61.8, 38.8)},
]


@dataclass(frozen=True)
class Budget:
    """Corpus size and training budget of one table."""

    videos: int  # synthetic videos, a quarter of them held out
    min_duration: float
    max_duration: float
    max_events: int
    steps: int  # optimizer steps per variant and seed
    warmup: int
    eval_videos: int  # held-out videos decoded (0 = all)
    seeds: int
    batch: int = 2  # samples per step (4 in one process = the embedded default's 2 workers x 2)
    min_frames: int = 8  # features.min_frames: 2 s segments from 8 frames up (the default's 32 cuts 14 s into 0.9 s)
    regime: str = "default"  # data.synthetic.regime; hard: the durations and events set data.synthetic.hard.*
    min_events: int = 2
    overrides: tuple[str, ...] = ()  # extra config overrides (`--set`), applied to every variant alike


FULL = Budget(videos=128, min_duration=14.0, max_duration=24.0, max_events=4, steps=2400, batch=4, warmup=50,
              eval_videos=0, seeds=2)
# the embedded default's corpus and training (make run: 144 videos of 20-40 s, 3800 steps x 2 workers x 2)
DEFAULT = Budget(videos=144, min_duration=20.0, max_duration=40.0, max_events=5, steps=3800, batch=4, warmup=50,
                 eval_videos=0, seeds=1, min_frames=32)
# the hard synthetic regime (data.synthetic.regime=hard, preprocess/synthetic_hard.py) with its own
# layout (8-16 events in 48-96 s, overlaps, repeats, distractors). Sized for 90 min on the 2-core box, one
# run at a time: a probe (the full variant, 200 steps) took 68 s for the corpus and 9 s + 0.235 s a step a run,
# so 27 runs of 700 steps ~80 min
HARD = Budget(videos=128, min_duration=48.0, max_duration=96.0, min_events=8, max_events=16, steps=700, batch=4,
              warmup=50, eval_videos=0, seeds=3, regime="hard")
SMOKE = Budget(videos=6, min_duration=8.0, max_duration=10.0, max_events=2, steps=3, batch=2, warmup=1, eval_videos=2,
               seeds=2)


def bench_config(budget: Budget, variant: str, seed: int) -> Config:
    """The embedded default with the budget's corpus and steps and the variant's model settings."""
    layout = "data.synthetic.hard" if budget.regime == "hard" else "data.synthetic"
    over = [
        f"data.synthetic.num_videos={budget.videos}", f"data.synthetic.regime={budget.regime}",
        f"{layout}.min_duration={budget.min_duration}", f"{layout}.max_duration={budget.max_duration}",
        f"{layout}.min_events={budget.min_events}", f"{layout}.max_events={budget.max_events}",
        "data.synthetic.seed=0", "data.synthetic.num_workers=2",
        f"features.min_frames={budget.min_frames}",
        f"train.max_steps={budget.steps}", f"train.batch_size={budget.batch}", f"train.warmup_steps={budget.warmup}",
        f"train.seed={seed}",
        "train.val_every=0", "train.val_samples=8", "train.checkpoint_every=0", "train.log_every=250",
        f"model.backbone_seed={seed}", f"infer.max_events={max(8, budget.max_events)}", "infer.max_branch_tokens=64",
        "infer.max_batch_videos=1", "infer.videos_per_call=1",
        "model.attribute_token_weight=1",  # the paper's losses: the default's training aid off in every variant
        *budget.overrides,
        *VARIANTS[variant],
    ]
    return load_config(DEFAULT_CONFIG, over)


def run_one(budget: Budget, variant: str, seed: int, work: Path) -> dict:
    from bench.ablation_run import run_variant

    cfg = bench_config(budget, variant, seed)
    shards = prepare_shards(cfg, work)
    return run_variant(cfg, shards, work / "runs" / f"{variant}_s{seed}", budget.eval_videos)


def _child(budget: Budget, variant: str, seed: int, work: Path) -> dict:
    """One run in its own (niced, one-thread) process; its record from run.json."""
    log = work / "logs" / f"{variant}_s{seed}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = ["nice", "-n", "10", sys.executable, "-m", "bench.ablation", "--one", variant, "--seed", str(seed),
           "--work", str(work), "--budget-json", json.dumps(asdict(budget))]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT)).returncode
    if rc != 0:
        raise RuntimeError(f"{variant} seed {seed} failed (exit {rc}); see {log}:\n" + log.read_text()[-2000:])
    print(f"[ablation] {variant} seed {seed}: {time.perf_counter() - t0:.0f}s", flush=True)
    return json.loads((work / "runs" / f"{variant}_s{seed}" / "run.json").read_text())


def score(records: dict[tuple[str, int], dict], refs: list) -> dict[str, list[dict]]:
    """Every run's outputs through the metrics (one Scorers) -> {variant: [per-seed numbers]}:
    the table's metrics, costs, the held-out accuracies (with the unique / repeated split and
    the overlap grounding when the corpus has them) and, for a text baseline, its parse failures."""
    from pipeline.metrics import evaluate
    from pipeline.metrics.scorers import Scorers
    from pipeline.textual import parse_failures

    out: dict[str, list[dict]] = {}
    with Scorers() as sc:
        for (variant, seed), rec in sorted(records.items()):
            result = evaluate(rec["outputs"], refs, protocol="padcaptioner", scorers=sc)
            ms = [c["ms"] for c in rec["costs"]]
            tokens = sum(c["tokens"] for c in rec["costs"])
            numbers = {**{k: float(v) for k, v in result["metrics"].items()},
                       "ms_per_video": sum(ms) / len(ms), "ms_per_token": sum(ms) / max(tokens, 1.0),
                       **{k: rec["heldout"][k] for k in ("attr_acc", "planning_acc", "grounding_f1@0.5",
                                                          "colour_acc", "shape_acc", "sound_acc", "motion_acc")},
                       **{k: rec["heldout"][k] for k in HELD_SPLIT if k in rec["heldout"]},
                       "seed": seed, "videos": result["counts"]["videos"],
                       "videos_parsed": result["counts"].get("prediction_status", {}).get("ok", 0),
                       "decoder": rec["decoder"], "train_seconds": rec["train"]["seconds"],
                       "loss_last": rec["train"]["loss_last"]}
            texts = [o["text"] for o in rec["outputs"].values() if "text" in o]
            if texts:
                numbers.update(parse_failures(texts))
            out.setdefault(variant, []).append(numbers)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny corpus and budget (CI); = --budget smoke")
    ap.add_argument("--budget", choices=("full", "smoke", "default", "hard"), default="full",
                    help="full: the table's; default: the embedded default's corpus and steps (make run); "
                         "hard: the hard synthetic regime (overlapping, look-alike events, distractor sounds)")
    ap.add_argument("--work", default=str(ROOT / "runs" / "ablation"), help="corpus, shards, runs, logs")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"), help="where ablation.json/.md/.png go")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset")
    ap.add_argument("--seeds", type=int, default=0, help="seeds per variant (0 = the budget's)")
    ap.add_argument("--steps", type=int, default=0, help="training steps per run (0 = the budget's)")
    ap.add_argument("--batch", type=int, default=0, help="samples per step (0 = the budget's)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every variant and seed alike (repeatable; recorded in the budget)")
    ap.add_argument("--jobs", type=int, default=2, help="runs at a time (one process each)")
    ap.add_argument("--inline", action="store_true", help="run every variant in this process (no subprocesses)")
    ap.add_argument("--rescore", action="store_true", help="train nothing: score the runs already under --work")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--budget-json", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    work = Path(args.work)
    if args.one:  # a child: one variant, one seed
        fields = json.loads(args.budget_json)
        run_one(Budget(**{**fields, "overrides": tuple(fields.get("overrides", ()))}), args.one, args.seed, work)
        return 0

    budget_name = "smoke" if args.smoke else args.budget
    budget = {"full": FULL, "smoke": SMOKE, "default": DEFAULT, "hard": HARD}[budget_name]
    budget = replace(budget, seeds=args.seeds or budget.seeds, steps=args.steps or budget.steps,
                     batch=args.batch or budget.batch, overrides=budget.overrides + tuple(args.set))
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {sorted(VARIANTS)}")
    t0 = time.perf_counter()
    shards = prepare_shards(bench_config(budget, "full", 0), work)  # once, before any run reads it
    t_data = time.perf_counter() - t0
    jobs = [(v, s) for s in range(budget.seeds) for v in variants]
    if args.rescore:
        done = {job: work / "runs" / f"{job[0]}_s{job[1]}" / "run.json" for job in jobs}
        records = {job: json.loads(path.read_text()) for job, path in done.items() if path.exists()}
    elif args.inline:
        records = {(v, s): run_one(budget, v, s, work) for v, s in jobs}
    else:
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            futures = {job: pool.submit(_child, budget, *job, work) for job in jobs}
            records = {job: f.result() for job, f in futures.items()}
    t_runs = time.perf_counter() - t0 - t_data

    from train.data import read_samples

    refs = read_samples([shards["test"]], limit=budget.eval_videos)
    scored = score(records, refs)
    rows = summarize([r for r in ROWS if r["variant"] in variants], scored)
    command = "python -m bench.ablation " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {
        "command": command.strip(),
        "budget": {"name": budget_name, **asdict(budget)},
        "corpus": {"train_videos": sum(1 for _ in open_records(shards["train"])), "heldout_videos": len(refs)},
        "timing_s": {"data": round(t_data, 1), "runs": round(t_runs, 1), "total": round(time.perf_counter() - t0, 1),
                     "jobs": 1 if args.inline else args.jobs},
        "protocol": "padcaptioner (F1, Sim: E.T.Bench; SODA_c; CIDEr, METEOR: densevid LongVALE)",
        "rows": rows,
        "runs": scored,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "ablation" if budget_name == "full" else f"ablation_{budget_name}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    header = (f"Ablation ({budget_name} budget: {result['corpus']['train_videos']} training / {len(refs)} held-out "
              f"synthetic videos, {budget.steps} steps x {budget.batch} samples, {budget.seeds} seeds; mean ± sd; "
              f"{result['timing_s']['jobs']} run(s) at a time, decode ms measured so; "
              f"`{result['command']}`)")
    write_markdown(rows, out / f"{stem}.md", header)
    write_plot(rows, out / f"{stem}.png")
    print((out / f"{stem}.md").read_text())
    print(f"[ablation] wrote {out / (stem + '.json')} in {result['timing_s']['total']:.0f}s", flush=True)
    return 0


def open_records(path: str):
    from train.data import read_shard_records

    return read_shard_records([path])


if __name__ == "__main__":
    raise SystemExit(main())
