"""Measurements of how the caption branches learn their attribute words (issue #27).

    probe = AttributeProbe(val_samples, every=100)
    train_loop(cfg, ctx, data, val, ..., probe=probe)      # adds probe_* keys to the history

Every `every` optimizer steps (after backward, before the update) it records:
  probe_grad_<group>   gradient norm of each parameter group that must learn the anchor
                       route: the new <G>/<S> rows, the visual / audio projectors, the
                       time and modality embeddings, LoRA q/k/v/o, the (trained) token
                       embedding, the grounding heads;
  probe_anchor_mass_l<i>  over the labelled branch rows of fixed held-out samples
                       (teacher-forced, true layout), the attention mass each branch token
                       puts on its OWN anchor at layer i (mean over heads and rows), and
                       probe_anchor_mass the mean over layers; uniform attention over the
                       ~300 visible keys would give ~0.003;
  probe_anchor_norm / probe_token_norm  the mean L2 norm of the anchors' input embeddings
                       (<G> row + aggregated feature) against ordinary token embeddings;
  probe_branch_attr_lm / probe_branch_other_lm  the branch cross-entropy over the tokens that
                       spell an attribute word (colour, shape, motion, sound) and over the
                       rest (the grammar: "Visual: a ... Audio: ...");
  probe_lin_<attr>     with `linear` samples: how much of each attribute the anchors' aggregated
                       features still carry: a multinomial logistic regression fitted on the
                       features of the fit samples' events (true intervals, eval mode) and
                       scored on the held-out events' (accuracy; chance ~1/#values).
Pure torch, one process; only bench/default_seeds.py uses it.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
from torch.nn import functional as F

from pipeline.anchor_attention import branch_anchor_pairs
from pipeline.layout import IGNORE, Role
from train.data import Batcher

GROUPS = {
    "new_rows": ("new_embed", "new_out"),
    "visual_proj": ("visual_proj",),
    "audio_proj": ("audio_proj",),
    "time_modality": ("time_embed", "modality_embed"),
    "lora_qk": ("q_proj.lora", "k_proj.lora"),
    "lora_vo": ("v_proj.lora", "o_proj.lora"),
    "embed_tokens": ("embed_tokens",),
    "heads": ("event_head", "segment_head"),
}


def group_of(name: str) -> str:
    for group, keys in GROUPS.items():
        if any(k in name for k in keys):
            return group
    return "other"


def grad_norms(model) -> dict[str, float]:
    sq: dict[str, float] = {}
    for name, p in model.named_parameters():
        if p.requires_grad and p.grad is not None:
            g = group_of(name)
            sq[g] = sq.get(g, 0.0) + float(p.grad.detach().float().pow(2).sum())
    return {f"probe_grad_{g}": math.sqrt(v) for g, v in sq.items()}


def _attribute_rows(model, batch, parse) -> torch.Tensor:
    """bool over the labelled branch rows: the row's label spells an attribute word."""
    from train.evaluate import attribute_token_spans

    pk = batch.packed
    s = pk.split
    lab = pk.labels[:, s:]
    flags = []
    for b in range(lab.shape[0]):
        row_ids = lab[b][lab[b] != IGNORE]
        events = pk.event[b, s:][lab[b] != IGNORE]
        hit = torch.zeros(row_ids.numel(), dtype=torch.bool)
        for ev in events.unique().tolist():
            idx = torch.nonzero(events == ev).flatten()
            texts = [model.tokenizer.decode([int(t)]) for t in row_ids[idx]]
            for span in attribute_token_spans(texts, parse).values():
                hit[idx[span]] = True
        flags.append(hit)
    return torch.cat(flags)


