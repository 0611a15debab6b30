"""Throughput benchmark: many videos per decode step against one at a time and the single chain.

One random-init model of a trained shape (cpu-small: the Qwen2 shape of bench/decode.py,
fp32), one set of videos with unequal prefixes (1k to 4k tokens), event counts (K 2 to
16) and caption lengths (8 to 80 tokens, forced through the test-only logits processor so
every mode generates the same tokens), captioned by

  one_at_a_time      the engine with one video in flight (its K branches per step)
  in_flight_N        the engine with N videos in flight (continuous admission: a finished
                     video's slot and rows go to the next video at once), N = 4, 16, 64
  single_chain       the standard decoder (infer/reference.py `monolithic`: HF forward,
                     DynamicCache, an explicit mask per step), all events in one chain
  single_chain_fast  the best single chain this code can run: the same decode step as
                     the engine (infer/step.py) with one row, a static KV buffer and no
                     mask, i.e. the honest baseline for the step ratio

Prefill, planning and grounding are per video and identical in every mode (none is
batched across videos), so each video's front is run once, its time kept, and reused by
every mode: the decode phase (anchor and branch steps) is timed per mode, and the end-to-end
time of a mode is its decode wall time plus the sum of the fronts. The single-chain modes
run on the first `--chain-videos` videos (their decode is 10-20x slower on a CPU) and are
reported per token.

Prints one JSON object with "throughput_speedup" {"4", "16", "64"} (decode-phase tokens/s
with N in flight over one at a time), "end_to_end_speedup" (same form, whole set),
"tokens_equal" (every video's tokens identical across all engine modes), tokens/s and
videos/min per mode, ms per step against a cost model (`cost_model`: the step's GEMMs
and prefix attention timed alone at each step's rows and prefixes: what the step would
cost with no other work and no Python or launch overhead), the memory floor per step
(weights + the prefix KV of every video in the step, over the measured copy bandwidth:
each video in flight costs one read of its prefix per step), and the kernel.

Run:
  .venv/bin/python bench/throughput.py                         # cpu-small, 64 videos, ~10 min on 2 cores
  .venv/bin/python bench/throughput.py --videos 16 --in-flight 4,16 --chain-videos 2   # quicker
  python bench/throughput.py --preset qwen2.5-3b --device cuda --dtype bfloat16 --out r.json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import (A_TOKENS, DA, DV, PRESETS, V_TOKENS, build_model, kv_bytes_per_token,  # noqa: E402
                    measure_bandwidth, weight_bytes)

from infer.engine import CaptionEngine, _Admit  # noqa: E402
from infer.requests import Request  # noqa: E402
from infer.front import StageTimer, decode_reserve, prepare_example, run_front  # noqa: E402
from infer.reference import monolithic  # noqa: E402
from infer.sampling import DecodeControl  # noqa: E402
from infer.kv_pool import StepMeta  # noqa: E402
from infer.step import StepRunner  # noqa: E402
from pipeline.config import InferConfig  # noqa: E402
from pipeline.layout import shared_position  # noqa: E402
from pipeline.schema import Sample  # noqa: E402
from transformers.cache_utils import DynamicCache  # noqa: E402


def make_videos(model, n: int, prefix_range: tuple[int, int], k_range: tuple[int, int], len_range: tuple[int, int],
                seed: int = 0) -> list[tuple[Sample, DecodeControl]]:
    """n videos with prefix, K and caption lengths drawn uniformly (seeded) from the ranges."""
    rng = np.random.default_rng(seed)
    text = len(model.prompt[0]) + len(model.prompt[1])
    out = []
    for i in range(n):
        prefix = int(rng.integers(prefix_range[0], prefix_range[1] + 1))
        t = max(1, (prefix - text) // (V_TOKENS + A_TOKENS))
        k = int(rng.integers(k_range[0], k_range[1] + 1))
        lengths = [int(x) for x in rng.integers(len_range[0], len_range[1] + 1, size=k)]
        times = np.stack([np.arange(t), np.arange(t) + 1], 1).astype(np.float32)
        s = Sample(video_id=f"v{i:03d}", duration=float(t), segment_times=times,
                   visual=rng.standard_normal((t, V_TOKENS, DV)).astype(np.float16),
                   audio=rng.standard_normal((t, A_TOKENS, DA)).astype(np.float16), has_audio=True)
        out.append((s, DecodeControl(num_events=k, lengths=lengths)))
    return out


def run_fronts(model, cfg: InferConfig, videos) -> tuple[dict, float]:
    """Each video's prefill + planning + grounding once -> {video_id: (front, timer)}, total ms."""
    fronts, total = {}, 0.0
    for s, ctl in videos:
        t0 = time.perf_counter()
        timer = StageTimer(model.device)
        ex = prepare_example(model, s, decode_reserve(cfg))
        front = run_front(model, ex, DynamicCache(config=model.hf_config), cfg.max_events, ctl, timer)
        total += (time.perf_counter() - t0) * 1000.0
        fronts[s.video_id] = (front, timer)
    return fronts, total


