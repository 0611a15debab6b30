"""The E.T.Bench dense-captioning protocol (the paper's F1 and Sim), docs/design/method.md section 3.

Videos: a reference video is "parsed" when its output gave at least one valid event;
missing, empty and unparsable outputs are left out of the averages, and the
precision and recall are then scaled by parsed / total (as E.T.Bench does).

For each tIoU t in {0.1, 0.3, 0.5, 0.7}:
  - per parsed video precision / recall with the strict tIoU > t, averaged over parsed
    videos, times parsed / total; F1(t) = 2PR / (P + R);
  - Sim: the densevid caption pairs (tIoU >= t, unmatched prediction vs a nonsense
    reference); a pair's similarity is the cosine of the L2-normalised mean-pooled
    all-MiniLM-L6-v2 embeddings of its two PTB-tokenised captions; per video the mean
    over its pairs, then the mean over parsed videos.
F1 and Sim are then the means over t.

    result = evaluate_etbench(prepare(data, scorers), scorers)
"""

from __future__ import annotations

import numpy as np

from pipeline.metrics.common import Prepared, caption_pairs, detection_pr, f1, mean, text_pairs, tkey

ETBENCH_TIOUS = (0.1, 0.3, 0.5, 0.7)


def etbench_sentences(prep: Prepared, tious=ETBENCH_TIOUS) -> list[str]:
    """Exactly the tokenised sentences Sim uses at some threshold: all predictions, the
    references paired at the lowest t, the nonsense references of predictions unpaired
    at the highest t. Embedding this set in one go makes Sim identical whichever
    protocol asks for it (batch composition decides the last float bits)."""
    lo, hi = min(tious), max(tious)
    out: list[str] = []
    for vid in prep.with_predictions():
        iou = prep.iou[vid]
        out += prep.pred_tok[vid]
        out += [s for j, s in enumerate(prep.ref_tok[vid]) if (iou[:, j] >= lo).any()]
        out += [s for i, s in enumerate(prep.nonsense_tok[vid]) if not (iou[i] >= hi).any()]
    return out


def evaluate_etbench(prep: Prepared, scorers, tious=ETBENCH_TIOUS) -> dict:
    """E.T.Bench F1 / Sim with per-threshold and per-video detail."""
    total = len(prep.videos)
    parsed = prep.with_predictions()
    scale = len(parsed) / total if total else 0.0

    pairs = {(ti, vid): text_pairs(prep, vid, caption_pairs(prep.iou[vid], t)) for ti, t in enumerate(tious) for vid in parsed}
    sentences = sorted({s for group in pairs.values() for pair in group for s in pair})
    scorers.prefetch_embeddings(etbench_sentences(prep, tious))  # the same set in every protocol
    emb = scorers.embed(sentences).astype(np.float64)
    row_of = {s: i for i, s in enumerate(sentences)}

    zeros = [0.0] * len(tious)
    per_video = {vid: {"Sim": list(zeros), "Precision": list(zeros), "Recall": list(zeros)} for vid in parsed}
    for (ti, vid), group in pairs.items():
        h = emb[[row_of[a] for a, _ in group]]
        r = emb[[row_of[b] for _, b in group]]
        pv = per_video[vid]
        pv["Sim"][ti] = float(np.mean(np.einsum("nd,nd->n", h, r)))
        pv["Precision"][ti], pv["Recall"][ti] = detection_pr(prep.iou[vid], tious[ti])

    per_threshold = {}
    for ti, t in enumerate(tious):
        p = mean(per_video[v]["Precision"][ti] for v in parsed) * scale
        r = mean(per_video[v]["Recall"][ti] for v in parsed) * scale
        per_threshold[tkey(t)] = {"F1": f1(p, r), "Precision": p, "Recall": r, "Sim": mean(per_video[v]["Sim"][ti] for v in parsed)}
    metrics = {name: mean(per_threshold[tkey(t)][name] for t in tious) for name in ("F1", "Sim", "Precision", "Recall")}
    return {
        "protocol": "etbench",
        "variant": {
            "tious": list(tious),
            "detection": "strict tIoU > t, P and R scaled by parsed / total",
            "sim": "cosine of L2-normalised mean-pooled all-MiniLM-L6-v2 embeddings of PTB-tokenised caption pairs (tIoU >= t)",
            "seed": prep.seed,
        },
        "metrics": metrics,
        "per_threshold": per_threshold,
        "counts": {"videos": total, "videos_parsed": len(parsed), "videos_averaged": len(parsed), "parsed_scale": scale, "sentences_embedded": len(sentences)},
        "per_video": per_video,
    }
