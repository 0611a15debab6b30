"""The densevid protocol (LongVALE / ActivityNet Captions evaluator), docs/design/method.md section 3.

For each tIoU t in {0.3, 0.5, 0.7, 0.9}:
  - captioning: per video, every (prediction, reference) with tIoU >= t is a caption
    pair (many-to-many), an unmatched prediction meets a nonsense reference; the
    video's score is the scorer's corpus-level score over its pairs (METEOR: the
    jar's aggregate; CIDEr-D: pycocoevalcap over those pairs); mean over videos;
  - detection: per video precision = share of predictions with some reference at
    tIoU > t, recall = share of references with some prediction at tIoU > t; both
    averaged over videos; F1(t) = 2PR / (P + R) from the averaged P and R.
Every metric is then the mean over t.

Videos without predictions: `missing="skip"` leaves them out of every average
(LongVALE); `missing="zero"` counts them as 0 for every metric (ActivityNet / PDVC).

    result = evaluate_densevid(prepare(data, scorers), scorers, missing="skip")
"""

from __future__ import annotations

from pipeline.metrics.common import Prepared, caption_pairs, detection_pr, f1, mean, text_pairs, tkey

DENSEVID_TIOUS = (0.3, 0.5, 0.7, 0.9)
MISSING_POLICIES = ("skip", "zero")


def densevid_groups(prep: Prepared, tious=DENSEVID_TIOUS) -> tuple[list[tuple[int, str]], list[list[tuple[str, str]]]]:
    """The caption-pair group of every (threshold index, video with predictions)."""
    keys, groups = [], []
    for ti, t in enumerate(tious):
        for vid in prep.with_predictions():
            keys.append((ti, vid))
            groups.append(text_pairs(prep, vid, caption_pairs(prep.iou[vid], t)))
    return keys, groups


def evaluate_densevid(prep: Prepared, scorers, tious=DENSEVID_TIOUS, missing: str = "skip") -> dict:
    """densevid metrics (0-1 scale scorer values) with per-threshold and per-video detail."""
    if missing not in MISSING_POLICIES:
        raise ValueError(f"missing must be one of {MISSING_POLICIES}, got {missing!r}")
    videos = prep.videos
    scored = prep.with_predictions()
    averaged = scored if missing == "skip" else videos

    keys, groups = densevid_groups(prep, tious)
    cider = scorers.cider_corpus_scores(groups)  # pure Python: runs while a METEOR prefetch streams
    meteor = scorers.meteor_corpus_scores(groups)

    zeros = [0.0] * len(tious)
    per_video = {
        vid: {"METEOR": list(zeros), "CIDEr": list(zeros), "Precision": list(zeros), "Recall": list(zeros), "pairs": [0] * len(tious)}
        for vid in videos
    }
    for (ti, vid), group, m, c in zip(keys, groups, meteor, cider):
        pv = per_video[vid]
        pv["METEOR"][ti], pv["CIDEr"][ti], pv["pairs"][ti] = float(m), float(c), len(group)
        pv["Precision"][ti], pv["Recall"][ti] = detection_pr(prep.iou[vid], tious[ti])

    per_threshold = {}
    for ti, t in enumerate(tious):
        row = {name: mean(per_video[v][name][ti] for v in averaged) for name in ("METEOR", "CIDEr", "Precision", "Recall")}
        row["F1"] = f1(row["Precision"], row["Recall"])
        per_threshold[tkey(t)] = row
    names = ("METEOR", "CIDEr", "Precision", "Recall", "F1")
    metrics = {name: mean(per_threshold[tkey(t)][name] for t in tious) for name in names}
    return {
        "protocol": "densevid",
        "variant": {
            "missing": missing,
            "missing_meaning": "videos without predictions are left out (LongVALE)" if missing == "skip" else "videos without predictions count as 0 (ActivityNet / PDVC)",
            "tious": list(tious),
            "caption_pairs": "tIoU >= t, many-to-many, unmatched prediction vs seeded nonsense reference",
            "detection": "strict tIoU > t",
            "seed": prep.seed,
        },
        "metrics": metrics,
        "per_threshold": per_threshold,
        "counts": {
            "videos": len(videos),
            "videos_with_predictions": len(scored),
            "videos_averaged": len(averaged),
            "caption_pairs": int(sum(len(g) for g in groups)),
        },
        "per_video": per_video,
    }
