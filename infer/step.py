"""The decode step: one forward of the caption-phase rows of many videos, layer by layer.

    runner = StepRunner(model, kernel="sdpa", rows=128, branch_tokens=320)   # once per engine
    runner.admit(video_slot, prefix_kv)                                     # a video's prefix KV
    hidden = runner.step(embeds, meta)                                      # [R, d] -> [R, d]
    logits = runner.logits(hidden)                                          # [R, V]

This is the inference path of the caption phase, in the style of an LLM server's model
runner: it loops over the backbone's decoder layers itself and calls the cascade
attention explicitly, with the HF module weights it was given (nothing is forked: the
norms and activations are the HF modules themselves, the linear weights are read from
them; HF's forward stays the training path and the test oracle).

Rows. A step carries R rows, each one caption branch of one video: an anchor (branch
step 0) or the last token of its branch. Rows of one video are contiguous; videos are
in admission order. Per row the step needs (`StepMeta`, all device tensors):

    positions  [R] long   layout position of the row's token (A + branch step)
    lengths    [R] long   branch KV entries before this token (0 for an anchor)
    slots      [R] long   the video slot of the row
    ranks      [R] long   the row's index among its video's rows
and per video (host ints, used only by the eager attention): `spans` (slot, first row,
rows). The new token's key/value is written into the branch KV pool at
[row, :, lengths[row]] and attends to (a) its video's prefix KV (chat preamble,
audio-visual block, instruction, serial <G>s; stored once per video, read once per step
by all of that video's rows) and (b) its own branch KV; (a) and (b) are merged by their
log-sum-exps in fp32 (exact up to the output rounding, also in bf16).

Attention over many videos (`PrefixAttention`):
  "varlen"  (eager, the default) per video one packed query block [1, Hkv, n*g, D]
            against that video's prefix [Hkv, Lp, D], no mask, no padding;
  "padded"  (static shapes, for torch.compile / CUDA graphs) the prefixes live in a
            pool [S, Hkv, Lcap, D]; the rows are scattered into [S, Hkv, Rv*g, D] by
            (slot, rank) and masked by each slot's prefix length. One call, no
            Python loop over videos, so a bucket of R rows is one graph.
Both give the same numbers (tests/test_step.py).

Pure torch + the loaded HF modules; no ray. The weights snapshot (`StepWeights`) folds
LoRA in (merged weights) and the two new token rows <G>/<S> into inference copies of the
embedding table and LM head, so the step runs no adapter matmuls and no patching.
"""

from __future__ import annotations

import enum
import importlib
import logging
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from infer.attention import (auto_prefix_splits, lse_attention_flash, lse_attention_math, lse_attention_sdpa,
                             merge_partials, resolve_backend)

log = logging.getLogger("padcap.infer")


class Mode(enum.Enum):
    """What a forward computes. PREFILL and PLAN run through HF's forward (infer/front.py:
    one video, the layout mask); ANCHOR and BRANCH rows go through `StepRunner.step`, mixed
    in one step (an anchor row is a branch at step 0)."""

    PREFILL = "prefill"
    PLAN = "plan"
    ANCHOR = "anchor"
    BRANCH = "branch"


@dataclass
class StepMeta:
    """Per-row metadata of one step (module doc); device tensors of R rows unless noted.

    spans: per video in the step (slot, first row, number of rows), host ints.
    max_length: max(lengths) + 1 over the real rows (host int), the branch KV the eager
    step reads; the padded step reads the whole pool.
    """

    positions: torch.Tensor
    lengths: torch.Tensor
    slots: torch.Tensor
    ranks: torch.Tensor
    spans: list[tuple[int, int, int]]
    max_length: int


# ----------------------------------------------------------------------------------- weights


