"""The release's grounding readout and aggregation, as pure functions (docs/design/release.md 4.4).

    a, b = find_and_merge(sim, threshold=0.7, merge_gap=2)        # timestep indices, inclusive
    feat = aggregate(attn_row, h_agg, lay, (a, b), mode, audio_weight)   # [d]

find_and_merge: salient timesteps are those with sim >= threshold * max(sim); contiguous
runs of them are bridged when the gap between two runs is at most `merge_gap` timesteps;
the bridged span with the largest sum of sim over the whole span (the non-salient gap
steps included) wins, the first on ties.

aggregate: for every timestep a..b the video (audio) index lists are concatenated,
duplicates kept (neighbouring audio sets overlap); weights over those tokens come from
the aggregation row (head-mean attention probabilities of the user turn's <|im_end|> at
layer `vision_audio_layer_index`): "release" = softmax of those probabilities (what the
release does; nearly uniform, docs/design/method.md section 1 names it a defect), "renormalised" = the
probabilities divided by their sum (ours); feature = sum w h (video) + audio_weight x
sum w h (audio), h = that layer's input states: pipeline/aggregation.py's `token_weights` and
`pooled`, the token selection (a timestep interval, duplicates kept) being the release's. Pure torch.
"""

from __future__ import annotations

import torch

from pipeline.aggregation import pooled, token_weights
from pipeline.grounding import bridged_runs, heaviest_run


def find_and_merge(sim: torch.Tensor, threshold: float, merge_gap: int) -> tuple[int, int]:
    """Similarities [T] -> the grounded interval (a, b) in timestep indices, inclusive (module doc):
    the project's run bridging (pipeline/grounding.py) with the release's mass rule ("span")."""
    keep = (sim >= threshold * sim.max()).tolist()
    return heaviest_run(sim, keep, bridged_runs(keep, merge_gap), mass="span")


def interval_tokens(lay, interval: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence indices of the video and audio tokens of timesteps a..b (duplicates kept)."""
    steps = range(interval[0], interval[1] + 1)
    return tuple(slots[torch.tensor([i for t in steps for i in sets[t]], dtype=torch.long)]
                 for slots, sets in ((lay.video_slots, lay.video_sets), (lay.audio_slots, lay.audio_sets)))


WEIGHT_RULES = {"release": "softmax", "renormalised": "normalise"}  # aggregation mode -> pipeline/aggregation.py rule


def aggregate(row: torch.Tensor, hidden: torch.Tensor, lay, interval: tuple[int, int], mode: str,
              audio_weight: float) -> torch.Tensor:
    """row [L] (aggregation probabilities), hidden [L, d] (layer input states) -> feature [d]: the
    project's token weights and pooling (pipeline/aggregation.py) over the interval's tokens."""
    dev = hidden.device
    v, a = (ix.to(dev) for ix in interval_tokens(lay, interval))
    parts = [(v, 1.0)] + ([(a, audio_weight)] if a.numel() else [])
    every = lambda ix: torch.ones(1, ix.numel(), dtype=torch.bool, device=dev)  # every selected token
    return pooled(hidden, [(token_weights(row[ix], every(ix), WEIGHT_RULES[mode]), ix, w) for ix, w in parts])[0]