@torch.no_grad()
def anchor_attention(model, batch) -> dict[str, Any]:
    """Full-sequence eager forward with attention maps -> own-anchor mass per layer, norms."""
    pk = batch.packed
    s = pk.split
    seen = []
    run = model.run_decoder

    def record(embeds, *args, **kwargs):  # the two stages' input embeddings, exactly as training builds them
        seen.append(embeds)
        return run(embeds, *args, **kwargs)

    model.run_decoder = record
    try:
        out = model.forward_train(batch)
    finally:
        del model.run_decoder
    emb = torch.cat(seen, 1)
    pos = model.position_ids(pk)
    cfg = model.decoder.config
    old = cfg._attn_implementation
    cfg._attn_implementation = "eager"
    try:
        res = model.decoder(inputs_embeds=emb, attention_mask=model.additive(pk.mask), position_ids=pos,
                            output_attentions=True)
    finally:
        cfg._attn_implementation = old
    pairs, ci = branch_anchor_pairs(pk, [ex.layout for ex in batch.examples], s)
    bi, ri = pairs[:, 0], pairs[:, 1]
    metrics: dict[str, Any] = {}
    masses = []
    for i, att in enumerate(res.attentions):  # [B, H, L, L]
        m = float(att[bi, :, ri, ci].mean())
        metrics[f"probe_anchor_mass_l{i}"] = m
        masses.append(m)
    metrics["probe_anchor_mass"] = sum(masses) / len(masses)
    anchor_rows = pk.role == Role.ANCHOR
    token_rows = (pk.role == Role.BRANCH) | (pk.role == Role.INSTRUCTION)
    metrics["probe_anchor_norm"] = float(emb[anchor_rows].norm(dim=-1).mean())
    metrics["probe_token_norm"] = float(emb[token_rows].norm(dim=-1).mean())
    metrics["_out"] = out
    return metrics


@torch.no_grad()
@contextlib.contextmanager
def aggregated_at(model, layer: int | None):
    """Within the block the model pools its anchors from layer `layer`'s input states (None: its own)."""
    own = model.aggregation_layer
    if layer is not None:
        model.aggregation_layer = layer
    try:
        yield
    finally:
        model.aggregation_layer = own


def anchor_feature_rows(model, samples: list, parse, batch: int = 8) -> tuple[torch.Tensor, list[dict]]:
    """Eval-mode forwards over `samples` -> (aggregated anchor features [E, d] of every event,
    true intervals; the attributes parsed from each event's caption, E dicts)."""
    return anchor_parts(model, samples, batch)["anchor"], [parse(e.caption) for s in samples for e in s.events]


def anchor_parts(model, samples: list, batch: int = 8) -> dict[str, torch.Tensor]:
    """Eval-mode forwards over `samples` -> {"anchor", "visual", "audio": [E, d]}: every event's
    aggregated feature and its two halves (the pooled visual and the pooled audio states, which sum
    to it), in the order of the samples' events."""
    parts: dict[str, list[torch.Tensor]] = {"anchor": [], "visual": [], "audio": []}
    run = model.anchor_features

    def record(hidden_in, layout, *args, **kwargs):
        f, w = run(hidden_in, layout, *args, **kwargs)
        parts["anchor"].append(f.detach().float().cpu())
        for name, index in (("visual", layout.visual_index), ("audio", layout.audio_index)):
            rows = hidden_in[index.reshape(-1).to(hidden_in.device)]
            half = w[name].to(hidden_in.dtype) @ rows if name in w else torch.zeros_like(f)
            parts[name].append(half.detach().float().cpu())
        return f, w

    model.anchor_features = record
    try:
        with torch.no_grad():
            for b in Batcher(model, batch)(samples):
                model.forward_train(b)
    finally:
        del model.anchor_features
    return {k: torch.cat(v) if v else torch.zeros(0, 0) for k, v in parts.items()}


def between_class_share(x: torch.Tensor, labels: list) -> float:
    """x [N, d], N labels -> the fraction of x's total variance that lies between the label classes'
    means (trace of the between-class scatter over the total scatter): 1 when x is a function of
    the label, ~(classes - 1) / (N - 1) when x is unrelated to it.

    >>> x = torch.tensor([[0.0, 1.0], [0.0, -1.0], [2.0, 1.0], [2.0, -1.0]])
    >>> round(between_class_share(x, ["a", "a", "b", "b"]), 3)  # the label explains the first axis
    0.5
    """
    values = sorted(set(labels))
    y = torch.tensor([values.index(v) for v in labels])
    mu = x.mean(0)
    total = ((x - mu) ** 2).sum()
    between = sum(((x[y == k].mean(0) - mu) ** 2).sum() * (y == k).sum() for k in range(len(values)))
    return float(between / total)


def attribute_shares(model, samples: list, parse, attributes=("colour", "shape", "motion", "sound"),
                     layer: int | None = None) -> dict[str, dict[str, float]]:
    """{part: {attribute: between-class share}} of the anchors' aggregated features and of their visual
    and audio halves, over the events of `samples`; `layer` as in `linear_probe`. How much of what
    the branches read from an anchor says its colour, against its sound, etc."""
    with aggregated_at(model, layer):
        parts = anchor_parts(model, samples)
    attrs = [parse(e.caption) for s in samples for e in s.events]
    out = {}
    for part, x in parts.items():
        out[part] = {}
        for a in attributes:
            keep = [i for i, r in enumerate(attrs) if r.get(a) is not None]
            if len({attrs[i][a] for i in keep}) > 1:
                out[part][a] = round(between_class_share(x[keep], [attrs[i][a] for i in keep]), 4)
        out[part]["norm"] = round(float(x.norm(dim=1).mean()), 3)
    return out


