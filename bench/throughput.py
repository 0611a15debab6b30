"""Throughput benchmark: the token-budget engine with N videos in flight against one at a time.

One random-init model of a trained shape (cpu-small: the Qwen2 shape of bench/decode.py,
fp32), one set of videos with unequal prefixes (1k to 4k tokens), event counts (K 2 to 16)
and caption lengths (8 to 80 tokens, forced through the test-only logits processor so every
mode generates the same tokens), captioned end to end (prefill, planning, grounding, decode)
by

  one_at_a_time      the engine with one video in flight (its K branches per step)
  in_flight_N        N videos in flight, N = 4, 16, 64: a finished video's pages go to the
                     next at once, whose prefill chunks and planning rows ride in the steps
                     of the videos already decoding (infer/engine/scheduler.py)
  single_chain       the standard decoder (infer/oracles/decoders.py `monolithic`: HF forward,
                     DynamicCache, an explicit mask per step), all events in one chain
  single_chain_fast  the best single chain this code can run: the engine's own step
                     (infer/engine/step.py) with one row over the paged pool, i.e. the honest
                     baseline for the step ratio

Each mode runs twice: `modes` with each newcomer's prefill in one step of its own (unlimited
budget), so the steps that only decode are the decode phase of N videos in flight; and
`arrivals` (one at a time and 16, or every N with --all-arrivals) under the engine's own
token budget, prefill chunks and planning rows riding with the decoding videos. Measured side
by side in one run and printed as one JSON object:
  throughput_speedup {N}: branch tokens per second in decode-only steps (`modes`), N in flight
                     over one at a time; tokens_equal: every video's tokens identical in every run
  end_to_end_speedup {N}: the whole set's wall time (`arrivals`), one at a time over N in flight
                     (prefill, planning and decode included, videos arriving as others finish),
                     with `time_split_ms` saying where the time goes
  ops_per_layer_step {"1", "16"}: aten ops (as the step's code issues them: torch.profiler,
                     top-level aten events) per decoder layer in one decode-only step
  kv_allocated_over_live: peak KV bytes in allocated pages over peak KV bytes of live keys
                     (16 in flight, arrivals)
  admission_p99_over_median: with videos arriving while 16 are in flight (arrivals), the 99th
                     percentile step time over the median decode-only step of 16 videos in
                     flight (`modes`, same mix): what a newcomer's prefill costs the decoding
                     videos. In the arrival run itself the decode-only steps come only at the
                     tail, with 1-3 videos left; the ratio over those is reported too
                     (`admission_p99_over_tail_median`)
  prefill_steps_per_video {"videos", "mean", "max", "bound"}: with videos arriving while 16 are in
                     flight (arrivals), the steps from a video's admission to the end of its planning;
                     bound: the mean of ceil(prefix tokens / step_tokens) + its planning steps. Over
                     the videos that arrived as others finished; the first 16, admitted together
                     (their prefills queue behind each other), in `prefill_steps_cold_start`
  videos_decoding_mean: the same run's videos with branch rows per step, over the steady state
                     (from the first video's end to the last video's admission)
  graph_coverage     with videos arriving while 16 are in flight, the share of steps that replay a
                     CUDA graph, whole or in pieces (infer/engine/graphs.py GraphPlan.route), with the
                     steps per route (`graph_routes`); where the run has no graphs (the CPU) an extra
                     arrival run in infer.cuda_graphs=static mode counts them (`arrivals/in_flight_16_static`)
  padded_over_needed query-key pairs FlexAttention computes over those the step's tokens see, by
                     arithmetic from every step's own attention metadata (infer/engine/attn_meta.py
                     flex_work), in an arrival run at 16 in flight with the engine at its CUDA
                     defaults (2048-token steps, 128-key pages, 128-row flex blocks); `padding` gives it
                     per size (the CPU's 16-key pages too) and over the decode-and-planning steps
  plus tokens/s, videos/min, ms per step and the memory floor per step per mode, the kernel.
  The speedups are also given in CPU time (`*_cpu_time`: the process's CPU time in the same
  steps; threads = 1): on a box other work shares, wall time moves with the load from one mode to
  the next, CPU time much less. The targets are judged on wall time.

Run:
  .venv/bin/python -m bench.throughput --out bench/results/throughput_cpu-small.json   # 51 min on a 2-core box (1-2 loaded)
  .venv/bin/python -m bench.throughput --videos 16 --in-flight 4,16 --chain-videos 2   # quicker
  .venv/bin/python -m bench.throughput --prefill-only --videos 48 --lengths 8,80       # the prefill keys only
  python -m bench.throughput --preset qwen2.5-3b --device cuda --dtype bfloat16 --out r.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from bench.decode import A_TOKENS, DA, DV, PRESETS, V_TOKENS, build_model, kv_bytes_per_token, measure_bandwidth, weight_bytes
from bench.engine_targets import verdict
from bench.output import emit
from bench.padding import padding_runs
from infer.engine.attn_meta import AttnMeta
from infer.engine.core import CaptionEngine
from infer.engine.graphs import coverage
from infer.engine.packing import QueryBlock
from infer.engine.paged import FREE_SEQ
from infer.engine.programs import PadProgram
from infer.engine.requests import Request
from infer.engine.sampling import DecodeControl
from infer.engine.scheduler import Phase
from infer.engine.step import ForwardBatch
from infer.oracles.decoders import monolithic
from pipeline.config import InferConfig
from pipeline.layout import shared_position
from pipeline.schema import Sample


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


def count_ops(fn) -> int:
    """Top-level aten ops `fn()` issues (an op called by another aten op is not counted again)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = prof.events()
    return sum(1 for e in events if e.name.startswith("aten::")
               and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))


