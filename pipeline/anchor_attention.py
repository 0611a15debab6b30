"""How much attention the caption branches pay to their own anchor, and a guide loss on it.

    rows, anchors = branch_anchor_pairs(packed, layouts, split)     # labelled branch rows -> own anchor column
    mass = own_anchor_mass(decoder, layer, adapter, hidden_in, pos, mask, rows, anchors)  # [R], with grad
    loss = anchor_guide_loss(mass, target=0.25)                     # 0 once the mass reaches the target

Why: a branch token can only name its event's colour, shape or sound by attending to its anchor,
one key among the ~300 of the prefix, and from a random-init backbone gradient descent finds that
route late, while the anchors' features carry the attributes throughout (the measurements:
docs/benchmarks.md, "The fix, now the default"). The guide is the remedy speech synthesis uses
for the same plateau (guided attention: a loss on where an attention map should look while the
alignment is learnt): a hinge on the log of the head-averaged mass that each labelled branch
row puts on its own anchor at one layer,
`model.anchor_guide_weight * mean(relu(log(target) - log(mass)))`, which stops pushing once
the mass reaches `model.anchor_guide_target`. A pretrained backbone finds the route by itself;
the guide is for random-init presets (the embedded default). Pure torch; no ray.
"""

from __future__ import annotations

import math

import torch

from pipeline.aggregation import head_probs
from pipeline.layout import IGNORE, Role


def branch_anchor_pairs(packed, layouts, split: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [R, 2] as (sample, column), anchor columns [R]) of every labelled branch row past
    `split` whose event has an anchor: the pairs the mass and the guide are taken over."""
    rows = (packed.role == Role.BRANCH) & (packed.labels != IGNORE) & (packed.event >= 0)
    rows[:, :split] = False
    anchor_col = torch.full_like(packed.role, -1)
    for b, lay in enumerate(layouts):
        if lay.num_events == 0:
            rows[b] = False
            continue
        anchors = packed.columns[b][lay.anchor_index]  # event i -> its anchor's column
        hit = rows[b]
        anchor_col[b, hit] = anchors[packed.event[b, hit]]
    bi, ci = torch.nonzero(rows, as_tuple=True)
    return torch.stack([bi, ci], 1), anchor_col[bi, ci]


def own_anchor_mass(decoder, layer_idx: int, adapter, hidden_in: torch.Tensor, position_ids: torch.Tensor,
                    mask: torch.Tensor, rows: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """Head-averaged attention probability of each row on its anchor at one decoder layer.

    hidden_in [B, L, d]: the layer's input states over the whole sequence; position_ids [B, L]
    (backbone ids, per sample indexable by column); mask [B, 1, L, L] additive (0 = visible);
    rows [R, 2] (sample, column), anchors [R] columns. Returns [R] in fp32, differentiable, equal
    to the layer's own attention probabilities (input norm, q/k incl. LoRA, RoPE, GQA).
    """
    keys = torch.arange(hidden_in.shape[1], device=hidden_in.device)
    out = []
    for b in rows[:, 0].unique().tolist():
        sel = rows[:, 0] == b
        cols, anc = rows[sel, 1], anchors[sel]
        probs = head_probs(decoder, layer_idx, adapter, hidden_in[b], position_ids[b], cols, keys,
                           bias=mask[b, 0, cols])  # [H, R_b, L]
        out.append(probs[:, torch.arange(cols.numel()), anc].mean(0))
    return torch.cat(out) if out else hidden_in.new_zeros(0, dtype=torch.float32)


def anchor_guide_loss(mass: torch.Tensor, target: float) -> torch.Tensor:
    """mean over rows of relu(log(target) - log(mass)): 0 for rows at or above the target."""
    if mass.numel() == 0:
        return mass.sum() * 0.0
    return torch.relu(math.log(target) - mass.clamp(min=1e-12).log()).mean()