def linear_probe_accuracy(x_fit: torch.Tensor, y_fit: torch.Tensor, x_test: torch.Tensor, y_test: torch.Tensor,
                          classes: int, l2: float = 1e-3, iters: int = 200) -> float:
    """Softmax regression on standardised features (LBFGS, L2) fitted on (x_fit [N, d], y_fit [N]),
    accuracy on (x_test, y_test). Deterministic: zero init, full batch."""
    mu, sd = x_fit.mean(0), x_fit.std(0).clamp(min=1e-6)
    xf, xt = (x_fit - mu) / sd, (x_test - mu) / sd
    w = torch.zeros(xf.shape[1], classes, requires_grad=True)
    b = torch.zeros(classes, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=iters, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(xf @ w + b, y_fit) + l2 * w.pow(2).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    return float(((xt @ w + b).argmax(-1) == y_test).float().mean())


def linear_probe(model, fit: list, test: list, parse, attributes=("colour", "shape", "motion", "sound"),
                 layer: int | None = None) -> dict:
    """{probe_lin_<attr>: held-out accuracy} of a linear read-out of the anchors' aggregated features.
    layer: aggregate another layer's input states instead (0 = the input embeddings; keys get an
    `_l<layer>` suffix), the model's own aggregation layer being restored afterwards."""
    with aggregated_at(model, layer):
        xf, af = anchor_feature_rows(model, fit, parse)
        xt, at = anchor_feature_rows(model, test, parse)
    suffix = "" if layer is None else f"_l{layer}"
    out = {}
    for a in attributes:
        values = sorted({r[a] for r in af + at if r.get(a) is not None})
        if len(values) < 2:
            continue
        idx = {v: i for i, v in enumerate(values)}
        kf = [i for i, r in enumerate(af) if r.get(a) is not None]
        kt = [i for i, r in enumerate(at) if r.get(a) is not None]
        yf = torch.tensor([idx[af[i][a]] for i in kf])
        yt = torch.tensor([idx[at[i][a]] for i in kt])
        out[f"probe_lin_{a}{suffix}"] = linear_probe_accuracy(xf[kf], yf, xt[kt], yt, len(values))
    return out


class AttributeProbe:
    """The loop's `probe` hook (see the module doc)."""

    def __init__(self, samples: list, parse, every: int = 100, max_samples: int = 8,
                 linear: tuple[list, list] | None = None, linear_layers: tuple[int, ...] = ()):
        self.samples, self.parse, self.every, self.max_samples = samples[:max_samples], parse, every, max_samples
        self.linear = linear  # (fit samples, held-out samples) of the linear probe, or None
        self.linear_layers = linear_layers  # other layers to read out too (probe_lin_<attr>_l<i>)
        self._batch = None
        self._attr_rows = None

    def due(self, step: int) -> bool:
        return self.every > 0 and (step == 1 or step % self.every == 0)

    def __call__(self, step: int, model) -> dict[str, float]:
        if not self.due(step):
            return {}
        rec = grad_norms(model)
        was = model.training
        model.eval()
        try:
            if self._batch is None:
                self._batch = next(Batcher(model, len(self.samples))(self.samples))
                self._attr_rows = _attribute_rows(model, self._batch, self.parse)
            m = anchor_attention(model, self._batch)
            if self.linear is not None:
                m.update(linear_probe(model, *self.linear, self.parse))
                for layer in self.linear_layers:
                    m.update(linear_probe(model, *self.linear, self.parse, layer=layer))
        finally:
            model.train(was)
        out = m.pop("_out")
        ce = F.cross_entropy(out["branch_logits"].float(), out["branch_labels"], reduction="none")
        attr = self._attr_rows.to(ce.device)
        pad = out["branch_pad"]
        rec.update(m)
        rec["probe_branch_attr_lm"] = float(ce[attr].mean())
        rec["probe_branch_other_lm"] = float(ce[~attr & ~pad].mean())
        print(f"[probe] step {step} " + "  ".join(f"{k[6:]} {v:.4g}" for k, v in rec.items()
                                                  if not k.startswith("probe_anchor_mass_l")), flush=True)
        return rec