def ops_per_layer(model, cfg: InferConfig, videos, n: int) -> float:
    """Aten ops per decoder layer in a decode-only step with n videos decoding: n videos start
    together (all prefilled in the first step) with captions of 24 tokens, and the first step in
    which all n decode (and nothing else) is profiled."""
    ecfg = replace(cfg, max_batch_videos=n, max_batch_rows=max(cfg.max_events, n * cfg.max_events),
                   step_tokens=1 << 20, max_branch_tokens=max(cfg.max_branch_tokens, 24))
    eng = CaptionEngine(model, ecfg)
    stepper = eng.graphs or eng.runner  # what the engine calls each step (CUDA graphs: their replay and copies)
    forward, counted = stepper.forward, []

    def recording(batch: ForwardBatch):
        decoding = [v for v in eng._in_flight if v.branches]
        if not counted and not batch.capture and len(decoding) == n and len(eng._in_flight) == n:
            counted.append(count_ops(lambda: forward(batch)))
        return forward(batch)

    stepper.forward = recording
    eng.caption([s for s, _ in videos[:n]], controls=[replace(c, lengths=[24]) for _, c in videos[:n]])
    if not counted:
        raise RuntimeError(f"no decode-only step with {n} videos decoding")
    return round(counted[0] / eng.weights.num_layers, 1)


def graph_routes(log) -> dict | None:
    """Steps per graph route in a step log and their coverage; None where the engine had no graphs."""
    routes = [r.graph for r in log if r.graph]
    return {"coverage": round(coverage(routes), 4), **{k: routes.count(k) for k in ("full", "pieces", "eager")}} \
        if routes else None


