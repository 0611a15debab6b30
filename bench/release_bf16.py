"""How often bf16 decoding of the release model agrees with fp32: intervals, K, tokens.

docs/design/release.md 5.2: thresholds on bf16 sigmoids, bf16 ties in the grounding mass and greedy
argmax near ties make exact bf16 parity unreachable; parity is defined statistically.
This benchmark draws many random release-format models (the fixture model with seeded
noise on every matrix, infer tests' `perturbed`) and random videos (3-8 timesteps, with and
without audio), decodes each with the engine in fp32 and in bf16 (same weights, cast),
and counts per video: K equal, every grounded interval equal, every branch's tokens
equal, and for differing branches the index of the first different token. Videos whose
fp32 decode has events and videos with K = 0 are counted apart (`with_events`,
`without_events`): a K = 0 video with equal K agrees on intervals and tokens trivially, so
only `with_events` measures interval and token agreement; `all` is both together.

Run:  .venv/bin/python bench/release_bf16.py --models 40 --videos 3 --out bench/results/release_bf16.json
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import torch

from bench.output import command, emit
from bench.release_models import fixture_video, perturbed, random_video
from infer.engine.core import CaptionEngine
from pipeline.config import InferConfig


def decode(model, videos, dtype: str):
    eng = CaptionEngine(model, InferConfig(max_events=model.max_events, max_branch_tokens=model.max_branch_tokens + 1,
                                           dtype=dtype, device="cpu"))
    return [eng.decode(v) for v in videos]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", type=int, default=24)
    ap.add_argument("--videos", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    keys = ("videos", "k_equal", "intervals_equal", "tokens_equal", "all_equal")
    groups = {g: dict.fromkeys(keys, 0) for g in ("with_events", "without_events")}
    branches = {"branches_compared": 0, "branches_equal": 0}
    first_diff: list[int] = []
    for seed in range(args.models):
        base = perturbed(seed, eos_gain=0.75)
        videos = [fixture_video(video_id=f"golden{seed}")] + [
            random_video(1000 * seed + i, timesteps=3 + (seed + i) % 6, audio=(seed + i) % 3 != 0)
            for i in range(args.videos - 1)]
        fp32 = decode(base, videos, "float32")
        bf16 = decode(copy.deepcopy(base), videos, "bfloat16")
        for a, b in zip(fp32, bf16):
            c = groups["with_events" if a.num_events > 0 else "without_events"]
            k_eq = a.num_events == b.num_events
            iv_eq = k_eq and [tuple(map(float, x)) for x in a.intervals] == [tuple(map(float, x)) for x in b.intervals]
            tok_eq = a.tokens == b.tokens
            for key, hit in zip(keys, (True, k_eq, iv_eq, tok_eq, iv_eq and tok_eq)):
                c[key] += hit
            if k_eq:
                for ta, tb in zip(a.tokens, b.tokens):
                    branches["branches_compared"] += 1
                    branches["branches_equal"] += ta == tb
                    if ta != tb:
                        first_diff.append(next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb))))
    groups["all"] = {k: sum(groups[g][k] for g in ("with_events", "without_events")) for k in keys}
    for c in groups.values():
        c["rates"] = {k: round(c[k] / c["videos"], 4) if c["videos"] else None for k in keys[1:]}
    result = {"models": args.models, "videos_per_model": args.videos, **groups, **branches,
              "branch_token_agreement": round(branches["branches_equal"] / max(branches["branches_compared"], 1), 4),
              "first_differing_token": {"count": len(first_diff),
                                        "median": sorted(first_diff)[len(first_diff) // 2] if first_diff else None},
              "seconds": round(time.perf_counter() - t0, 1),
              "command": command("release_bf16.py", argv)}
    return emit(result, args.out)


if __name__ == "__main__":
    main()
