"""The token-budget scheduler: what each step carries, for every video in flight.

    sched = Scheduler(runner, pool, step_tokens=512, q_block=16)
    plan = sched.plan(videos)            # -> StepPlan (ForwardBatch + who owns which rows), or None
    hidden, states = runner.forward(plan.batch)
    # the engine (infer/engine/core.py, CaptionEngine._absorb) hands the outputs back to each video:
    # prefill states, planning decisions, branch tokens

A video moves through three phases, each a kind of row in the shared step:

  PREFILL  chunks of its prefix, at most what is left of the step's token budget, cut only
           where the prefix mask allows (`legal_cuts`: never inside a bidirectional block). A
           bidirectional block larger than a whole step is prefilled layer by layer instead
           (`LayerJob`: at each layer the keys and values of the whole block, then the rest
           of the layer in parts: exact). A token through one layer is charged 1/layers of
           a token, so a block moves through as many layers a step as the budget left pays
           for, and costs what a chunk of its size would;
  PLAN     one row per step: the serial <G> it decided on at the previous row; the row's
           final state and grounding-layer state come back from the same forward;
  BRANCH   its K caption branches, one row each (the anchor at step 0, then the last token).

Each step is filled in that priority: every running branch row, then every planning row,
then prefill chunks and layered blocks in admission order up to `step_tokens` (several videos'
prefills share a step when the first leaves room). A newcomer's prefill thus never stalls
running videos for more than one chunk. Rows are laid out per video in query blocks
of at most `q_block` tokens (infer/engine/kernels.py); all of it is host bookkeeping done once per
step, never per layer. Pure torch; no ray.
"""

from __future__ import annotations

import bisect
import enum
import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from infer.engine.attn_meta import AttnMeta, Workspace
from infer.engine.packing import QueryBlock
from infer.engine.paged import FREE_SEQ, SCRATCH_SEQ, PagePool, Seq, pages_for, taken_pages
from infer.engine.step import ForwardBatch, LayerJob, ModelRunner


class Phase(enum.Enum):
    PREFILL = "prefill"
    PLAN = "plan"
    READY = "ready"  # planned, waiting for room for its branch rows
    BRANCH = "branch"


@dataclass
class Branch:
    event: int
    seq: Seq
    tokens: list[int] = field(default_factory=list)
    traced: list[torch.Tensor] | None = None


class VideoState:
    """A video in flight: its program (infer/engine/programs.py), its sequences, and where it is."""

    def __init__(self, request, prog, reserved: int, cap: int, extent: int = 0):
        self.request, self.prog = request, prog
        self.prefix: Seq | None = None  # opened at admission
        self.extent = extent  # the prefix's pages (its tokens and serial <G>s), set aside as one run at admission
        self.cursor = 0  # prefix tokens prefilled
        self.reserved = reserved  # pages promised to this video, not yet taken
        self.cap = cap  # tokens per branch
        self.phase = Phase.PREFILL
        self.feed_g = False  # a serial <G> goes into the next step
        self.job: LayerJob | None = None  # a bidirectional block being prefilled layer by layer
        self.chunks: dict[int, list[torch.Tensor]] = {i: [] for i in prog.capture}
        self.branches: list[Branch] = []  # active ones, in event order
        self.finished: list[Branch] = []
        self.anchors = None  # programs.Anchors once planned
        self.steps = 0  # branch steps taken (lock-step within a video)
        self.processors = request.control.processors(prog.model.eos_id)
        self.sampler = None
        self.times = {"admit": time.perf_counter()}
        self.grounding_ms = 0.0

    @property
    def rows(self) -> int:
        return len(self.branches)


@dataclass
class StepPlan:
    """One step: its ForwardBatch and the layout of its rows.

    branch: (video, first row, rows) for the branch rows, which come first ([0, n_branch));
    plan: (video, row) of each planning row; prefill: (video, first row, lo, hi) of each chunk;
    jobs: (video, LayerJob) of each layered block with a part in this step.
    """

    batch: ForwardBatch
    n_branch: int
    branch: list[tuple[VideoState, int, int]]
    plan: list[tuple[VideoState, int]]
    prefill: list[tuple[VideoState, int, int, int]]
    jobs: list[tuple[VideoState, LayerJob]] = field(default_factory=list)
    tokens: int = 0  # the main batch's (0 in a step of layered blocks only: its main batch is one scratch token)
    layer_tokens: int = 0  # what the layered blocks' parts cost, in tokens (token-layers / layers)


