"""Grounding: event/segment vectors -> similarity logits -> soft targets and interval readout.

    head = GroundingHead(d)                                  # LayerNorm-Linear-GELU-Linear
    seg = segment_hidden(h, visual_index, audio_index)       # [T, d]: mean(visual) + mean(audio)
    logits = similarity_logits(event_head(h_ev), segment_head(seg))   # [K, T] = <e, s> / sqrt(d)
    targets = soft_targets(intervals, segment_times)          # 0.5 ** distance (1 inside)
    loss = grounding_bce(logits, targets)
    spans = readout(logits, segment_times, threshold=0.5, max_gap=2)  # [(start, end)] seconds

Pure torch; used by pipeline/model.py in training and by the decoding engine.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import nn
from torch.nn import functional as F


class GroundingHead(nn.Module):
    """LayerNorm -> Linear(d, d/2) -> GELU -> Linear(d/2, d)."""

    def __init__(self, dim: int):
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim // 2), nn.GELU(), nn.Linear(dim // 2, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.to(self.net[1].weight.dtype))


def segment_hidden(hidden: torch.Tensor, visual_sets, audio_sets=None, audio_weight: float = 1.0,
                   audio_hidden: torch.Tensor | None = None) -> torch.Tensor:
    """Per timestep: mean(rows of its visual set) + audio_weight x mean(rows of its audio set) -> [T, d].

    hidden [N, d]: the rows the visual sets index (the project: sequence states; the release: head
    outputs of its video tokens); audio_hidden: the rows the audio sets index (default hidden). The
    sets per timestep: an index tensor [T, M] (the project's grid: every timestep at once) or T index
    lists (the release's, whose sizes differ: one mean per set, the same arithmetic, tested equal).
    An empty audio set, or none (M = 0, None), adds nothing.
    """
    audio = hidden if audio_hidden is None else audio_hidden
    if isinstance(visual_sets, torch.Tensor):
        seg = hidden[visual_sets].mean(dim=1)
        if audio_sets is not None and audio_sets.numel():
            m = audio[audio_sets].mean(dim=1)
            seg = seg + (m if audio_weight == 1.0 else audio_weight * m)
        return seg
    rows = []
    for t, vs in enumerate(visual_sets):
        seg = hidden[vs].mean(0)
        if audio_sets is not None and audio_sets[t]:
            m = audio[audio_sets[t]].mean(0)
            seg = seg + (m if audio_weight == 1.0 else audio_weight * m)
        rows.append(seg)
    return torch.stack(rows)


Precision = Literal["float32", "product", "inputs"]


def similarity_logits(events: torch.Tensor, segments: torch.Tensor, precision: Precision = "float32") -> torch.Tensor:
    """events [K, d], segments [T, d] -> [K, T] = <e_i, s_t> / sqrt(d); or a batch of such pairs:
    [B, K, d], [B, T, d] -> [B, K, T] (padded rows and columns give 0); or one event [d] -> [T]
    (taken as segments @ event).

    precision, the family's policy: "float32" (the project's: both sides upcast, the product in fp32),
    "product" (the product in the inputs' dtype, then fp32: the release's fine-tuning), "inputs"
    (everything in the inputs' dtype: the release's decoding similarity, pipeline/release/model.py)."""
    if events.ndim == 1:
        prod = segments @ events
    else:
        keys = segments.transpose(-1, -2)
        prod = events.float() @ keys.float() if precision == "float32" else events @ keys
    if precision == "product":
        prod = prod.float()
    return prod / math.sqrt(events.shape[-1])


def soft_targets(intervals: torch.Tensor, segment_times: torch.Tensor) -> torch.Tensor:
    """intervals [K, 2], segment_times [T, 2] -> [K, T] targets: 0.5 ** the distance of segment t from interval i.

    The distance is 0 when the segment overlaps the interval (positive overlap; the same "inside" as
    aggregation's `interval_mask`), so the target is 1 inside; otherwise it is the seconds from the
    segment's centre (its timestamp) to the nearest interval bound, so a segment that merely touches
    the interval is not "inside" it.
    """
    s, e = intervals[:, :1].float(), intervals[:, 1:].float()
    a, b = segment_times[None, :, 0].float(), segment_times[None, :, 1].float()
    overlap = (torch.minimum(e, b) - torch.maximum(s, a)) > 0
    centre = (a + b) / 2
    outside = torch.clamp(torch.maximum(s - centre, centre - e), min=0.0)
    return torch.pow(0.5, torch.where(overlap, torch.zeros_like(outside), outside))


def grounding_bce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean BCE-with-logits over all (event, segment) entries."""
    return F.binary_cross_entropy_with_logits(logits.float(), targets.float())


def bridged_runs(keep: list[bool], max_gap: int) -> list[tuple[int, int]]:
    """Index runs of kept segments, joining runs separated by <= max_gap dropped ones (inclusive ends)."""
    if max_gap < 0:
        raise ValueError(f"the gap bridged between runs must be >= 0, got {max_gap}")
    runs: list[list[int]] = []
    for t, k in enumerate(keep):
        if not k:
            continue
        if runs and t - runs[-1][1] - 1 <= max_gap:
            runs[-1][1] = t
        else:
            runs.append([t, t])
    return [(a, b) for a, b in runs]


def heaviest_run(p: torch.Tensor, keep: list[bool], runs: list[tuple[int, int]], mass: str = "kept") -> tuple[int, int]:
    """The run with the largest mass, the first on ties. mass "kept": the sum of p over the run's kept
    segments (this project's rule); "span": over the whole bridged span, gap steps included (the
    release's). Sums are taken in p's dtype, as the release does (bf16 ties included)."""
    if mass not in ("kept", "span"):
        raise ValueError(f"unknown run mass {mass!r}")
    best, best_mass = None, None
    for a, b in runs:
        seg = p[a: b + 1]
        m = seg.sum() if mass == "span" else (seg * torch.tensor(keep[a: b + 1], dtype=p.dtype)).sum()
        if best_mass is None or m > best_mass:
            best, best_mass = (a, b), m
    if best is None:
        raise ValueError("no run to choose from")
    return best


def readout_one(logits: torch.Tensor, segment_times: torch.Tensor, threshold: float, max_gap: int) -> tuple[float, float]:
    """logits [T] -> (start, end) seconds.

    p = sigmoid(logits); keep t with p >= threshold * max(p); join runs across gaps of
    <= max_gap segments; the run with the largest mass (sum of p over its kept segments)
    wins; interval = [start of its first segment, end of its last segment].
    """
    p = torch.sigmoid(logits.float()).cpu()  # [T] is small: one transfer, then plain host work
    keep = (p >= threshold * p.max()).tolist()
    a, b = heaviest_run(p, keep, bridged_runs(keep, max_gap), mass="kept")
    return float(segment_times[a, 0]), float(segment_times[b, 1])


def readout(logits: torch.Tensor, segment_times: torch.Tensor, threshold: float = 0.5, max_gap: int = 2) -> list[tuple[float, float]]:
    """logits [K, T] -> K intervals (start, end) in seconds (see `readout_one`)."""
    return [readout_one(row, segment_times, threshold, max_gap) for row in logits]
