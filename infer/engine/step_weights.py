"""Inference snapshot of a PadCaptioner's backbone for the decode step (infer/engine/step.py).

    weights = StepWeights.of(model)     # shared by every engine on this model while it is unchanged

Per decoder layer the HF norm / activation modules and the linear weights with LoRA
folded in (`effective_linear`: the base weight itself when the adapter is merged, as
infer/loading.py does at load; W + delta otherwise), the final norm, the rotary module,
and inference copies of the embedding table and LM head with the two new token rows
<G>/<S> folded in, so a decode step runs no adapter matmuls and patches nothing.
Pure torch; no ray.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pipeline.weights import effective_linear


def fused_norm(module: torch.nn.Module):
    """An HF RMSNorm module as one torch.nn.functional.rms_norm call (same arithmetic: the fp32
    normalisation, the cast back, then the weight), or the module itself if it is another norm."""
    w, eps = getattr(module, "weight", None), getattr(module, "variance_epsilon", None)
    if w is None or eps is None or not type(module).__name__.endswith("RMSNorm") or w.ndim != 1:
        return module
    shape = (w.shape[0],)

    def norm(x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and w.dtype == torch.float32:
            return F.rms_norm(x, shape, w, eps)
        return w * F.rms_norm(x.float(), shape, None, eps).to(x.dtype)

    return norm


_SNAPSHOTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (parameter key, StepWeights)


@dataclass
class LayerWeights:
    """One decoder layer as the step uses it: its norms (HF's RMSNorm as one fused call), the HF
    activation module, the linear weights; o_t / down_t: o_proj / down_proj weights transposed
    (views) for the residual GEMMs (x + a @ W^T as one addmm), None when the layer has a bias."""

    input_norm: object
    post_norm: object
    act: torch.nn.Module
    q: tuple[torch.Tensor, torch.Tensor | None]
    k: tuple[torch.Tensor, torch.Tensor | None]
    v: tuple[torch.Tensor, torch.Tensor | None]
    o: tuple[torch.Tensor, torch.Tensor | None]
    gate: tuple[torch.Tensor, torch.Tensor | None]
    up: tuple[torch.Tensor, torch.Tensor | None]
    down: tuple[torch.Tensor, torch.Tensor | None]
    o_t: torch.Tensor | None = None
    down_t: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.o_t = self.o[0].t() if self.o[1] is None else None
        self.down_t = self.down[0].t() if self.down[1] is None else None


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
        self.layers = []
        for layer in dec.layers:
            at, mlp = layer.self_attn, layer.mlp
            self.layers.append(LayerWeights(
                input_norm=fused_norm(layer.input_layernorm), post_norm=fused_norm(layer.post_attention_layernorm),
                act=mlp.act_fn,
                q=effective_linear(at.q_proj), k=effective_linear(at.k_proj), v=effective_linear(at.v_proj),
                o=effective_linear(at.o_proj), gate=effective_linear(mlp.gate_proj), up=effective_linear(mlp.up_proj),
                down=effective_linear(mlp.down_proj)))
        self.norm = fused_norm(dec.norm)
        self.rope = dec.rotary_emb
        self.mrope = getattr(self.rope, "mrope_section", None) is not None  # Qwen2.5-VL: 3-axis position ids
        self.embed, self.head, self.head_bias = model.step_tables()  # the family's tables, <G>/<S> rows in place
        self.dtype = self.embed.dtype

    @classmethod
    def of(cls, model) -> StepWeights:
        """The snapshot for `model`, shared by every engine built on it (e.g. the parallel and the
        monolithic engine of the caption stage's speed-up) while its parameters are unchanged
        (same device, dtype and in-place version counters); otherwise a fresh one."""
        key = tuple((id(p), p._version, p.device, p.dtype) for p in model.parameters())
        cached = _SNAPSHOTS.get(model)
        if cached is not None and cached[0] == key:
            return cached[1]
        weights = cls(model)
        _SNAPSHOTS[model] = (key, weights)
        return weights