def engine_mode(model, cfg: InferConfig, videos, fronts, in_flight: int) -> dict:
    """The engine with `in_flight` videos in flight over all videos, fronts reused."""
    kmax = max(c.num_events for _, c in videos)
    ecfg = replace(cfg, max_batch_videos=in_flight, max_batch_rows=max(cfg.max_events, in_flight * kmax))
    eng = CaptionEngine(model, ecfg)
    eng._front = lambda req, emit: _Admit(req, req.options.resolve(eng.cfg), fronts[req.sample.video_id][0],
                                          copy.deepcopy(fronts[req.sample.video_id][1]))
    rows: list[tuple[int, int, int, int]] = []  # per step: (rows, sum of rows x prefix keys, prefix keys read, videos)
    step = eng.runner.step
    kv = eng.runner.prefix.kv

    def recording(e, meta):
        lens = [(n, kv[slot][0][0].shape[1]) for slot, _, n in meta.spans]
        rows.append((e.shape[0], sum(n * lp for n, lp in lens), sum(lp for _, lp in lens), len(lens)))
        return step(e, meta)

    eng.runner.step = recording
    tokens = {}
    t0 = time.perf_counter()
    eng.run(iter([Request(s, c) for s, c in videos]), lambda req, res: tokens.__setitem__(req.sample.video_id, res.tokens))
    wall = (time.perf_counter() - t0) * 1000.0
    n_tok = sum(len(t) for toks in tokens.values() for t in toks)
    st = eng.stats
    return {"decode_ms": round(st["step_ms"], 1), "wall_ms": round(wall, 1), "steps": st["steps"], "tokens": n_tok,
            "rows_per_step": round(st["row_steps"] / max(1, st["steps"]), 2), "ms_per_step": round(st["step_ms"] / st["steps"], 3),
            "tokens_per_s": round(n_tok / (st["step_ms"] / 1000.0), 2), "kernel": eng.kernel.name,
            "_tokens": tokens, "_rows": rows}


