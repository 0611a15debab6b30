"""Validation numbers of the training stage (teacher-forced, and free-running through the engine).

    counts = EvalCounts()
    counts += batch_counts(model, batch, model.forward_train(batch))   # teacher-forced, per batch
    summary(counts)   # planning_acc, grounding_f1@0.5, token_acc, colour/shape/motion/sound acc, attr_acc
    counts = engine_counts(samples, results, parse)                     # free-running (infer/ engine)

Definitions (all on held-out videos):
  planning_acc      fraction of videos whose greedy planning gives the true K. Teacher-forced:
                    the K+1 planning rows, each read as argmax over {<G>, <S>}, must say
                    <G> x K then <S>; given the true prefix this IS greedy planning.
  grounding_f1@0.5  per video precision / recall of the read-out intervals against the
                    references with the strict tIoU > 0.5 (pipeline.metrics.tiou); the mean
                    P and mean R over videos give F1. Teacher-forced: one interval per true event.
  token_acc         teacher-forced argmax accuracy over the caption-branch tokens (the real
                    caption tokens and each branch's real <eos>; <eos> padding excluded).
  <attr>_acc        per reference event, the attribute word (synthetic grammar, via a parser
                    such as preprocess.synthetic.parse_caption) is right. Teacher-forced: every
                    token spelling the word in the reference is the argmax at its row (a
                    parser over the argmax string would be fooled: with tied embeddings an
                    untrained model echoes its input token, i.e. the reference shifted by one).
                    Free-running: the parsed attribute of the prediction with the highest tIoU
                    to the reference equals the reference's (none overlapping = wrong).
  attr_acc          mean of the colour, shape and sound accuracies.
Free-running only (`engine_counts`; absent from a summary whose counts never saw one):
  <attr>_acc_unique / <attr>_acc_repeated   <attr>_acc over the reference events whose
                    value of that attribute occurs once / more than once among their video's
                    references (in the hard synthetic regime colours and sounds repeat, and a
                    model that captions by listing a video's attributes fails the repeated side).
  attr_acc_unique / attr_acc_repeated   the same pooled over colour, shape and sound (hits
                    over events, all three attributes together).
  overlap_grounding_f1@0.5   grounding F1@0.5 of the reference events that overlap another
                    reference of their video in time (intersection > 0): per video with such
                    events, recall over them (any prediction, tIoU > 0.5) and precision over
                    the predictions whose highest-tIoU reference (tIoU > 0) is one of them;
                    the mean P and R over those videos give F1, as for grounding_f1@0.5.
Counts are sums (`EvalCounts.tensor()` all-reduces across ranks). Pure torch; no ray.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, fields

import numpy as np
import torch

from pipeline.caption_grammar import ATTRIBUTES, parse_caption
from pipeline.layout import IGNORE

HEADLINE_ATTRIBUTES = ("colour", "shape", "sound")
TIOU = 0.5


@dataclass
class EvalCounts:
    """Sums over videos / events / tokens (floats, so they travel in one tensor)."""

    videos: float = 0.0
    planning_correct: float = 0.0
    precision_sum: float = 0.0
    recall_sum: float = 0.0
    tokens: float = 0.0
    tokens_correct: float = 0.0
    events: float = 0.0
    colour: float = 0.0
    shape: float = 0.0
    motion: float = 0.0
    sound: float = 0.0
    # free-running only: <attr>_unique / _repeated reference events and their hits (module doc)
    colour_unique: float = 0.0
    colour_unique_hits: float = 0.0
    colour_repeated: float = 0.0
    colour_repeated_hits: float = 0.0
    shape_unique: float = 0.0
    shape_unique_hits: float = 0.0
    shape_repeated: float = 0.0
    shape_repeated_hits: float = 0.0
    motion_unique: float = 0.0
    motion_unique_hits: float = 0.0
    motion_repeated: float = 0.0
    motion_repeated_hits: float = 0.0
    sound_unique: float = 0.0
    sound_unique_hits: float = 0.0
    sound_repeated: float = 0.0
    sound_repeated_hits: float = 0.0
    overlap_videos: float = 0.0  # videos with at least one overlapping reference pair
    overlap_events: float = 0.0
    overlap_precision_sum: float = 0.0
    overlap_recall_sum: float = 0.0

    def __iadd__(self, other: EvalCounts) -> EvalCounts:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self

    def tensor(self) -> torch.Tensor:
        return torch.tensor([getattr(self, f.name) for f in fields(self)], dtype=torch.float64)

    def add_detection(self, pred: np.ndarray, ref: np.ndarray) -> np.ndarray:
        """Add one video's precision and recall with the strict tIoU > TIOU; -> its tIoU matrix [P, R]."""
        from pipeline.metrics.tiou import tiou_matrix

        iou = tiou_matrix(pred, ref)
        if iou.size:
            hit = iou > TIOU
            self.precision_sum += float(hit.any(1).mean())
            self.recall_sum += float(hit.any(0).mean())
        return iou


def caption_parser(cfg) -> Callable[[str], dict] | None:
    """The attribute parser for `cfg.data.dataset` (the synthetic grammar's), or None."""
    return parse_caption if cfg.data.dataset == "synthetic" else None


