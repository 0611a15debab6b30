"""Attention over the paged KV pool: one interface, kernels with public contracts, a pure-torch reference.

    kernel = choose_kernel("auto", dtype, device)               # "sdpa" on CPU, "flex" on CUDA
    meta = AttnMeta.build(blocks, seq_a, lim_a, seq_b, lim_b, q_block=16, pool=pool, kernel=kernel)
    o = kernel(q, pool, layer, meta, scale)                     # q [N, Hq, D] -> o [N, Hq * D]

`AttnMeta.build` runs once per step (infer/engine/attn_meta.py). One query over six keys of one
sequence, against a dense softmax:

    >>> import torch
    >>> from infer.engine.attn_meta import AttnMeta
    >>> from infer.engine.packing import QueryBlock
    >>> from infer.engine.paged import PagePool
    >>> _ = torch.manual_seed(0)
    >>> kernel = choose_kernel("reference", torch.float32, torch.device("cpu"))
    >>> pool = PagePool(1, 4, 4, 1, 8, torch.float32, torch.device("cpu"))  # 1 layer, 4 pages of 4, Hkv 1, D 8
    >>> seq = pool.open(); _ = pool.reserve(2); pool.grow(seq, 6); pool.sync()
    >>> k, v = torch.randn(6, 1, 8), torch.randn(6, 1, 8)
    >>> pool.layer[0][pool.slots(seq, 0, 6), 0] = k; pool.layer[0][pool.slots(seq, 0, 6), 1] = v
    >>> meta = AttnMeta.build([QueryBlock(tokens=[0], pages=seq.pages)], [seq.id], [6], [seq.id], [0],
    ...                       q_block=16, pool=pool, kernel=kernel)   # token 0 sees keys 0..5 of seq
    >>> q = torch.randn(1, 1, 8)
    >>> o = kernel(q, pool, 0, meta, 8 ** -0.5)
    >>> dense = torch.softmax(q[0] @ k[:, 0].T * 8 ** -0.5, -1) @ v[:, 0]
    >>> o.shape, torch.allclose(o, dense, atol=1e-6)
    (torch.Size([1, 8]), True)

What a step asks of attention. The N tokens of a step (prefill chunks, planning rows, branch
rows of many videos) each see at most two sequences of the pool (infer/engine/paged.py): query t
sees key i of sequence s iff (s == seq_a[t] and i < lim_a[t]) or (s == seq_b[t] and i <
lim_b[t]). A prefill token sees its video's prefix up to its causal limit (the end of the
audio-visual block for a token inside a bidirectional block); a planning row sees the prefix
and the serial <G>s so far; a branch row sees its video's prefix (all of it) and its own
branch. One softmax over both: no log-sum-exp merge is needed, and the shared prefix pages
are read once per query block, not once per branch (the cascade, without copies).

Query blocks. The scheduler cuts the step's tokens into blocks of one video each (its decode
rows, a planning row, a prefill piece); a block lists the pages its tokens may see. For flex
that is FlexAttention's block-sparse description (BlockMask.from_kv_blocks with BLOCK_SIZE =
(q_block, page_size)) and the visibility above is the mask_mod: flex reads only the listed
pages. A gathering kernel (reference, sdpa) copies the pages of a call's blocks side by side and
runs one dense attention over them, which pads every block to the call's fullest and widest:
infer/engine/packing.py repacks the blocks into bins and cuts them into a few calls of similar width,
so the padded work stays close to the work needed, with a fixed number of ops per layer.

Kernels (`infer.kernel`; chosen explicitly, never a silent fallback):
  "reference"  pure torch: gather the blocks' pages, fp32 scores, mask, softmax, fp32 sum;
               the oracle. It enforces the contract of the kernel it stands in for
               (`contract=`), so CPU tests drive the exact glue a GPU kernel runs.
  "sdpa"       the same gather, then torch.nn.functional.scaled_dot_product_attention with
               the additive mask, one call per width class (public API; CPU default). With
               `infer.attention_calls=0` both gathering kernels make one call per query block
               instead: no padding, at 2-3 host ops per block per layer.
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
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from infer.engine.attn_meta import AttnMeta, Workspace, flex_block_mask
from infer.engine.packing import MAX_CALLS

log = logging.getLogger("padcap.infer")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Contract:
    """What a kernel accepts: dtypes, and the alignment of page and query-block sizes."""

    dtypes: tuple[torch.dtype, ...] = _DTYPES
    page_multiple: int = 1
    q_block_multiple: int = 1
    max_head_dim: int = 256
    # elements one pool layer may hold (0 = no limit): compiled FlexAttention computes a key's offset in
    # int32 (key x 2*Hkv*D), and past 2**31 it wraps: an illegal access or, silently, wrong keys
    # (pytorch/pytorch#190857; vLLM caps its flex pools the same way, vllm-project/vllm#50427)
    max_layer_elements: int = 0

    def check(self, q: torch.Tensor, kv: torch.Tensor, meta: AttnMeta) -> None:
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
        if self.max_layer_elements and kv.numel() > self.max_layer_elements:
            raise ValueError(f"a pool layer of {kv.numel()} elements is over the kernel's {self.max_layer_elements} "
                             f"(int32 offsets): a smaller infer.kv_memory_gb / kv_memory_fraction")

    def check_sizes(self, page_size: int, q_blocks: tuple[int, ...], kernel: str) -> None:
        """At start-up: the engine's page size and query blocks suit this kernel (else a clear error then,
        not in the middle of a batch)."""
        if page_size % self.page_multiple or any(q % self.q_block_multiple for q in q_blocks):
            raise ValueError(f"infer.kernel={kernel} takes pages and query blocks in multiples of "
                             f"{self.page_multiple} / {self.q_block_multiple}; got infer.page_size={page_size}, "
                             f"query blocks {q_blocks} (infer.q_block and 4 x infer.q_block for prefill)")


class Kernel:
    """The step's attention kernel (module doc): kernel(q, k, v, meta, scale) -> o.

    q [N, Hq, D]; k, v: one layer of the pool [P*S, Hkv, D]; o [N, Hq, D] in q's dtype.
    name: what runs; reason: why it was chosen (reported in /v1/model and the result rows);
    contract: what it accepts, checked on every call.
    """

    name = "base"
    reads_whole_pool = False  # True: reads pages outside the blocks' lists (masked), so the pool must be zeroed

    def __init__(self, reason: str, contract: Contract, max_calls: int = MAX_CALLS):
        self.reason, self.contract = reason, contract
        self.workspace = Workspace()  # gathering kernels: one buffer reused by every layer and step
        # gathering kernels: at most this many dense calls a layer (infer/engine/packing.py); 0 = one per query block
        self.max_calls = max_calls

    def __call__(self, q, pool, layer: int, meta: AttnMeta, scale: float) -> torch.Tensor:
        self.contract.check(q, pool.layer[layer], meta)
        return self.attend(q, pool, layer, meta, scale)

    def attend(self, q, pool, layer: int, meta: AttnMeta, scale: float) -> torch.Tensor:
        raise NotImplementedError


class GatheringKernel(Kernel):
    """Gathers each layer's pages for the step's calls (GatherMeta.calls), runs `call` on each, and puts the
    outputs back in step order: a fixed handful of ops per layer plus two per call, whatever the videos."""

    def attend(self, q, pool, layer, meta, scale):
        torch.index_select(pool.layer_pages[layer], 0, meta.pages_flat, out=meta.kv_out)
        hkv, d = pool.layer[layer].shape[2:]
        rows = q[meta.q_tok, meta.q_head]  # [R, D]: every call's queries, folded per KV head
        parts = rows.split(meta.q_split) if len(meta.calls) > 1 else (rows,)
        kv = pool.layer[layer]
        outs = [self.call(qc.view(c.bins, hkv, -1, d), *c.keys(kv), c.visible, scale).view(-1, d)
                for c, qc in zip(meta.calls, parts)]
        o = outs[0] if len(outs) == 1 else torch.cat(outs)
        return o.index_select(0, meta.out_rows).view(meta.tokens, -1)

    def call(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
             scale: float) -> torch.Tensor:
        """q [bins, Hkv, BM*g, D] over k, v [bins, Hkv, keys, D] with the additive mask `visible` ->
        [bins, Hkv, BM*g, D] in q's dtype (GatherCall)."""
        raise NotImplementedError