def single_chain_fast(model, eng: CaptionEngine, front, control: DecodeControl) -> tuple[list[list[int]], float, int]:
    """All events in one causal chain on the engine's decode step with one row (module doc).

    The chain (anchor 1, caption 1, anchor 2, ...) is the row's own KV in a static buffer;
    every token sees the prefix + serial <G>s and all of the chain before it, at consecutive
    positions, as infer/reference.py `monolithic` decodes. Returns (tokens, decode ms, steps).
    """
    k = front.num_events
    total = sum(min(control.length(e), eng.cfg.max_branch_tokens) for e in range(k))
    runner = StepRunner(eng.weights, eng.kernel, rows=1, branch_tokens=total)
    runner.admit(0, [(layer.keys[0], layer.values[0]) for layer in front.cache.layers])
    start = front.cache.get_seq_length()
    eng.weights.rope_tables(start + total + 1)
    dev = eng.device
    bias = eng.bias
    procs = control.processors(model.eos_id)
    zero = torch.zeros(1, dtype=torch.long, device=dev)
    tokens: list[list[int]] = [[] for _ in range(k)]
    embeds = front.anchors[0:1]
    length = torch.zeros(1, dtype=torch.long, device=dev)
    t0 = time.perf_counter()
    steps = 0
    for e in range(k):
        while True:
            meta = StepMeta(positions=shared_position(start) + length, lengths=length, slots=zero, ranks=zero,
                            spans=[(0, 0, 1)], max_length=steps + 1)
            scores = runner.logits(runner.step(embeds, meta)).float() + bias
            for p in procs:
                scores = p(scores, len(tokens[e]), [e])
            tok = int(scores.argmax(-1)[0])
            tokens[e].append(tok)
            steps += 1
            length += 1
            if tok == model.eos_id or len(tokens[e]) >= eng.cfg.max_branch_tokens:
                break
            embeds = runner.embed(torch.tensor([tok], device=dev))
        if e + 1 < k:
            embeds = front.anchors[e + 1:e + 2]
    return tokens, (time.perf_counter() - t0) * 1000.0, steps