class Scheduler:
    """Fills each step under the token budget and lays out its metadata (module doc)."""

    def __init__(self, runner: ModelRunner, pool: PagePool, *, step_tokens: int, q_block: int):
        self.runner, self.pool = runner, pool
        self.step_tokens, self.q_block = step_tokens, q_block
        # prefill chunks attend in larger blocks: a block gathers its pages once for all its queries; the
        # step's attention metadata takes their size as its query block (flex's BM)
        self.prefill_block = 4 * q_block
        # the step's mask is rebuilt into one buffer every step
        self.mask_workspace = Workspace()
        self.part_workspace = Workspace()  # the masks of the layered blocks' parts, built as each runs
        self.device = pool.device

    # ------------------------------------------------------------------ building a step

    def _grow(self, v: VideoState, seq: Seq, length: int) -> None:
        before = len(seq.pages)
        self.pool.grow(seq, length)
        v.reserved -= len(seq.pages) - before

    def _blocks(self, first: int, count: int, pages: list[int], own: list[list[int]] | None = None,
                size: int = 0) -> list[QueryBlock]:
        """Query blocks of `size` (default q_block) over step tokens [first, first + count): each sees
        `pages` (+ its rows' own pages)."""
        out = []
        size = size or self.q_block
        for lo in range(first, first + count, size):
            hi = min(first + count, lo + size)
            extra = [p for r in range(lo - first, hi - first) for p in own[r]] if own else []
            out.append(QueryBlock(range(lo, hi), pages + extra))
        return out

    def plan(self, videos: list[VideoState]) -> StepPlan | None:
        S = self.pool.page_size
        embeds: list[torch.Tensor] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        seq_a: list[int] = []  # per token, the two (sequence, limit) rules of AttnMeta.build (only branch
        lim_a: list[int] = []  # rows have a second sequence: the others' are added as FREE_SEQ at the end)
        seq_b: list[int] = []
        lim_b: list[int] = []
        blocks: list[QueryBlock] = []
        n = 0
        branch_rows, plan_rows, chunks = [], [], []
        # 1. every running branch row (anchors at step 0, else the last token)
        tok_ids: list[int] = []
        for v in videos:
            if v.phase is not Phase.BRANCH:
                continue
            j = v.steps
            pref = v.prefix
            for b in v.branches:
                self._grow(v, b.seq, j + 1)
            if j == 0:
                embeds.append(v.anchors.anchors.to(self.runner.w.dtype))
            else:
                tok_ids.extend(b.tokens[-1] for b in v.branches)
                embeds.append(None)  # filled by one embedding gather below
            k = v.rows
            positions.append(torch.full((3, k), v.anchors.anchor_pos + j, dtype=torch.long))
            slots.append(torch.tensor([b.seq.pages[j // S] * S + j % S for b in v.branches], dtype=torch.long))
            seq_a += [pref.id] * k
            lim_a += [pref.length] * k
            seq_b += [b.seq.id for b in v.branches]
            lim_b += [j + 1] * k
            blocks += self._blocks(n, k, pref.pages, [b.seq.pages for b in v.branches])
            branch_rows.append((v, n, k))
            n += k
        n_branch = n
        # 2. one planning row per planning video
        for v in videos:
            if v.phase is not Phase.PLAN or not v.feed_g:
                continue
            pref = v.prefix
            x, pos = v.prog.plan_input()
            key = pref.length
            self._grow(v, pref, key + 1)
            embeds.append(x[None].to(self.runner.w.dtype))
            positions.append(pos[:, None].cpu())
            slots.append(self.pool.slots(pref, key, key + 1))
            seq_a.append(pref.id)
            lim_a.append(key + 1)
            blocks += self._blocks(n, 1, pref.pages)
            plan_rows.append((v, n))
            n += 1
        # 3. prefill in admission order, up to the budget: first the chunks (short causal pieces, which bring
        #    videos to their blocks), then the layered blocks, started or going on, each charged what its parts
        #    cost (a block in progress moves every step, by at least one block of queries)
        for v in videos:
            if v.phase is not Phase.PREFILL or v.job is not None:
                continue
            lo, cuts = v.cursor, v.prog.cuts
            hi = _largest_cut(cuts, lo, lo + self.step_tokens - n)
            if hi is None and not chunks and _smallest_cut(cuts, lo) - lo <= self.step_tokens:
                hi = _smallest_cut(cuts, lo)  # the step's first chunk: its next block whole, over what is left
            if hi is None:
                continue
            pref = v.prefix
            self._grow(v, pref, hi)
            embeds.append(v.prog.embeds[lo:hi].to(self.runner.w.dtype))
            positions.append(v.prog.positions[:, lo:hi].cpu())
            slots.append(self.pool.slots(pref, lo, hi))
            lims = v.prog.limits[lo:hi].tolist()
            seq_a += [pref.id] * (hi - lo)
            lim_a += lims
            blocks += self._chunk_blocks(n, pref, lims)
            chunks.append((v, n, lo, hi))
            n += hi - lo
        ends = {v: hi for v, _, _, hi in chunks}  # where each video's chunk in this step ends
        jobs: list[tuple[VideoState, LayerJob]] = []
        charged = 0  # what the layered parts cost, in tokens
        for v in videos:
            if v.phase is not Phase.PREFILL:
                continue
            if v.job is None:  # its next block, after its chunk (whose keys it sees at each layer)
                v.job = self._new_job(v, ends.get(v, v.cursor), self.step_tokens - n - charged, not (chunks or jobs))
            if v.job is not None:
                charged += self._job_parts(v.job, self.step_tokens - n - charged)
                jobs.append((v, v.job))
        if n == 0 and not jobs:
            return None
        # a step of layered blocks only: its main batch (never empty) is one scratch token, whose KV goes to the
        # scratch page; it sees only the scratch page's first key and nothing reads its output
        if n == 0:
            w = self.runner.w
            embeds = [torch.zeros(1, w.hidden, dtype=w.dtype, device=self.device)]
            positions, slots = [torch.zeros(3, 1, dtype=torch.long)], [torch.zeros(1, dtype=torch.long)]
            blocks, seq_a, lim_a = [QueryBlock([0], [0])], [SCRATCH_SEQ], [1]
        table = self.pool.pending()  # the page table's changes ride in the step's copy
        pos, slot, ids, *table = self.pool.staging.to_device([
            torch.cat(positions, dim=1), torch.cat(slots), torch.tensor(tok_ids, dtype=torch.long),
            *(() if table is None else (table, taken_pages(table)))])  # one copy on CUDA
        if table:
            self.pool.apply(*table)
        capture = tuple(sorted({i for v, *_ in plan_rows + chunks for i in v.prog.capture}))
        free = len(seq_a) - n_branch
        attn = self._meta(blocks, seq_a, lim_a, seq_b + [FREE_SEQ] * free, lim_b + [0] * free, self.prefill_block,
                          self.mask_workspace)
        if tok_ids:  # the branch tokens of every video: one embedding gather
            pieces = iter(self.runner.embed(ids).split([k for (_, _, k), e in zip(branch_rows, embeds) if e is None]))
            embeds = [next(pieces) if e is None else e for e in embeds]
        batch = ForwardBatch(embeds=torch.cat(embeds), positions=pos, slots=slot, attn=attn, capture=capture,
                             jobs=tuple(job for _, job in jobs))
        return StepPlan(batch, n_branch, branch_rows, plan_rows, chunks, jobs, tokens=n, layer_tokens=charged)

    def _meta(self, blocks: list[QueryBlock], seq_a: Sequence[int], lim_a: Sequence[int], seq_b: Sequence[int],
              lim_b: Sequence[int], q_block: int, workspace: Workspace | None = None) -> AttnMeta:
        """AttnMeta.build for this pool and kernel (its arguments there)."""
        w = self.runner.w
        return AttnMeta.build(blocks, seq_a, lim_a, seq_b, lim_b, q_block=q_block, pool=self.pool,
                              kernel=self.runner.kernel, group=w.heads // w.kv_heads, workspace=workspace)

    def _chunk_blocks(self, first: int, pref: Seq, lims: list[int]) -> list[QueryBlock]:
        """Query blocks of a prefill chunk at step tokens [first, first + len(lims)): each sees the prefix
        pages up to the furthest limit among its tokens."""
        out = self._blocks(first, len(lims), [], size=self.prefill_block)
        for blk in out:
            last = max(lims[t - first] for t in blk.tokens)
            blk.pages = pref.pages[: pages_for(last, self.pool.page_size)]
        return out

    def _new_job(self, v: VideoState, lo: int, room: int, alone: bool) -> LayerJob | None:
        """v's block at prefix token lo as a LayerJob if no step can hold it whole (its pages now) and the
        step has room for a part, else None."""
        if lo == v.prog.length or (room <= 0 and not alone):
            return None
        hi = _smallest_cut(v.prog.cuts, lo)
        if hi - lo <= self.step_tokens:
            return None
        pref, prog, w = v.prefix, v.prog, self.runner.w
        self._grow(v, pref, hi)
        cos, sin = self.runner.rope(prog.positions[:, lo:hi].to(self.device), w.dtype)
        return LayerJob(x=prog.embeds[lo:hi].to(w.dtype), cos=cos, sin=sin,
                        slots=self.pool.slots(pref, lo, hi).to(self.device), capture=prog.capture, span=(lo, hi),
                        meta=functools.partial(self._part_meta, pref, prog.limits[lo:hi]))

    def _job_parts(self, job: LayerJob, room: int) -> int:
        """The job's parts in this step: `room` tokens' worth of its work (a token through one layer is
        1/layers of a token; at least one block of queries), in parts of at most step_tokens queries.
        -> what they cost, in tokens (rounded up).

        >>> from types import SimpleNamespace as NS
        >>> sched = NS(runner=NS(w=NS(layers=[0] * 4)), step_tokens=8, prefill_block=4)
        >>> job = NS(layer=0, at=6, tokens=10, parts=())
        >>> Scheduler._job_parts(sched, job, 5), job.parts   # 20 token-layers: the rest of layer 0, then on
        (5, ((0, 6, 10), (1, 0, 8), (1, 8, 10), (2, 0, 6)))
        >>> Scheduler._job_parts(sched, NS(layer=3, at=0, tokens=10, parts=()), 0)  # at least 4 token-layers
        1
        """
        layers = len(self.runner.w.layers)
        share = max(room * layers, self.prefill_block)
        parts, li, a, n = [], job.layer, job.at, job.tokens
        while share > 0 and li < layers:
            b = min(n, a + share, a + self.step_tokens)
            parts.append((li, a, b))
            share -= b - a
            li, a = (li + 1, 0) if b == n else (li, b)
        job.parts = tuple(parts)
        return -(-sum(b - a for _, a, b in parts) // layers)

    def _part_meta(self, seq: Seq, limits: torch.Tensor, a: int, b: int) -> AttnMeta:
        """The attention metadata of a layered block's tokens [a, b) (`limits`: the block's), its masks in
        the one workspace of the layered parts (a part's meta is used before the next is built)."""
        lims = limits[a:b].tolist()
        return self._meta(self._chunk_blocks(0, seq, lims), [seq.id] * (b - a), lims, [FREE_SEQ] * (b - a),
                          [0] * (b - a), self.prefill_block, self.part_workspace)


def _largest_cut(cuts: list[int], lo: int, hi: int) -> int | None:
    """The largest legal cut in (lo, hi], or None."""
    i = bisect.bisect_right(cuts, hi) - 1
    return cuts[i] if i >= 0 and cuts[i] > lo else None


def _smallest_cut(cuts: list[int], lo: int) -> int:
    return cuts[bisect.bisect_right(cuts, lo)]