def effective_linear(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight [out, in], bias [out] | None) that `module` applies, LoRA folded in.

    A peft LoRA layer that is not merged contributes W + sum of its active adapters'
    delta weights (a new tensor); a plain nn.Linear (or a merged LoRA layer) gives its
    own weight, not a copy.
    """
    base = getattr(module, "base_layer", None)
    if base is None:
        return module.weight, module.bias
    weight = base.weight
    if not getattr(module, "merged", False) and not getattr(module, "disable_adapters", False):
        deltas = [module.get_delta_weight(a) for a in module.active_adapters if a in getattr(module, "lora_A", {})]
        if deltas:
            weight = weight + sum(d.to(weight.dtype) for d in deltas)
    return weight, base.bias


_SNAPSHOTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> (parameter key, StepWeights)


@dataclass
class LayerWeights:
    """One decoder layer as the step uses it: HF norm / activation modules + linear weights."""

    input_norm: torch.nn.Module
    post_norm: torch.nn.Module
    act: torch.nn.Module
    q: tuple[torch.Tensor, torch.Tensor | None]
    k: tuple[torch.Tensor, torch.Tensor | None]
    v: tuple[torch.Tensor, torch.Tensor | None]
    o: tuple[torch.Tensor, torch.Tensor | None]
    gate: tuple[torch.Tensor, torch.Tensor | None]
    up: tuple[torch.Tensor, torch.Tensor | None]
    down: tuple[torch.Tensor, torch.Tensor | None]


class StepWeights:
    """Inference snapshot of a PadCaptioner's backbone for the decode step.

    layers: per decoder layer its `LayerWeights` (LoRA merged); norm: the final norm;
    embed [V, d] and head [V, d]: copies of the input table and LM head with the <G>/<S>
    rows of `new_embed` / `new_out` folded in (one tensor when the backbone ties them);
    rope: the backbone's rotary module. Taken once when an engine is built: an engine
    built before further training does not see the new weights (build a new one).
    """

    @torch.no_grad()
    def __init__(self, model):
        dec = model.decoder
        cfg = model.hf_config.get_text_config(decoder=True)
        self.hidden = cfg.hidden_size
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.num_layers = len(dec.layers)
        self.dtype = model.dtype if model.new_embed.dtype == model.dtype else model.new_embed.dtype
        self.layers = []
        for layer in dec.layers:
            at, mlp = layer.self_attn, layer.mlp
            self.layers.append(LayerWeights(
                input_norm=layer.input_layernorm, post_norm=layer.post_attention_layernorm, act=mlp.act_fn,
                q=effective_linear(at.q_proj), k=effective_linear(at.k_proj), v=effective_linear(at.v_proj),
                o=effective_linear(at.o_proj), gate=effective_linear(mlp.gate_proj), up=effective_linear(mlp.up_proj),
                down=effective_linear(mlp.down_proj)))
        self.norm = dec.norm
        self.rope = dec.rotary_emb
        self.rotate_half = importlib.import_module(type(dec).__module__).rotate_half
        base = model.backbone.get_base_model()
        in_w = base.get_input_embeddings().weight
        out_w = base.get_output_embeddings().weight
        ids = model.new_ids
        self.embed = in_w.detach().clone()
        self.embed[ids] = model.new_embed.detach().to(self.embed.dtype)
        if in_w.data_ptr() == out_w.data_ptr() and model.new_out is None:
            self.head = self.embed
        else:
            self.head = out_w.detach().clone()
            rows = model.new_embed if model.new_out is None else model.new_out
            self.head[ids] = rows.detach().to(self.head.dtype)
        self.head_bias = getattr(base.get_output_embeddings(), "bias", None)
        self.device = self.embed.device
        self._cos = self._sin = None

    @classmethod
    def of(cls, model) -> "StepWeights":
        """The snapshot for `model`, shared by every engine built on it (Serve builds several: one
        per set of engine-level settings) while its parameters are unchanged (same device, dtype
        and in-place version counters); otherwise a fresh one."""
        key = tuple((id(p), p._version, p.device, p.dtype) for p in model.parameters())
        cached = _SNAPSHOTS.get(model)
        if cached is not None and cached[0] == key:
            return cached[1]
        weights = cls(model)
        _SNAPSHOTS[model] = (key, weights)
        return weights

    def rope_tables(self, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [positions, D] in the model dtype, computed by the backbone's own rotary
        module for every position at once (elementwise in the position: batch-invariant)."""
        if self._cos is None or self._cos.shape[0] < positions:
            n = max(positions, 2 * (0 if self._cos is None else self._cos.shape[0]))
            probe = torch.zeros(1, dtype=self.embed.dtype, device=self.device)
            cos, sin = self.rope(probe, torch.arange(n, device=self.device)[None])
            self._cos, self._sin = cos[0], sin[0]
        return self._cos, self._sin


# ----------------------------------------------------------------------------------- kernels


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
        if self.name == "sdpa":
            return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
        return mask

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


