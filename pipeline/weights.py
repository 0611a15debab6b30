"""Weights as a model applies them, LoRA and the new token rows folded in (pure torch + peft's layer API).

    w, b = effective_linear(module)                # [out, in], [out] | None
    embed, head, bias = folded_tables(model)       # a PadCaptioner's tables with its <G>/<S> rows in place

Used by the decode step's snapshot (infer/engine/step_weights.py) and by the release's merged
export (pipeline/release/finetune.py).
"""

from __future__ import annotations

import torch


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


def folded_tables(model) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A PadCaptioner's (embed [V, d], head [V, d], head bias): copies of the backbone's tables
    with the <G>/<S> rows of `new_embed` / `new_out` folded in (one tensor when tied)."""
    base = model.backbone.get_base_model()
    in_w = base.get_input_embeddings().weight
    out_w = base.get_output_embeddings().weight
    ids = model.new_ids
    embed = in_w.detach().clone()
    embed[ids] = model.new_embed.detach().to(embed.dtype)
    if in_w.data_ptr() == out_w.data_ptr() and model.new_out is None:
        head = embed
    else:
        head = out_w.detach().clone()
        rows = model.new_embed if model.new_out is None else model.new_out
        head[ids] = rows.detach().to(head.dtype)
    return embed, head, getattr(base.get_output_embeddings(), "bias", None)