def cost_model(eng: CaptionEngine, row_counts: list[int], prefix_keys: int, reps: int = 3) -> dict:
    """The kernels of a step timed alone, for a step cost with no per-step overhead.

    GEMMs: every linear of every layer + the LM head on R rows (F.linear, the step's own
    weights), timed at a few R and interpolated. Prefix attention: one packed block of 5
    rows (x g query heads; a video's live rows in a step of the prescribed mix) against `prefix_keys` keys in every layer, through the engine's
    kernel, as ms per (row x prefix key), hot (one prefix, cached across layers: a lone
    video's step) and cold (a distinct prefix per call: several videos in flight stream
    their prefixes from memory every step); a step's share is that rate x sum over its
    videos of rows x prefix length. Everything else a step does (branch-part attention, merge,
    norms, RoPE, sampling, bookkeeping, Python) is what `overhead_ms_per_step` measures.
    """
    w = eng.weights
    dev, dt = eng.device, w.dtype
    probe = sorted({1, 8, 32, 128, max(row_counts)})

    def time_it(fn):
        fn()
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        return best * 1000.0

    gemm = {}
    for r in probe:
        x = torch.randn(r, w.hidden, device=dev, dtype=dt)
        xo = torch.randn(r, w.heads * w.head_dim, device=dev, dtype=dt)
        xi = torch.randn(r, w.layers[0].down[0].shape[1], device=dev, dtype=dt)

        def lin():
            for lw in w.layers:
                for weight, bias in (lw.q, lw.k, lw.v, lw.gate, lw.up):
                    F.linear(x, weight, bias)
                F.linear(xo, *lw.o)
                F.linear(xi, *lw.down)
            F.linear(x, w.head)

        gemm[r] = time_it(lin)
    lp, rows = max(1, int(prefix_keys)), 5  # ~ a video's live rows in a step of the prescribed mix
    q = torch.randn(1, w.kv_heads, rows * (w.heads // w.kv_heads), w.head_dim, device=dev, dtype=dt)
    # hot: one prefix per layer, the same every call (a lone video's step: it stays in cache); cold: a
    # distinct key and value tensor per call, 64 of each (far more than a last-level cache: many
    # videos in flight stream their prefixes from memory)
    kvs = [(torch.randn(1, w.kv_heads, lp, w.head_dim, device=dev, dtype=dt),
            torch.randn(1, w.kv_heads, lp, w.head_dim, device=dev, dtype=dt)) for _ in range(64)]
    layers = len(w.layers)
    hot = time_it(lambda: [eng.kernel(q, *kvs[i % 2], 0.1) for i in range(layers)])
    cold = time_it(lambda: [eng.kernel(q, k, v, 0.1) for k, v in kvs]) * layers / len(kvs)
    return {"gemm_ms_at_rows": {str(r): round(gemm[r], 2) for r in probe},
            "prefix_attention_ms_per_row_key": {"hot": hot / (rows * lp), "cold": cold / (rows * lp)},
            "prefix_attention_probe": {"rows": rows, "keys": lp, "hot_ms": round(hot, 2), "cold_ms": round(cold, 2)}}


def modelled_ms(costs: dict, steps: list[tuple[int, int]]) -> float:
    """Mean modelled step time over `steps` [(rows, sum of rows x prefix keys, prefix keys read, videos)]:
    GEMMs at the step's rows + prefix attention at the hot rate (one video) or the cold one (several)."""
    xs = [int(r) for r in costs["gemm_ms_at_rows"]]
    g = np.interp([st[0] for st in steps], xs, list(costs["gemm_ms_at_rows"].values()))
    rate = costs["prefix_attention_ms_per_row_key"]
    a = np.array([st[1] * (rate["hot"] if st[3] == 1 else rate["cold"]) for st in steps], dtype=float)
    return float(np.mean(g + a))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="cpu-small", choices=sorted(PRESETS))
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--videos", type=int, default=64)
    ap.add_argument("--in-flight", default="4,16,64")
    ap.add_argument("--chain-videos", type=int, default=4, help="videos the single-chain modes decode (0 = none)")
    ap.add_argument("--prefix", default="1000,4000", help="prefix token range")
    ap.add_argument("--events", default="2,16", help="K range")
    ap.add_argument("--lengths", default="8,80", help="caption length range (tokens, eos included)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = 1 on CPU)")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    rng_of = lambda s: tuple(int(x) for x in s.split(","))  # noqa: E731
    preset = PRESETS[args.preset]
    preset = replace(preset, **{k: v for k, v in dict(device=args.device, dtype=args.dtype).items() if v is not None})
    if preset.device == "cpu":
        torch.set_num_threads(args.threads or 1)
    device = torch.device(preset.device)
    pr, kr, lr = rng_of(args.prefix), rng_of(args.events), rng_of(args.lengths)
    torch.manual_seed(0)
    model = build_model(preset, device, max_len=pr[1] + kr[1] + lr[1] + 256, segments=pr[1] // (V_TOKENS + A_TOKENS) + 1)
    videos = make_videos(model, args.videos, pr, kr, lr)
    cfg = InferConfig(device=preset.device, max_events=kr[1], max_branch_tokens=lr[1], temperature=0.0)
    in_flight = [int(x) for x in args.in_flight.split(",") if x]

    with torch.inference_mode():
        CaptionEngine(model, cfg).decode(videos[0][0], replace(videos[0][1], lengths=[2]))  # warm-up
        fronts, front_ms = run_fronts(model, cfg, videos)
        modes = {"one_at_a_time": engine_mode(model, cfg, videos, fronts, 1)}
        for n in in_flight:
            modes[f"in_flight_{n}"] = engine_mode(model, cfg, videos, fronts, n)
        chain = {}
        if args.chain_videos:
            eng = CaptionEngine(model, cfg)
            sub = videos[: args.chain_videos]
            ms, toks, steps = 0.0, 0, 0
            fast_tokens = {}
            for s, c in sub:
                t, dt_ms, n = single_chain_fast(model, eng, fronts[s.video_id][0], c)
                fast_tokens[s.video_id] = t
                ms, toks, steps = ms + dt_ms, toks + sum(map(len, t)), steps + n
            chain["single_chain_fast"] = {"videos": len(sub), "decode_ms": round(ms, 1), "tokens": toks, "steps": steps,
                                          "ms_per_step": round(ms / steps, 3), "tokens_per_s": round(toks / ms * 1000, 2)}
            ms, toks, steps, equal = 0.0, 0, 0, True
            for s, c in sub:
                d = monolithic(model, s, cfg, c)
                ms, toks, steps = ms + d.timings["decode_ms"], toks + d.num_tokens, steps + d.steps
                equal &= d.tokens == fast_tokens[s.video_id]
            chain["single_chain"] = {"videos": len(sub), "decode_ms": round(ms, 1), "tokens": toks, "steps": steps,
                                     "ms_per_step": round(ms / steps, 3), "tokens_per_s": round(toks / ms * 1000, 2)}
            chain["single_chain_fast"]["tokens_equal_single_chain"] = equal
        rows_all = [st[0] for m in modes.values() for st in m["_rows"]]
        prefix_mean = statistics.mean(len(fronts[s.video_id][0].keys.order) for s, _ in videos)
        costs = cost_model(CaptionEngine(model, cfg), sorted(set(rows_all)), int(prefix_mean))

    w_bytes, kv_bytes, bandwidth = weight_bytes(model), kv_bytes_per_token(model), measure_bandwidth(device)
    base = modes["one_at_a_time"]
    ref_tokens = base["_tokens"]
    tokens_equal = all(m["_tokens"] == ref_tokens for m in modes.values())
    n_videos = len(videos)
    for name, m in modes.items():
        rows = m.pop("_rows")
        m.pop("_tokens")
        e2e = m["wall_ms"] + front_ms
        m["end_to_end_ms"] = round(e2e, 1)
        m["videos_per_min"] = round(n_videos / (e2e / 60000.0), 2)
        m["modelled_ms_per_step"] = round(modelled_ms(costs, rows), 3)
        prefix_read = statistics.mean(st[2] for st in rows)
        m["prefix_kv_mb_per_step"] = round(prefix_read * kv_bytes / 1e6, 1)
        m["floor_ms_per_step"] = round((w_bytes + prefix_read * kv_bytes) / (bandwidth * 1e9) * 1e3, 3)
        m["overhead_ms_per_step"] = round(m["ms_per_step"] - m["modelled_ms_per_step"], 3)
    speed = {str(n): round(modes[f"in_flight_{n}"]["tokens_per_s"] / base["tokens_per_s"], 3) for n in in_flight}
    e2e = {str(n): round(base["end_to_end_ms"] / modes[f"in_flight_{n}"]["end_to_end_ms"], 3) for n in in_flight}
    c = model.hf_config
    out = {"preset": args.preset, "device": str(device),
           "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "dtype": preset.dtype, "torch": torch.__version__, "threads": torch.get_num_threads(),
           "model": {"layers": c.num_hidden_layers, "hidden": c.hidden_size, "heads": c.num_attention_heads,
                     "kv_heads": c.num_key_value_heads},
           "videos": n_videos, "prefix_range": pr, "events_range": kr, "length_range": lr,
           "total_tokens": base["tokens"], "front_ms_total": round(front_ms, 1),
           "bandwidth_gbs": round(bandwidth, 1), "weight_mb": round(w_bytes / 1e6, 1),
           "kernel": base["kernel"], "throughput_speedup": speed, "end_to_end_speedup": e2e,
           "tokens_equal": tokens_equal, "modes": modes, **({"single_chain": chain} if chain else {}),
           "cost_model": costs}
    if chain:
        out["single_chain_fast_over_single_chain_tokens_per_s"] = round(
            chain["single_chain_fast"]["tokens_per_s"] / chain["single_chain"]["tokens_per_s"], 3)
        out["one_at_a_time_over_single_chain_fast_tokens_per_s"] = round(
            base["tokens_per_s"] / chain["single_chain_fast"]["tokens_per_s"], 3)
    if "16" in speed:
        out["targets"] = {"throughput_speedup_16_min": 2.0, "met": speed["16"] >= 2.0 and tokens_equal}
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return out


if __name__ == "__main__":
    main()