def merge(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Two partial attentions over disjoint keys -> one, in fp32, cast once to `dtype`.

    o_*: [..., D], lse_*: [...] natural log. The weight of side a is sigmoid(l_a - l_b);
    weights and the blend stay fp32 (rounding the weight to bf16 costs 4-5x the error of
    one kernel), so the only rounding is the final cast.
    """
    w = torch.sigmoid(lse_a.float() - lse_b.float()).unsqueeze(-1)
    return torch.lerp(o_b.float(), o_a.float(), w).to(dtype)


# ----------------------------------------------------------------------------------- KV storage


class BranchPool:
    """Branch KV of every row, preallocated: k, v per layer [rows, Hkv, tokens, D].

    Row r's first `lengths[r]` entries are valid. `compact(keep)` moves the kept rows
    (in order) to the front in place; rows past the live count are scratch.
    """

    def __init__(self, layers: int, rows: int, kv_heads: int, tokens: int, head_dim: int, dtype, device):
        shape = (rows, kv_heads, max(1, tokens), head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.rows, self.tokens = rows, max(1, tokens)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor) -> None:
        """k, v [R, Hkv, D] of the step's tokens -> entry lengths[r] of rows 0..R-1."""
        rows = torch.arange(k.shape[0], device=k.device)
        self.k[layer][rows, :, lengths] = k
        self.v[layer][rows, :, lengths] = v

    def compact(self, keep: torch.Tensor, live_tokens: int, start: int = 0) -> None:
        """Rows `keep` (device long, increasing) -> rows 0..len(keep)-1, first live_tokens entries.

        start: rows before it are already in place (keep[:start] == arange(start)): not copied.
        """
        n, t = keep.shape[0], max(1, live_tokens)
        if start >= n:
            return
        moved = keep[start:]
        for store in (self.k, self.v):
            for buf in store:
                buf[start:n, :, :t] = buf[:, :, :t].index_select(0, moved)


class VarlenPrefix:
    """Eager prefix attention: each video's prefix KV as it came out of prefill (no copy).

    Per layer the queries are laid out once as [Hkv, R*g, D] (rows of one video, then its
    g query heads per KV head, adjacent), so a video's packed block is a view of that and its
    result lands in a view of one output buffer: per video one kernel call and two copies.
    """

    name = "varlen"

    def __init__(self, kernel, splits: int = 0):
        self.kernel = kernel
        self.splits = splits  # 0 = auto per video (infer.attention.auto_prefix_splits)
        self.kv: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.video_splits: dict[int, int] = {}

    def admit(self, slot: int, prefix_kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """prefix_kv: per layer (k, v) [Hkv, Lp, D]."""
        self.kv[slot] = prefix_kv
        lp = prefix_kv[0][0].shape[1]
        splits = self.splits or auto_prefix_splits(lp, prefix_kv[0][0].device)
        self.video_splits[slot] = max(1, min(splits, lp))  # never more chunks than keys

    def release(self, slot: int) -> None:
        self.kv.pop(slot, None)
        self.video_splits.pop(slot, None)

    def attend(self, layer: int, qg: torch.Tensor, meta: StepMeta, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """qg [R, Hkv, g, D] -> o [R, Hkv, g, D], lse [R, Hkv, g] (fp32 views) over each row's video prefix."""
        R, hkv, g, d = qg.shape
        qt = qg.transpose(0, 1).reshape(1, hkv, R * g, d)  # one copy per layer
        o = qg.new_empty(1, hkv, R * g, d)
        lse = qg.new_empty(1, hkv, R * g, dtype=torch.float32)
        for slot, first, n in meta.spans:
            pk, pv = self.kv[slot][layer]
            rows = slice(first * g, (first + n) * g)
            if self.video_splits[slot] == 1:
                o_v, l_v = self.kernel(qt[:, :, rows], pk[None], pv[None], scale)
            else:
                o_v, l_v = merge_partials(*_split_prefix(self.kernel, qt[:, :, rows], pk, pv, scale,
                                                         self.video_splits[slot]))
            o[:, :, rows] = o_v
            lse[:, :, rows] = l_v
        return o[0].view(hkv, R, g, d).transpose(0, 1), lse[0].view(hkv, R, g).transpose(0, 1)


def _split_prefix(kernel, qp, pk, pv, scale, splits):
    """qp [1, Hkv, Q, D] against pk/pv [Hkv, Lp, D] cut into `splits` chunks -> stacked partials."""
    lp = pk.shape[1]
    bounds = [lp * i // splits for i in range(splits + 1)]
    outs, lses = [], []
    for a, b in zip(bounds[:-1], bounds[1:]):
        o, l = kernel(qp, pk[None, :, a:b], pv[None, :, a:b], scale)
        outs.append(o.float())
        lses.append(l.float())
    return torch.stack(outs), torch.stack(lses)


class PaddedPrefix:
    """Static-shape prefix attention: a pool [slots, Hkv, cap, D] per layer, masked by length.

    Every tensor the step reads has a shape fixed by (rows, slots, rows_per_video, cap), so a
    step over a bucket of rows compiles to one graph (torch.compile fullgraph, CUDA graphs).
    """

    name = "padded"

    def __init__(self, kernel, layers: int, slots: int, rows_per_video: int, cap: int, kv_heads: int, head_dim: int,
                 dtype, device):
        shape = (slots + 1, kv_heads, cap, head_dim)  # the last slot is scratch for padding rows
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.lengths = torch.ones(slots + 1, dtype=torch.long, device=device)  # >= 1: no all-masked row
        self.kernel, self.slots, self.rows_per_video, self.cap = kernel, slots, rows_per_video, cap
        self._visible = None

    def admit(self, slot: int, prefix_kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        lp = prefix_kv[0][0].shape[1]
        if lp > self.cap:
            raise ValueError(f"prefix of {lp} tokens over the padded pool's {self.cap} (infer.max_prefix_tokens)")
        for layer, (k, v) in enumerate(prefix_kv):
            self.k[layer][slot, :, :lp] = k
            self.v[layer][slot, :, :lp] = v
        self.lengths[slot] = lp

    def release(self, slot: int) -> None:
        self.lengths[slot] = 1

    def attend(self, layer: int, qg: torch.Tensor, meta: StepMeta, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        R, hkv, g, d = qg.shape
        s1, rv = self.slots + 1, self.rows_per_video
        qs = qg.new_zeros(s1, rv, hkv, g, d)
        qs[meta.slots, meta.ranks] = qg
        qs = qs.permute(0, 2, 1, 3, 4).reshape(s1, hkv, rv * g, d)
        if layer == 0 or self._visible is None:  # one mask per step, shared by the layers
            self._visible = self.kernel.visible(self.lengths, self.cap, qg.dtype)
        o, lse = self.kernel(qs, self.k[layer], self.v[layer], scale, self._visible)
        o = o.reshape(s1, hkv, rv, g, d).permute(0, 2, 1, 3, 4)[meta.slots, meta.ranks]
        lse = lse.reshape(s1, hkv, rv, g).permute(0, 2, 1, 3)[meta.slots, meta.ranks]
        return o.float(), lse.float()


# ----------------------------------------------------------------------------------- the step


class StepRunner:
    """One decode step over R caption rows of many videos (module doc).

    weights: StepWeights; kernel: the `Kernel` chosen once (`choose_kernel`);
    rows: branch rows the pool holds (infer.max_batch_rows); branch_tokens: KV entries per
    branch (infer.max_branch_tokens); prefix: "varlen" | "padded" (with slots, rows per
    video and the prefix cap for the padded pool).
    """

    def __init__(self, weights: StepWeights, kernel: Kernel, rows: int, branch_tokens: int, *, prefix: str = "varlen",
                 prefix_splits: int = 0, slots: int = 1, rows_per_video: int = 1, prefix_cap: int = 1):
        w = weights
        self.w = w
        self.kernel = kernel
        self.scale = w.head_dim ** -0.5
        self.group = w.heads // w.kv_heads
        dev, dt = w.device, w.dtype
        self.branch = BranchPool(w.num_layers, rows, w.kv_heads, branch_tokens, w.head_dim, dt, dev)
        if prefix == "varlen":
            self.prefix = VarlenPrefix(self.kernel, prefix_splits)
        elif prefix == "padded":
            self.prefix = PaddedPrefix(self.kernel, w.num_layers, slots, rows_per_video, prefix_cap, w.kv_heads,
                                       w.head_dim, dt, dev)
        else:
            raise ValueError(f"unknown prefix attention {prefix!r}")
        self.padded = prefix == "padded"

    def admit(self, slot: int, prefix_kv) -> None:
        self.prefix.admit(slot, prefix_kv)

    def release(self, slot: int) -> None:
        self.prefix.release(slot)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [R] -> [R, d] from the inference embedding table (<G>/<S> rows folded in)."""
        return self.w.embed[ids]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, d] -> [R, V] (the LM head with the <G>/<S> rows folded in)."""
        return F.linear(hidden, self.w.head, self.w.head_bias)

    def branch_keys(self, meta: StepMeta) -> int:
        """Branch KV entries a step reads per row: the live maximum (eager) or the whole pool (padded)."""
        return self.branch.tokens if self.padded else meta.max_length

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [R, H, D], cos/sin [R, 1, D] -> x rotated (HF's apply_rotary_pos_emb, per row)."""
        return x * cos + self.w.rotate_half(x) * sin

    def _attention(self, layer: int, q: torch.Tensor, meta: StepMeta, visible: torch.Tensor) -> torch.Tensor:
        """q [R, Hq, D] (this step's tokens already in the branch pool) -> [R, Hq, D];
        visible: which branch KV entries each row sees (its own, this token included)."""
        R, hq, d = q.shape
        hkv, g = self.w.kv_heads, self.group
        qg = q.reshape(R, hkv, g, d)  # the g query heads of one KV head are adjacent
        o_a, lse_a = self.prefix.attend(layer, qg, meta, self.scale)
        t = self.branch_keys(meta)
        kb, vb = self.branch.k[layer][:R, :, :t], self.branch.v[layer][:R, :, :t]
        o_b, lse_b = self.kernel(qg, kb, vb, self.scale, visible)
        return merge(o_a, lse_a, o_b, lse_b, q.dtype).reshape(R, hq, d)

    def step(self, embeds: torch.Tensor, meta: StepMeta) -> torch.Tensor:
        """embeds [R, d] of the step's tokens -> final-norm hidden states [R, d].

        Per layer: norm -> q, k, v -> RoPE at the rows' positions -> write k, v into the
        branch pool -> cascade attention (prefix part, own-branch part, LSE merge) ->
        o_proj + residual -> norm -> MLP + residual. Same arithmetic as the HF layer.
        """
        w = self.w
        R = embeds.shape[0]
        cos_t, sin_t = w.rope_tables(0)
        cos, sin = cos_t[meta.positions][:, None], sin_t[meta.positions][:, None]  # [R, 1, D]
        visible = self.kernel.visible(meta.lengths + 1, self.branch_keys(meta), embeds.dtype)  # once per step
        x = embeds
        for li, lw in enumerate(w.layers):
            h = lw.input_norm(x)
            q = F.linear(h, *lw.q).view(R, w.heads, w.head_dim)
            k = F.linear(h, *lw.k).view(R, w.kv_heads, w.head_dim)
            v = F.linear(h, *lw.v).view(R, w.kv_heads, w.head_dim)
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            self.branch.write(li, k, v, meta.lengths)
            a = self._attention(li, q, meta, visible)
            x = x + F.linear(a.reshape(R, w.heads * w.head_dim), *lw.o)
            h = lw.post_norm(x)
            x = x + F.linear(lw.act(F.linear(h, *lw.gate)) * F.linear(h, *lw.up), *lw.down)
        return w.norm(x)


class GraphedStep:
    """The padded step replayed from CUDA graphs, one graph per bucket of rows (CUDA only).

    graphed = GraphedStep(runner); hidden = graphed(embeds, meta)   # same contract as runner.step

    A bucket (R rows) is captured on its first use: its inputs (embeds, positions, lengths,
    slots, ranks) are copied into static tensors, the step is run twice on a side stream
    (warm-up), then captured; later steps of R rows copy their inputs in and replay. Every
    other tensor the step reads is persistent and updated in place (branch pool, prefix pool
    and its lengths, weights, RoPE tables sized at set-up), so a replay sees the live state.
    If the RoPE tables had to grow, the graphs are dropped and recaptured.
    """

    def __init__(self, runner: StepRunner):
        if not runner.padded:
            raise ValueError("CUDA graphs need the padded (static-shape) step: infer.step_attention=padded")
        self.runner = runner
        self.graphs: dict[int, tuple] = {}
        self.pool = None
        self._rope_id = None

    def __call__(self, embeds: torch.Tensor, meta: StepMeta) -> torch.Tensor:
        cos, _ = self.runner.w.rope_tables(0)
        if self._rope_id != id(cos):
            self.graphs.clear()
            self._rope_id = id(cos)
        r = embeds.shape[0]
        if r not in self.graphs:
            self.graphs[r] = self._capture(embeds, meta)
        graph, static_in, static_meta, out = self.graphs[r]
        static_in.copy_(embeds)
        for name in ("positions", "lengths", "slots", "ranks"):
            getattr(static_meta, name).copy_(getattr(meta, name))
        graph.replay()
        return out

    def _capture(self, embeds: torch.Tensor, meta: StepMeta):
        static_in = embeds.clone()
        static_meta = StepMeta(positions=meta.positions.clone(), lengths=meta.lengths.clone(), slots=meta.slots.clone(),
                               ranks=meta.ranks.clone(), spans=[], max_length=meta.max_length)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.runner.step(static_in, static_meta)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.runner.step(static_in, static_meta)
        self.pool = graph.pool()
        return graph, static_in, static_meta, out
