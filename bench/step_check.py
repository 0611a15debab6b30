"""The engine's step at a model's shape with nothing but torch (and Triton on CUDA): the device check's numbers.

A decoder of `--shape` (`3b`: Qwen2.5-VL-3B's LLM, hidden 2048, 36 layers, 16 heads, 2 KV heads, MLP
11008, vocab 151936; `tiny`: a CPU smoke size) with random weights built on the device, driven by
synthetic videos through the engine's own scheduler, step, kernels, CUDA graphs (whole steps and
pieces: infer/engine/graphs.py) and staging. No model family, tokenizer or checkpoint: no
transformers. Each video: a prefix of causal text, a bidirectional audio-visual block larger than
the step budget (prefilled layer by layer: layered steps) and more text; `--events` forced serial
<G> planning rows; then that many branches of `--caption` greedy tokens. Videos arrive as others
finish, under the engine's token budget, so steps are mixed (prefill chunks, layered parts and
planning rows riding with the decoding branches). Reports, per in-flight count (1, 16, 64):

  ms_per_step (median over all steps) and ms_per_decode_step (steps with branch rows only), over
      the weight floor (the layers' and LM head's bytes over `--bandwidth-gbs`);
  prefill_steps_per_video: steps from admission to the end of planning (mean, max; bound: the mean
      of ceil(prefix / step_tokens) + events);
  graph_coverage and the steps per route (full, pieces, eager); flex_shapes: the compiled
      FlexAttention shapes (block counts) the run used, against their bound;
  batched_equals_alone: every video's tokens equal its tokens with one video in flight (else the
      first differing token and the alone run's top-1 minus top-2 logit margin there);
  on CUDA peak memory against infer.engine.memory_plan's figure (weights + KV pool + working memory).

  python -m bench.step_check --shape tiny --in-flight 1 3 --videos 4            # CPU smoke
  python -m bench.step_check --shape 3b --device cuda --dtype bfloat16 --out r.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace as NS

import torch

from bench.output import emit
from infer.engine.attn_meta import FlexMeta, pow2
from infer.engine.graphs import coverage, step_graphs
from infer.engine.kernels import choose_kernel
from infer.engine.memory_plan import Shape, working_bytes, worst_pages
from infer.engine.paged import PagePool, pages_for
from infer.engine.sampling import DecodeControl
from infer.engine.scheduler import Branch, Phase, Scheduler, VideoState
from infer.engine.staging import to_host
from infer.engine.step import ModelRunner
from infer.engine.step_weights import LayerWeights

SHAPES = {"3b": Shape(layers=36, hidden=2048, heads=16, kv_heads=2, head_dim=128, intermediate=11008, vocab=151936),
          "tiny": Shape(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=256)}


@dataclass
class RandomWeights:
    """What the step reads of a model (infer/engine/step_weights.py StepWeights), random, built on the device."""

    shape: Shape
    dtype: torch.dtype
    device: torch.device
    layers: list = field(default_factory=list)

    def __post_init__(self) -> None:
        s, g = self.shape, torch.Generator(self.device).manual_seed(0)
        self.hidden, self.heads, self.kv_heads, self.head_dim = s.hidden, s.heads, s.kv_heads, s.head_dim
        self.num_layers, self.mrope, self.head_bias = s.layers, False, None

        def lin(o: int, i: int, bias: bool = False):
            w = torch.randn(o, i, generator=g, device=self.device, dtype=self.dtype) * i ** -0.5
            return w, (torch.randn(o, generator=g, device=self.device, dtype=self.dtype) * 0.02 if bias else None)

        q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
        for _ in range(s.layers):
            self.layers.append(LayerWeights(
                input_norm=self.norm_module(), post_norm=self.norm_module(), act=torch.nn.SiLU(),
                q=lin(q, s.hidden, True), k=lin(kv, s.hidden, True), v=lin(kv, s.hidden, True), o=lin(s.hidden, q),
                gate=lin(s.intermediate, s.hidden), up=lin(s.intermediate, s.hidden), down=lin(s.hidden, s.intermediate)))
        self.norm = self.norm_module()
        self.embed = torch.randn(s.vocab, s.hidden, generator=g, device=self.device, dtype=self.dtype) * 0.02
        self.head = torch.randn(s.vocab, s.hidden, generator=g, device=self.device, dtype=self.dtype) * s.hidden ** -0.5
        self.inv_freq = 1.0 / 1e6 ** (torch.arange(0, s.head_dim, 2, device=self.device).float() / s.head_dim)

    def norm_module(self) -> torch.nn.RMSNorm:
        return torch.nn.RMSNorm(self.shape.hidden, eps=1e-6, device=self.device, dtype=self.dtype)

    def rope(self, probe: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """1D RoPE: probe (dtype), pos [1, N] -> cos, sin [1, N, D]."""
        f = pos[..., None].float() * self.inv_freq
        emb = torch.cat([f, f], dim=-1)
        return emb.cos().to(probe.dtype), emb.sin().to(probe.dtype)

    def read_bytes(self) -> int:
        """What a step reads of the weights: every layer's matrices and the LM head (not the embedding table)."""
        mats = [t for lw in self.layers for p in (lw.q, lw.k, lw.v, lw.o, lw.gate, lw.up, lw.down) for t in p
                if t is not None]
        return sum(t.numel() * t.element_size() for t in [*mats, self.head])


