"""CUDA graphs of the step, captured at start-up and replayed step after step: whole steps and pieces.

    graphs = step_graphs(cfg.infer, runner, device, tokens=2048, q_block=sched.q_block,
                         attn_q_block=sched.prefill_block, capture_layers=model.capture_layers())
    hidden, states = graphs.forward(batch)      # replayed whole, in pieces, or eagerly: graphs.plan.route

Why. At the published model's size a decode step is a few milliseconds of weight reads on a
GPU but ~40 kernels per layer x 36 layers: launched one by one from Python, the host is the
bottleneck. A CUDA graph records kernels once and replays them with one launch; it needs every
shape and device address fixed. Two kinds, chosen per step by one pure function of the step's
metadata (`GraphPlan.route`; `graph_coverage` in bench/throughput.py counts it):

  "full"    the whole step (attention included), recorded per bucket (tokens N_b, query blocks
            Q_b) over static buffers: decode-heavy steps with the flex kernel, no layered block,
            at most `infer.graph_tokens` tokens;
  "pieces"  everything but attention, per token bucket, attention run eagerly between the
            pieces (infer/engine/pieces.py): mixed steps (prefill chunks, planning rows) and steps
            with layered blocks (their parts run eagerly beside attention), any kernel, up to the
            step budget's largest step;
  "eager"   the rest (a step over every bucket: the benchmarks' unlimited budgets).

Whole steps. What is static per token bucket: the input embeddings, M-RoPE positions, KV slots
and the output row of each token; per block bucket: FlexAttention's block table (`npages`,
`indices`, wide as the pool), the query slots' token and their two (sequence, limit) pairs, and
the BlockMask over those very tensors (its mask_mod reads them and the pool's page owners, which
`PagePool.sync` edits in place). Padding: tokens past N write their KV into the scratch page
(slot 0, which nothing real reads) and their outputs are dropped; blocks past Q have no pages;
query slots past Q x BM see the scratch page's first key. Each token's arithmetic is its own,
so a replayed step equals the eager one (tests/test_graphs.py, on the CPU through the same
buffers and padding with the eager forward standing in for the replay: `capture=False`).

Capture runs at start-up for every bucket, largest first, sharing one memory pool. Any failure at
start-up, in building the static buffers (their checks included: a BlockMask that copies its block
table) or in the capture, is logged with its reason and the engine runs eagerly (`describe()` says so). The outputs are copied
out of the graphs' buffers (a video keeps its prefill states across steps). Pure torch; no ray.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from infer.engine.attn_meta import SLOT_PAD, FlexMeta, flex_block_mask, pow2
from infer.engine.pieces import StepPieces
from infer.engine.step import ForwardBatch, ModelRunner

log = logging.getLogger("padcap.infer")


@dataclass(frozen=True)
class Buckets:
    """The shapes recorded: token buckets N_b and block buckets Q_b (powers of two); a pair is recorded
    where Q_b <= N_b (a step has at least one token per block)."""

    tokens: tuple[int, ...]
    blocks: tuple[int, ...]

    def pairs(self) -> list[tuple[int, int]]:
        return [(n, q) for n in self.tokens for q in self.blocks if q <= n]

    def fit(self, n: int, q: int) -> tuple[int, int] | None:
        """The smallest recorded (N_b, Q_b) with N_b >= n and Q_b >= q, or None."""
        nb = next((t for t in self.tokens if t >= n), None)
        qb = next((b for b in self.blocks if b >= q), None)
        if nb is None or qb is None:
            return None
        return (max(nb, qb), qb) if max(nb, qb) in self.tokens else None


def graph_buckets(max_tokens: int, max_blocks: int, min_tokens: int = 8) -> Buckets:
    """Powers of two from min_tokens up to max_tokens (tokens) and from 1 up to max_blocks (blocks)."""
    if max_tokens < 1 or max_blocks < 1:
        raise ValueError(f"graph buckets need max_tokens and max_blocks >= 1 (got {max_tokens}, {max_blocks})")
    tokens, t = [], min(min_tokens, pow2(max_tokens))
    while t < max_tokens:
        tokens.append(t)
        t *= 2
    tokens.append(pow2(max_tokens))
    blocks = [1 << i for i in range(pow2(max_blocks).bit_length())]
    return Buckets(tuple(tokens), tuple(blocks))


MAX_PIECE_TOKENS = 8192  # the largest piece bucket (a budget over it: its larger steps run eagerly)


def piece_buckets(max_tokens: int, min_tokens: int = 8) -> tuple[int, ...]:
    """Powers of two from min_tokens up to max_tokens (at most MAX_PIECE_TOKENS): the pieces' token buckets.

    >>> piece_buckets(648), piece_buckets(1 << 30)[-1]
    ((8, 16, 32, 64, 128, 256, 512, 1024), 8192)
    """
    return graph_buckets(min(max_tokens, MAX_PIECE_TOKENS), 1, min_tokens).tokens


@dataclass(frozen=True)
class StepKey:
    """What routing reads of a step: its tokens N, its flex query blocks and their size (0, 0: another
    kernel's metadata), whether layered blocks have parts in it, the hidden states it asks for."""

    tokens: int
    blocks: int
    q_block: int
    jobs: bool
    capture: tuple[int, ...]

    @staticmethod
    def of(batch: ForwardBatch) -> StepKey:
        a = batch.attn
        flex = isinstance(a, FlexMeta)
        return StepKey(a.tokens, a.blocks if flex else 0, a.q_block if flex else 0, bool(batch.jobs), batch.capture)


@dataclass(frozen=True)
class GraphPlan:
    """Which graph a step replays (module doc): whole-step buckets (None: no flex kernel, or none asked for),
    the pieces' token buckets, the whole steps' query block and the hidden states they return."""

    full: Buckets | None
    pieces: tuple[int, ...]
    q_block: int = 0
    capture_layers: tuple[int, ...] = ()

    def route(self, k: StepKey) -> tuple[str, tuple[int, int] | int | None]:
        """-> ("full", (N_b, Q_b)), ("pieces", N_b) or ("eager", None).

        >>> plan = GraphPlan(graph_buckets(64, 4), piece_buckets(512), q_block=64, capture_layers=(2, 4))
        >>> plan.route(StepKey(40, 3, 64, False, ())), plan.route(StepKey(40, 3, 64, True, ()))
        (('full', (64, 4)), ('pieces', 64))
        >>> plan.route(StepKey(300, 9, 64, False, (2,))), plan.route(StepKey(600, 9, 64, False, ()))
        (('pieces', 512), ('eager', None))
        >>> plan.route(StepKey(8, 1, 64, False, (3,)))  # a hidden state the whole steps do not return
        ('pieces', 8)
        """
        if self.full is not None and not k.jobs and k.q_block == self.q_block \
                and set(k.capture) <= set(self.capture_layers):
            key = self.full.fit(k.tokens, k.blocks)
            if key is not None:
                return "full", key
        nb = next((t for t in self.pieces if t >= k.tokens), None)
        return ("pieces", nb) if nb is not None else ("eager", None)


def coverage(routes: list[str]) -> float | None:
    """The share of steps that replay a graph (whole or in pieces); None for no steps.

    >>> coverage(["full", "pieces", "eager", "pieces"])
    0.75
    """
    return sum(r != "eager" for r in routes) / len(routes) if routes else None


@dataclass
class _TokenBuffers:
    """One token bucket's static inputs: embeds [N_b, d], positions [3, N_b], slots [N_b], q_out [N_b]."""

    embeds: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    q_out: torch.Tensor


@dataclass
class _BlockBuffers:
    """One block bucket's static attention metadata (module doc): npages [Q_b] int32, indices [Q_b, pool
    pages] int32, q_gather and the four rules [Q_b*BM] long, and the BlockMask over them."""

    npages: torch.Tensor
    indices: torch.Tensor
    q_gather: torch.Tensor
    rules: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    block_mask: object = None


@dataclass
class _Recorded:
    """A bucket pair: its static ForwardBatch, and once captured its graph and output buffers."""

    batch: ForwardBatch
    graph: object = None
    hidden: torch.Tensor | None = None
    states: dict[int, torch.Tensor] = field(default_factory=dict)


class StepGraphs:
    """The step's graphs (module doc): whole steps per bucket pair over static buffers, and the pieces.

    runner: the engine's ModelRunner; plan: what is recorded (`GraphPlan`; whole steps need the flex
    kernel, q_block = the step's query block BM); capture: record CUDA graphs (else the same buffers and
    padding, run eagerly: the CPU stand-in the tests drive).
    """

    def __init__(self, runner: ModelRunner, plan: GraphPlan, capture: bool):
        self.runner, self.plan = runner, plan
        self.buckets, self.q_block = plan.full, plan.q_block
        self.capture_layers = plan.capture_layers
        self.captured = False
        self.enabled = True  # False after a failed start-up (buffers or capture): every step eager
        self.reason = "not captured (CPU stand-in: the static buffers, run eagerly)"
        self.stats = {"replayed": 0, "pieces": 0, "eager": 0}
        self.last = "eager"  # the last step's route
        self.tokens: dict[int, _TokenBuffers] = {}
        self.blocks: dict[int, _BlockBuffers] = {}
        self.recorded: dict[tuple[int, int], _Recorded] = {}
        self.pieces: StepPieces | None = None
        stage = "building the graphs' static buffers"
        try:  # every start-up error, the buffers' checks included: eager, said in describe() and the log
            self._build()
            if capture:
                stage = "capture"
                self._capture_all()
        except Exception as e:  # noqa: BLE001 - any start-up failure: eager, with its reason
            self._fall_back(stage, e)
            return
        if capture:
            self._captured()

    def _build(self) -> None:
        """The static buffers (module doc): the pieces', each token and block bucket's, and each pair's batch.
        Raises when this torch's BlockMask would not read the static block table (a graph could not reach it)."""
        runner, plan = self.runner, self.plan
        self.pieces = StepPieces(runner, plan.pieces, capture=False)
        pool, w = runner.pool, runner.w
        dev = pool.device
        buckets = plan.full or Buckets((), ())
        self.tokens = {n: _TokenBuffers(torch.zeros(n, w.hidden, dtype=w.dtype, device=dev),
                                        torch.zeros(3, n, dtype=torch.long, device=dev),
                                        torch.zeros(n, dtype=torch.long, device=dev),
                                        torch.zeros(n, dtype=torch.long, device=dev)) for n in buckets.tokens}
        for q in buckets.blocks:
            slots = q * self.q_block
            blk = _BlockBuffers(torch.zeros(q, dtype=torch.int32, device=dev),
                                torch.zeros(q, pool.pages, dtype=torch.int32, device=dev),
                                torch.zeros(slots, dtype=torch.long, device=dev),
                                tuple(torch.full((slots,), f, dtype=torch.long, device=dev) for f in SLOT_PAD))
            shape = self._meta(1, blk, self.tokens[buckets.tokens[0]])  # only the block fields are read
            blk.block_mask = flex_block_mask(shape, pool, indices=blk.indices)
            if blk.block_mask.kv_num_blocks.data_ptr() != blk.npages.data_ptr() or \
                    blk.block_mask.kv_indices.data_ptr() != blk.indices.data_ptr():
                raise RuntimeError("this torch's BlockMask copies its block table: a graph's static table would "
                                   "not reach it")
            self.blocks[q] = blk
        for n, q in buckets.pairs():
            meta = self._meta(n, self.blocks[q], self.tokens[n])
            tb = self.tokens[n]
            self.recorded[n, q] = _Recorded(ForwardBatch(embeds=tb.embeds, positions=tb.positions, slots=tb.slots,
                                                         attn=meta, capture=self.capture_layers))

    def _meta(self, n: int, blk: _BlockBuffers, tb: _TokenBuffers) -> FlexMeta:
        sa, la, sb, lb = blk.rules
        return FlexMeta(tokens=n, q_block=self.q_block, page_size=self.runner.pool.page_size, pages=blk.indices,
                        npages=blk.npages, q_gather_clamped=blk.q_gather, q_out=tb.q_out, seq_a=sa, lim_a=la,
                        seq_b=sb, lim_b=lb, block_mask=blk.block_mask)

    # ------------------------------------------------------------------ a step

    def route(self, batch: ForwardBatch) -> tuple[str, tuple[int, int] | int | None]:
        """Where this step runs: `GraphPlan.route` of its metadata (every step eager after a failed start-up)."""
        return self.plan.route(StepKey.of(batch)) if self.enabled else ("eager", None)

    def forward(self, batch: ForwardBatch) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """ModelRunner.forward's outputs for the step: replayed whole or in pieces where it routes there."""
        how, key = self.route(batch)
        self.last = how
        self.stats["replayed" if how == "full" else how] += 1
        if how == "eager":
            return self.runner.forward(batch)
        if how == "pieces":
            return self.pieces.forward(batch, key)
        self._load(batch, *key)
        rec = self.recorded[key]
        if rec.graph is not None:
            rec.graph.replay()
            hidden, states = rec.hidden, rec.states
        else:
            hidden, states = self.runner.forward(rec.batch)
        n = batch.attn.tokens
        return hidden[:n].clone(), {i: states[i][:n].clone() for i in batch.capture}

    def _load(self, batch: ForwardBatch, nb: int, qb: int) -> None:
        """Copy the step into bucket (nb, qb)'s buffers, padding the rest (module doc)."""
        m: FlexMeta = batch.attn
        n, q = m.tokens, m.blocks
        tb, blk = self.tokens[nb], self.blocks[qb]
        tb.embeds[:n].copy_(batch.embeds)
        tb.positions[:, :n].copy_(batch.positions)
        tb.slots[:n].copy_(batch.slots)
        tb.slots[n:].fill_(0)  # the scratch page's first slot
        tb.q_out[:n].copy_(m.q_out)
        tb.q_out[n:].fill_(0)
        blk.npages[:q].copy_(m.npages)
        blk.npages[q:].fill_(0)
        blk.indices[:q, : m.pages.shape[1]].copy_(m.pages)
        s = q * self.q_block
        blk.q_gather[:s].copy_(m.q_gather_clamped)
        blk.q_gather[s:].fill_(0)
        for dst, src, pad in zip(blk.rules, (m.seq_a, m.lim_a, m.seq_b, m.lim_b), SLOT_PAD):
            dst[:s].copy_(src)
            dst[s:].fill_(pad)

    # ------------------------------------------------------------------ capture

    def _idle(self, nb: int, qb: int) -> None:
        """A harmless step in bucket (nb, qb) for warm-up and capture: every token padding."""
        tb, blk = self.tokens[nb], self.blocks[qb]
        tb.embeds.zero_()
        tb.positions.zero_()
        tb.slots.zero_()
        tb.q_out.zero_()
        blk.npages.fill_(0)
        blk.npages[0] = 1
        blk.indices[:, 0] = 0
        blk.q_gather.zero_()
        for dst, pad in zip(blk.rules, SLOT_PAD):
            dst.fill_(pad)

    @torch.no_grad()  # as the engine decodes: dynamo guards on grad mode, so warm-up compiles what decoding runs
    def _capture_all(self) -> None:
        """Every bucket pair, largest first, into one memory pool, then the pieces. Raises on a failure (the
        constructor runs eagerly and says why)."""
        mempool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        for key in sorted(self.recorded, reverse=True):
            rec = self.recorded[key]
            self._idle(*key)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: compiles flex for this shape, settles the allocator
                for _ in range(2):
                    self.runner.forward(rec.batch)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=mempool):
                rec.hidden, rec.states = self.runner.forward(rec.batch)
            rec.graph = graph
        torch.cuda.synchronize()
        self.pieces._capture_all()

    def _fall_back(self, stage: str, error: Exception) -> None:
        """After a start-up failure in `stage`: what was recorded is dropped (its pool memory goes back) and
        every step runs eagerly, the reason in describe() and the log."""
        for rec in self.recorded.values():
            rec.graph, rec.hidden, rec.states = None, None, {}
        if self.pieces is not None:
            self.pieces.drop()
        self.enabled = False
        self.reason = f"{stage} failed, running eagerly: {type(error).__name__}: {error}"
        log.warning("CUDA graphs: %s", self.reason)

    def _captured(self) -> None:
        """Every graph recorded: said in describe() and the log."""
        self.captured = True
        self.reason = (f"captured {len(self.recorded)} whole-step bucket pairs and {len(self.plan.pieces)} x "
                       f"{len(self.runner.w.layers) + 1} pieces at start-up")
        log.info("CUDA graphs: %s (whole steps: tokens %s, blocks %s; pieces: tokens %s)", self.reason,
                 self.buckets.tokens if self.buckets else (), self.buckets.blocks if self.buckets else (),
                 self.plan.pieces)

    def reset_stats(self) -> None:
        self.stats.update(replayed=0, pieces=0, eager=0)

    def describe(self) -> dict:
        """What /v1/model and the rows say: the buckets, the steps per route since the last reset and their
        graph coverage (replayed whole or in pieces, over all steps)."""
        b = self.buckets or Buckets((), ())
        return {"captured": self.captured, "enabled": self.enabled, "reason": self.reason,
                "token_buckets": list(b.tokens), "block_buckets": list(b.blocks), "piece_buckets": list(self.plan.pieces),
                **self.stats, "coverage": coverage(["full"] * self.stats["replayed"] + ["pieces"] * self.stats["pieces"]
                                                   + ["eager"] * self.stats["eager"])}


