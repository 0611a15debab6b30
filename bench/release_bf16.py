"""How often bf16 decoding of the release model agrees with fp32: intervals, K, tokens.

RELEASE.md 7.2: thresholds on bf16 sigmoids, bf16 ties in the grounding mass and greedy
argmax near ties make exact bf16 parity unreachable; parity is defined statistically.
This benchmark draws many random release-format models (the fixture model with seeded
noise on every matrix, infer tests' `perturbed`) and random videos (3-8 timesteps, with and
without audio), decodes each with the engine in fp32 and in bf16 (same weights, cast),
and counts per video: K equal, every grounded interval equal, every branch's tokens
equal, and for differing branches the index of the first different token.

Run:  .venv/bin/python bench/release_bf16.py --models 24 --videos 3 --out bench/results/release_bf16.json
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from infer.engine import CaptionEngine  # noqa: E402
from pipeline.config import InferConfig  # noqa: E402
from tests.support.release import fixture_video, perturbed, random_video  # noqa: E402


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
    counts = {"videos": 0, "videos_with_events": 0, "k_equal": 0, "intervals_equal": 0, "tokens_equal": 0, "all_equal": 0,
              "branches_compared": 0, "branches_equal": 0}
    first_diff: list[int] = []
    for seed in range(args.models):
        base = perturbed(seed, eos_gain=0.75)
        videos = [fixture_video(video_id=f"golden{seed}")] + [
            random_video(1000 * seed + i, timesteps=3 + (seed + i) % 6, audio=(seed + i) % 3 != 0)
            for i in range(args.videos - 1)]
        fp32 = decode(base, videos, "float32")
        bf16 = decode(copy.deepcopy(base), videos, "bfloat16")
        for a, b in zip(fp32, bf16):
            counts["videos"] += 1
            counts["videos_with_events"] += a.num_events > 0
            k_eq = a.num_events == b.num_events
            iv_eq = k_eq and [tuple(map(float, x)) for x in a.intervals] == [tuple(map(float, x)) for x in b.intervals]
            tok_eq = a.tokens == b.tokens
            counts["k_equal"] += k_eq
            counts["intervals_equal"] += iv_eq
            counts["tokens_equal"] += tok_eq
            counts["all_equal"] += iv_eq and tok_eq
            if k_eq:
                for ta, tb in zip(a.tokens, b.tokens):
                    counts["branches_compared"] += 1
                    counts["branches_equal"] += ta == tb
                    if ta != tb:
                        first_diff.append(next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb))))
    n = counts["videos"]
    result = {"models": args.models, "videos_per_model": args.videos, **counts,
              "rates": {k: round(counts[k] / n, 4) for k in ("k_equal", "intervals_equal", "tokens_equal", "all_equal")},
              "branch_token_agreement": round(counts["branches_equal"] / max(counts["branches_compared"], 1), 4),
              "first_differing_token": {"count": len(first_diff),
                                        "median": sorted(first_diff)[len(first_diff) // 2] if first_diff else None},
              "seconds": round(time.perf_counter() - t0, 1),
              "command": "python bench/release_bf16.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
