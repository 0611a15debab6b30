"""Shared steps of every protocol: tokenise once, tIoU matrices, caption pairs, detection P/R.

`prepare(data, scorers, seed)` turns an `EvalInput` into `Prepared`: every caption
of the run (predictions, references, and the seeded nonsense references) goes through
the PTB tokenizer in ONE java call, and each video gets its tIoU matrix.

Caption pairing (densevid / E.T.Bench): for a threshold t, every (prediction,
reference) with tIoU >= t is a pair (many-to-many); a prediction with no such
reference is paired with a nonsense reference: 10-20 random lowercase letters from
`random.Random(f"{seed}|{video_id}|{prediction index}")`, so results do not depend
on video order, thresholds or the Python hash seed. (The public evaluators draw a
fresh random string per pair from the global generator; the string only has to
match nothing, which any such string does.)

Detection precision / recall use the strict tIoU > t.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

import numpy as np

from pipeline.metrics.io import EvalInput
from pipeline.metrics.tiou import tiou_matrix


def nonsense_reference(seed: int, video_id: str, pred_index: int) -> str:
    """The seeded garbage reference for an unmatched prediction (10-20 lowercase letters)."""
    rng = random.Random(f"{seed}|{video_id}|{pred_index}")
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(10, 20)))


@dataclass
class Prepared:
    data: EvalInput
    seed: int
    pred_tok: dict[str, list[str]]  # PTB-tokenised predictions, output order
    ref_tok: dict[str, list[str]]  # PTB-tokenised references, annotation order
    nonsense_tok: dict[str, list[str]]  # one nonsense reference per prediction
    iou: dict[str, np.ndarray]  # float64 [P, R] tIoU(prediction i, reference j)

    @property
    def videos(self) -> list[str]:
        return list(self.data.refs)

    def with_predictions(self) -> list[str]:
        return [v for v in self.data.refs if self.data.preds[v].has_predictions]


def prepare(data: EvalInput, scorers, seed: int = 0) -> Prepared:
    """Tokenise every caption of the run in one PTB call; compute tIoU matrices."""
    texts: list[str] = []
    spans: dict[tuple[str, str], tuple[int, int]] = {}
    for vid, ref in data.refs.items():
        pred = data.preds[vid]
        parts = {
            "pred": pred.captions,
            "ref": ref.captions,
            "nonsense": [nonsense_reference(seed, vid, i) for i in range(len(pred.captions))],
        }
        for kind, caps in parts.items():
            spans[(vid, kind)] = (len(texts), len(texts) + len(caps))
            texts.extend(caps)
    toks = scorers.tokenize(texts)
    out = {"pred": {}, "ref": {}, "nonsense": {}}
    for (vid, kind), (a, b) in spans.items():
        out[kind][vid] = toks[a:b]
    iou = {vid: tiou_matrix(data.preds[vid].times, data.refs[vid].times) for vid in data.refs}
    return Prepared(data, seed, out["pred"], out["ref"], out["nonsense"], iou)


def caption_pairs(iou: np.ndarray, t: float) -> list[tuple[int, int]]:
    """(prediction, reference) index pairs with tIoU >= t, prediction-major;
    (i, -1) for a prediction i with no such reference (it meets the nonsense reference)."""
    out: list[tuple[int, int]] = []
    hits = iou >= t
    for i in range(iou.shape[0]):
        out.extend([(i, int(j)) for j in np.flatnonzero(hits[i])] or [(i, -1)])
    return out


def text_pairs(prep: Prepared, vid: str, pairs: list[tuple[int, int]]) -> list[tuple[str, str]]:
    """Index pairs -> (hypothesis, reference) tokenised text pairs."""
    p, r, n = prep.pred_tok[vid], prep.ref_tok[vid], prep.nonsense_tok[vid]
    return [(p[i], r[j] if j >= 0 else n[i]) for i, j in pairs]


def detection_pr(iou: np.ndarray, t: float) -> tuple[float, float]:
    """(precision, recall) of one video at threshold t with the strict tIoU > t."""
    if iou.shape[0] == 0 or iou.shape[1] == 0:
        return 0.0, 0.0
    hit = iou > t
    return float(hit.any(axis=1).sum()) / iou.shape[0], float(hit.any(axis=0).sum()) / iou.shape[1]


def f1(precision: float, recall: float) -> float:
    return 2.0 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0


def mean(values) -> float:
    """Mean as a Python float; 0.0 for no values (reported counts say when that happens)."""
    values = list(values)
    return float(np.mean(values)) if values else 0.0


def tkey(t: float) -> str:
    """Threshold -> its JSON key ("0.3")."""
    return repr(float(t))
