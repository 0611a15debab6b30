"""Attention over the paged KV pool: one interface, kernels with public contracts, a pure-torch reference.

    kernel = choose_kernel("auto", dtype, device)               # "sdpa" on CPU, "flex" on CUDA
    meta = AttnMeta.build(plan, pool, kernel, scratch)          # once per step, shared by the layers
    o = kernel(q, pool, layer, meta, scale)                     # q [N, Hq, D] -> o [N, Hq * D]

What a step asks of attention. The N tokens of a step (prefill chunks, planning rows, branch
rows of many videos) each see at most two sequences of the pool (infer/paged.py): query t
sees key i of sequence s iff (s == seq_a[t] and i < lim_a[t]) or (s == seq_b[t] and i <
lim_b[t]). A prefill token sees its video's prefix up to its causal limit (the end of the
audio-visual block for a token inside a bidirectional block); a planning row sees the prefix
and the serial <G>s so far; a branch row sees its video's prefix (all of it) and its own
branch. One softmax over both: no log-sum-exp merge is needed, and the shared prefix pages
are read once per query block, not once per branch (the cascade, without copies).

Query blocks. The scheduler cuts the step's tokens into blocks of one video each (its decode
rows, a planning row, a prefill piece), and `pack_blocks` repacks them into blocks of at most F
tokens (F chosen per step; blocks of several videos share one, each token still seeing only its
own sequences) so that a kernel call, which pads every block to the fullest and the widest, does
little padded work. A block lists the pages its tokens may see (`pages` [Qb, B], padded with
the scratch page 0, `npages` [Qb]). That is FlexAttention's block-sparse description (BlockMask.from_kv_blocks
with BLOCK_SIZE = (q_block, page_size)), and the reference and the SDPA kernel gather exactly
those pages. The visibility above is the mask_mod.

Kernels (`infer.kernel`; chosen explicitly, never a silent fallback):
  "reference"  pure torch: gather the blocks' pages, fp32 scores, mask, softmax, fp32 sum;
               the oracle. It enforces the contract of the kernel it stands in for
               (`contract=`), so CPU tests drive the exact glue a GPU kernel runs.
  "sdpa"       the same gather, then torch.nn.functional.scaled_dot_product_attention with
               the boolean mask (public API; CPU default).
  "flex"       torch.nn.attention.flex_attention over the whole pool with the BlockMask
               (public API; compiled through Triton on CUDA, the CUDA default; eager on the
               CPU, for tests on small pools).
No private aten call anywhere: their signatures differ between torch releases.
Pure torch; no ray. Tests: tests/test_kernels.py.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

log = logging.getLogger("padcap.infer")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Contract:
    """What a kernel accepts: dtypes, and the alignment of page and query-block sizes."""

    dtypes: tuple[torch.dtype, ...] = _DTYPES
    page_multiple: int = 1
    q_block_multiple: int = 1
    max_head_dim: int = 256

    def check(self, q: torch.Tensor, kv: torch.Tensor, meta: "AttnMeta") -> None:
        """Raise ValueError naming the broken rule (shapes, dtypes, alignment). kv: one layer of the pool."""
        if q.ndim != 3 or kv.ndim != 4 or kv.shape[1] != 2:
            raise ValueError(f"attention wants q [N, Hq, D] and a pool layer [keys, 2, Hkv, D]; got q {tuple(q.shape)}, "
                             f"kv {tuple(kv.shape)}")
        if q.dtype != kv.dtype or q.dtype not in self.dtypes:
            raise ValueError(f"attention dtypes q {q.dtype}, kv {kv.dtype}: need one of {self.dtypes}")
        n, hq, d = q.shape
        keys, _, hkv, dk = kv.shape
        if d != dk or d > self.max_head_dim or hq % hkv:
            raise ValueError(f"attention head dims: q {hq}x{d}, kv {hkv}x{dk} (Hq % Hkv == 0, D <= {self.max_head_dim})")
        if meta.page_size % self.page_multiple or keys % meta.page_size:
            raise ValueError(f"page size {meta.page_size} must be a multiple of {self.page_multiple} and divide the "
                             f"pool's {keys} keys")
        if meta.q_block % self.q_block_multiple:
            raise ValueError(f"query block {meta.q_block} must be a multiple of {self.q_block_multiple}")
        if n != meta.tokens:
            raise ValueError(f"{n} queries for a step of {meta.tokens} tokens")

    def check_sizes(self, page_size: int, q_blocks: tuple[int, ...], kernel: str) -> None:
        """At start-up: the engine's page size and query blocks suit this kernel (else a clear error then,
        not in the middle of a batch)."""
        if page_size % self.page_multiple or any(q % self.q_block_multiple for q in q_blocks):
            raise ValueError(f"infer.kernel={kernel} takes pages and query blocks in multiples of "
                             f"{self.page_multiple} / {self.q_block_multiple}; got infer.page_size={page_size}, "
                             f"query blocks {q_blocks} (infer.q_block and 4 x infer.q_block for prefill)")


@dataclass
class BlockPlan:
    """One query block as the scheduler describes it (host): its step tokens and the pages they may see."""

    tokens: Sequence[int]
    pages: Sequence[int]


@dataclass
class AttnMeta:
    """A step's attention metadata (module doc); device tensors, built once per step.

    tokens: N; q_block: BM; page_size: S;
    q_gather [Qb*BM]: step token of each padded query slot (N = padding); q_gather_clamped: the same
    with padding pointing at token 0 (a query whose output nobody reads);
    q_out [N]: padded slot of each step token;
    pages [Qb, B] long, npages [Qb] int32: the pages each block may see (padded with page 0); pages_flat:
    pages as [Qb*B];
    seq_a, lim_a, seq_b, lim_b [Qb*BM]: per padded query slot, the two (sequence, limit) pairs;
    visible [Qb, 1, BM*g, B*S]: the mask over the gathered keys as an additive mask in the pool's dtype
    (0 visible, -inf hidden), rows as the kernels lay out the queries (query, head in its KV group)
    (reference / sdpa kernels);
    block_mask: the FlexAttention BlockMask (flex kernel only).
    """

    tokens: int
    q_block: int
    page_size: int
    q_gather: torch.Tensor
    q_gather_clamped: torch.Tensor
    q_out: torch.Tensor
    pages: torch.Tensor
    pages_flat: torch.Tensor
    npages: torch.Tensor
    seq_a: torch.Tensor
    lim_a: torch.Tensor
    seq_b: torch.Tensor
    lim_b: torch.Tensor
    visible: torch.Tensor | None = None
    block_mask: object | None = None

    @property
    def blocks(self) -> int:
        return int(self.pages.shape[0])

    @staticmethod
    def build(blocks: Sequence[BlockPlan], seq_a: Sequence[int], lim_a: Sequence[int], seq_b: Sequence[int],
              lim_b: Sequence[int], *, q_block: int, pool, kernel: "Kernel", group: int = 1,
              workspace: "Workspace | None" = None) -> "AttnMeta":
        """Host description of a step -> AttnMeta on the pool's device (one copy per tensor).

        seq_*/lim_* are per step token (N of them); a token with no second sequence has
        seq_b = -1 (FREE: matches no page a sequence holds) and lim_b = 0. workspace: where the
        additive mask is written (the caller's buffer, reused step after step; the meta is valid
        until the next build into it); None = a fresh tensor.
        """
        from infer.paged import SCRATCH_SEQ

        n, S = len(seq_a), pool.page_size
        if kernel.name == "flex":
            # compiled FlexAttention specialises on shapes: a fixed query block and the number of blocks
            # rounded up to a power of two keep a decode to a handful of compiled variants
            blocks = pack_blocks(blocks, (q_block,), group)
            qb = len(blocks)
            blocks = list(blocks) + [BlockPlan((), ())] * ((1 << (qb - 1).bit_length()) - qb)
        else:
            mult = kernel.contract.q_block_multiple
            sizes = sorted({-(-f // mult) * mult for f in _SIZES if f < q_block} | {q_block})
            blocks = pack_blocks(blocks, tuple(sizes), group)
            fill = max(1, max(len(b.tokens) for b in blocks))
            q_block = -(-fill // mult) * mult
        qb = len(blocks)
        width = max(1, max(len(b.pages) for b in blocks))
        gather = torch.full((qb, q_block), n, dtype=torch.long)
        page_t = torch.zeros((qb, width), dtype=torch.long)
        npages = torch.zeros(qb, dtype=torch.int32)
        for i, b in enumerate(blocks):
            gather[i, : len(b.tokens)] = torch.as_tensor(list(b.tokens), dtype=torch.long)
            page_t[i, : len(b.pages)] = torch.as_tensor(list(b.pages), dtype=torch.long)
            npages[i] = len(b.pages)
        gather = gather.flatten()
        out = torch.empty(n, dtype=torch.long)
        real = gather < n
        out[gather[real]] = torch.arange(qb * q_block)[real]
        pad = lambda vals, fill: torch.cat([torch.as_tensor(list(vals), dtype=torch.long),  # noqa: E731
                                            torch.tensor([fill])])[gather]
        dev = pool.device
        page_t = page_t.to(dev)
        meta = AttnMeta(tokens=n, q_block=q_block, page_size=S, q_gather=gather.to(dev),
                        q_gather_clamped=torch.where(gather < n, gather, 0).to(dev), q_out=out.to(dev),
                        pages=page_t, pages_flat=page_t.flatten(), npages=npages.to(dev),
                        seq_a=pad(seq_a, SCRATCH_SEQ).to(dev),
                        lim_a=pad(lim_a, 1).to(dev), seq_b=pad(seq_b, -1).to(dev), lim_b=pad(lim_b, 0).to(dev))
        if kernel.name == "flex":
            meta.block_mask = flex_block_mask(meta, pool)
        else:
            vis = gathered_visibility(meta, pool)  # [Qb, BM, T]
            # as an additive mask in the model's dtype, once per step (a bool mask is converted in every call),
            # rows (query, head in group) as the kernels lay out the queries
            qb_, bm, t = vis.shape
            out = (workspace or Workspace()).take(qb_ * bm * group, t, pool.layer[0]).view(qb_, bm, group, t)
            zero = torch.zeros((), dtype=pool.dtype, device=dev)
            torch.where(vis[:, :, None].expand(qb_, bm, group, t), zero, zero - float("inf"), out=out)
            meta.visible = out.view(qb_, 1, bm * group, t)
        return meta


_SIZES = (4, 8, 16, 32, 64)  # the query-block sizes pack_blocks tries for a gathering kernel
# gathering a key costs about what 16 query rows attending to it cost (fp32 on the 2-core CPU box: 0.15 us a
# key gathered, 0.009 us a key per query row in SDPA; both scale with Hkv x D, so the ratio holds across shapes)
GATHER_ROWS = 16


def pack_blocks(blocks: Sequence[BlockPlan], sizes: Sequence[int], group: int) -> list[BlockPlan]:
    """The step's query blocks repacked to cost the kernel least: -> blocks of at most F tokens, F one of `sizes`.

    A step's blocks are cut per video (decode rows, a planning row, prefill pieces), so their token
    counts and page counts differ widely, while a kernel call pads every block to the fullest block's
    tokens (F) and widest block's pages (W): a block of 3 decode rows beside one of 16, or a planning row
    beside a prefill piece of 64, would compute as much as the full ones. For each F, blocks longer
    than F are split (each piece sees the block's pages) and the pieces are packed first-fit-decreasing
    into bins of at most F tokens whose pages (a union: pieces of one sequence share pages) stay within
    W, the widest single piece; the F with the least cost, bins x W x (F * group + GATHER_ROWS) (query
    rows times keys, plus the gather of the keys), wins. Exact: each token still sees only its own sequences
    (the visibility rule is per token); packing only changes which tokens share a block.
    """
    real = [b for b in blocks if len(b.tokens)]
    if not real:
        return list(blocks)
    best: tuple[float, list[list[tuple[list[int], list[int]]]]] | None = None
    for F in sizes:
        pieces = [(list(b.tokens[lo:lo + F]), list(b.pages)) for b in real for lo in range(0, len(b.tokens), F)]
        W = max(1, max(len(p) for _, p in pieces))
        pieces.sort(key=lambda t: (-len(t[1]), -len(t[0])))
        # a bin: [tokens, {first page: widest piece starting there}, pages]; pieces that start on the same
        # page are one sequence's (a prefix and its prefixes): their union is the widest of them
        bins: list[list] = []
        for toks, pages in pieces:
            head = pages[0] if pages else -1
            for b in bins:
                old = b[1].get(head, 0)
                if b[0] + len(toks) <= F and b[2] - old + max(old, len(pages)) <= W:
                    b[0] += len(toks)
                    b[1][head] = max(old, len(pages))
                    b[2] += max(old, len(pages)) - old
                    b[3].append((toks, pages))
                    break
            else:
                bins.append([len(toks), {head: len(pages)}, len(pages), [(toks, pages)]])
        cost = len(bins) * W * (F * group + GATHER_ROWS)
        if best is None or cost < best[0]:
            best = (cost, [b[3] for b in bins])
    # the exact union of each bin's pages (the estimate above only sizes the bins)
    return [BlockPlan([t for toks, _ in members for t in toks],
                      list(dict.fromkeys(p for _, pages in members for p in pages))) for members in best[1]]


def gathered_visibility(meta: AttnMeta, pool) -> torch.Tensor:
    """[Qb, BM, B*S] bool: which gathered key each padded query sees (module doc's rule); a padding
    query sees the block's first key (its output is dropped; no row is all -inf)."""
    S = meta.page_size
    owner = pool.owner[meta.pages]  # [Qb, B]
    first = pool.start[meta.pages]  # [Qb, B]
    real = torch.arange(meta.pages.shape[1], device=owner.device)[None] < meta.npages[:, None].long()
    owner = owner.masked_fill(~real, -3)  # padding page slots: nobody's
    kseq = owner.repeat_interleave(S, dim=1)  # [Qb, T]
    kidx = (first[:, :, None] + torch.arange(S, device=owner.device)).flatten(1)  # [Qb, T]
    shape = (meta.blocks, meta.q_block, 1)
    sa, la = meta.seq_a.view(shape), meta.lim_a.view(shape)
    sb, lb = meta.seq_b.view(shape), meta.lim_b.view(shape)
    ks, ki = kseq[:, None], kidx[:, None]
    vis = ((ks == sa) & (ki < la)) | ((ks == sb) & (ki < lb))
    vis[..., 0] |= (meta.q_gather == meta.tokens).view(meta.blocks, meta.q_block)
    return vis


def flex_block_mask(meta: AttnMeta, pool):
    """The step's BlockMask over the whole pool: the blocks' pages as kv blocks (the index as wide as
    the pool's pages, as compiled FlexAttention requires), the rule as mask_mod."""
    from torch.nn.attention.flex_attention import BlockMask

    S = meta.page_size
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


# ----------------------------------------------------------------------------------- kernels


def _padded_queries(q: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
    """q [N, Hq, D] -> [Qb*BM, Hq, D] in block order (padding slots repeat a real query; their
    outputs are never read)."""
    return q[meta.q_gather_clamped]


class Workspace:
    """A reusable buffer for the gathered pages (grown, never shrunk). A fresh tensor per layer per step
    would be a new large allocation each time: on the CPU that is fresh memory from the OS, page faults
    and zeroing that cost 3x the copy itself."""

    def __init__(self):
        self.buf: torch.Tensor | None = None

    def take(self, rows: int, width: int, like: torch.Tensor) -> torch.Tensor:
        need = rows * width
        b = self.buf
        if b is None or b.numel() < need or b.dtype != like.dtype or b.device != like.device:
            self.buf = b = torch.empty(need, dtype=like.dtype, device=like.device)
        return b[:need].view(rows, width)


def _gather(pool, layer: int, meta: AttnMeta, ws: Workspace) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks' pages of one layer -> k, v [Qb, Hkv, B*S, D] (one gather of whole pages, K and V at
    once, into the kernel's workspace: valid until the next call)."""
    _, _, hkv, d = pool.layer[layer].shape
    src = pool.layer_pages[layer]  # [P, S*2*Hkv*D]
    g = torch.index_select(src, 0, meta.pages_flat, out=ws.take(meta.pages_flat.numel(), src.shape[1], src))
    return g.view(meta.blocks, -1, 2, hkv, d).permute(2, 0, 3, 1, 4).unbind(0)


def _blocked(q: torch.Tensor, meta: AttnMeta, hkv: int) -> torch.Tensor:
    """q [N, Hq, D] -> [Qb, Hkv, BM*g, D]: a block's queries of one KV head, rows (query, head in group)."""
    hq, d = q.shape[1:]
    qp = _padded_queries(q, meta).view(meta.blocks, meta.q_block, hkv, hq // hkv, d)
    return qp.permute(0, 2, 1, 3, 4).flatten(2, 3)


def _unblocked(o: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
    """[Qb, Hkv, BM*g, D] -> [N, Hq*D] in step order (the o_proj input)."""
    qb, hkv, _, d = o.shape
    o = o.view(qb, hkv, meta.q_block, -1, d).permute(0, 2, 1, 3, 4).reshape(qb * meta.q_block, -1)
    return o[meta.q_out]


class Kernel:
    """The step's attention kernel (module doc): kernel(q, k, v, meta, scale) -> o.

    q [N, Hq, D]; k, v: one layer of the pool [P*S, Hkv, D]; o [N, Hq, D] in q's dtype.
    name: what runs; reason: why it was chosen (reported in /v1/model and the result rows);
    contract: what it accepts, checked on every call.
    """

    name = "base"
    reads_whole_pool = False  # True: reads pages outside the blocks' lists (masked), so the pool must be zeroed

    def __init__(self, reason: str, contract: Contract):
        self.reason, self.contract = reason, contract
        self.workspace = Workspace()  # gathering kernels: one buffer reused by every layer and step

    def __call__(self, q, pool, layer: int, meta: AttnMeta, scale: float) -> torch.Tensor:
        self.contract.check(q, pool.layer[layer], meta)
        return self.attend(q, pool, layer, meta, scale)

    def attend(self, q, pool, layer: int, meta: AttnMeta, scale: float) -> torch.Tensor:
        raise NotImplementedError


class ReferenceKernel(Kernel):
    """Pure torch, fp32 scores and sums (the oracle); `contract` is that of the kernel it stands in for."""

    name = "reference"

    def attend(self, q, pool, layer, meta, scale):
        k, v = _gather(pool, layer, meta, self.workspace)
        qb = _blocked(q, meta, k.shape[1]).float()
        s = torch.matmul(qb, k.float().transpose(-1, -2)) * scale + meta.visible
        o = torch.matmul(torch.softmax(s, dim=-1), v.float())
        return _unblocked(o, meta).to(q.dtype)


class SdpaKernel(Kernel):
    """The gathered pages through torch's public scaled_dot_product_attention (boolean mask)."""

    name = "sdpa"

    def attend(self, q, pool, layer, meta, scale):
        k, v = _gather(pool, layer, meta, self.workspace)
        o = F.scaled_dot_product_attention(_blocked(q, meta, k.shape[1]), k, v, attn_mask=meta.visible, scale=scale)
        return _unblocked(o, meta)


@functools.cache
def _compiled_flex():
    """flex_attention compiled once per shape (the step's shapes are bucketed: a fixed query block, the
    number of blocks a power of two, the pool's width). Hitting the recompile limit is an error, not a
    silent fall back to eager (which would materialise scores over the whole pool)."""
    import torch._dynamo

    from torch.nn.attention.flex_attention import flex_attention

    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), 32))
    if hasattr(cfg, "fail_on_recompile_limit_hit"):
        cfg.fail_on_recompile_limit_hit = True
    return torch.compile(flex_attention, dynamic=False)


class FlexKernel(Kernel):
    """torch's public FlexAttention over the whole pool with the step's BlockMask (compiled on CUDA)."""

    name = "flex"

    # eager flex materialises the scores over every key (and a compiled one that fell back would too):
    # the pool is zeroed at start so masked keys are finite
    reads_whole_pool = True

    def __init__(self, reason: str, contract: Contract, compiled: bool):
        super().__init__(reason, contract)
        self.compiled = compiled

    def attend(self, q, pool, layer, meta, scale):
        from torch.nn.attention.flex_attention import flex_attention

        fn = _compiled_flex() if self.compiled else flex_attention
        kv = pool.layer[layer]
        qf = _padded_queries(q, meta).transpose(0, 1)[None]  # [1, Hq, Qb*BM, D]
        kf, vf = kv[:, 0].transpose(0, 1)[None], kv[:, 1].transpose(0, 1)[None]  # [1, Hkv, P*S, D] views
        o = fn(qf, kf, vf, block_mask=meta.block_mask, scale=scale, enable_gqa=q.shape[1] != kv.shape[2])
        return o[0].transpose(0, 1)[meta.q_out].flatten(1)


# FlexAttention's compiled Triton kernel tiles queries by BLOCK_M and keys by BLOCK_N (128 x 64 for bf16 at
# head dim 128, 128 x 32 for fp32 at 64 on sm80/sm90) and needs the BlockMask's block sizes divisible by
# them: pages and query blocks of 128 on CUDA. Eager (and inductor's C++ backend) take multiples of 16.
FLEX_CONTRACT = Contract(dtypes=_DTYPES, page_multiple=16, q_block_multiple=16, max_head_dim=256)
FLEX_CUDA_CONTRACT = Contract(dtypes=_DTYPES, page_multiple=128, q_block_multiple=128, max_head_dim=256)
SDPA_CONTRACT = Contract()


def _flex_unavailable(device: torch.device) -> str:
    """Why FlexAttention cannot run compiled on `device` ("" = it can)."""
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except ImportError as e:
        return f"torch {torch.__version__} has no FlexAttention ({e})"
    if device.type == "cuda" and importlib.util.find_spec("triton") is None:
        return "FlexAttention on CUDA compiles through Triton, which is not installed"
    return ""


def choose_kernel(name: str, dtype: torch.dtype, device: torch.device, *, stand_in_for: str = "") -> Kernel:
    """The kernel `infer.kernel` asks for, on this device and dtype (module doc).

    "auto" = "flex" on CUDA, "sdpa" on the CPU. A kernel that cannot run raises with the
    reason (never a silent fallback). stand_in_for: for "reference", whose contract to enforce.
    """
    chosen = name if name != "auto" else ("flex" if device.type == "cuda" else "sdpa")
    if chosen == "reference":
        contract = (FLEX_CUDA_CONTRACT if device.type == "cuda" else FLEX_CONTRACT) if stand_in_for == "flex" \
            else SDPA_CONTRACT
        kernel: Kernel = ReferenceKernel(f"requested ({'flex' if stand_in_for == 'flex' else 'sdpa'} contract)",
                                         contract)
    elif chosen == "sdpa":
        kernel = SdpaKernel("torch scaled_dot_product_attention over the gathered pages"
                            + (" (auto on CPU)" if name == "auto" else ""), SDPA_CONTRACT)
    elif chosen == "flex":
        why = _flex_unavailable(device)
        if why:
            raise RuntimeError(f"infer.kernel=flex cannot run on {device}: {why}")
        compiled = device.type == "cuda"
        kernel = FlexKernel(f"torch FlexAttention ({'compiled, Triton' if compiled else 'eager'})"
                            + (" (auto on CUDA)" if name == "auto" else ""),
                            FLEX_CUDA_CONTRACT if compiled else FLEX_CONTRACT, compiled)
    else:
        raise ValueError(f"unknown infer.kernel {name!r} (auto, sdpa, flex, reference)")
    if dtype not in kernel.contract.dtypes:
        raise RuntimeError(f"infer.kernel={chosen} does not take {dtype}")
    log.info("attention kernel: %s (%s)", kernel.name, kernel.reason)
    return kernel
