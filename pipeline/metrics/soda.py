"""SODA_c (story-oriented dense captioning), docs/design/method.md section 3.

Per video: sort predictions and references by start time; S[r, p] = tIoU(r, p) x
METEOR(pred p vs ref r) (per-pair METEOR from the jar); find the order-preserving
one-to-one matching (no crossings) that maximises the sum of S with the dynamic
programme

    dp[i, j] = max(dp[i-1, j], dp[i, j-1], dp[i-1, j-1] + S[i-1, j-1]),  dp[0, :] = dp[:, 0] = 0

computed row by row with numpy (iterative: no recursion, so 1,000 x 1,000 is fine);
P = best / #predictions, R = best / #references, F = 2PR / (P + R). SODA_c is the
mean F over videos that have predictions. Pairs with tIoU = 0 contribute 0 whatever
their METEOR, so only overlapping pairs are sent to METEOR.

Direction of the pair scorer (`direction`):
- "published" (default): as the public SODA evaluator (fujiso/SODA `calc_score_matrix`,
  pinned by PDVC and bundled by LongVALE, so the SODA_c of those papers) computes it.
  It calls pycocoevalcap's `compute_score(res, gt)` with the predictions where the
  references go, so METEOR scores the *reference* caption as the hypothesis against the
  prediction as the reference; and with `cider=True` it makes one CIDEr-D call per
  reference caption r over all P predictions of the video (hypothesis r for every p,
  reference p), so each row's IDF comes from the video's predictions (P documents).
- "documented": METEOR's documented direction (prediction = hypothesis, reference =
  reference) and one CIDEr-D call over all (prediction, reference) pairs of the video,
  whose IDF is then the video's reference set. METEOR is not symmetric, so the two
  directions give different numbers (the sign depends on caption lengths).

    best, matches = soda_dp(score)   # score float [R, P]
"""

from __future__ import annotations

import numpy as np

from pipeline.metrics.common import Prepared, f1, mean


def soda_dp(score: np.ndarray) -> tuple[float, list[tuple[int, int]]]:
    """Order-preserving one-to-one matching maximising the summed score.

    score: float [R, P] (references x predictions, both sorted by start).
    Returns (best total, [(ref index, pred index), ...] in increasing order).
    """
    score = np.asarray(score, dtype=np.float64)
    n_ref, n_pred = score.shape
    if n_ref == 0 or n_pred == 0:
        return 0.0, []
    dp = np.zeros((n_ref + 1, n_pred + 1), dtype=np.float64)
    for i in range(1, n_ref + 1):
        prev = dp[i - 1]
        # best with ref i matched to pred j, or ref i unmatched; then carry the best along j
        cand = np.maximum(prev[1:], prev[:-1] + score[i - 1])
        dp[i, 1:] = np.maximum.accumulate(cand)
    matches: list[tuple[int, int]] = []
    i, j = n_ref, n_pred
    while i > 0 and j > 0:
        if dp[i, j] == dp[i - 1, j]:
            i -= 1
        elif dp[i, j] == dp[i, j - 1]:
            j -= 1
        else:
            matches.append((i - 1, j - 1))
            i, j = i - 1, j - 1
    matches.reverse()
    return float(dp[n_ref, n_pred]), matches


def _sorted_order(times: np.ndarray) -> np.ndarray:
    return np.argsort(times[:, 0], kind="stable")


DIRECTIONS = ("published", "documented")
_DIRECTION_TEXT = {
    "published": "published (fujiso/SODA: METEOR(hyp=reference, ref=prediction); CIDEr-D IDF per reference row over the predictions)",
    "documented": "documented (METEOR(hyp=prediction, ref=reference); CIDEr-D IDF over the video's references)",
}


def soda_plan(prep: Prepared, direction: str = "published") -> tuple[dict, list[tuple[str, str]]]:
    """Per video (sort orders, tIoU [R, P], overlapping index pairs, captions, slice) and
    the (hyp, ref) pairs whose METEOR is needed (tIoU > 0); published: (reference, prediction)."""
    if direction not in DIRECTIONS:
        raise ValueError(f"unknown SODA direction {direction!r}; expected one of {DIRECTIONS}")
    plans = {}
    needed: list[tuple[str, str]] = []
    for vid in prep.with_predictions():
        po = _sorted_order(prep.data.preds[vid].times)
        ro = _sorted_order(prep.data.refs[vid].times)
        iou = prep.iou[vid][np.ix_(po, ro)].T  # [R, P], both sorted by start
        rs, ps = np.nonzero(iou > 0)
        hyps = [prep.pred_tok[vid][k] for k in po]
        refs = [prep.ref_tok[vid][k] for k in ro]
        if direction == "published":
            pairs = [(refs[r], hyps[p]) for r, p in zip(rs, ps)]
        else:
            pairs = [(hyps[p], refs[r]) for r, p in zip(rs, ps)]
        plans[vid] = (po, ro, iou, rs, ps, hyps, refs, len(needed), len(needed) + len(pairs))
        needed.extend(pairs)
    return plans, needed


def _cider_matrix(scorers, hyps: list[str], refs: list[str], direction: str) -> np.ndarray:
    """CIDEr-D [R, P] of one video, in the pair direction and IDF scope of `direction`."""
    if direction == "published":  # one call per reference row, IDF over the predictions
        return np.stack([scorers.cider_item_scores([(ref, h) for h in hyps]) for ref in refs])
    group = [(h, ref) for ref in refs for h in hyps]
    return scorers.cider_item_scores(group).reshape(len(refs), len(hyps))


def evaluate_soda(prep: Prepared, scorers, cider: bool = False, direction: str = "published") -> dict:
    """SODA_c (METEOR; optionally also CIDEr-D) with per-video detail."""
    videos = prep.with_predictions()
    plans, needed = soda_plan(prep, direction)
    meteor = scorers.meteor_pair_scores(needed)

    per_video = {}
    for vid in videos:
        po, ro, iou, rs, ps, hyps, refs, a, b = plans[vid]
        score = np.zeros_like(iou)
        score[rs, ps] = meteor[a:b]
        best, matches = soda_dp(iou * score)
        p, r = best / iou.shape[1], best / iou.shape[0]
        entry = {
            "SODA_c": f1(p, r),
            "precision": p,
            "recall": r,
            "matches": [[int(po[j]), int(ro[i])] for i, j in matches],  # [pred index, ref index] in input order
        }
        if cider:
            cmat = _cider_matrix(scorers, hyps, refs, direction)
            cbest, _ = soda_dp(iou * cmat)
            entry["SODA_c_CIDEr"] = f1(cbest / iou.shape[1], cbest / iou.shape[0])
        per_video[vid] = entry

    rows = per_video.values()  # video order
    metrics = {"SODA_c": mean(e["SODA_c"] for e in rows), "Precision": mean(e["precision"] for e in rows),
               "Recall": mean(e["recall"] for e in rows)}
    if cider:
        metrics["SODA_c_CIDEr"] = mean(e["SODA_c_CIDEr"] for e in rows)
    return {
        "protocol": "soda",
        "variant": {
            "scorer": "METEOR" + (" (+ CIDEr-D)" if cider else ""),
            "direction": _DIRECTION_TEXT[direction],
            "matching": "order-preserving one-to-one, max sum of tIoU x score (iterative DP)",
            "averaged_over": "videos with predictions",
        },
        "metrics": metrics,
        "counts": {"videos": len(prep.videos), "videos_with_predictions": len(videos), "videos_averaged": len(videos), "meteor_pairs": len(needed)},
        "per_video": per_video,
    }
