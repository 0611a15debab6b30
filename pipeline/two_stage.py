"""The two-stage training forward of both model families, its shared steps once (pipeline/model.py
`PadCaptioner.forward_train`, pipeline/release/finetune.py `ReleaseFinetune.forward_one`).

    cache = stage_cache(model)                        # None when stage 2 must rerun stage 1
    out1 = run_decoder(model, emb1, mask1, pos1, cache, output_hidden_states=True)  # stage 1 (the family's)
    two = stage_two(model, emb1, emb2, mask_rows, positions, cache)                   # stage 2
    out = train_outputs(lm_logits, text_logits, text_labels, (branch_hidden, labels, pad), grounding_logits=[...])

Stage 1 runs the prefix (for PadCaptioner also the serial <G>s) through a KV cache: planning rows,
grounding-layer and aggregation-layer states. The family then grounds its events and aggregates their
intervals into features, and builds stage 2's inputs (anchors carrying the features, branches; for the
release the serial <G>s too, whose inputs carry them). Stage 2 attends to stage 1 through the cache
with its own rows of the same mask. HF drops caches under activation checkpointing when a backward
follows (`stage_cache` None): stage 2 then runs the whole sequence again, stage 1 in front, and keeps its own
columns. `train_outputs` is the dict train/losses.py reads. Pure torch + HF.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache

from pipeline.layout import additive_mask


def stage_cache(model) -> DynamicCache | None:
    """Stage 1's KV cache for stage 2, or None when stage 2 must rerun stage 1 instead of reading it:
    HF's own condition for dropping caches (checkpointed layers, training mode, gradients on)."""
    dec = model.decoder
    checkpointed = any(getattr(layer, "gradient_checkpointing", False) for layer in dec.layers)
    return None if checkpointed and dec.training and torch.is_grad_enabled() else DynamicCache(config=model.hf_config)


def run_decoder(model, embeds: torch.Tensor, mask: torch.Tensor, position_ids: torch.Tensor, cache=None,
                output_hidden_states: bool = False):
    """The family's decoder over embeds [B, n, d] -> BaseModelOutputWithPast (each family's `run_decoder`). mask [B, 1, n, keys]: 0 (or
    False) where a query sees a key, made additive in the model dtype (never None: HF would read
    position drops as packed documents); position_ids [..., n] as the backbone takes them."""
    return model.decoder(inputs_embeds=embeds, attention_mask=additive_mask(mask.to(model.device) == 0, model.dtype),
                         position_ids=position_ids.to(model.device), cache=cache, use_cache=cache is not None,
                         output_hidden_states=output_hidden_states)


@dataclass
class StageTwo:
    """What stage 2's pass gives: `last` [B, n, d] final-norm states of its columns; `states` per layer
    (when asked) over what the pass ran: the whole sequence when it reran stage 1 (`skip` = stage 1's
    columns), else stage 2's columns alone (`skip` = 0)."""

    last: torch.Tensor
    states: tuple | None
    skip: int

    def layer(self, i: int) -> torch.Tensor:
        """[B, n, d]: layer i's states of stage 2's columns."""
        return self.states[i][:, self.skip:]

    def whole(self, i: int, first: tuple) -> torch.Tensor:
        """[B, s + n, d]: layer i's states of the whole sequence (stage 1's from `first`, its pass's
        hidden states, when stage 2 read the cache)."""
        return self.states[i] if self.skip else torch.cat([first[i], self.states[i]], 1)


def stage_two(model, emb1: torch.Tensor, emb2: torch.Tensor, mask_rows: Callable[[int], torch.Tensor],
              positions: torch.Tensor, cache, output_hidden_states: bool = False) -> StageTwo:
    """Stage 2 over the columns after stage 1's s, by the family's `run_decoder`: through `cache`, or
    (cache None: `stage_cache`) over the whole sequence with stage 1 in front.

    emb1 [B, s, d], emb2 [B, n, d]; mask_rows(a) -> the mask of query columns a.. over every key
    [B, 1, s + n - a, s + n] (`run_decoder`'s convention); positions [..., s + n]."""
    s = emb1.shape[1]
    if cache is None:
        out = model.run_decoder(torch.cat([emb1, emb2], 1), mask_rows(0), positions, None, output_hidden_states)
        return StageTwo(out.last_hidden_state[:, s:], out.hidden_states, s)
    out = model.run_decoder(emb2, mask_rows(s), positions[..., s:], cache, output_hidden_states)
    return StageTwo(out.last_hidden_state, out.hidden_states, 0)


def train_outputs(lm_logits: Callable[[torch.Tensor], torch.Tensor], text: torch.Tensor, text_labels: torch.Tensor,
                  branch: tuple | None = None, **lists) -> dict:
    """The dict train/losses.py reads.

    text [N1, V]: text_logits, with text_labels [N1] (planning rows, plain responses; the caller takes
    them where its autograd order has them); branch (hidden [N2, d], labels [N2], pad bool [N2]: rows
    predicting <eos> padding) -> branch_logits = lm_logits(hidden), branch_labels, branch_pad, or N2 = 0
    when None; lists: grounding_logits / grounding_targets (lists of [K, T]), aggregation_weights and
    any other per-video list (each [] unless given)."""
    out = {"text_logits": text, "text_labels": text_labels, "grounding_logits": [], "grounding_targets": [],
           "aggregation_weights": [], **lists}
    if branch is None:
        empty = torch.zeros(0, dtype=torch.long, device=text.device)
        return {**out, "branch_logits": text.new_zeros(0, text.shape[-1]), "branch_labels": empty, "branch_pad": empty.bool()}
    hidden, labels, pad = branch
    return {**out, "branch_logits": lm_logits(hidden), "branch_labels": labels, "branch_pad": pad}
