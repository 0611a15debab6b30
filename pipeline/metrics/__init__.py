"""Dense video captioning metrics: densevid, SODA_c, E.T.Bench and the PadCaptioner table.

    from pipeline.metrics import evaluate, write_report
    result = evaluate("pred.json", "val.json", protocol="padcaptioner")
    result["metrics"]   # {"F1", "Sim", "SODA_c", "CIDEr", "METEOR"} on the 0-1 scale
    write_report(result, "pred.json", "val.json", "runs/x/report")

Protocols (docs/design/method.md section 3; every result names its protocol and variant):
    densevid      METEOR / CIDEr-D at tIoU {0.3, 0.5, 0.7, 0.9}, detection P / R / F1;
                  missing="skip" (LongVALE) or "zero" (ActivityNet / PDVC)
    soda          SODA_c with METEOR (soda_cider=True adds CIDEr-D)
    etbench       F1 at tIoU {0.1, 0.3, 0.5, 0.7} and MiniLM Sim, parsed/total scaling
    padcaptioner  the paper's table in one run: F1, Sim (etbench), SODA_c (soda),
                  CIDEr, METEOR (densevid, LongVALE variant)

One run starts each external scorer once (PTB tokenizer call, METEOR JVM, MiniLM) and
closes the JVM at the end. CLI: `python -m pipeline.metrics --help`. No ray imports.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from pipeline.metrics.common import prepare
from pipeline.metrics.densevid import densevid_groups, evaluate_densevid
from pipeline.metrics.etbench import etbench_sentences, evaluate_etbench
from pipeline.metrics.io import MAX_PREDICTIONS, EvalInput, load_inputs
from pipeline.metrics.report import write_report
from pipeline.metrics.scorers import Scorers
from pipeline.metrics.soda import DIRECTIONS as SODA_DIRECTIONS
from pipeline.metrics.soda import evaluate_soda, soda_plan
from pipeline.metrics.tiou import tiou

PROTOCOLS = ("densevid", "soda", "etbench", "padcaptioner")

__all__ = [
    "PROTOCOLS",
    "SODA_DIRECTIONS",
    "evaluate",
    "public_result",
    "tiou",
    "write_report",
]


def _missing_policy(protocol: str, missing: str | None) -> str | None:
    if protocol == "densevid":
        return missing or "skip"
    if protocol == "padcaptioner":
        if missing not in (None, "skip"):
            raise ValueError("padcaptioner reports densevid's LongVALE variant (videos without predictions skipped); use --protocol densevid for 'zero'")
        return "skip"
    if missing not in (None, "skip"):  # soda / etbench leave such videos out (etbench then scales P, R)
        raise ValueError(f"the {protocol} protocol leaves videos without predictions out (docs/design/method.md section 3); missing='zero' applies to densevid only")
    return None


def _video_summary(data: EvalInput, max_predictions: int) -> tuple[dict, dict]:
    videos, counts = {}, {"reference_events": 0, "predicted_events": 0, "predicted_events_dropped": 0, "predicted_events_truncated": 0}
    for vid, ref in data.refs.items():
        pred = data.preds[vid]
        truncated = max(0, pred.raw_count - max_predictions)
        dropped = max(0, pred.raw_count - truncated - len(pred.captions))
        videos[vid] = {
            "status": pred.status,
            "predictions": len(pred.captions),
            "references": len(ref.captions),
            "problems": [p["problem"] for p in data.problems if p["video_id"] == vid],
        }
        counts["reference_events"] += len(ref.captions)
        counts["predicted_events"] += len(pred.captions)
        counts["predicted_events_dropped"] += dropped
        counts["predicted_events_truncated"] += truncated
    counts["prediction_status"] = dict(Counter(data.preds[vid].status for vid in data.refs))  # first-seen order
    return videos, counts


def evaluate(
    pred: Any,
    ref: Any = None,
    protocol: str = "padcaptioner",
    *,
    ref_format: str | None = None,
    missing: str | None = None,
    seed: int = 0,
    soda_cider: bool = False,
    soda_direction: str = "published",
    max_predictions: int = MAX_PREDICTIONS,
    progress: bool = False,
    scorers: Scorers | None = None,
) -> dict:
    """Score predictions against references with one protocol.

    pred / ref: paths or loaded objects in any form `pipeline.metrics.io` reads.
    missing: "skip" (default) or "zero"; "zero" is densevid-only
    (the other protocols always leave videos without predictions out).
    soda_direction: "published" (fujiso/SODA's pair direction, default) or "documented"
    (METEOR's own); see pipeline/metrics/soda.py.
    scorers: reuse an open `Scorers` (its JVM) across calls; else one is opened and closed.
    Returns a JSON-ready dict: protocol, variant, metrics, per_threshold, counts,
    components (padcaptioner), videos (status + problems per video), problems.
    """
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; expected one of {PROTOCOLS}")
    missing = _missing_policy(protocol, missing)
    if soda_direction not in SODA_DIRECTIONS:
        raise ValueError(f"unknown soda_direction {soda_direction!r}; expected one of {SODA_DIRECTIONS}")
    timing: dict[str, float] = {}

    def timed(name, fn, *args, **kw):
        start = time.perf_counter()
        out = fn(*args, **kw)
        timing[name] = time.perf_counter() - start
        return out

    t0 = time.perf_counter()
    data = timed("read", load_inputs, pred, ref, ref_format, max_predictions)
    sc = scorers if scorers is not None else Scorers(progress=progress)
    try:
        if protocol != "etbench" and any(p.has_predictions for p in data.preds.values()):
            sc.start_meteor()  # the JVM loads its tables while the PTB tokenizer runs
        prep = timed("tokenize", prepare, data, sc, seed)
        if protocol == "densevid":
            result = timed("densevid", evaluate_densevid, prep, sc, missing=missing)
        elif protocol == "soda":
            result = timed("soda", evaluate_soda, prep, sc, cider=soda_cider, direction=soda_direction)
        elif protocol == "etbench":
            result = timed("etbench", evaluate_etbench, prep, sc)
        else:
            # Overlap the three costly scorers: MiniLM (background thread, one torch thread
            # while busy), the METEOR JVM (background stream of every pair SODA and densevid
            # need) and CIDEr (pure Python, in densevid on this thread).
            sc.busy = True
            try:
                sc.prefetch_embeddings(etbench_sentences(prep))
                if prep.with_predictions():
                    sc.prefetch_meteor(soda_plan(prep, soda_direction)[1] + [p for g in densevid_groups(prep)[1] for p in g])
                dense = timed("densevid", evaluate_densevid, prep, sc, missing="skip")
                soda = timed("soda", evaluate_soda, prep, sc, cider=soda_cider, direction=soda_direction)
            finally:
                sc.busy = False  # MiniLM may now use every core
            etb = timed("etbench", evaluate_etbench, prep, sc)
            metrics = {
                "F1": etb["metrics"]["F1"],
                "Sim": etb["metrics"]["Sim"],
                "SODA_c": soda["metrics"]["SODA_c"],
                "CIDEr": dense["metrics"]["CIDEr"],
                "METEOR": dense["metrics"]["METEOR"],
            }
            if soda_cider:
                metrics["SODA_c_CIDEr"] = soda["metrics"]["SODA_c_CIDEr"]
            result = {
                "protocol": "padcaptioner",
                "variant": {
                    "F1, Sim": "etbench (tIoU 0.1/0.3/0.5/0.7, parsed/total scaling)",
                    "SODA_c": f"soda (METEOR, mean over videos with predictions, {soda['variant']['direction']})",
                    "CIDEr, METEOR": "densevid LongVALE variant (tIoU 0.3/0.5/0.7/0.9, videos without predictions skipped)",
                    "seed": seed,
                },
                "metrics": metrics,
                "per_threshold": {"etbench": etb["per_threshold"], "densevid": dense["per_threshold"]},
                "counts": {"videos": len(prep.videos), "videos_with_predictions": len(prep.with_predictions())},
                "components": {"etbench": etb, "soda": soda, "densevid": dense},
            }
        result["scorer_calls"] = dict(sc.counters)
    finally:
        if scorers is None:
            sc.close()
    videos, counts = _video_summary(data, max_predictions)
    result["counts"] = {**result["counts"], **counts, "problems": len(data.problems)}
    result["inputs"] = {"ref_format": data.ref_format, "pred_format": data.pred_format, "max_predictions": max_predictions}
    result["videos"] = videos
    result["problems"] = data.problems
    timing["total"] = time.perf_counter() - t0
    result["timing_s"] = timing
    return result


def public_result(result: dict, per_video: bool = False) -> dict:
    """The result without the bulky per-video sections (unless per_video=True)."""
    if per_video:
        return result
    out = {k: v for k, v in result.items() if k not in ("per_video", "videos")}
    if "components" in out:
        out["components"] = {name: {k: v for k, v in comp.items() if k != "per_video"} for name, comp in out["components"].items()}
    return out
