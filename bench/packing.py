"""Where a decode step's CPU attention time goes: the packed calls against exact shapes.

The gathering kernel (`infer.kernel=sdpa`, the CPU default) runs a step's attention as at most
MAX_CALLS dense SDPA calls over gathered pages (infer/engine/packing.py): every query block of a call
is padded to the call's fullest and widest bin. This benchmark runs the engine on
bench/throughput.py's video mix with N videos in flight, records the query blocks of every
decode-only step in which all N decode, and times one layer's attention for each of them, on
tensors of the model's attention shape (page gather + SDPA with an additive mask), under

  packed        the engine's own plan (`infer.attention_calls`, default 3: infer/engine/packing.py pack_calls;
                0: the exact plan below)
  max_calls_K   the same planner allowed K calls, K = 1..6
  exact         one call per query block, its own rows and pages: no padding at all, the lower
                bound of dense-SDPA attention, at the price of one call per video per layer
                (the host work the engine's step is built not to have)

Each call is timed at the shape the engine runs it (its bins, each padded to the fullest bin's
tokens, and its widest bin's pages; infer/engine/packing.py Call.rows / Call.width). Per plan: ms per
layer summed over the steps, padded work over the work the blocks need (query tokens x pages),
calls per layer. Then, from the steps' own measured wall time, what the
decode steps would take with exact attention (`step_ms_packed_over_exact`): the factor by which
throughput_speedup at N in flight would rise if padding were free (one video at a time is one
block a step, already exact). Plans are timed interleaved, step by step, so drift on a shared
box hits them alike.

Run:
  .venv/bin/python -m bench.packing --out bench/results/packing_cpu-small.json    # ~4 min on a 2-core box
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

import infer.engine.attn_meta as attn_meta
from bench.decode import A_TOKENS, PRESETS, V_TOKENS, build_model
from bench.output import command, emit
from bench.throughput import make_videos
from infer.engine.core import CaptionEngine
from infer.engine.packing import Call, QueryBlock, kernel_calls, padded_work
from infer.engine.step import ForwardBatch
from pipeline.config import InferConfig


def record_steps(model, cfg: InferConfig, videos, in_flight: int) -> list[tuple[list[QueryBlock], float]]:
    """(query blocks, wall ms) of every decode-only step in which `in_flight` videos decode.

    The engine runs as bench/throughput.py's decode phase (each newcomer's prefill in a step of its
    own); the blocks are those of the step's attention metadata (the last one built before its forward:
    a layered block's own metadata comes first, infer/engine/scheduler.py), the ms the step's own forward."""
    ecfg = replace(cfg, max_batch_videos=in_flight, max_batch_rows=in_flight * cfg.max_events, step_tokens=1 << 30)
    eng = CaptionEngine(model, ecfg)
    if eng.kernel.name not in ("sdpa", "reference"):
        raise SystemExit(f"bench/packing.py measures the gathering kernels; the engine chose {eng.kernel.name}")
    asked: list[list[QueryBlock]] = []
    build = attn_meta._gather_meta

    def recording_build(blocks, *args, **kw):
        asked.append([QueryBlock(list(b.tokens), list(b.pages)) for b in blocks])
        return build(blocks, *args, **kw)

    forward, steps = eng.runner.forward, []

    def timed(batch: ForwardBatch):
        decoding = len(eng._in_flight) == in_flight and all(v.branches for v in eng._in_flight)
        t0 = time.perf_counter()
        out = forward(batch)
        if decoding and not batch.capture and not batch.jobs:
            steps.append((asked[-1], (time.perf_counter() - t0) * 1000.0))
        return out

    eng.runner.forward = timed
    attn_meta._gather_meta = recording_build
    try:
        eng.caption([s for s, _ in videos], controls=[c for _, c in videos])
    finally:
        attn_meta._gather_meta = build
    return steps


def needed_work(blocks: list[QueryBlock], group: int) -> int:
    """Query rows x pages the blocks need (padded_work's unit)."""
    return sum(len(b.tokens) * group * len(b.pages) for b in blocks)


class AttentionTimer:
    """One layer's attention for a list of calls, on random tensors of the model's shape: the gather
    of every call's pages from a pool, then one SDPA per call with an additive mask of its shape."""

    def __init__(self, kv_heads: int, head_dim: int, group: int, page_size: int, pool_pages: int, dtype,
                 multiple: int = 1):
        self.hkv, self.d, self.g, self.S, self.dtype = kv_heads, head_dim, group, page_size, dtype
        self.multiple = multiple  # the kernel's query-block alignment
        self.pool = torch.randn(pool_pages, page_size * 2 * kv_heads * head_dim, dtype=dtype)

    def prepare(self, calls: list[Call]):
        shapes = [(len(c.bins), c.rows(self.multiple), c.width) for c in calls]
        pages = sum(b * w for b, _, w in shapes)
        idx = torch.randint(0, self.pool.shape[0], (pages,))
        out = torch.empty(pages, self.pool.shape[1], dtype=self.dtype)
        qs = [torch.randn(b, self.hkv, f * self.g, self.d, dtype=self.dtype) for b, f, _ in shapes]
        masks = [torch.zeros(b, 1, f * self.g, w * self.S, dtype=self.dtype) for b, f, w in shapes]

        def run():
            torch.index_select(self.pool, 0, idx, out=out)
            at = 0
            for (b, _, w), q, m in zip(shapes, qs, masks):
                kv = out[at:at + b * w].view(b, w * self.S, 2, self.hkv, self.d).permute(2, 0, 3, 1, 4)
                F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=m)
                at += b * w
        return run


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="cpu-small", choices=sorted(PRESETS))
    ap.add_argument("--videos", type=int, default=24)
    ap.add_argument("--in-flight", type=int, default=16)
    ap.add_argument("--prefix", default="1000,4000")
    ap.add_argument("--events", default="2,16")
    ap.add_argument("--lengths", default="8,80")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--attention-calls", type=int, default=InferConfig.attention_calls,
                    help="infer.attention_calls of the engine (its plan is `packed`)")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    rng_of = lambda s: tuple(int(x) for x in s.split(","))  # noqa: E731
    preset = PRESETS[args.preset]
    if preset.device != "cpu":
        raise SystemExit("bench/packing.py measures the CPU's gathering kernel")
    torch.set_num_threads(1)
    pr, kr, lr = rng_of(args.prefix), rng_of(args.events), rng_of(args.lengths)
    torch.manual_seed(0)
    model = build_model(preset, torch.device("cpu"), max_len=pr[1] + kr[1] + lr[1] + 256,
                        segments=pr[1] // (V_TOKENS + A_TOKENS) + 1)
    videos = make_videos(model, args.videos, pr, kr, lr)
    cfg = InferConfig(device="cpu", max_events=kr[1], max_branch_tokens=lr[1], temperature=0.0,
                      attention_calls=args.attention_calls)
    with torch.inference_mode():
        CaptionEngine(model, cfg).decode(videos[0][0], replace(videos[0][1], lengths=[2]))  # warm-up
        steps = record_steps(model, cfg, videos, args.in_flight)
    if not steps:
        raise SystemExit(f"no decode-only step with {args.in_flight} videos decoding")

    c = model.hf_config
    layers, hkv = c.num_hidden_layers, c.num_key_value_heads
    group = c.num_attention_heads // hkv
    probe = CaptionEngine(model, cfg)
    S, mult = probe.pool.page_size, probe.kernel.contract.q_block_multiple
    plans = {"packed": cfg.attention_calls, **{f"max_calls_{k}": k for k in range(1, 7)}, "exact": 0}  # -> max_calls
    timer = AttentionTimer(hkv, c.hidden_size // c.num_attention_heads, group, S,
                           pool_pages=probe.pool.pages, dtype=probe.weights.dtype, multiple=mult)
    ms = {name: 0.0 for name in plans}
    work = {name: 0 for name in plans}
    calls = {name: 0 for name in plans}
    needed = 0
    with torch.inference_mode():
        for blocks, _ in steps:
            needed += needed_work(blocks, group)
            for name, max_calls in plans.items():
                planned = kernel_calls(blocks, group, S, max_calls, mult)
                work[name] += padded_work(planned, group, mult)
                calls[name] += len(planned)
                run = timer.prepare(planned)
                run()  # warm: first touch of the buffers
                t0 = time.perf_counter()
                for _ in range(args.repeats):
                    run()
                ms[name] += (time.perf_counter() - t0) * 1000.0 / args.repeats
    step_ms = sum(m for _, m in steps)
    exact_step_ms = step_ms - layers * (ms["packed"] - ms["exact"])
    if exact_step_ms <= 0:
        raise SystemExit(f"the timed attention ({layers} x {ms['packed']:.1f} ms) exceeds the steps' own "
                         f"{step_ms:.1f} ms: the box was too loaded to compare them; run again")
    out = {
        "command": command("packing.py", argv), "preset": args.preset, "torch": torch.__version__, "threads": torch.get_num_threads(),
        "videos": args.videos, "in_flight": args.in_flight, "prefix_range": pr, "events_range": kr,
        "length_range": lr, "page_size": S, "layers": layers, "kv_heads": hkv, "group": group,
        "attention_calls": cfg.attention_calls, "steps": len(steps),
        "rows_per_step": round(statistics.mean(sum(len(b.tokens) for b in bl) for bl, _ in steps), 1),
        "attention_ms_per_layer_summed": {k: round(v, 3) for k, v in ms.items()},
        "padded_over_needed_work": {k: round(v / needed, 3) for k, v in work.items()},
        "calls_per_layer": {k: round(v / len(steps), 2) for k, v in calls.items()},
        "packed_over_exact_attention": round(ms["packed"] / ms["exact"], 3),
        "step_ms_summed": round(step_ms, 1),
        "attention_share_of_step_packed": round(layers * ms["packed"] / step_ms, 3),
        "step_ms_packed_over_exact": round(step_ms / exact_step_ms, 3),
    }
    return emit(out, Path(args.out) if args.out else None)


if __name__ == "__main__":
    main()