class ReferenceKernel(GatheringKernel):
    """Pure torch, fp32 scores and sums (the oracle); `contract` is that of the kernel it stands in for."""

    name = "reference"

    def call(self, q, k, v, visible, scale):
        s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale + visible
        return torch.matmul(torch.softmax(s, dim=-1), v.float()).to(q.dtype)


class SdpaKernel(GatheringKernel):
    """The gathered pages through torch's public scaled_dot_product_attention (additive mask)."""

    name = "sdpa"

    def call(self, q, k, v, visible, scale):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale)


@functools.cache
def _compiled_flex():
    """flex_attention compiled once per shape (the step's shapes are bucketed: a fixed query block, the
    number of blocks a power of two, the pool's width). Hitting the recompile limit is an error, not a
    silent fall back to eager (which would materialise scores over the whole pool). The limit is 256: each
    engine's pool width is a new set of shapes (one per block bucket its CUDA graphs record, up to 8), and a
    process may build several engines (tests, benchmarks)."""
    import torch._dynamo
    from torch.nn.attention.flex_attention import flex_attention

    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), 256))
    if hasattr(cfg, "fail_on_recompile_limit_hit"):
        cfg.fail_on_recompile_limit_hit = True
    return torch.compile(flex_attention, dynamic=False)