def engine_mode(model, cfg: InferConfig, videos, in_flight: int, decode_phase: bool = False, graphs: str = "") -> dict:
    """The engine with at most `in_flight` videos in flight over all videos (arrivals as others finish).

    decode_phase: each newcomer's prefill in one step of its own (an unlimited token budget), so the
    steps that only decode are the decode phase of N videos in flight (what throughput_speedup
    compares); otherwise the engine's own budget interleaves prefill chunks with decoding. graphs: an
    infer.cuda_graphs other than cfg's."""
    ecfg = replace(cfg, max_batch_videos=in_flight, max_batch_rows=max(cfg.max_events, in_flight * cfg.max_events),
                   cuda_graphs=graphs or cfg.cuda_graphs)
    if decode_phase:
        ecfg = replace(ecfg, step_tokens=1 << 30)
    eng = CaptionEngine(model, ecfg)
    stepper = eng.graphs or eng.runner
    forward = stepper.forward
    peaks = {"allocated": 0, "live": 0}
    watch = PrefillWatch(eng)

    def recording(batch: ForwardBatch):
        live = sum(v.prefix.length + sum(b.seq.length for b in v.branches) for v in eng._in_flight)
        peaks["allocated"] = max(peaks["allocated"], eng.pool.allocated * eng.pool.page_size)
        peaks["live"] = max(peaks["live"], live)
        watch.step()
        return forward(batch)

    def emit(req: Request, res) -> None:
        tokens[req.sample.video_id] = res.tokens
        watch.finished += 1

    stepper.forward = recording
    tokens = {}
    t0, c0 = time.perf_counter(), time.process_time()
    eng.run(watch.feed(iter([Request(s, c) for s, c in videos])), emit)
    wall, cpu = (time.perf_counter() - t0) * 1000.0, (time.process_time() - c0) * 1000.0
    n_tok = sum(len(t) for toks in tokens.values() for t in toks)
    st = eng.stats
    log = st["step_log"]
    decode_only = [r for r in log if r.branch_rows and not r.prefill_tokens and not r.plan_rows and not r.layer_tokens]
    mixed = [r for r in log if r.branch_rows and (r.prefill_tokens or r.plan_rows or r.layer_tokens)]
    front = [r for r in log if not r.branch_rows]
    dec_ms = sum(r.ms for r in decode_only)
    dec_cpu = sum(r.cpu_ms for r in decode_only)
    return {"wall_ms": round(wall, 1), "cpu_ms": round(cpu, 1), "steps": st["steps"], "tokens": n_tok,
            "decode_only_steps": len(decode_only), "decode_only_ms": round(dec_ms, 1),
            "decode_only_tokens": sum(r.branch_rows for r in decode_only),
            "rows_per_decode_step": round(statistics.mean(r.branch_rows for r in decode_only), 2) if decode_only else 0,
            "ms_per_decode_step": round(statistics.median(r.ms for r in decode_only), 3) if decode_only else 0,
            "tokens_per_s": round(sum(r.branch_rows for r in decode_only) / max(dec_ms, 1e-9) * 1000.0, 2),
            "ms_per_decode_step_cpu": round(statistics.median(r.cpu_ms for r in decode_only), 3) if decode_only else 0,
            "tokens_per_cpu_s": round(sum(r.branch_rows for r in decode_only) / max(dec_cpu, 1e-9) * 1000.0, 2),
            "time_split_ms": {"decode_only_steps": round(dec_ms, 1), "mixed_steps": round(sum(r.ms for r in mixed), 1),
                              "prefill_and_planning_steps": round(sum(r.ms for r in front), 1),
                              "programs": round(st["prepare_ms"], 1),
                              "grounding_and_anchors (inside steps)": round(st["front_ms"], 1),
                              "other": round(wall - st["step_ms"] - st["prepare_ms"], 1)},
            "step_ms_p99": round(float(np.percentile([r.ms for r in log], 99)), 3),
            "kernel": eng.kernel.name, "graph_routes": graph_routes(log), **watch.summary(eng.step_tokens), "_tokens": tokens, "_peaks": peaks, "_log": log, "_pool": eng.pool}


