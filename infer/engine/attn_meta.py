"""A step's attention metadata for the kernels of infer/engine/kernels.py, built once per step, shared by the layers.

    meta = AttnMeta.build(blocks, seq_a, lim_a, seq_b, lim_b, q_block=..., pool=pool, kernel=kernel)

What a token may see (the two-sequence rule) and the query blocks are described in infer/engine/kernels.py.
Per kernel: GatherMeta for the gathering kernels (reference, sdpa: the blocks packed into dense calls
by infer/engine/packing.py, each call's queries, pages and additive mask laid out once) and FlexMeta for
FlexAttention (one block per scheduler block, its page list; the BlockMask built from it by
`flex_block_mask`). Workspace: a reusable buffer for the gathered pages and the masks. These
functions read only a kernel's `name`, `contract`, `max_calls` and `workspace`.
Pure torch; no ray. Tests: tests/test_kernels.py, tests/test_graphs.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from infer.engine.packing import CALL_COST, GATHER_ROWS, Call, QueryBlock, kernel_calls, round_up
from infer.engine.paged import FREE_SEQ, SCRATCH_SEQ


class _Multiples(Protocol):
    q_block_multiple: int  # query blocks come in multiples of this


class KernelTraits(Protocol):
    """What building the metadata reads of a kernel (infer/engine/kernels.py `Kernel` has it): this module
    imports no kernel, so kernels.py may import the metadata without a cycle."""

    name: str
    contract: _Multiples
    max_calls: int
    workspace: Workspace


@dataclass
class GatherCall:
    """One call of a gathering kernel, valid for one step: `bins` blocks of `q_block` padded queries, each
    over `width` gathered pages. k, v [bins, Hkv, width*S, D]: views into the step's gathered pages
    (GatherMeta.kv_out, refilled at every layer); at >= 0: instead one block whose pages are the run
    at, at+1, ..., read in place as a view of each layer of the pool (`in_place`; k, v None); visible
    [bins, 1, q_block*g, width*S]: the additive mask
    (0 visible, -inf hidden) in the pool's dtype, rows (query, head in its KV group) as q is laid out."""

    bins: int
    q_block: int
    width: int
    k: torch.Tensor | None
    v: torch.Tensor | None
    visible: torch.Tensor
    at: int = -1

    def keys(self, layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [bins, Hkv, width*S, D] of this call at one pool layer [P*S, 2, Hkv, D]."""
        if self.at < 0:
            return self.k, self.v
        S = self.visible.shape[-1] // self.width  # the page size
        run = layer[self.at * S:(self.at + self.width) * S]  # the pages themselves: no copy
        return run.permute(1, 2, 0, 3)[:, None].unbind(0)


def in_place(block: QueryBlock, page_size: int) -> bool:
    """Whether a gathering kernel reads this block's pages in place (one call of its own) rather than packed
    with others: its pages are one run of consecutive ids (a prefix's extent, infer/engine/paged.py) and
    gathering them would cost more than a call (infer/engine/packing.py's cost units).

    >>> in_place(QueryBlock([0], range(40, 48)), 16), in_place(QueryBlock([0], [40, 41, 43]), 16)
    (True, False)
    """
    p = list(block.pages)
    return (len(block.tokens) > 0 and len(p) * page_size * GATHER_ROWS >= CALL_COST
            and p == list(range(p[0], p[0] + len(p))))


@dataclass
class AttnMeta:
    """A step's attention metadata (module doc); device tensors, built once per step by `build`, as the
    chosen kernel's subclass (GatherMeta or FlexMeta). tokens: N; q_block: BM; page_size: S."""

    tokens: int
    q_block: int
    page_size: int

    @staticmethod
    def build(blocks: Sequence[QueryBlock], seq_a: Sequence[int], lim_a: Sequence[int], seq_b: Sequence[int],
              lim_b: Sequence[int], *, q_block: int, pool, kernel: KernelTraits, group: int = 1,
              workspace: Workspace | None = None) -> AttnMeta:
        """Host description of a step -> AttnMeta on the pool's device (a few copies in all).

        seq_*/lim_* are per step token (N of them); a token with no second sequence has
        seq_b = -1 (FREE: matches no page a sequence holds) and lim_b = 0. workspace: where the
        additive masks are written (the caller's buffer, reused step after step; the meta is valid
        until the next build into it); None = a fresh tensor.
        """
        rules = [torch.as_tensor(list(x), dtype=torch.long) for x in (seq_a, lim_a, seq_b, lim_b)]
        if kernel.name == "flex":
            return _flex_meta(blocks, rules, q_block, pool, kernel)
        return _gather_meta(blocks, rules, pool, kernel, group, workspace)


@dataclass
class GatherMeta(AttnMeta):
    """The gathering kernels' (reference, sdpa) meta. q_block: the largest of the calls'.
    calls: their GatherCalls (infer/engine/packing.py decides them); pages_flat [P]: every call's pages, call
    after call, bin after bin (padded with page 0); kv_out [P, S*2*Hkv*D]: where a layer's pages are
    gathered (the kernel's workspace; the calls' k, v view it); q_tok, q_head [R]: the step token and
    query head of each row of the calls' folded queries (R = sum of bins x Hkv x BM x g; padding rows
    repeat token 0, their outputs are never read); q_split: each call's rows; out_rows [N*Hq]: where
    (token, head) sits among the calls' outputs."""

    calls: tuple[GatherCall, ...]
    pages_flat: torch.Tensor
    kv_out: torch.Tensor
    q_tok: torch.Tensor
    q_head: torch.Tensor
    q_split: tuple[int, ...]
    out_rows: torch.Tensor


@dataclass
class FlexMeta(AttnMeta):
    """FlexAttention's meta. pages [Qb, B] long, npages [Qb] int32: the pages each block may see;
    q_gather_clamped [Qb*BM]: step token of each padded query slot (padding: token 0); q_out [N]: padded
    slot of each step token; seq_a, lim_a, seq_b, lim_b [Qb*BM]: per slot, the two (sequence, limit)
    pairs; block_mask: the FlexAttention BlockMask (built by the kernel at the step's first layer)."""

    pages: torch.Tensor
    npages: torch.Tensor
    q_gather_clamped: torch.Tensor
    q_out: torch.Tensor
    seq_a: torch.Tensor
    lim_a: torch.Tensor
    seq_b: torch.Tensor
    lim_b: torch.Tensor
    block_mask: object | None = None

    @property
    def blocks(self) -> int:
        return int(self.pages.shape[0])


def _slots(blocks: Sequence[QueryBlock], n: int, q_block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Blocks -> gather [Qb, BM] (step token of each slot, n = padding), pages [Qb, B] (padded with
    page 0), npages [Qb] int32."""
    width = max(1, max(len(b.pages) for b in blocks))
    gather = torch.full((len(blocks), q_block), n, dtype=torch.long)
    page_t = torch.zeros((len(blocks), width), dtype=torch.long)
    npages = torch.zeros(len(blocks), dtype=torch.int32)
    for i, b in enumerate(blocks):
        gather[i, : len(b.tokens)] = torch.as_tensor(list(b.tokens), dtype=torch.long)
        page_t[i, : len(b.pages)] = torch.as_tensor(list(b.pages), dtype=torch.long)
        npages[i] = len(b.pages)
    return gather, page_t, npages


# (seq_a, lim_a, seq_b, lim_b) of a padding query slot: the scratch sequence with limit 1 (it sees
# its block's first key, so no row is all -inf) and no second rule. The CUDA graphs' static
# buffers (infer/engine/graphs.py) pad with the same values.
SLOT_PAD = (SCRATCH_SEQ, 1, FREE_SEQ, 0)


def pow2(n: int) -> int:
    """The smallest power of two >= max(n, 1)."""
    return 1 << (max(1, n) - 1).bit_length()


def _per_slot(rules: list[torch.Tensor], gather: torch.Tensor) -> list[torch.Tensor]:
    """The per-token (seq_a, lim_a, seq_b, lim_b) at each padded slot (padding: SLOT_PAD)."""
    return [torch.cat([r, torch.tensor([f])])[gather] for r, f in zip(rules, SLOT_PAD)]


def _visibility(page_t: torch.Tensor, npages: torch.Tensor, slot_rules: list[torch.Tensor], pool) -> torch.Tensor:
    """[Qb, BM, B*S] bool: which gathered key each padded query slot sees (module doc's rule); all on
    the pool's device."""
    S = pool.page_size
    qb, width = page_t.shape
    owner = pool.owner[page_t]  # [Qb, B]
    first = pool.start[page_t]
    real = torch.arange(width, device=owner.device)[None] < npages[:, None].long()
    owner = owner.masked_fill(~real, -3)  # padding page slots: nobody's
    kseq = owner.repeat_interleave(S, dim=1)[:, None]  # [Qb, 1, T]
    kidx = (first[:, :, None] + torch.arange(S, device=owner.device)).flatten(1)[:, None]
    sa, la, sb, lb = (r.view(qb, -1, 1) for r in slot_rules)
    return ((kseq == sa) & (kidx < la)) | ((kseq == sb) & (kidx < lb))


def _gather_meta(blocks, rules, pool, kernel: KernelTraits, group: int, workspace: Workspace | None) -> GatherMeta:
    """A gathering kernel's meta: the blocks planned into calls (infer/engine/packing.py), each call's queries,
    pages and mask laid out once, for every layer of the step."""
    n, S, mult = len(rules[0]), pool.page_size, kernel.contract.q_block_multiple
    kv = pool.layer[0]
    _, _, hkv, d = kv.shape
    hq = hkv * group
    runs = [b for b in blocks if in_place(b, S)]
    rest = [b for b in blocks if not in_place(b, S)]
    calls = [(c, -1) for c in (kernel_calls(rest, group, S, kernel.max_calls, mult) if rest or not runs else [])]
    calls += [(Call(round_up(len(b.tokens), mult), [b]), b.pages[0]) for b in runs]
    q_tok, q_head, pages, masks, shapes = [], [], [], [], []
    out_rows = torch.zeros(n * hq, dtype=torch.long)
    heads = torch.arange(hq).view(1, hkv, 1, group)
    row, dev = 0, pool.device
    for c, first in calls:
        bm = c.rows(mult)
        gather, page_t, npages = _slots(c.bins, n, bm)
        vis = _visibility(page_t.to(dev), npages.to(dev), [r.to(dev) for r in _per_slot(rules, gather)], pool)
        vis[..., 0] |= (gather == n).to(dev)  # a padding slot sees its block's first key; vis [bins, BM, W*S]
        bins, width = page_t.shape
        tok = gather.view(bins, 1, bm, 1).expand(bins, hkv, bm, group)
        head = heads.expand(bins, hkv, bm, group)
        at = row + torch.arange(tok.numel()).view(tok.shape)
        real = tok < n
        out_rows[(tok * hq + head)[real]] = at[real]
        q_tok.append(torch.where(real, tok, 0).flatten())
        q_head.append(head.flatten())
        if first < 0:
            pages.append(page_t.flatten())
        masks.append(vis[:, :, None].expand(bins, bm, group, width * S))
        shapes.append((bins, bm, width, first))
        row += tok.numel()
    pages_flat = (torch.cat(pages) if pages else torch.zeros(0, dtype=torch.long)).to(dev)
    src = pool.layer_pages[0]
    kv_out = kernel.workspace.take(pages_flat.numel(), src.shape[1], src)
    mask_all = (workspace or Workspace()).take(1, sum(m.numel() for m in masks), kv)[0]
    zero = torch.zeros((), dtype=pool.dtype, device=dev)
    built, p_at, m_at = [], 0, 0
    for (bins, bm, width, at), m in zip(shapes, masks):
        vis = mask_all[m_at:m_at + m.numel()].view(m.shape)
        torch.where(m, zero, zero - float("inf"), out=vis)
        k = v = None
        if at < 0:
            g = kv_out[p_at:p_at + bins * width].view(bins, width * S, 2, hkv, d).permute(2, 0, 3, 1, 4)
            k, v = g.unbind(0)
            p_at += bins * width
        built.append(GatherCall(bins, bm, width, k, v, vis.view(bins, 1, bm * group, width * S), at))
        m_at += m.numel()
    return GatherMeta(tokens=n, q_block=max(c.q_block for c in built), page_size=S, calls=tuple(built),
                    pages_flat=pages_flat, kv_out=kv_out, q_tok=torch.cat(q_tok).to(dev),
                    q_head=torch.cat(q_head).to(dev), q_split=tuple(c.bins * hkv * c.q_block * group for c in built),
                    out_rows=out_rows.to(dev))


def flex_work(blocks: Sequence[QueryBlock], lim_a: Sequence[int], lim_b: Sequence[int], q_block: int,
              page_size: int) -> tuple[int, int]:
    """(computed, needed) query-key pairs of one step under FlexAttention, per query head, by arithmetic.

    computed: what the BlockMask makes flex compute, every block padded to `q_block` query rows and
    each listed page read whole (blocks x q_block rows x listed pages x page_size keys); needed: what
    the step's tokens see, sum over tokens of lim_a + lim_b (a token's two sequences never overlap:
    a branch row's second sequence is its own branch). Their ratio is the padding the step pays.

    A video with 3 branch rows at step 2 over a 40-token prefix (pages of 16: 3 prefix pages and
    one page per branch), in a 16-row block:

    >>> flex_work([QueryBlock(range(3), [0, 1, 2, 7, 8, 9])], [40] * 3, [2] * 3, q_block=16, page_size=16)
    (1536, 126)
    """
    computed = sum(q_block * len(b.pages) * page_size for b in blocks if len(b.tokens))
    return computed, int(sum(lim_a) + sum(lim_b))


def _flex_meta(blocks, rules, q_block: int, pool, kernel: KernelTraits) -> FlexMeta:
    """FlexAttention's meta: one block per scheduler block (no packing: flex reads only the listed pages
    of each block, so several videos in one block would compute as much and in fewer parallel tiles),
    their number rounded up to a power of two and a fixed query block (compiled flex specialises on
    shapes: a decode stays within a handful of compiled variants)."""
    n = len(rules[0])
    if max(len(b.tokens) for b in blocks) > q_block:
        raise ValueError(f"a query block of {max(len(b.tokens) for b in blocks)} tokens over q_block {q_block}")
    qb = len(blocks)
    blocks = list(blocks) + [QueryBlock((), ())] * (pow2(qb) - qb)
    gather, page_t, npages = _slots(blocks, n, q_block)
    gather = gather.flatten()
    out = torch.empty(n, dtype=torch.long)
    real = gather < n
    out[gather[real]] = torch.arange(gather.numel())[real]
    pages, npages, q_gather, q_out, sa, la, sb, lb = pool.staging.to_device(
        [page_t, npages, torch.where(real, gather, 0), out, *_per_slot(rules, gather)])  # one copy on CUDA
    return FlexMeta(tokens=n, q_block=q_block, page_size=pool.page_size, pages=pages, npages=npages,
                    q_gather_clamped=q_gather, q_out=q_out, seq_a=sa, lim_a=la, seq_b=sb, lim_b=lb)


def check_flex_block(page_size: int, kv_block: int, block_n: int = 0) -> None:
    """Refuse FlexAttention blocks that span a page: flex groups keys into blocks of the BlockMask's KV block
    and the kernel's BLOCK_N (kernel_options), and a block over a page boundary makes the reduction order,
    so the result, depend on where the pages physically sit (pytorch/pytorch#182593). Both must divide the
    page size.

    >>> check_flex_block(128, 128, 64)
    >>> check_flex_block(16, 32)
    Traceback (most recent call last):
    ValueError: a FlexAttention KV block of 32 keys (BLOCK_N 0) spans pages of 16: results would depend on page placement
    """
    if kv_block > page_size or page_size % kv_block or (block_n and page_size % block_n):
        raise ValueError(f"a FlexAttention KV block of {kv_block} keys (BLOCK_N {block_n}) spans pages of {page_size}: "
                         "results would depend on page placement")


def flex_block_mask(meta: FlexMeta, pool, indices: torch.Tensor | None = None, block_n: int = 0):
    """The step's BlockMask over the whole pool: the blocks' pages as kv blocks (the index as wide as
    the pool's pages: compiled FlexAttention's lowering asserts that the keys passed are no more than the
    index's width x the KV block), the rule as mask_mod; block_n: the kernel's BLOCK_N (`check_flex_block`). The kernel builds it at
    the step's first layer (a step replayed from a CUDA graph never builds one: infer/engine/graphs.py).

    indices: a [blocks, pool pages] int32 buffer the caller fills (a graph's static one, whose later
    contents the mask then reads); None = a fresh one filled from meta.pages. The BlockMask holds
    meta.npages and indices themselves, not copies."""
    from torch.nn.attention.flex_attention import BlockMask

    S = meta.page_size
    check_flex_block(S, S, block_n)
    if indices is None:
        indices = torch.zeros(meta.blocks, pool.pages, dtype=torch.int32, device=meta.pages.device)
        indices[:, : meta.pages.shape[1]] = meta.pages
    owner, start = pool.owner, pool.start
    sa, la, sb, lb = meta.seq_a, meta.lim_a, meta.seq_b, meta.lim_b

    def mask_mod(b, h, q_idx, kv_idx):
        page = kv_idx // S
        seq, idx = owner[page], start[page] + kv_idx % S
        return ((seq == sa[q_idx]) & (idx < la[q_idx])) | ((seq == sb[q_idx]) & (idx < lb[q_idx]))

    return BlockMask.from_kv_blocks(meta.npages[None, None], indices[None, None],
                                    BLOCK_SIZE=(meta.q_block, S), mask_mod=mask_mod,
                                    seq_lengths=(meta.blocks * meta.q_block, pool.pages * S),
                                    compute_q_blocks=False)  # forward only: no transposed (q-block) index


class Workspace:
    """A reusable buffer (grown, never shrunk) for the gathered pages or the step's masks. A fresh tensor
    per step would be a new large allocation each time: on the CPU that is fresh memory from the OS, page
    faults and zeroing that cost 3x the copy itself."""

    def __init__(self):
        self.buf: torch.Tensor | None = None

    def take(self, rows: int, width: int, like: torch.Tensor) -> torch.Tensor:
        need = rows * width
        b = self.buf
        if b is None or b.numel() < need or b.dtype != like.dtype or b.device != like.device:
            self.buf = b = torch.empty(need, dtype=like.dtype, device=like.device)
        return b[:need].view(rows, width)