class FlexKernel(Kernel):
    """torch's public FlexAttention over the whole pool with the step's BlockMask (compiled on CUDA)."""

    name = "flex"

    # eager flex materialises the scores over every key (and a compiled one that fell back would too):
    # the pool is zeroed at start so masked keys are finite
    reads_whole_pool = True

    def __init__(self, reason: str, contract: Contract, compiled: bool, options: dict | None = None):
        super().__init__(reason, contract)
        self.compiled = compiled
        self.options = options or {}  # flex_attention's kernel_options (BLOCK_M, BLOCK_N, ...); {} = torch's own

    def attend(self, q, pool, layer, meta, scale):
        from torch.nn.attention.flex_attention import flex_attention

        fn = _compiled_flex() if self.compiled else flex_attention
        if meta.block_mask is None:  # once per step, at its first layer
            meta.block_mask = flex_block_mask(meta, pool, block_n=self.options.get("BLOCK_N", 0))
        kv = pool.layer[layer]
        qf = q[meta.q_gather_clamped].transpose(0, 1)[None]  # [1, Hq, Qb*BM, D]
        kf, vf = kv[:, 0].transpose(0, 1)[None], kv[:, 1].transpose(0, 1)[None]  # [1, Hkv, P*S, D] views
        o = fn(qf, kf, vf, block_mask=meta.block_mask, scale=scale, enable_gqa=q.shape[1] != kv.shape[2],
               kernel_options=self.options or None)
        return o[0].transpose(0, 1)[meta.q_out].flatten(1)


INT32_ELEMENTS = 2 ** 31  # the elements a tensor's int32 offsets address (0 .. 2**31 - 1)
# FlexAttention's compiled Triton kernel tiles queries by BLOCK_M and keys by BLOCK_N (128 x 64 for bf16 at
# head dim 128, 128 x 32 for fp32 at 64 on sm80/sm90) and needs the BlockMask's block sizes divisible by
# them: pages and query blocks of 128 on CUDA. Eager (and inductor's C++ backend) take multiples of 16.
FLEX_CONTRACT = Contract(page_multiple=16, q_block_multiple=16)
FLEX_CUDA_CONTRACT = Contract(page_multiple=128, q_block_multiple=128, max_layer_elements=INT32_ELEMENTS)
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


def choose_kernel(name: str, dtype: torch.dtype, device: torch.device, *, stand_in_for: str = "",
                  max_calls: int = MAX_CALLS) -> Kernel:
    """The kernel `infer.kernel` asks for, on this device and dtype (module doc).

    "auto" = "flex" on CUDA, "sdpa" on the CPU. A kernel that cannot run raises with the
    reason (never a silent fallback). stand_in_for: for "reference", whose contract to enforce.
    max_calls (`infer.attention_calls`): the gathering kernels' dense calls per layer at most
    (infer/engine/packing.py), 0 = one per query block; flex ignores it.
    """
    if max_calls < 0:
        raise ValueError(f"infer.attention_calls must be >= 0 (0 = one call per query block), got {max_calls}")
    chosen = name if name != "auto" else ("flex" if device.type == "cuda" else "sdpa")
    calls = "" if max_calls else ", one call per query block"  # the gathering kernels' infer.attention_calls=0
    if chosen == "reference":
        contract = (FLEX_CUDA_CONTRACT if device.type == "cuda" else FLEX_CONTRACT) if stand_in_for == "flex" \
            else SDPA_CONTRACT
        kernel: Kernel = ReferenceKernel(f"requested ({'flex' if stand_in_for == 'flex' else 'sdpa'} contract{calls})",
                                         contract, max_calls)
    elif chosen == "sdpa":
        kernel = SdpaKernel("torch scaled_dot_product_attention over the gathered pages"
                            + (" (auto on CPU)" if name == "auto" else "") + calls, SDPA_CONTRACT, max_calls)
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
