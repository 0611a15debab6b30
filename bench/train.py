"""Training throughput: the factorized mask's overhead, and 1 vs 2 Ray Train workers.

Part 1 (in-process, side by side): the same packed batch (default-preset shapes: T=36
segments of 8 visual + 2 audio tokens, 4 events with synthetic-grammar captions; tiny
backbone) is trained with `model.mask=factorized` and `model.mask=causal`: forward_train
+ losses + backward + AdamW step, interleaved rounds, median ms/step and tokens/s. The
ratio factorized / causal is the mask overhead (target <= 1.25x on CPU).

Part 2 (local Ray, 2 CPUs): TorchTrainer running train/loop.py on a small shard set of
the same shapes, `train.num_workers` 1 and then 2 (1 CPU each, DDP over gloo): steady-state
step time and global tokens/s from the run history (first steps excluded), and the
scaling 2-worker / 1-worker tokens/s.

Prints one JSON object. Run:
    .venv/bin/python -m bench.train [--steps 40] [--rounds 12] [--skip-ray] [--out bench/results/train.json]
(Part 2 starts Ray: run it under `flock /tmp/padcap-ray.lock` on a shared machine.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from pipeline.config import Config, FeaturesConfig, ModelConfig, TrainConfig
from pipeline.layout import Role
from pipeline.schema import Event, Sample, encode
from preprocess.encoders import get_audio_encoder, get_visual_encoder

ROOT = Path(__file__).resolve().parents[1]

# feature dims of the default encoders (pixels / mel), so the benchmark's batch matches real shards
DV, DA = get_visual_encoder(FeaturesConfig()).dim, get_audio_encoder(FeaturesConfig()).dim
CAPTIONS = ("Visual: a red circle moves up. Audio: a high beep.", "Visual: a set of blue stripes grows. Audio: silence.",
            "Visual: an orange square moves to the left. Audio: a rising chirp.",
            "Visual: a green triangle blinks. Audio: white noise.")


def make_sample(i: int, t: int = 36, v: int = 8, a: int = 2, events: int = 4) -> Sample:
    rng = np.random.default_rng(i)
    times = np.stack([np.arange(t), np.arange(t) + 1], 1).astype(np.float32)
    span = t / events
    evs = [Event(float(k * span + 1), float((k + 1) * span - 1), CAPTIONS[(k + i) % len(CAPTIONS)]) for k in range(events)]
    return Sample(video_id=f"bench{i}", duration=float(t), segment_times=times,
                  visual=rng.standard_normal((t, v, DV)).astype(np.float16),
                  audio=rng.standard_normal((t, a, DA)).astype(np.float16), has_audio=True, events=evs, split="train")


# --------------------------------------------------------------------------- part 1: mask overhead


def mask_overhead(rounds: int, batch_size: int, threads: int) -> dict:
    from pipeline.model import PadCaptioner
    from train.data import Batcher
    from train.losses import compute_losses

    torch.set_num_threads(threads)
    samples = [make_sample(i) for i in range(batch_size)]
    runs = {}
    for mask in ("factorized", "causal"):
        torch.manual_seed(0)
        cfg = ModelConfig(backbone="tiny", tokenizer="bpe", mask=mask, train_backbone_embeddings=True)
        model = PadCaptioner(cfg, visual_dim=DV, audio_dim=DA).train()
        batch = next(Batcher(model, batch_size)(samples))
        opt = torch.optim.AdamW(list(model.trainable_parameters().values()), lr=1e-4)
        tokens = int((batch.packed.role != Role.PAD).sum())

        def step(model=model, batch=batch, opt=opt, cfg=cfg):
            loss = compute_losses(model.forward_train(batch), cfg).total
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        runs[mask] = {"step": step, "tokens": tokens, "times": []}
    for fn in runs.values():  # warm-up
        fn["step"]()
        fn["step"]()
    for _ in range(rounds):  # interleaved, so load changes hit both alike
        for r in runs.values():
            t0 = time.perf_counter()
            r["step"]()
            r["times"].append(time.perf_counter() - t0)
    out = {}
    for mask, r in runs.items():
        ms = statistics.median(r["times"]) * 1e3
        out[mask] = {"ms_per_step": round(ms, 2), "tokens_per_step": r["tokens"], "tokens_per_s": round(r["tokens"] / ms * 1e3, 1)}
    out["overhead_factorized_over_causal"] = round(out["factorized"]["ms_per_step"] / out["causal"]["ms_per_step"], 3)
    out["target"] = "<= 1.25"
    out["batch_size"] = batch_size
    out["threads"] = threads
    return out


# --------------------------------------------------------------------------- part 2: Ray Train workers


def write_shards(root: Path, n_train: int = 16, n_test: int = 2) -> str:
    """A preprocess-like output dir (manifest.parquet + shards/<chunk>/<split>/*.tar)."""
    import webdataset as wds

    from preprocess import manifest as mf

    rows = []
    for split, n, off in (("train", n_train, 0), ("test", n_test, 1000)):
        shard = root / "shards" / "bench" / split / "000000.tar"
        shard.parent.mkdir(parents=True, exist_ok=True)
        with wds.TarWriter(str(shard)) as sink:
            for i in range(n):
                s = make_sample(off + i)
                s.split = split
                fields = encode(s)
                sink.write(fields)
                rows.append(mf.empty_row(video_id=s.video_id, split=split, status="ok", shard=str(shard),
                                         key=fields["__key__"], num_segments=s.num_segments, num_events=len(s.events)))
    mf.write_table(mf.manifest_path(str(root)), rows)
    return str(root)


def ray_scaling(steps: int, workers: list[int]) -> dict:
    import ray

    from train.checkpoint import read_history
    from train.trainer import build_trainer

    tmp = Path(tempfile.mkdtemp(prefix="padcap-bench-train-"))
    shards = write_shards(tmp / "data")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    out = {}
    try:
        for n in workers:
            cfg = Config(model=ModelConfig(backbone="tiny", train_backbone_embeddings=True),
                         train=TrainConfig(num_workers=n, cpus_per_worker=1.0, backend="ddp", max_steps=steps,
                                           batch_size=2, checkpoint_every=0, val_every=0, val_samples=1,
                                           log_every=steps, warmup_steps=2))
            t0 = time.perf_counter()
            result = build_trainer(cfg, shards, str(tmp / f"out{n}")).fit()
            wall = time.perf_counter() - t0
            hist = read_history(result.checkpoint.to_directory(str(tmp / f"ck{n}")))
            steady = [h for h in hist if h["step"] > max(3, steps // 5) and h["step"] < steps]
            step_s = statistics.median(h["step_s"] for h in steady)
            tps = statistics.median(h["tokens_per_s"] for h in steady)
            out[f"workers_{n}"] = {"ms_per_step": round(step_s * 1e3, 1), "global_tokens_per_s": round(tps, 1),
                                   "samples_per_step": 2 * n, "fit_wall_s": round(wall, 1)}
    finally:
        ray.shutdown()
    if len(workers) == 2:
        a, b = (out[f"workers_{n}"]["global_tokens_per_s"] for n in workers)
        out["scaling_tokens_per_s"] = round(b / a, 3)
    out["steps"] = steps
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=40, help="steps per Ray Train run")
    ap.add_argument("--skip-ray", action="store_true")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    result = {"mask_overhead": mask_overhead(args.rounds, args.batch_size, args.threads)}
    if not args.skip_ray:
        result["ray_train_workers"] = ray_scaling(args.steps, [1, 2])
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