def step_graphs(cfg, runner: ModelRunner, device: torch.device, *, tokens: int, q_block: int, attn_q_block: int,
                capture_layers: tuple[int, ...]) -> StepGraphs | None:
    """An engine's graphs for infer.cuda_graphs (pipeline/config.py): captured now (auto, on CUDA), the static
    stand-in (static), or None (every step eager; the monolithic decoder takes no steps). Whole steps with the
    flex kernel only; pieces with any. tokens: the step budget; q_block: the scheduler's block of branch rows;
    attn_q_block: its attention metadata's BM. A step has at most one query block per video plus one per
    q_block of branch rows, and at most the budget plus a row per branch and per video (a step's first
    prefill chunk may fill the budget whole: infer/engine/scheduler.py)."""
    mode = cfg.cuda_graphs
    if mode == "off" or cfg.decoder != "parallel" or (mode == "auto" and device.type != "cuda"):
        return None
    full = None
    if runner.kernel.name == "flex":
        blocks = cfg.max_batch_videos + -(-cfg.max_batch_rows // q_block)
        full = graph_buckets(min(cfg.graph_tokens, tokens), blocks)
    plan = GraphPlan(full, piece_buckets(tokens + cfg.max_batch_rows + cfg.max_batch_videos), attn_q_block,
                     tuple(sorted(set(capture_layers))))
    return StepGraphs(runner, plan, capture=mode == "auto")


def describe_graphs(graphs: StepGraphs | None, cfg) -> dict:
    """What /v1/model and the offline rows say about the step's graphs."""
    if graphs is not None:
        return graphs.describe()
    why = "" if cfg.cuda_graphs == "off" else " (captured on CUDA with the parallel decoder only)"
    return {"captured": False, "reason": f"infer.cuda_graphs={cfg.cuda_graphs}{why}"}