class PrefillWatch:
    """What the steps of a run did for each video before its branches, and how many videos decoded.

    Called before each forward (`step`): a video in PREFILL or PLAN counts the step (whether or not
    the step carried any of its work). The steady state runs from the first video's end to the feed's
    last video: the videos admitted in it are the arrivals (the first ones all start at once, a cold
    start), and its steps count the videos with branch rows."""

    def __init__(self, eng: CaptionEngine):
        self.eng = eng
        self.front: dict[str, int] = {}  # video -> steps in PREFILL or PLAN
        self.plan: dict[str, int] = {}  # video -> steps in PLAN (one planning row each)
        self.length: dict[str, int] = {}  # video -> prefix tokens
        self.arrived: set[str] = set()  # videos admitted in the steady state
        self.decoding: list[int] = []  # videos with branch rows, per steady-state step
        self.finished, self.fed_all = 0, False

    def feed(self, reqs):
        def poll():
            req = next(reqs, None)
            self.fed_all |= req is None
            return req
        return poll

    def step(self) -> None:
        for v in self.eng._in_flight:
            vid = v.request.sample.video_id
            if self.finished and vid not in self.front:
                self.arrived.add(vid)
            if v.phase in (Phase.PREFILL, Phase.PLAN):
                self.front[vid] = self.front.get(vid, 0) + 1
                self.plan[vid] = self.plan.get(vid, 0) + (v.phase is Phase.PLAN)
                self.length[vid] = v.prog.length
        if self.finished and not self.fed_all:
            self.decoding.append(sum(1 for v in self.eng._in_flight if v.phase is Phase.BRANCH))

    def summary(self, step_tokens: int) -> dict:
        """prefill_steps_per_video (the arrivals) and prefill_steps_cold_start (the first videos): mean and
        max steps from admission to the end of planning, and the bound (mean of ceil(prefix / step_tokens)
        + planning steps); videos_decoding_mean: over the steady-state steps."""
        def steps(vids: list[str]) -> dict | None:
            bound = [-(-self.length[v] // step_tokens) + self.plan[v] for v in vids]
            return {"videos": len(vids), "mean": round(statistics.mean(self.front[v] for v in vids), 2),
                    "max": max(self.front[v] for v in vids), "bound": round(statistics.mean(bound), 2)} if vids else None
        return {"prefill_steps_per_video": steps([v for v in self.front if v in self.arrived]),
                "prefill_steps_cold_start": steps([v for v in self.front if v not in self.arrived]),
                "videos_decoding_mean": round(statistics.mean(self.decoding), 2) if self.decoding else None,
                "steady_steps": len(self.decoding)}


def single_chain_fast(model, eng: CaptionEngine, sample: Sample, control: DecodeControl) -> tuple[list[list[int]], float, int]:
    """All events in one causal chain on the engine's step with one row (module doc).

    The prefix and the K serial <G>s go through the engine's step in one forward (K is forced,
    so no decision is read), the anchors come from the program's own rules; the chain (anchor 1, caption 1, anchor 2, ...) is one sequence in the pool at
    consecutive positions after the serial <G>s, each token seeing the prefix, the <G>s and
    the chain before it, as infer/oracles/decoders.py `monolithic` decodes. -> (tokens, decode ms, steps).
    """
    prog = PadProgram(model, sample, eng.cfg, control)
    k = min(control.num_events, eng.cfg.max_events)  # planning is forced to K in this benchmark
    pool, runner, S = eng.pool, eng.runner, eng.pool.page_size
    total = sum(min(control.length(e), eng.cfg.max_branch_tokens) for e in range(k))
    pool.reserve(-(-(prog.length + k) // S) + -(-total // S) + 2)
    prefix, chain = pool.open(), pool.open()
    pool.grow(prefix, prog.length + k)
    pool.sync()
    # prefix + serial <G>s through the step, then the anchors from the program's own rules
    embeds = [prog.embeds]
    positions = [prog.positions]
    lims = prog.limits.tolist()
    for i in range(k):
        x, pos = prog.plan_input()
        embeds.append(x[None])
        positions.append(pos[:, None])
        lims.append(prog.length + i + 1)
    n = prog.length + k
    meta = AttnMeta.build([QueryBlock(range(lo, min(n, lo + eng.q_block)), prefix.pages)
                           for lo in range(0, n, eng.q_block)], [prefix.id] * n, lims, [FREE_SEQ] * n, [0] * n,
                          q_block=eng.q_block, pool=pool, kernel=eng.kernel, group=eng.weights.heads // eng.weights.kv_heads)
    dev = eng.device
    _, states = runner.forward(ForwardBatch(torch.cat(embeds).to(eng.weights.dtype), torch.cat(positions, 1).to(dev),
                                            pool.slots(prefix, 0, n).to(dev), meta, prog.capture))
    prog.prefilled({i: states[i][: prog.length] for i in prog.capture})
    prog.queries = [states[prog.ground_layer][prog.length - 1 + i] for i in range(k)]
    anchors = prog.finish().anchors
    start = shared_position(prog.length + k)
    procs = control.processors(model.eos_id)
    tokens: list[list[int]] = [[] for _ in range(k)]
    x = anchors[0:1]
    steps = 0
    t0 = time.perf_counter()
    for e in range(k):
        while True:
            pool.grow(chain, steps + 1)
            pool.sync()
            meta = AttnMeta.build([QueryBlock([0], prefix.pages + chain.pages)], [prefix.id], [n], [chain.id], [steps + 1],
                                  q_block=eng.q_block, pool=pool, kernel=eng.kernel, group=eng.weights.heads // eng.weights.kv_heads)
            batch = ForwardBatch(x.to(eng.weights.dtype), torch.full((3, 1), start + steps, device=dev),
                                 pool.slots(chain, steps, steps + 1).to(dev), meta)
            h, _ = runner.forward(batch)
            scores = runner.logits(h).float() + eng.bias
            for p in procs:
                scores = p(scores, len(tokens[e]), [e])
            tok = int(scores.argmax(-1)[0])
            tokens[e].append(tok)
            steps += 1
            if tok == model.eos_id or len(tokens[e]) >= eng.cfg.max_branch_tokens:
                break
            x = runner.embed(torch.tensor([tok], device=eng.device))
        if e + 1 < k:
            x = anchors[e + 1:e + 2]
    ms = (time.perf_counter() - t0) * 1000.0
    pool.close(prefix)
    pool.close(chain)
    pool.unreserve(pool._reserved)
    return tokens, ms, steps


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
    ap.add_argument("--step-tokens", type=int, default=0, help="infer.step_tokens (0 = the engine's default)")
    ap.add_argument("--all-arrivals", action="store_true", help="the budgeted arrival runs for every N, not only 16")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = 1 on CPU)")
    ap.add_argument("--attention-calls", type=int, default=InferConfig.attention_calls,
                    help="infer.attention_calls for every mode (0 = one call per query block)")
    ap.add_argument("--no-arrivals", action="store_true", help="skip the budgeted arrival runs (and the figures "
                    "that come from them: end_to_end_speedup, kv_allocated_over_live, admission)")
    ap.add_argument("--prefill-only", action="store_true", help="only the arrival run at 16 in flight and its "
                    "prefill_steps_per_video and videos_decoding_mean (quick)")
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
    cfg = InferConfig(device=preset.device, max_events=kr[1], max_branch_tokens=lr[1], temperature=0.0,
                      step_tokens=args.step_tokens, attention_calls=args.attention_calls)
    in_flight = [int(x) for x in args.in_flight.split(",") if x]

    with torch.inference_mode():
        CaptionEngine(model, cfg).decode(videos[0][0], replace(videos[0][1], lengths=[2]))  # warm-up
        if args.prefill_only:  # the arrival run at 16 in flight, for its prefill and graph keys (module doc)
            m = engine_mode(model, cfg, videos, 16, graphs="auto" if device.type == "cuda" else "static")
            out = {k: m[k] for k in ("prefill_steps_per_video", "prefill_steps_cold_start", "videos_decoding_mean",
                                     "steady_steps", "steps", "wall_ms", "graph_routes")}
            out["graph_coverage"] = (m["graph_routes"] or {}).get("coverage")
            out["padding"] = padding_runs(model, cfg, videos)
            out["padded_over_needed"] = out["padding"]["cuda_defaults"]["overall"]
            return emit(out, Path(args.out) if args.out else None)
        modes = {"one_at_a_time": engine_mode(model, cfg, videos, 1, decode_phase=True)}
        for n in in_flight:
            modes[f"in_flight_{n}"] = engine_mode(model, cfg, videos, n, decode_phase=True)
        arrivals = {} if args.no_arrivals else {"one_at_a_time": engine_mode(model, cfg, videos, 1)}
        for n in [n for n in in_flight if not args.no_arrivals and (n == 16 or args.all_arrivals)]:
            arrivals[f"in_flight_{n}"] = engine_mode(model, cfg, videos, n)
        if "in_flight_16" in arrivals and arrivals["in_flight_16"]["graph_routes"] is None:  # no graphs: count them
            arrivals["in_flight_16_static"] = engine_mode(model, cfg, videos, 16, graphs="static")
        ops = {str(n): ops_per_layer(model, cfg, videos, n) for n in (1, 16) if n <= len(videos)}
        padding = padding_runs(model, cfg, videos)
        chain = {}
        if args.chain_videos:
            eng = CaptionEngine(model, cfg)
            sub = videos[: args.chain_videos]
            ms, toks, steps = 0.0, 0, 0
            fast_tokens = {}
            for s, c in sub:
                t, dt_ms, n = single_chain_fast(model, eng, s, c)
                fast_tokens[s.video_id] = t
                ms, toks, steps = ms + dt_ms, toks + sum(map(len, t)), steps + n
            chain["single_chain_fast"] = {"videos": len(sub), "decode_ms": round(ms, 1), "tokens": toks, "steps": steps,
                                          "ms_per_step": round(ms / steps, 3), "tokens_per_s": round(toks / ms * 1000, 2)}
            ms, toks, steps, equal = 0.0, 0, 0, True
            for s, c in sub:
                d = monolithic(model, s, eng.cfg, c)
                ms, toks, steps = ms + d.timings["decode_ms"], toks + d.num_tokens, steps + d.steps
                equal &= d.tokens == fast_tokens[s.video_id]
            chain["single_chain"] = {"videos": len(sub), "decode_ms": round(ms, 1), "tokens": toks, "steps": steps,
                                     "ms_per_step": round(ms / steps, 3), "tokens_per_s": round(toks / ms * 1000, 2)}
            chain["single_chain_fast"]["tokens_equal_single_chain"] = equal

    w_bytes, kv_bytes, bandwidth = weight_bytes(model), kv_bytes_per_token(model), measure_bandwidth(device)
    base = modes["one_at_a_time"]
    ref_tokens = base["_tokens"]
    tokens_equal = all(m["_tokens"] == ref_tokens for m in [*modes.values(), *arrivals.values()])
    n_videos = len(videos)
    prefix_mean = statistics.mean(len(model.make_example(s, with_targets=False).layout) for s, _ in videos)
    peaks16, admission = None, None
    for name, m in [*modes.items(), *(("arrivals/" + k, v) for k, v in arrivals.items())]:
        m.pop("_tokens")
        log, peaks, pool = m.pop("_log"), m.pop("_peaks"), m.pop("_pool")
        m["videos_per_min"] = round(n_videos / (m["wall_ms"] / 60000.0), 2)
        pure = [r for r in log if r.branch_rows and not r.prefill_tokens and not r.plan_rows and not r.layer_tokens]
        videos_per_step = statistics.mean(r.videos for r in pure) if pure else 1
        m["floor_ms_per_step"] = round((w_bytes + videos_per_step * prefix_mean * kv_bytes) / (bandwidth * 1e9) * 1e3, 3)
        m["kv_peak_allocated_mb"] = round(peaks["allocated"] * kv_bytes / 1e6, 2)
        m["kv_peak_live_mb"] = round(peaks["live"] * kv_bytes / 1e6, 2)
        m["kv_pool_mb"] = round(pool.pages * pool.page_size * kv_bytes / 1e6, 1)
        if name == "arrivals/in_flight_16":
            peaks16 = peaks
            dec = [r.ms for r in pure]
            admission = {"p99_step_ms": round(float(np.percentile([r.ms for r in log], 99)), 3),
                         "median_decode_step_ms_16_in_flight": modes["in_flight_16"]["ms_per_decode_step"]
                         if "in_flight_16" in modes else None,
                         "median_decode_step_ms_tail": round(statistics.median(dec), 3),
                         "mixed_steps": sum(1 for r in log if r.branch_rows and (r.prefill_tokens or r.plan_rows
                                                                                   or r.layer_tokens)),
                         "max_step_ms": round(max(r.ms for r in log), 3),
                         "max_prefill_tokens_in_a_step": max(r.prefill_tokens + r.layer_tokens for r in log)}
    # wall time, and the same ratios in CPU time: on a box other work shares, wall time moves with the load
    def ratios(rate: str, total: str) -> tuple[dict, dict]:
        speed = {str(n): round(modes[f"in_flight_{n}"][rate] / base[rate], 3) for n in in_flight}
        e2e = {k.removeprefix("in_flight_"): round(arrivals["one_at_a_time"][total] / m[total], 3)
               for k, m in arrivals.items() if k != "one_at_a_time" and not k.endswith("_static")}
        return speed, e2e
    (speed, e2e), (speed_cpu, e2e_cpu) = ratios("tokens_per_s", "wall_ms"), ratios("tokens_per_cpu_s", "cpu_ms")
    c = model.hf_config
    probe = CaptionEngine(model, cfg)
    out = {"preset": args.preset, "device": str(device),
           "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "dtype": preset.dtype, "torch": torch.__version__, "threads": torch.get_num_threads(),
           "model": {"layers": c.num_hidden_layers, "hidden": c.hidden_size, "heads": c.num_attention_heads,
                     "kv_heads": c.num_key_value_heads, "av_bidirectional": bool(model.cfg.av_bidirectional)},
           "videos": n_videos, "prefix_range": pr, "events_range": kr, "length_range": lr,
           "step_tokens": probe.step_tokens, "page_size": probe.pool.page_size, "q_block": probe.q_block,
           "total_tokens": base["tokens"], "bandwidth_gbs": round(bandwidth, 1), "weight_mb": round(w_bytes / 1e6, 1),
           "kernel": base["kernel"], "attention_calls": cfg.attention_calls, "throughput_speedup": speed, "end_to_end_speedup": e2e,
           "throughput_speedup_cpu_time": speed_cpu, "end_to_end_speedup_cpu_time": e2e_cpu,
           "load_average_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
           "tokens_equal": tokens_equal, "ops_per_layer_step": ops,
           "kv_allocated_over_live": round(peaks16["allocated"] / max(1, peaks16["live"]), 3) if peaks16 else None,
           "admission_p99_over_median": round(admission["p99_step_ms"] / admission["median_decode_step_ms_16_in_flight"], 3)
           if admission and admission["median_decode_step_ms_16_in_flight"] else None,
           "admission_p99_over_tail_median": round(admission["p99_step_ms"] / admission["median_decode_step_ms_tail"], 3)
           if admission else None, "admission": admission,
           **{k: arrivals["in_flight_16"][k] for k in ("prefill_steps_per_video", "prefill_steps_cold_start",
                                                       "videos_decoding_mean")
              if "in_flight_16" in arrivals},
           "graph_coverage": next((m["graph_routes"]["coverage"] for k, m in arrivals.items()
                                   if k.startswith("in_flight_16") and m["graph_routes"]), None),
           "padded_over_needed": padding["cuda_defaults"]["overall"], "padding": padding,
           "modes": modes, "arrivals": arrivals,
           **({"single_chain": chain} if chain else {})}
    if chain:
        out["single_chain_fast_over_single_chain_tokens_per_s"] = round(
            chain["single_chain_fast"]["tokens_per_s"] / chain["single_chain"]["tokens_per_s"], 3)
        out["one_at_a_time_over_single_chain_fast_tokens_per_s"] = round(
            base["tokens_per_s"] / chain["single_chain_fast"]["tokens_per_s"], 3)
    if targets := verdict(out):
        out["targets"] = targets
    return emit(out, Path(args.out) if args.out else None)


if __name__ == "__main__":
    main()
