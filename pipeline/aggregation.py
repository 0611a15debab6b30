"""Aggregation: pool an event's audio-visual prefix states into its anchor (`ModelConfig.aggregation`).

    inside = interval_mask(intervals, segment_times)          # [K, T] segments of each event
    row = attention_row(decoder, layer_idx, adapter, h_in, pos, query, keys)  # [S] (attention mode)
    feats, weights = aggregator(h_in, visual_index, audio_index, inside, row)  # [K, d]
    anchor_i = embed(<G>) + feats[i]

Modes, per modality (visual tokens, then audio tokens), over the tokens of the
segments inside the event's interval:
  none          no feature (the anchor is the bare <G> embedding)
  mean          uniform weights
  scoring_head  softmax of a small MLP's logits (LayerNorm-Linear-GELU-Linear -> 1)
  attention     the head-averaged attention probabilities of the LAST instruction token
                over the prefix at layer `aggregation_layer`, renormalised inside the
                interval: w_j = a_j / sum_inside a (a proper normalisation of the
                probabilities; a softmax over probabilities would be ~uniform)
feature = sum_j w_j h_j (visual) + sum_j w_j h_j (audio), h = that layer's input states.
The attention row is computed here for the single query row (input norm, q/k
projections incl. LoRA, RoPE at the layout positions, GQA), never by asking HF for
full attention matrices; it is an importance score, so it carries no gradient.
Training uses ground-truth intervals with +-jitter (`jitter_intervals`), inference
the grounded ones.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import nn


def interval_mask(intervals: torch.Tensor, segment_times: torch.Tensor) -> torch.Tensor:
    """intervals [K, 2], segment_times [T, 2] -> bool [K, T]: segments overlapping the interval.

    An interval that overlaps no segment (zero length, or outside) takes the segment
    whose centre is nearest to its centre, so every event has at least one segment.
    """
    s, e = intervals[:, :1].float(), intervals[:, 1:].float()
    a, b = segment_times[None, :, 0].float(), segment_times[None, :, 1].float()
    inside = (torch.minimum(e, b) - torch.maximum(s, a)) > 0
    centre = (s + e) / 2
    nearest = torch.argmin(((a + b) / 2 - centre).abs(), dim=1)
    empty = ~inside.any(dim=1)
    inside[empty, nearest[empty]] = True
    return inside


def jitter_intervals(intervals: torch.Tensor, duration: float, frac: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """[K, 2] -> [K, 2]: each bound moved by U(-frac, frac) * length, clipped to [0, duration], start < end."""
    if frac <= 0 or intervals.numel() == 0:
        return intervals.clone().float()
    iv = intervals.float()
    length = (iv[:, 1] - iv[:, 0]).clamp(min=1e-3)
    shift = (torch.rand(iv.shape, generator=generator) * 2 - 1) * frac * length[:, None]
    out = (iv + shift).clamp(0.0, float(duration))
    bad = out[:, 1] <= out[:, 0]
    out[bad] = iv[bad]
    return out


def head_probs(decoder, layer_idx: int, adapter, hidden_in: torch.Tensor, position_ids: torch.Tensor,
               queries: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 attention probabilities per head of rows `queries` over rows `keys` at one decoder layer.

    hidden_in [S, d]: the layer's input states; position_ids [S]: backbone position ids; queries
    [R] and keys [N]: row indices; bias [R, N]: added to the logits (an additive mask), or None.
    Returns [H, R, N], equal to the layer's own probabilities over those keys (input norm, q/k
    projections incl. LoRA, RoPE at the layout positions, GQA), differentiable.
    """
    layer = decoder.layers[layer_idx]
    attn = layer.self_attn
    hd = attn.head_dim
    x = layer.input_layernorm(hidden_in)
    q = attn.q_proj(x[queries]).view(queries.numel(), -1, hd).transpose(0, 1)  # [H, R, hd]
    k = attn.k_proj(x[keys]).view(keys.numel(), -1, hd).transpose(0, 1)  # [Hkv, N, hd]
    q = adapter.rotate(decoder, q, position_ids[queries])
    k = adapter.rotate(decoder, k, position_ids[keys])
    heads, kv_heads = q.shape[0], k.shape[0]
    qg = q.reshape(kv_heads, heads // kv_heads, queries.numel(), hd)  # GQA: group query heads per KV head
    scores = torch.einsum("gqrd,gnd->gqrn", qg.float(), k.float()) * attn.scaling  # [Hkv, G, R, N]
    if bias is not None:
        scores = scores + bias.float()
    return scores.softmax(dim=-1).reshape(heads, queries.numel(), keys.numel())


@torch.no_grad()
def attention_row(decoder, layer_idx: int, adapter, hidden_in: torch.Tensor, position_ids: torch.Tensor,
                  query: int, keys: torch.Tensor, probs_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Head-averaged attention probabilities of one query row at one decoder layer.

    hidden_in [S, d]: the layer's input states; position_ids [S]: backbone position ids;
    query: row index; keys: bool [S] visible keys of that row. Returns [S] (0 on hidden keys),
    equal to the layer's attention probabilities (mean over heads) for that row. probs_dtype:
    cast the fp32 probabilities to it before the head mean (as the release does; default fp32).
    """
    key_idx = torch.nonzero(keys).flatten()
    q_idx = torch.tensor([query], device=hidden_in.device)
    probs = head_probs(decoder, layer_idx, adapter, hidden_in, position_ids, q_idx, key_idx)[:, 0]  # [H, N]
    probs = probs.to(probs_dtype or torch.float32).mean(dim=0)  # [N]
    row = torch.zeros(hidden_in.shape[0], dtype=probs.dtype, device=hidden_in.device)
    row[key_idx] = probs
    return row


def normalise_inside(scores: torch.Tensor, inside: torch.Tensor) -> torch.Tensor:
    """scores [N] >= 0, inside bool [K, N] -> weights [K, N]: scores / sum over inside, 0 outside.

    A row whose inside scores sum to 0 falls back to uniform weights inside.
    """
    w = scores[None, :].float() * inside
    total = w.sum(dim=1, keepdim=True)
    uniform = inside.float() / inside.sum(dim=1, keepdim=True).clamp(min=1)
    return torch.where(total > 0, w / total.clamp(min=torch.finfo(torch.float32).tiny), uniform)


WeightRule = Literal["normalise", "softmax"]


def token_weights(scores: torch.Tensor, inside: torch.Tensor, rule: WeightRule) -> torch.Tensor:
    """scores [N], inside bool [K, N] -> weights [K, N] over each row's inside tokens, summing to 1, in
    scores' dtype. rule "normalise": `normalise_inside` (fp32, for probabilities or uniform scores);
    "softmax": a softmax of the scores (logits) inside, in their dtype."""
    if rule == "softmax":
        return scores[None, :].masked_fill(~inside, -math.inf).softmax(dim=-1)
    return normalise_inside(scores, inside).to(scores.dtype)


def pooled(hidden: torch.Tensor, parts: list[tuple[torch.Tensor, torch.Tensor, float]]) -> torch.Tensor:
    """hidden [S, d]; parts: (weights [K, N], token rows [N] of hidden, scale) per modality -> [K, d]:
    the sum over parts of scale x weights @ hidden[rows] (the weights cast to hidden's dtype)."""
    total = None
    for w, rows, scale in parts:
        f = w.to(hidden.dtype) @ hidden[rows]
        f = f if scale == 1.0 else scale * f
        total = f if total is None else total + f
    return total


class ScoringHead(nn.Module):
    """Token importance logits: LayerNorm -> Linear(d, d/4) -> GELU -> Linear(d/4, 1)."""

    def __init__(self, dim: int):
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, max(dim // 4, 1)), nn.GELU(), nn.Linear(max(dim // 4, 1), 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.to(self.net[1].weight.dtype)).squeeze(-1)


class Aggregator(nn.Module):
    """Pools the audio-visual states of each event's interval (modes in the module doc)."""

    MODES = ("none", "mean", "scoring_head", "attention")

    def __init__(self, mode: str, dim: int):
        super().__init__()
        if mode not in self.MODES:
            raise ValueError(f"unknown aggregation mode {mode!r} (modes: {self.MODES})")
        self.mode = mode
        self.scorer = ScoringHead(dim) if mode == "scoring_head" else None

    def token_weights(self, hidden: torch.Tensor, token_index: torch.Tensor, inside: torch.Tensor,
                      attn_row: torch.Tensor | None) -> torch.Tensor:
        """token_index [T, M] -> weights [K, T*M] over the modality's tokens (rows sum to 1)."""
        t, m = token_index.shape
        tok_inside = inside[:, torch.arange(t, device=inside.device).repeat_interleave(m)]  # [K, T*M]
        flat = token_index.reshape(-1)
        if self.mode == "mean":
            return token_weights(torch.ones(flat.numel(), device=hidden.device), tok_inside, "normalise")
        if self.mode == "attention":
            if attn_row is None:
                raise ValueError("attention aggregation needs the attention row")
            return token_weights(attn_row[flat], tok_inside, "normalise")
        return token_weights(self.scorer(hidden[flat]).float(), tok_inside, "softmax")  # scoring_head

    def forward(self, hidden: torch.Tensor, visual_index: torch.Tensor, audio_index: torch.Tensor | None,
                inside: torch.Tensor, attn_row: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """hidden [S, d], visual_index [T, V], audio_index [T, A], inside [K, T] -> ([K, d], weights)."""
        k = inside.shape[0]
        if self.mode == "none" or k == 0:
            return hidden.new_zeros(k, hidden.shape[-1]), {}
        parts = [("visual", visual_index)]
        if audio_index is not None and audio_index.numel():
            parts.append(("audio", audio_index))
        weights = {name: self.token_weights(hidden, index, inside, attn_row) for name, index in parts}
        return pooled(hidden, [(weights[name], index.reshape(-1), 1.0) for name, index in parts]), weights