def summary(c: EvalCounts, prefix: str = "") -> dict[str, float]:
    """Counts -> the reported numbers (see the module doc)."""
    div = lambda a, b: a / b if b else 0.0  # noqa: E731
    p, r = div(c.precision_sum, c.videos), div(c.recall_sum, c.videos)
    out = {
        "planning_acc": div(c.planning_correct, c.videos),
        "grounding_precision@0.5": p,
        "grounding_recall@0.5": r,
        "grounding_f1@0.5": 2 * p * r / (p + r) if p + r > 0 else 0.0,
        "token_acc": div(c.tokens_correct, c.tokens),
        **{f"{a}_acc": div(getattr(c, a), c.events) for a in ATTRIBUTES},
        "videos": c.videos,
        "events": c.events,
    }
    out["attr_acc"] = float(np.mean([out[f"{a}_acc"] for a in HEADLINE_ATTRIBUTES]))
    for side in ("unique", "repeated"):
        for a in ATTRIBUTES:
            if getattr(c, f"{a}_{side}"):
                out[f"{a}_acc_{side}"] = getattr(c, f"{a}_{side}_hits") / getattr(c, f"{a}_{side}")
        n = sum(getattr(c, f"{a}_{side}") for a in HEADLINE_ATTRIBUTES)
        if n:
            out[f"attr_acc_{side}"] = sum(getattr(c, f"{a}_{side}_hits") for a in HEADLINE_ATTRIBUTES) / n
    if c.overlap_videos:
        p, r = c.overlap_precision_sum / c.overlap_videos, c.overlap_recall_sum / c.overlap_videos
        out.update({"overlap_grounding_precision@0.5": p, "overlap_grounding_recall@0.5": r,
                    "overlap_grounding_f1@0.5": 2 * p * r / (p + r) if p + r > 0 else 0.0,
                    "overlap_videos": c.overlap_videos, "overlap_events": c.overlap_events})
    return {prefix + k: v for k, v in out.items()}


def heldout_counts(model, batch, out: dict, parse: Callable[[str], dict] | None = None) -> EvalCounts:
    """Teacher-forced counts of one batch as the model's family counts them (`counting`, pipeline/family.py):
    per token and attribute word from the packed batch (`batch_counts`), or from the loss dict (`loss_counts`)."""
    return batch_counts(model, batch, out, parse) if model.counting == "tokens" else loss_counts(model, out)


def loss_counts(model, out: dict) -> EvalCounts:
    """Teacher-forced counts of one release-model video (pipeline/release/finetune.py outputs):
    planning (every <G> row says <G>, the last says <S>), grounding P/R@0.5 of the read-out
    intervals, caption token accuracy. No attribute words (the release's captions are free text)."""
    c = EvalCounts(videos=1.0)
    text = out["text_logits"].float()
    says_g = (text[:, model.model.g_id] > text[:, model.model.s_id]).cpu()
    c.planning_correct = float(bool(says_g[:-1].all()) and not bool(says_g[-1]))
    for pred, ref in out.get("grounded", []):
        c.add_detection(np.asarray(pred, dtype=np.float64).reshape(-1, 2), np.asarray(ref, dtype=np.float64))
    labels = out["branch_labels"]
    c.tokens = float(labels.numel())
    c.tokens_correct = float((out["branch_logits"].argmax(-1) == labels).sum())
    c.events = float(text.shape[0] - 1)
    return c


def attribute_token_spans(token_texts: list[str], parse: Callable[[str], dict]) -> dict[str, list[int]]:
    """Token indices that spell each attribute word of a reference caption.

    token_texts: the caption's tokens decoded one by one (their concatenation is the text).
    The attribute value comes from `parse`; its first whole-word occurrence in the visual part
    (colour, shape, motion: before "Audio:") or the audio part (sound) is located (spelled as
    `parse.surface[value]` says, a regular expression, where the captions spell it otherwise,
    e.g. stripes as 'striped square') and the tokens overlapping it are returned. Attributes
    not found are left out.
    """
    text = "".join(token_texts)
    low = text.lower()
    cut = low.find("audio:")
    values = parse(text)
    bounds = np.cumsum([0] + [len(t) for t in token_texts])
    spans: dict[str, list[int]] = {}
    for a in ATTRIBUTES:
        word = values.get(a)
        if not word:
            continue
        lo, hi = (cut, len(low)) if (a == "sound" and cut >= 0) else (0, cut if cut >= 0 else len(low))
        spelled = getattr(parse, "surface", {}).get(word, re.escape(word))
        m = re.compile(r"\b(?:" + spelled + r")\b").search(low, lo, hi)
        if m is None:
            continue
        spans[a] = [j for j in range(len(token_texts)) if bounds[j] < m.end() and bounds[j + 1] > m.start()]
    return spans