class Video:
    """A synthetic video's program (infer/engine/programs.py's interface as the scheduler reads it)."""

    def __init__(self, i: int, w: RandomWeights, text: int, block: int, events: int):
        g = torch.Generator(w.device).manual_seed(1000 + i)
        self.length = text + block + text
        self.embeds = torch.randn(self.length, w.hidden, generator=g, device=w.device, dtype=w.dtype) * 0.02
        self.positions = torch.arange(self.length).expand(3, -1)
        lim = torch.arange(1, self.length + 1)
        lim[text:text + block] = text + block  # the block sees itself whole
        self.limits = lim
        self.cuts = [c for c in range(1, self.length + 1) if not text < c < text + block]
        self.capture = (w.num_layers - 1,)
        self.model = NS(eos_id=-1)  # never ends early: every branch writes its tokens
        self.events, self.k = events, 0
        self.g_emb = torch.randn(w.hidden, generator=g, device=w.device, dtype=w.dtype) * 0.02
        self.anchors = NS(anchors=torch.randn(events, w.hidden, generator=g, device=w.device, dtype=w.dtype) * 0.02,
                          anchor_pos=self.length + events)

    def plan_input(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.k += 1
        return self.g_emb, torch.full((3,), self.length + self.k - 1, dtype=torch.long)


class Loop:
    """The engine's loop (infer/engine/core.py CaptionEngine._run) over synthetic videos, one engine for every
    in-flight count (its pool, graphs and compiled shapes built once)."""

    def __init__(self, w: RandomWeights, args, device: torch.device):
        cuda = device.type == "cuda"
        self.w, self.args, self.device = w, args, device
        self.kernel = choose_kernel(args.kernel, w.dtype, device)
        page, self.q_block = (128, 32) if cuda else (16, 16)
        self.step_tokens = args.step_tokens or (2048 if cuda else 32)
        self.pool = PagePool.for_budget(w.num_layers, w.kv_heads, w.head_dim, w.dtype, device, page,
                                        int(args.kv_memory_gb * 1e9), zero=self.kernel.reads_whole_pool,
                                        max_layer_elements=self.kernel.contract.max_layer_elements)
        self.runner = ModelRunner(w, self.pool, self.kernel)
        self.sched = Scheduler(self.runner, self.pool, step_tokens=self.step_tokens, q_block=self.q_block)
        self.rows = max(args.in_flight) * args.events
        cfg = NS(cuda_graphs="auto" if cuda else "static", decoder="parallel", max_batch_videos=max(args.in_flight),
                 max_batch_rows=self.rows, graph_tokens=self.rows)
        self.graphs = step_graphs(cfg, self.runner, device, tokens=self.step_tokens, q_block=self.q_block,
                                  attn_q_block=self.sched.prefill_block, capture_layers=(w.num_layers - 1,))

    def run(self, videos: list[Video], in_flight: int) -> dict:
        """Every video, at most `in_flight` at once -> tokens, margins, the step log, prefill steps per video."""
        todo, live, out = list(videos), [], {"tokens": {}, "margins": {}, "log": [], "front": {}, "arrived": set()}
        cap = self.args.caption
        while todo or live:
            while todo and len(live) < in_flight:
                worst = worst_pages(todo[0].length, todo[0].events, cap, self.pool.page_size)
                if not self.pool.reserve(worst):
                    if not live:
                        raise RuntimeError(f"a video's {worst} KV pages do not fit the pool: raise --kv-memory-gb")
                    break
                v = VideoState(NS(control=DecodeControl()), todo.pop(0), worst, cap)
                v.prog.k = 0  # its planning starts over (the videos are run once per in-flight count)
                v.prefix, v.margins = self.pool.open(), []
                live.append(v)
                if out["tokens"]:
                    out["arrived"].add(id(v.prog))
            self._start_branches(live)
            for v in live:
                if v.phase in (Phase.PREFILL, Phase.PLAN):
                    out["front"][id(v.prog)] = out["front"].get(id(v.prog), 0) + 1
            t0 = time.perf_counter()
            plan = self.sched.plan(live)
            if plan is None:
                raise RuntimeError("videos in flight but nothing to run")
            hidden, _ = (self.graphs or self.runner).forward(plan.batch)
            self._absorb(plan, hidden, live, out)
            a = plan.batch.attn
            out["log"].append(NS(ms=(time.perf_counter() - t0) * 1e3, branch=plan.n_branch, mixed=bool(
                plan.prefill or plan.plan or plan.jobs), layered=bool(plan.jobs), route=self.graphs.last if self.graphs
                else "", blocks=a.blocks if isinstance(a, FlexMeta) else 0))
        return out

    def _start_branches(self, live: list[VideoState]) -> None:
        rows = sum(v.rows for v in live if v.phase is Phase.BRANCH)
        for v in live:
            if v.phase is Phase.READY:
                if rows + v.prog.events > self.rows:
                    break
                v.branches = [Branch(i, self.pool.open()) for i in range(v.prog.events)]
                v.phase, rows = Phase.BRANCH, rows + v.prog.events

    def _absorb(self, plan, hidden: torch.Tensor, live: list[VideoState], out: dict) -> None:
        for v, _, _, hi in plan.prefill:
            v.cursor = hi
        for v, job in plan.jobs:
            if job.hidden is not None:
                v.job, v.cursor = None, job.span[1]
        done_prefill = [v for v in live if v.phase is Phase.PREFILL and v.cursor == v.prog.length]
        for v in done_prefill + [v for v, _ in plan.plan]:
            v.phase, v.feed_g = Phase.PLAN, v.prog.k < v.prog.events
            if not v.feed_g:  # planning ends: the branches' worst case is all it keeps
                v.anchors, v.phase = v.prog.anchors, Phase.READY
                keep = v.prog.events * pages_for(v.cap, self.pool.page_size)
                self.pool.unreserve(v.reserved - keep)
                v.reserved = keep
        if not plan.n_branch:
            return
        top = self.runner.logits(hidden[: plan.n_branch]).float().topk(2, dim=-1)
        chosen, margin = to_host([top.indices[:, 0], top.values[:, 0] - top.values[:, 1]])
        for v, first, k in plan.branch:
            v.steps += 1
            for i, b in enumerate(v.branches):
                b.tokens.append(int(chosen[first + i]))
                v.margins.append(float(margin[first + i]))
            if v.steps >= v.cap:
                for b in v.branches:
                    self.pool.close(b.seq)
                v.finished, v.branches = v.branches, []
                live.remove(v)
                self.pool.close(v.prefix)
                self.pool.unreserve(v.reserved)
                out["tokens"][id(v.prog)] = [b.tokens for b in v.finished]
                out["margins"][id(v.prog)] = v.margins


def first_difference(alone: dict, got: dict) -> dict | None:
    """The first video / event / position whose batched token differs from alone, with alone's margin there."""
    for vid, events in alone["tokens"].items():
        for e, (a, b) in enumerate(zip(events, got["tokens"][vid])):
            for j, (x, y) in enumerate(zip(a, b)):
                if x != y:
                    return {"event": e, "position": j, "alone": x, "batched": y,
                            "margin": alone["margins"][vid][j * len(events) + e]}
    return None


def summarise(r: dict, floor_ms: float, videos: list[Video], step_tokens: int) -> dict:
    log = r["log"]
    dec = [s.ms for s in log if s.branch and not s.mixed]
    ids = [id(v) for v in videos if id(v) in r["arrived"]] or [id(v) for v in videos]
    bound = statistics.mean(-(-v.length // step_tokens) + v.events for v in videos)
    routes = [s.route for s in log if s.route]
    return {"steps": len(log), "mixed_steps": sum(s.mixed for s in log), "layered_steps": sum(s.layered for s in log),
            "ms_per_step": round(statistics.median(s.ms for s in log), 3),
            "ms_per_decode_step": round(statistics.median(dec), 3) if dec else None,
            "ms_per_step_over_floor": round(statistics.median(s.ms for s in log) / floor_ms, 3),
            "prefill_steps_per_video": {"videos": len(ids), "mean": round(statistics.mean(r["front"][i] for i in ids), 2),
                                        "max": max(r["front"][i] for i in ids), "bound": round(bound, 2)},
            "graph_coverage": round(coverage(routes), 4) if routes else None,
            "graph_routes": {k: routes.count(k) for k in ("full", "pieces", "eager")},
            "flex_shapes": sorted({s.blocks for s in log if s.blocks and s.route != "full"})}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--in-flight", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--videos", type=int, default=0, help="videos per in-flight count (0 = 1.5 x it, at least 2)")
    ap.add_argument("--text", type=int, default=0, help="causal tokens before and after the block (0: 64, tiny 8)")
    ap.add_argument("--block", type=int, default=0, help="the bidirectional block (0: 3000, tiny 40)")
    ap.add_argument("--kernel", default="auto", choices=["auto", "flex", "sdpa"], help="auto: flex on CUDA, sdpa on CPU")
    ap.add_argument("--events", type=int, default=8)
    ap.add_argument("--caption", type=int, default=32)
    ap.add_argument("--step-tokens", type=int, default=0, help="the step budget (0 = the engine's: 2048 CUDA, tiny 32)")
    ap.add_argument("--kv-memory-gb", type=float, default=0.0, help="the KV pool (0: 16 GB on CUDA, 0.01 GB on CPU)")
    ap.add_argument("--bandwidth-gbs", type=float, default=3350.0, help="H100 SXM HBM3: 3.35 TB/s")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    device, tiny = torch.device(args.device), args.shape == "tiny"
    args.kv_memory_gb = args.kv_memory_gb or (16.0 if device.type == "cuda" else 0.01)
    text, block = args.text or (8 if tiny else 64), args.block or (40 if tiny else 3000)
    w = RandomWeights(SHAPES[args.shape], getattr(torch, args.dtype), device)
    t0 = time.perf_counter()
    loop = Loop(w, args, device)
    out = {"shape": args.shape, "device": str(device), "dtype": args.dtype, "kernel": loop.kernel.name,
           "graphs": loop.graphs.describe() if loop.graphs else None, "setup_s": round(time.perf_counter() - t0, 1),
           "step_tokens": loop.step_tokens, "prefix_tokens": 2 * text + block, "events": args.events,
           "caption_tokens": args.caption, "floor_ms_per_step": w.read_bytes() / (args.bandwidth_gbs * 1e9) * 1e3,
           "modes": {}}
    with torch.no_grad():
        loop.run([Video(0, w, text, block, args.events)], 1)  # warm-up: compiles what decoding runs
        runs = {}
        n_max = max(args.in_flight)
        videos = [Video(i, w, text, block, args.events) for i in range(args.videos or max(2, n_max * 3 // 2))]
        for n in sorted(set([1, *args.in_flight])):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            if loop.graphs:
                loop.graphs.reset_stats()
            t = time.perf_counter()
            runs[n] = r = loop.run(videos, n)
            m = summarise(r, out["floor_ms_per_step"], videos, loop.step_tokens)
            m["wall_s"] = round(time.perf_counter() - t, 2)
            if n > 1:
                diff = first_difference(runs[1], r)
                m["batched_equals_alone"], m["first_difference"] = diff is None, diff
            if device.type == "cuda":
                m["peak_memory_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 3)
            out["modes"][f"in_flight_{n}"] = m
            print(f"in_flight_{n}: {m}", file=sys.stderr, flush=True)  # what a run cut off by a timeout got to
    size = w.embed.element_size()
    weights = sum(t.numel() * t.element_size() for t in [*(p for lw in w.layers for q in (lw.q, lw.k, lw.v, lw.o, lw.gate,
                  lw.up, lw.down) for p in q if p is not None), w.embed, w.head])
    out["plan_gb"] = round((weights + loop.pool.pages * loop.pool.bytes_per_page
                            + working_bytes(w.shape, loop.step_tokens + loop.rows, loop.rows, size)) / 1e9, 3)
    out["kv_pool_gb"] = round(loop.pool.pages * loop.pool.bytes_per_page / 1e9, 3)
    # compiled FlexAttention shapes (one compile each, this pool): the whole steps' block buckets and the block
    # counts of the steps that ran it outside them (layered parts' own metas not listed); the bound: every power
    # of two up to the most blocks a step can have
    full = list(loop.graphs.buckets.blocks) if loop.graphs and loop.graphs.buckets else []
    used = sorted(set(full) | {b for m in out["modes"].values() for b in m["flex_shapes"]}) if loop.kernel.name == "flex" else []
    most = max(args.in_flight) + -(-loop.rows // loop.q_block) + -(-loop.step_tokens // loop.sched.prefill_block)
    out["flex_compiles"], out["flex_compiles_bound"] = len(used), (pow2(most).bit_length() if used else 0)
    return emit(out, args.out)


if __name__ == "__main__":
    main()
