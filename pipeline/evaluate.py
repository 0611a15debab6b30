"""The evaluate stage: score a captioning run against reference annotations and write a report.

    summary = evaluate_run(cfg, captions_dir, "longvale_test.json", "longvale", out_dir)

Reads the consolidated caption rows (`captions.jsonl`, written by infer/offline/job.py),
scores them with the configured protocol (`eval.protocol`, default the paper's
table: F1, Sim, SODA_c, CIDEr, METEOR), writes `result.json` and the HTML report
with per-video timelines (pipeline.metrics.write_report). On the synthetic corpus
it also reports how many colour / shape / motion / sound words of the matched
events' captions are right, the quickest read of whether a model learned.

Pure python (no ray); run by `pipeline/run.py`.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

from pipeline import storage
from pipeline.caption_grammar import ATTRIBUTES, parse_caption
from pipeline.config import Config, ConfigError
from pipeline.metrics import evaluate, tiou, write_report


def attribute_accuracy(pred: dict[str, dict[str, Any]], ref_path: str) -> dict[str, float]:
    """Synthetic corpus only: per reference event, the prediction with the best tIoU; the share
    of its caption's attribute words (colour, shape, motion, sound) that equal the reference's."""
    refs = storage.read_json(ref_path)
    hits = {a: 0 for a in ATTRIBUTES}
    total = 0
    matched = 0
    for vid, ref in refs.items():
        events = pred.get(vid, {}).get("events", [])
        for (s, e), sentence in zip(ref["timestamps"], ref["sentences"]):
            total += 1
            best = max(events, key=lambda p: tiou((p["start"], p["end"]), (s, e)), default=None)
            if best is None or tiou((best["start"], best["end"]), (s, e)) < 0.5:
                continue
            matched += 1
            want, got = parse_caption(sentence), parse_caption(best["caption"])
            for a in ATTRIBUTES:
                hits[a] += int(want.get(a) is not None and got.get(a) == want.get(a))
    out = {f"{a}_accuracy": hits[a] / total if total else 0.0 for a in ATTRIBUTES}
    out["words_accuracy"] = sum(hits.values()) / (len(ATTRIBUTES) * total) if total else 0.0
    out["matched_events@0.5"] = matched / total if total else 0.0
    return out


def missing_policy(cfg: Config) -> str | None:
    """`eval.missing` for the metrics. Only densevid has the choice; the other protocols always
    leave videos without predictions out, so `zero` with them is an error, not a silent skip."""
    if cfg.eval.protocol == "densevid":
        return cfg.eval.missing
    if cfg.eval.missing != "skip":
        raise ConfigError(f"eval.missing={cfg.eval.missing!r} applies to eval.protocol=densevid only; "
                          f"{cfg.eval.protocol!r} leaves videos without predictions out (set eval.missing=skip)")
    return None


def evaluate_run(cfg: Config, captions_dir: str, ref_path: str, ref_format: str, out_dir: str) -> dict[str, Any]:
    missing = missing_policy(cfg)
    text = storage.read_bytes(storage.join(captions_dir, "captions.jsonl")).decode("utf-8")
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    # the engine-output form the metrics read, {video_id: {"events": [...]}}, of the captioned videos
    pred = {r["video_id"]: {"events": r["events"]} for r in rows if r["status"] == "ok"}
    result = evaluate(pred, ref_path, protocol=cfg.eval.protocol, ref_format=ref_format, missing=missing,
                      seed=cfg.eval.seed, soda_direction=cfg.eval.soda_direction)
    if cfg.data.dataset == "synthetic":
        result["synthetic_attributes"] = attribute_accuracy(pred, ref_path)
    storage.write_json(storage.join(out_dir, "result.json"), result)

    local = out_dir if not storage.is_remote(out_dir) else tempfile.mkdtemp(prefix="padcap-report-")
    report = write_report(result, pred, ref_path, os.path.join(local, "report"), ref_format=ref_format)
    if local != out_dir:
        storage.upload_dir(os.path.join(local, "report"), storage.join(out_dir, "report"))
        report_path = storage.join(out_dir, "report", "index.html")
    else:
        report_path = str(report)

    metrics = {k: round(float(v), 4) for k, v in result["metrics"].items()}
    summary: dict[str, Any] = {"protocol": result["protocol"], "videos": len(pred), **metrics, "report": report_path}
    if "synthetic_attributes" in result:
        summary["caption_words"] = round(result["synthetic_attributes"]["words_accuracy"], 3)
    return summary
