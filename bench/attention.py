"""Micro-benchmark: one decode step's attention for K lock-step branches.

Qwen2.5-0.5B shapes (14 query heads, 2 KV heads, head dim 64, 24 layers), a shared
prefix of 2048 tokens, K = 8 branches, branch lengths 1..32. Three ways, side by side:
  (a) loop:    one branch at a time, each against its full KV (prefix + own tokens);
  (b) batched: batch K with the prefix copied K times and an additive mask (HF-style);
  (c) cascade: infer.attention.cascade_attention (prefix read once, LSE merge).
Every variant is checked against (c)'s output before timing. Prints JSON (ms per layer,
ms per step for all layers, ratios) and optionally writes a PNG.

Run: .venv/bin/python bench/attention.py [--device cuda [--graphs]] [--dtype bfloat16] [--threads 1] [--png out.png]
(on a shared CPU, --threads 1 avoids OpenMP stalls when another process holds a core)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from infer.attention import cascade_attention  # noqa: E402


def make_inputs(K, Hq, Hkv, D, Lp, Lb, dtype, device, seed=0):
    """q [K, Hq, 1, D]; prefix [Hkv, Lp, D]; branch [K, Hkv, Lb, D]."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    return r(K, Hq, 1, D), r(Hkv, Lp, D), r(Hkv, Lp, D), r(K, Hkv, Lb, D), r(K, Hkv, Lb, D)


def variant_loop(q, pk, pv, bk, bv):
    """(a) Returns a step function: each branch alone against its own full KV
    [1, Hkv, Lp+Lb, D] (stored per branch, built outside the timed step)."""
    full = [(torch.cat([pk, bk[i]], 1)[None], torch.cat([pv, bv[i]], 1)[None]) for i in range(q.shape[0])]

    def step():
        return torch.cat(
            [F.scaled_dot_product_attention(q[i : i + 1], k, v, enable_gqa=True) for i, (k, v) in enumerate(full)]
        )

    return step


def variant_batched(q, pk, pv, bk, bv):
    """(b) Batch K, prefix copied per branch ([K, Hkv, Lp+Lb, D], stored), additive
    mask [K, 1, 1, Lp+Lb] as HF passes one; GQA by packing the query heads (HF's
    decode path with a mask)."""
    K, Hq, _, D = q.shape
    Hkv = pk.shape[0]
    k = torch.cat([pk.unsqueeze(0).expand(K, -1, -1, -1), bk], 2)
    v = torch.cat([pv.unsqueeze(0).expand(K, -1, -1, -1), bv], 2)
    mask = torch.zeros(K, 1, 1, k.shape[2], dtype=q.dtype, device=q.device)

    def step():
        o = F.scaled_dot_product_attention(q.reshape(K, Hkv, Hq // Hkv, D), k, v, attn_mask=mask)
        return o.reshape(K, Hq, 1, D)

    return step


def variant_cascade(q, pk, pv, bk, bv, backend):
    return lambda: cascade_attention(q, pk, pv, bk, bv, backend=backend)


def time_interleaved(fns, device, reps, warmup=3):
    """Median ms per call of each fn; calls are interleaved round-robin so that load
    from other processes hits all variants alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def cuda_graphed(fn):
    """Capture fn in a CUDA graph and return its replay: the GPU time without Python
    and launch overhead (what an engine that graphs its decode step would see)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def kv_bytes(K, Hkv, D, Lp, Lb, itemsize):
    """K+V bytes per layer each variant keeps (and reads every step)."""
    per_token = 2 * Hkv * D * itemsize
    return {
        "loop": K * (Lp + Lb) * per_token,  # one full cache per branch
        "batched_copy": K * (Lp + Lb) * per_token,
        "cascade": (Lp + K * Lb) * per_token,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--branches", type=int, default=8)
    ap.add_argument("--lengths", default="1,8,16,32")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    ap.add_argument("--graphs", action="store_true", help="CUDA: also time CUDA-graph replays")
    ap.add_argument("--png", default="")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    Hq, Hkv, D, K = 14, 2, 64, args.branches
    cascade_backend = "auto" if args.device == "cuda" else "sdpa"
    rows = []
    with torch.inference_mode():
        for Lb in [int(x) for x in args.lengths.split(",")]:
            x = make_inputs(K, Hq, Hkv, D, args.prefix, Lb, dtype, args.device)
            fns = {
                "loop": variant_loop(*x),
                "batched_copy": variant_batched(*x),
                "cascade": variant_cascade(*x, cascade_backend),
            }
            want = fns["cascade"]().float()
            tol = 1e-4 if dtype == torch.float32 else 3e-2
            for name, fn in fns.items():  # same answer before any timing
                err = (fn().float() - want).abs().max().item()
                if err > tol:
                    raise SystemExit(f"{name} disagrees with cascade at Lb={Lb}: max err {err}")
            row = {"branch_len": Lb, "ms_per_layer": time_interleaved(fns, args.device, args.reps),
                   "kv_bytes_per_layer": kv_bytes(K, Hkv, D, args.prefix, Lb, x[0].element_size())}
            if args.device == "cuda" and args.graphs:
                graphed = {name: cuda_graphed(fn) for name, fn in fns.items()}
                row["ms_per_layer_cuda_graph"] = time_interleaved(graphed, args.device, args.reps)
            rows.append(row)
    mean = {n: statistics.mean(r["ms_per_layer"][n] for r in rows) for n in rows[0]["ms_per_layer"]}
    result = {
        "shapes": {"q_heads": Hq, "kv_heads": Hkv, "head_dim": D, "prefix": args.prefix, "branches": K,
                   "layers": args.layers, "dtype": args.dtype, "device": args.device,
                   "cascade_backend": cascade_backend, "threads": torch.get_num_threads()},
        "per_length": rows,
        "mean_ms_per_layer": mean,
        "mean_ms_per_step_all_layers": {n: v * args.layers for n, v in mean.items()},
        "ratio_loop_over_cascade": mean["loop"] / mean["cascade"],
        "ratio_batched_copy_over_cascade": mean["batched_copy"] / mean["cascade"],
    }
    if "ms_per_layer_cuda_graph" in rows[0]:
        gmean = {n: statistics.mean(r["ms_per_layer_cuda_graph"][n] for r in rows) for n in mean}
        result["mean_ms_per_layer_cuda_graph"] = gmean
        result["graph_ratio_loop_over_cascade"] = gmean["loop"] / gmean["cascade"]
        result["graph_ratio_batched_copy_over_cascade"] = gmean["batched_copy"] / gmean["cascade"]
    print(json.dumps(result, indent=2))
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        lens = [r["branch_len"] for r in rows]
        for n in mean:
            ax.plot(lens, [r["ms_per_layer"][n] for r in rows], marker="o", label=n)
        ax.set_xlabel("branch length (tokens)")
        ax.set_ylabel("ms per layer per step")
        ax.set_title(f"decode-step attention, prefix {args.prefix}, K={K}, {args.dtype} {args.device}")
        ax.set_yscale("log")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png, dpi=120)
    return result


if __name__ == "__main__":
    main()