@torch.no_grad()
def batch_counts(model, batch, out: dict, parse: Callable[[str], dict] | None = None) -> EvalCounts:
    """Teacher-forced counts of one batch from `model.forward_train(batch)` outputs."""
    c = EvalCounts()
    pk, exs = batch.packed, batch.examples
    s = pk.split

    # planning: K + 1 labelled stage-1 rows per dense sample, in batch order
    rows1 = (pk.labels[:, :s] != IGNORE).sum(1).tolist()
    text = out["text_logits"].float()
    says_g = (text[:, model.g_id] > text[:, model.s_id]).cpu()
    start = 0
    for ex, n in zip(exs, rows1):
        if ex.layout.kind == "dense":
            k = ex.layout.num_events
            pred = says_g[start:start + n]
            c.videos += 1
            c.planning_correct += float(bool(pred[:k].all()) and not bool(pred[k]))
        start += n

    # grounding: one read-out interval per true event
    dense = [ex for ex in exs if ex.layout.num_events > 0]
    for ex, logits in zip(dense, out["grounding_logits"]):
        pred = np.asarray(model.ground(logits.detach().float().cpu(), ex.segment_times), dtype=np.float64)
        c.add_detection(pred, ex.intervals.numpy().astype(np.float64))

    # caption tokens
    logits2, labels2 = out["branch_logits"], out["branch_labels"]
    if labels2.numel():
        pred_ids = logits2.argmax(-1).cpu()
        labels2 = labels2.cpu()
        real = ~out["branch_pad"].cpu()
        c.tokens += float(real.sum())
        c.tokens_correct += float(((pred_ids == labels2) & real).sum())
        if parse is not None:
            # (sample index, event, step) of every row of branch_logits (same order)
            b_idx, c_idx = (pk.labels[:, s:] != IGNORE).nonzero(as_tuple=True)
            ev, step = pk.event[:, s:][b_idx, c_idx], pk.step[:, s:][b_idx, c_idx]
            for b, ex in enumerate(exs):
                for i in range(ex.layout.num_events):
                    sel = torch.nonzero((b_idx == b) & (ev == i) & real).flatten()
                    sel = sel[torch.argsort(step[sel])]
                    ref_ids = labels2[sel].tolist()
                    right = (pred_ids[sel] == labels2[sel]).tolist()
                    spans = attribute_token_spans([model.tokenizer.decode([t]) for t in ref_ids], parse)
                    c.events += 1
                    for a, span in spans.items():
                        if span:
                            setattr(c, a, getattr(c, a) + float(all(right[j] for j in span)))
    return c


def engine_counts(samples: list, results: list[list[tuple[float, float, str]]],
                  parse: Callable[[str], dict] | None = None) -> EvalCounts:
    """Free-running counts: `results[i]` = the predicted (start, end, caption) events of samples[i]."""
    c = EvalCounts()
    for sample, pred_events in zip(samples, results):
        refs = sorted(sample.events, key=lambda e: (e.start, e.end))
        c.videos += 1
        c.planning_correct += float(len(pred_events) == len(refs))
        pred = np.asarray([[s, e] for s, e, _ in pred_events], dtype=np.float64).reshape(-1, 2)
        ref = np.asarray([[e.start, e.end] for e in refs], dtype=np.float64).reshape(-1, 2)
        iou = c.add_detection(pred, ref)
        _overlap_counts(c, ref, iou)
        if parse is None:
            continue
        values = [parse(ev.caption) for ev in refs]
        for j, ev in enumerate(refs):
            best = None
            if iou.shape[0]:
                i = int(np.argmax(iou[:, j]))
                best = pred_events[i][2] if iou[i, j] > 0 else None
            got = parse(best) if best is not None else {}
            c.events += 1
            for a in ATTRIBUTES:
                h = float(got.get(a) is not None and got.get(a) == values[j].get(a))
                setattr(c, a, getattr(c, a) + h)
                if values[j].get(a) is not None:
                    side = "unique" if sum(v.get(a) == values[j][a] for v in values) == 1 else "repeated"
                    setattr(c, f"{a}_{side}", getattr(c, f"{a}_{side}") + 1)
                    setattr(c, f"{a}_{side}_hits", getattr(c, f"{a}_{side}_hits") + h)
    return c


def overlapping_references(ref: np.ndarray) -> np.ndarray:
    """bool [R]: the reference intervals [R, 2] that intersect another one (touching does not)."""
    if len(ref) < 2:
        return np.zeros(len(ref), dtype=bool)
    inter = np.minimum(ref[:, None, 1], ref[None, :, 1]) - np.maximum(ref[:, None, 0], ref[None, :, 0])
    np.fill_diagonal(inter, 0.0)
    return (inter > 0).any(1)


def _overlap_counts(c: EvalCounts, ref: np.ndarray, iou: np.ndarray) -> None:
    """Add one video's overlap-grounding precision / recall (module doc) to `c`."""
    ov = overlapping_references(ref)
    if not ov.any():
        return
    c.overlap_videos += 1
    c.overlap_events += float(ov.sum())
    if iou.shape[0] == 0:
        return
    hit = iou > TIOU
    c.overlap_recall_sum += float(hit[:, ov].any(0).mean())
    owner = np.argmax(iou, axis=1)
    mine = ov[owner] & (iou.max(axis=1) > 0)
    if mine.any():
        c.overlap_precision_sum += float(hit[mine][:, ov].any(1).mean())

