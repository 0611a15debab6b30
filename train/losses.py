"""PadCaptioner training losses over `PadCaptioner.forward_train` outputs.

    out = model.forward_train(batch)
    losses = compute_losses(out, cfg.model)
    losses.total.backward(); log(losses.components)

Components (each a mean over its own rows, so the few planning tokens are not drowned
by thousands of caption tokens):
  lm         cross-entropy of the stage-1 labelled tokens: the planning tokens
             (<G> ... <G>, <S>) and the responses of plain samples
  branch_lm  cross-entropy of the caption branches, including the <eos> padding rows
             when `model.eos_padding_loss` (the layout already set their labels)
  grounding  BCE-with-logits of event/segment similarities against the soft targets,
             weighted by `model.grounding_loss_weight` (default 5) in the total
  attribute_token_weight  a training aid (1 = off, the paper's loss): with w != 1 each caption-branch
             token that varies with the attributes (pipeline/caption_grammar.py attribute_token_ids)
             counts w times in branch_lm's mean over rows (logged unweighted; the weighted one
             as branch_lm_weighted)
  anchor_guide  with `model.anchor_guide_weight` > 0: the hinge of pipeline/anchor_attention.py
             on each branch row's attention mass on its own anchor (and `anchor_mass`, its mean)
total = lm + branch_loss_weight * branch_lm + grounding_loss_weight * grounding
        [+ anchor_guide_weight * anchor_guide]. A component without rows in
the batch is 0 (and is still reported). Pure torch; no ray.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from pipeline.anchor_attention import anchor_guide_loss
from pipeline.caption_grammar import attribute_token_ids, parse_caption
from pipeline.grounding import grounding_bce


@dataclass
class LossOutput:
    total: torch.Tensor
    components: dict[str, float]  # detached floats for logging


def _ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    if labels.numel() == 0:
        return logits.sum() * 0.0
    return F.cross_entropy(logits.float(), labels)


def _weighted_ce(logits: torch.Tensor, labels: torch.Tensor, ids: torch.Tensor, weight: float) -> torch.Tensor:
    """Mean over rows of the cross-entropy with the rows whose label is in `ids` counted `weight` times.

    >>> logits, labels = torch.zeros(4, 3), torch.tensor([0, 1, 2, 2])
    >>> round(float(_weighted_ce(logits, labels, torch.tensor([2]), 3.0) / _ce(logits, labels)), 4)
    2.0
    """
    if labels.numel() == 0:
        return logits.sum() * 0.0
    ce = F.cross_entropy(logits.float(), labels, reduction="none")
    w = torch.where(torch.isin(labels, ids.to(labels.device)), weight, 1.0)
    return (ce * w).sum() / labels.numel()


def check_attribute_weight(cfg) -> float:
    """`cfg.model.attribute_token_weight`, checked against the config: > 0, and != 1 only on the
    synthetic dataset, whose caption grammar says which words carry the attributes (another dataset
    with the weight set is an error, never an override silently ignored). The train stage calls it
    before it starts its workers.

    >>> from pipeline.config import Config
    >>> check_attribute_weight(Config())
    1.0
    """
    weight = cfg.model.attribute_token_weight
    if weight <= 0:
        raise ValueError(f"model.attribute_token_weight must be > 0 (got {weight})")
    if weight != 1.0 and cfg.data.dataset != "synthetic":
        raise ValueError(f"model.attribute_token_weight={weight} needs the synthetic dataset's caption grammar "
                         f"(data.dataset={cfg.data.dataset}); set model.attribute_token_weight=1 for other data")
    return weight


def check_attribute_captions(samples, weight: float) -> None:
    """With the weight set (!= 1), every event caption of `samples` must be one the synthetic grammar
    spells (all four attributes read back): shards of other data under the synthetic config would
    otherwise be weighted by words that mean nothing in them. The train loop checks the held-out
    samples it is given.

    >>> from pipeline.schema import Event, Sample
    >>> def video(caption):
    ...     return Sample("v", 4.0, None, None, None, True, events=[Event(0.0, 2.0, caption)])
    >>> check_attribute_captions([video("Visual: the red circle moves up. Audio: silence.")], 3.0)
    >>> check_attribute_captions([video("A man speaks.")], 3.0)
    Traceback (most recent call last):
    ...
    ValueError: model.attribute_token_weight=3.0 weights the synthetic grammar's attribute words, but video v has the caption 'A man speaks.'; set model.attribute_token_weight=1 for other data
    """
    if weight == 1.0:
        return
    for s in samples:
        for e in s.events:
            if None in parse_caption(e.caption).values():
                raise ValueError(f"model.attribute_token_weight={weight} weights the synthetic grammar's attribute words, "
                                 f"but video {s.video_id} has the caption {e.caption!r}; set "
                                 "model.attribute_token_weight=1 for other data")


def attribute_ids(model, cfg) -> torch.Tensor | None:
    """The ids `model.attribute_token_weight` up-weights, or None with the weight at 1 (off).

    The weight is checked by `check_attribute_weight`; the ids are the model's own tokenizer's, so a
    model without one (the release family) with the weight set is an error too.
    """
    if check_attribute_weight(cfg) == 1.0:
        return None
    tok = getattr(model, "tokenizer", None)
    if tok is None:
        raise ValueError(f"model.attribute_token_weight != 1 needs a model with a tokenizer ({type(model).__name__} "
                         "has none); set model.attribute_token_weight=1")
    return torch.tensor(attribute_token_ids(lambda text: tok.encode(text, add_special_tokens=False)))


def compute_losses(out: dict, model_cfg, attribute_ids: torch.Tensor | None = None,
                   attribute_weight: float = 1.0) -> LossOutput:
    """out: the dict of `PadCaptioner.forward_train`; returns the total and logged components.
    attribute_ids, attribute_weight: `attribute_ids(model, cfg)` and `cfg.model.attribute_token_weight`
    (the ids are needed when the weight is not 1). Passed apart from `model_cfg` because both families
    train through here and the release family's `model_cfg` holds only the loss weights it uses."""
    lm = _ce(out["text_logits"], out["text_labels"])
    branch = _ce(out["branch_logits"], out["branch_labels"])
    weighted = None
    if attribute_weight != 1.0:
        if attribute_ids is None:
            raise ValueError("model.attribute_token_weight != 1 but no attribute ids were given (train/losses.py attribute_ids)")
        weighted = _weighted_ce(out["branch_logits"], out["branch_labels"], attribute_ids, attribute_weight)
    if out["grounding_logits"]:
        logits = torch.cat([g.flatten() for g in out["grounding_logits"]])
        targets = torch.cat([t.flatten() for t in out["grounding_targets"]])
        grounding = grounding_bce(logits, targets)
    else:
        grounding = out["text_logits"].sum() * 0.0
    total = lm + model_cfg.branch_loss_weight * (branch if weighted is None else weighted) \
        + model_cfg.grounding_loss_weight * grounding
    comps = {"lm": lm, "branch_lm": branch, "grounding": grounding}
    if weighted is not None:
        comps["branch_lm_weighted"] = weighted
    if "anchor_mass" in out:
        guide = anchor_guide_loss(out["anchor_mass"], model_cfg.anchor_guide_target)
        total = total + model_cfg.anchor_guide_weight * guide
        comps["anchor_guide"] = guide
        comps["anchor_mass"] = out["anchor_mass"].mean() if out["anchor_mass"].numel() else guide * 0.0
    comps = {"total": total, **comps}
    components = {k: float(v.detach()) for k, v in comps.items()}
    pad = out.get("branch_pad")
    if pad is not None and pad.any():
        with torch.no_grad():
            components["branch_eos_pad_lm"] = float(_ce(out["branch_logits"][pad], out["branch_labels"][pad]))
    components["lm_tokens"] = float(out["text_labels"].numel())
    components["branch_tokens"] = float(out["branch_labels"].numel())
    return LossOutput(total=total, components=components)
