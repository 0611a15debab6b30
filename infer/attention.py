"""Shared-prefix ("cascade") attention for lock-step branch decoding, and the kernels it runs on.

PadCaptioner decodes the K caption branches of one video in lock-step. Every branch
sees the same long prefix (chat preamble, audio-visual block, instruction, serial
`<G>` planning tokens) plus its own short KV (its anchor and its tokens so far). One
decode step therefore splits into

  (a) prefix part: all K branch queries against the shared prefix KV, packed into
      one query block per KV head (GQA by reshaping the queries, never by repeating
      KV), no mask, the prefix read once;
  (b) branch part: each branch against its own KV (batched over branches);
  (c) a log-sum-exp merge of (a) and (b), exact up to rounding.
On CUDA a long prefix is also split into KV chunks (flash-decoding style, views, no
copies) so that a packed block with only Hkv heads still fills the GPU.

Backends (chosen at run time, `resolve_backend`):
  "sdpa"  torch's fused kernels that also return the LSE
          (CPU: aten._scaled_dot_product_flash_attention_for_cpu; CUDA: aten's flash
          kernel for fp16/bf16, the memory-efficient one for fp32), falling back to
  "math"  matmul + logsumexp in fp32 (the obviously-correct path; also a test oracle);
  "flash" flash-attn 2 (`flash_attn_with_kvcache(..., return_softmax_lse=True)`),
          only where `flash_attn` imports, on CUDA, for fp16/bf16;
  "auto"  flash where available, else sdpa.
All LSEs are natural-log (torch and flash-attn agree; FlashInfer would be base 2).

The decode step (infer/step.py) runs the same cascade over the rows of many videos
with these kernels (`lse_attention_sdpa`, `lse_attention_math`, `lse_attention_flash`)
and its own merge; `cascade_attention` is the one-video form (dense branch KV of equal
lengths), kept as a building block and for bench/attention.py.

Run: imported by infer/step.py; tests in tests/test_attention.py; timings in
bench/attention.py.
"""

from __future__ import annotations

import functools
import logging
from typing import Literal

import torch

