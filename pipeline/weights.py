"""Weights as a model applies them, LoRA and the new token rows folded in (pure torch + peft's layer API).

    w, b = effective_linear(module)                # [out, in], [out] | None
    emb = with_rows(table_emb, ids, row_ids, rows)       # [..., d]: the trained <G>/<S> rows where ids hit
    logits = with_row_logits(base, hidden, row_ids, rows)  # [N, V]: those rows' logit columns replaced
    table = fold_rows(table, row_ids, rows)        # a copy of a [V, d] table with the rows in place

Both families train the two new rows (<G>, <S>) as a separate [2, d] parameter beside the frozen
vocab-size table; these are the one way they are substituted (training) and folded (decoding, export).

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


def with_rows(emb: torch.Tensor, ids: torch.Tensor, row_ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """emb [..., d] (the frozen table's rows of ids [...]) -> the same with rows [2, d] where ids == row_ids[k]."""
    ids = ids.to(emb.device)
    for k in range(rows.shape[0]):
        emb = torch.where((ids == row_ids[k])[..., None], rows[k].to(emb.dtype), emb)
    return emb


def with_row_logits(base: torch.Tensor, hidden: torch.Tensor, row_ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """base logits [N, V] of hidden [N, d] -> the same with the row_ids columns from rows [2, d]."""
    return base.index_copy(-1, row_ids.to(hidden.device), hidden @ rows.to(hidden.dtype).T)


def fold_rows(table: torch.Tensor, row_ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """A copy of table [V, d] with rows [2, d] at row_ids (in the table's dtype)."""
    out = table.detach().clone()
    out[row_ids] = rows.detach().to(out.dtype)
    return out