Backend = Literal["auto", "sdpa", "math", "flash"]
log = logging.getLogger("padcap.infer")
_HALF = (torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------------
# backend selection


@functools.cache
def flash_attn_available() -> bool:
    """True when flash-attn 2 imports and CUDA is present (checked once)."""
    if not torch.cuda.is_available():
        return False
    try:
        from flash_attn import flash_attn_with_kvcache  # noqa: F401
    except Exception:  # ImportError, or a wheel built against another torch/CUDA
        return False
    return True


def resolve_backend(backend: Backend, q: torch.Tensor) -> Literal["sdpa", "math", "flash"]:
    """The concrete backend for queries `q` (device and dtype decide what can run).

    "auto" -> "flash" if flash-attn is usable for q (CUDA, fp16/bf16), else "sdpa".
    "flash" where it cannot run raises (an explicit request must not silently degrade).
    """
    flash_ok = q.is_cuda and q.dtype in _HALF and flash_attn_available()
    if backend == "auto":
        return "flash" if flash_ok else "sdpa"
    if backend == "flash" and not flash_ok:
        raise RuntimeError(
            "attention backend 'flash' needs flash-attn installed, CUDA and fp16/bf16 "
            f"(device={q.device}, dtype={q.dtype}, flash_attn importable={flash_attn_available()})"
        )
    if backend not in ("sdpa", "math", "flash"):
        raise ValueError(f"unknown attention backend {backend!r}")
    return backend


# ----------------------------------------------------------------------------------
# attention that also returns the log-sum-exp


def tail_causal_mask(rows: int, q_tokens: int, kv_len: int, device: torch.device) -> torch.Tensor | None:
    """Visibility of new tokens inside their own branch KV (True = visible).

    Query row r stands for new token i = r % q_tokens (rows pack (group, token));
    its own KV ends with the q_tokens new tokens, so it sees keys j <= kv_len - q_tokens + i.
    Returns None when q_tokens == 1 (everything visible). Shape [rows, kv_len], bool.
    """
    if q_tokens == 1:
        return None
    i = torch.arange(rows, device=device) % q_tokens
    j = torch.arange(kv_len, device=device)
    return j[None, :] <= (kv_len - q_tokens + i)[:, None]


def lse_attention_math(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with its log-sum-exp, in fp32 (fp64 for fp64 inputs); reference / fallback.

    q: [B, H, Lq, D]; k, v: [B, H, Lk, D]; mask: None, bool broadcastable to [B, H, Lq, Lk]
    (True = visible), or an additive float mask.
    Returns o [B, H, Lq, D] and lse [B, H, Lq] (natural log), both fp32 (or fp64).
    fp16/bf16 inputs are upcast (a transient fp32 copy of k/v, never a K-fold one).
    """
    acc = torch.promote_types(q.dtype, torch.float32)
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.to(acc)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    return torch.matmul(p, v.to(acc)), lse


def additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A visibility mask as an additive float mask in `dtype`: bool (True = visible) -> 0 / -inf;
    a float mask is taken as already additive."""
    if mask is None or mask.dtype != torch.bool:
        return None if mask is None else mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def lse_attention_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None = None,
    strict: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `lse_attention_math`, through torch's fused kernels.

    mask: None, bool broadcastable to [B, H, Lq, Lk] (True = visible), or an additive float
    mask of that shape. Output o keeps
    q's dtype; lse is fp32. Where no fused kernel with an LSE output applies (a dtype or
    shape the device has no kernel for) it raises with `strict`, else it falls back to the
    math path and logs that once per reason (never silently).
    """
    if q.device.type == "cpu":
        attn_mask = additive(mask, q.dtype)
        if attn_mask is not None:
            while attn_mask.ndim < 4:
                attn_mask = attn_mask[None]
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=attn_mask, scale=scale
        )
        return o, lse
    error = "no fused kernel with an LSE output for this device"
    if q.is_cuda and q.shape[-1] <= 256:
        try:
            if mask is None and q.dtype in _HALF:
                out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)
                return out[0], out[1]
            bias = additive(mask, q.dtype)
            if bias is not None:
                bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
            out = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, False, scale=scale)
            return out[0], out[1][..., : q.shape[-2]]  # the LSE may be padded along Lq
        except RuntimeError as e:
            error = str(e).splitlines()[0][:200]
    if strict:
        raise RuntimeError(f"fused SDPA with LSE unavailable ({q.device}, {q.dtype}, head dim {q.shape[-1]}): {error}")
    _log_fallback_once(f"{q.device.type}/{q.dtype}/mask={mask is not None}", error)
    return lse_attention_math(q, k, v, scale, mask)


@functools.cache
def _log_fallback_once(where: str, reason: str) -> None:
    log.warning("attention: no fused SDPA kernel for %s (%s); using the math kernel", where, reason)


def lse_attention_flash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, lengths: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """flash-attn 2 with its LSE: q [B, H, Lq, D], k/v [B, H, Lk, D] (same H), keys
    [0, lengths[b]) visible (None = all). Returns o [B, H, Lq, D] (a view), lse [B, H, Lq] fp32."""
    from flash_attn import flash_attn_with_kvcache

    seqlens = None if lengths is None else lengths.to(torch.int32)
    o, lse = flash_attn_with_kvcache(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), cache_seqlens=seqlens,
                                     softmax_scale=scale, causal=False, return_softmax_lse=True)
    return o.transpose(1, 2), lse.float()


def merge_partials(o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """P partial attentions over disjoint key chunks -> one: o [P, ..., D], lse [P, ...] ->
    (o [..., D], lse [...]) fp32, weights softmax(lse) over P."""
    lse = lse.float()
    w = torch.softmax(lse, dim=0).unsqueeze(-1)
    return (w * o.float()).sum(0), torch.logsumexp(lse, dim=0)


def merge_lse(
    o_a: torch.Tensor,
    lse_a: torch.Tensor,
    o_b: torch.Tensor,
    lse_b: torch.Tensor,
    with_lse: bool = True,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Merge two partial softmax-attentions over disjoint key sets (exact).

    o_*: [..., D] (any float dtype, any strides), lse_*: [...] (natural log). With
    m = max(l_a, l_b): o = (e^(l_a-m) o_a + e^(l_b-m) o_b) / (e^(l_a-m) + e^(l_b-m)),
    l = m + log(e^(l_a-m) + e^(l_b-m)). The weight of side a is exactly
    sigmoid(l_a - l_b), so o = lerp(o_b, o_a, sigmoid(l_a - l_b)): a few fused kernels.
    Weights and the blend in fp32, rounded once into `out` (rounding the weight to
    bf16 first costs 4-5x the error of a single attention kernel).
    Returns (o, lse fp32 or None); o is `out` when given, else fp32. A side with
    lse = -inf (no visible key) gets weight 0; one side per row must see a key.
    """
    w = torch.sigmoid(lse_a.float() - lse_b.float()).unsqueeze(-1)
    o = torch.lerp(o_b.float(), o_a.float(), w)
    if out is not None:
        o = out.copy_(o)
    return o, (torch.logaddexp(lse_a.float(), lse_b.float()) if with_lse else None)


SPLIT_MIN_PREFIX = 8192  # CUDA: below this a split costs more launches than it saves
SPLIT_CHUNK = 2048


def auto_prefix_splits(prefix_len: int, device: torch.device) -> int:
    """How many KV chunks the prefix part is split into (flash-decoding style).

    On CUDA a packed prefix block has only Hkv (e.g. 2) query heads, so one kernel
    occupies a couple of SMs; for a long prefix, chunks of SPLIT_CHUNK keys (at most 64)
    merged by LSE spread it over the GPU. A short prefix is read in microseconds by those
    SMs, while a split adds about ten kernel launches per layer (expand, cat, softmax,
    weighted sum): a decode step there is launch-bound, so it is not split. CPU kernels
    parallelise over the query rows fine: 1. `infer.attention_prefix_splits` overrides.
    """
    if device.type != "cuda" or prefix_len < SPLIT_MIN_PREFIX:
        return 1
    return max(1, min(64, prefix_len // SPLIT_CHUNK))


# ----------------------------------------------------------------------------------
# cascade attention


def prefix_partials(kernel, qp, prefix_k, prefix_v, scale, splits):
    """A packed query block against a prefix, optionally in KV chunks (flash-decoding style).

    qp: [1, Hkv, Q, D]; prefix_k/v: [Hkv, Lp, D]. With splits = S > 1 (clamped to Lp: more
    chunks than keys would make empty chunks, a SIGFPE in the CPU kernel) the prefix is
    viewed as [S, Hkv, Lp/S, D] (no copy) and run as a batch of S, plus one call for the
    last Lp % S keys. Returns o [P, Hkv, Q, D] and lse [P, Hkv, Q]: P partial results
    (P = 1 unsplit) over disjoint key chunks, to be merged by LSE (`merge_partials`).
    """
    Lp = prefix_k.shape[1]
    splits = max(1, min(int(splits), Lp))
    if splits == 1:
        return kernel(qp, prefix_k.unsqueeze(0), prefix_v.unsqueeze(0), scale)
    chunk = Lp // splits
    main = splits * chunk
    ks = prefix_k[:, :main].unflatten(1, (splits, chunk)).transpose(0, 1)  # [S, Hkv, chunk, D] view
    vs = prefix_v[:, :main].unflatten(1, (splits, chunk)).transpose(0, 1)
    o, lse = kernel(qp.expand(splits, -1, -1, -1).contiguous(), ks, vs, scale)
    if main < Lp:
        o_t, lse_t = kernel(qp, prefix_k[None, :, main:], prefix_v[None, :, main:], scale)
        o, lse = torch.cat([o, o_t]), torch.cat([lse, lse_t])
    return o, lse


def _prefix_part(qb, prefix_k, prefix_v, scale, kernel, splits):
    """All branch queries qb [K, Hkv, G, D] against the shared prefix as one packed block
    [1, Hkv, K*G, D] (only the queries are copied, never the KV; `prefix_partials`).
    Returns o [P, Hkv, K, G, D] and lse [P, Hkv, K, G]."""
    K, Hkv, G, D = qb.shape
    qp = qb.transpose(0, 1).reshape(1, Hkv, K * G, D)
    o, lse = prefix_partials(kernel, qp, prefix_k, prefix_v, scale, splits)
    return o.unflatten(2, (K, G)), lse.unflatten(2, (K, G))


def _cascade_torch(q, prefix_k, prefix_v, branch_k, branch_v, scale, kernel, splits, out, with_lse):
    """Cascade attention with a torch kernel (`lse_attention_sdpa` or `_math`).

    Shapes as in `cascade_attention`; out: [K, Hkv, g, t, D], a view of the output
    storage that receives the result. Returns lse [K, Hkv, g*t] fp32, or None.
    Two parts merge as o = lerp(o_b, o_a, sigmoid(l_a - l_b)) straight into `out`; a
    split prefix merges all parts with one softmax over their LSEs.
    """
    K, Hq, t, D = q.shape
    Hkv = prefix_k.shape[0]
    g = Hq // Hkv
    G = g * t
    # (b) branch part: q [K, Hq, t, D] -> [K, Hkv, g*t, D] (the g query heads of one KV
    # head are adjacent), rows ordered (group, token); a view when q is contiguous.
    qb = q.reshape(K, Hkv, G, D)
    mask = tail_causal_mask(G, t, branch_k.shape[2], q.device)
    o_b, lse_b = kernel(qb, branch_k, branch_v, scale, mask)  # [K, Hkv, G, D], [K, Hkv, G]
    if prefix_k.shape[1] == 0:
        out.copy_(o_b.unflatten(2, (g, t)))
        return lse_b.float() if with_lse else None
    # (a) prefix part
    o_a, lse_a = _prefix_part(qb, prefix_k, prefix_v, scale, kernel, splits)  # [P, Hkv, K, G, (D)]
    # (c) merge
    if o_a.shape[0] == 1:
        o_a, lse_a = o_a[0].transpose(0, 1), lse_a[0].transpose(0, 1)  # [K, Hkv, G, (D)] views
        unf = lambda x: x.unflatten(2, (g, t))  # noqa: E731  [K, Hkv, G, ...] -> [K, Hkv, g, t, ...]
        _, lse = merge_lse(unf(o_a), unf(lse_a), unf(o_b), unf(lse_b), with_lse, out=out)
        return lse.flatten(2) if with_lse else None
    lse_all = torch.cat([lse_a.float(), lse_b.float().transpose(0, 1).unsqueeze(0)])  # [P+1, Hkv, K, G]
    o_all = torch.cat([o_a, o_b.transpose(0, 1).unsqueeze(0)])  # [P+1, Hkv, K, G, D]
    w = torch.softmax(lse_all, dim=0).unsqueeze(-1)
    o = (w * o_all).sum(0)  # [Hkv, K, G, D]
    out.copy_(o.transpose(0, 1).unflatten(2, (g, t)))
    return torch.logsumexp(lse_all, dim=0).transpose(0, 1) if with_lse else None


def _cascade_flash(q, prefix_k, prefix_v, branch_k, branch_v, scale, out, with_lse):
    """Cascade attention with flash-attn 2 (CUDA, fp16/bf16).

    flash-attn does GQA natively (query heads h*g..h*g+g-1 read KV head h), splits long
    KV itself (num_splits heuristic) and takes strided KV with a contiguous last dim, so
    the HF-layout caches are passed as transposed views, never copied. causal=True is
    bottom-right aligned: exactly "new token i sees its own KV up to Lb - t + i".
    Shapes as in `cascade_attention`; out: [K, t, Hq, D] receives the result.
    Returns lse [K, t, Hq] fp32, or None.
    """
    from flash_attn import flash_attn_with_kvcache

    K, Hq, t, D = q.shape
    qf = q.transpose(1, 2)  # [K, t, Hq, D]
    # (b) branch part: batch K, k_cache [K, Lb, Hkv, D]
    o_b, lse_b = flash_attn_with_kvcache(
        qf, branch_k.transpose(1, 2), branch_v.transpose(1, 2),
        softmax_scale=scale, causal=True, return_softmax_lse=True,
    )  # o_b [K, t, Hq, D], lse_b [K, Hq, t]
    lse_b = lse_b.transpose(1, 2)
    if prefix_k.shape[1] == 0:
        out.copy_(o_b)
        return lse_b if with_lse else None
    # (a) prefix part: batch 1, all K*t queries as one sequence, k_cache [1, Lp, Hkv, D]
    o_a, lse_a = flash_attn_with_kvcache(
        qf.reshape(1, K * t, Hq, D), prefix_k.transpose(0, 1).unsqueeze(0), prefix_v.transpose(0, 1).unsqueeze(0),
        softmax_scale=scale, causal=False, return_softmax_lse=True,
    )  # o_a [1, K*t, Hq, D], lse_a [1, Hq, K*t]
    o_a = o_a.reshape(K, t, Hq, D)
    lse_a = lse_a.reshape(Hq, K, t).permute(1, 2, 0)
    return merge_lse(o_a, lse_a, o_b, lse_b, with_lse, out=out)[1]


def cascade_attention(
    q: torch.Tensor,
    prefix_k: torch.Tensor,
    prefix_v: torch.Tensor,
    branch_k: torch.Tensor,
    branch_v: torch.Tensor,
    scale: float | None = None,
    backend: Backend = "auto",
    return_lse: bool = False,
    prefix_splits: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One decode step of K lock-step branches against a shared prefix + own KV.

    q:        [K, Hq, t, D]  the step's queries (t = 1 normally; t > 1 = t new tokens
                             per branch, causal among themselves)
    prefix_k: [Hkv, Lp, D]   shared by all branches, stored once (Lp may be 0)
    prefix_v: [Hkv, Lp, D]
    branch_k: [K, Hkv, Lb, D] each branch's own KV incl. this step's t tokens; all
                             branches have the same Lb (lock-step: anchor + j tokens),
                             so the dense layout is exact, no lengths or padding
    branch_v: [K, Hkv, Lb, D]
    scale:    softmax scale (default D**-0.5)
    prefix_splits: KV chunks for the prefix part (torch backends; None = auto, see
              `auto_prefix_splits`); flash-attn splits by itself.
    Hq must be a multiple of Hkv (GQA). Branch query k sees the whole prefix and
    branch k's own keys (the new tokens causally), nothing of other branches.
    Returns [K, Hq, t, D] in q's dtype, a transposed view of contiguous [K, t, Hq, D]
    (and lse [K, Hq, t] fp32 if return_lse).
    """
    K, Hq, t, D = q.shape
    Hkv = prefix_k.shape[0]
    if Hq % Hkv or branch_k.shape[:2] != (K, Hkv) or branch_k.shape[2] < t or branch_k.shape[-1] != D:
        raise ValueError(
            f"cascade_attention shapes: q {tuple(q.shape)}, prefix_k {tuple(prefix_k.shape)}, "
            f"branch_k {tuple(branch_k.shape)}"
        )
    scale = D**-0.5 if scale is None else scale
    name = resolve_backend(backend, q)
    # The result is written into [K, t, Hq, D] storage (what HF's o_proj wants) and
    # returned as a [K, Hq, t, D] view, so the caller's transpose + contiguous is free.
    out = torch.empty(K, t, Hq, D, dtype=q.dtype, device=q.device)
    if name == "flash":
        lse = _cascade_flash(q, prefix_k, prefix_v, branch_k, branch_v, scale, out, return_lse)
        lse = lse.transpose(1, 2) if return_lse else None
    else:
        kernel = lse_attention_sdpa if name == "sdpa" else lse_attention_math
        if prefix_splits is None:
            prefix_splits = auto_prefix_splits(prefix_k.shape[1], q.device)
        g = Hq // Hkv
        target = out.view(K, t, Hkv, g, D).permute(0, 2, 3, 1, 4)  # [K, Hkv, g, t, D]
        lse = _cascade_torch(
            q, prefix_k, prefix_v, branch_k, branch_v, scale, kernel, prefix_splits, target, return_lse
        )
        lse = lse.reshape(K, Hq, t) if return_lse else None
    out = out.transpose(1, 2)
    return (out, lse.float()) if return_lse else out


# ----------------------------------------------------------------------------------
# the decode step's kernel (infer/step.py, infer/kv_pool.py)


def length_mask(lengths: torch.Tensor, kv_len: int) -> torch.Tensor:
    """lengths [B] -> bool [B, 1, 1, kv_len]: keys [0, lengths[b]) visible."""
    return (torch.arange(kv_len, device=lengths.device)[None, :] < lengths[:, None])[:, None, None, :]


class Kernel:
    """The attention kernel of the step, chosen once per engine (`choose_kernel`).

    kernel(q, k, v, scale, visible=None): q [B, H, Lq, D], k/v [B, H, Lk, D] (same H:
    GQA is done by packing query heads into rows); `visible` from `kernel.visible(lengths,
    Lk, dtype)` (keys [0, lengths[b]) of batch element b; None = all), built once per step
    and shared by every layer. Returns o [B, H, Lq, D] and lse [B, H, Lq] (natural log, fp32).
    name: "sdpa" | "math" | "flash"; reason: why this one (a fallback says so).
    """

    def __init__(self, name: str, reason: str):
        self.name, self.reason = name, reason

    def visible(self, lengths: torch.Tensor, kv_len: int, dtype: torch.dtype) -> torch.Tensor:
        """The kernel's form of "keys [0, lengths[b]) visible": int32 lengths (flash-attn), an
        additive mask [B, 1, 1, Lk] in `dtype` (sdpa) or a bool mask (math)."""
        if self.name == "flash":
            return lengths.to(torch.int32)
        mask = length_mask(lengths, kv_len)
        return additive(mask, dtype) if self.name == "sdpa" else mask

    def __call__(self, q, k, v, scale: float, visible: torch.Tensor | None = None):
        if self.name == "flash":
            return lse_attention_flash(q, k, v, scale, visible)
        if self.name == "sdpa":
            return lse_attention_sdpa(q, k, v, scale, visible, strict=True)
        return lse_attention_math(q, k, v, scale, visible)


def choose_kernel(backend: str, dtype: torch.dtype, device: torch.device, head_dim: int) -> Kernel:
    """The step's kernel: "flash" (flash-attn) where asked for / auto and usable; else
    "sdpa" (torch's fused kernels with an LSE) when a probe on this device and dtype runs
    both the unmasked and the length-masked case; else "math", logged once with the reason.
    """
    name = resolve_backend(backend, torch.zeros(1, dtype=dtype, device=device))
    if name == "flash":
        return Kernel("flash", "flash-attn 2")
    if name == "math":
        return Kernel("math", "requested")
    probe = Kernel("sdpa", "")
    q = torch.zeros(2, 1, 2, head_dim, dtype=dtype, device=device)
    k = torch.zeros(2, 1, 3, head_dim, dtype=dtype, device=device)
    try:
        probe(q, k, k, 1.0)
        probe(q, k, k, 1.0, probe.visible(torch.tensor([1, 3], device=device), 3, dtype))
    except RuntimeError as e:
        reason = str(e).splitlines()[0][:200]
        log.warning("attention: the fused SDPA kernel does not run on %s/%s (%s); using the math kernel",
                    device, dtype, reason)
        return Kernel("math", f"fallback from sdpa: {reason}")
    return Kernel("sdpa", "torch fused SDPA with LSE")
