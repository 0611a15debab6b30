"""HTML + PNG report of an evaluation: the metrics table and per-video timelines.

    write_report(result, pred, ref, "runs/x/report", max_videos=50)
    -> report/index.html, report/metrics.png, report/videos/<key>.png

`result` is what `pipeline.metrics.evaluate` returned; `pred` / `ref` are the same
inputs (paths or loaded objects). A timeline shows one video's
reference events (top lanes) and valid predicted events (bottom lanes, coloured by
their best tIoU with any reference) with their captions; at most `max_videos`
videos (input order) and `max_events` events per side are drawn. Matplotlib's Agg
canvas is used directly (no pyplot, no global backend switch), so this runs in
headless workers and inside the pipeline's evaluate stage.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.figure import Figure

from pipeline.metrics.io import EvalInput, load_inputs
from pipeline.schema import sample_key


def _fmt(v: Any) -> str:
    return f"{v:.4f}" if isinstance(v, float) else str(v)


def _sections(result: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) tables: overall metrics, then per-threshold blocks."""
    out = [(f"{result['protocol']} (0-1 scale)", ["metric", "value"], [[k, _fmt(v)] for k, v in result["metrics"].items()])]
    blocks = result.get("per_threshold") or {}
    if blocks and all(isinstance(v, dict) and all(isinstance(x, dict) for x in v.values()) for v in blocks.values()):
        named = list(blocks.items())  # padcaptioner: {component: {t: row}}
    else:
        named = [(result["protocol"], blocks)] if blocks else []
    for name, per_t in named:
        ts = list(per_t)
        metrics = list(next(iter(per_t.values())).keys()) if per_t else []
        rows = [[m] + [_fmt(per_t[t][m]) for t in ts] for m in metrics]
        out.append((f"{name} per tIoU", ["metric"] + [f"@{t}" for t in ts], rows))
    return out


def _metrics_png(result: dict, path: Path) -> None:
    sections = _sections(result)
    heights = [0.5 + 0.28 * (len(rows) + 1) for _, _, rows in sections]
    fig = Figure(figsize=(8, sum(heights) + 0.3))
    grid = fig.add_gridspec(len(sections), 1, height_ratios=heights)
    for k, (title, header, rows) in enumerate(sections):
        ax = fig.add_subplot(grid[k])
        ax.axis("off")
        ax.set_title(title, fontsize=11, loc="left")
        table = ax.table(cellText=rows or [["-"] * len(header)], colLabels=header, loc="upper left", cellLoc="center")
        table.auto_set_font_size(False)
        table.set_fontsize(9)
        table.scale(1, 1.2)
    fig.savefig(path, dpi=100, bbox_inches="tight")


def _video_scores(result: dict, vid: str) -> str:
    comps = result.get("components") or {result["protocol"]: result}
    parts = []
    for name, comp in comps.items():
        pv = (comp.get("per_video") or {}).get(vid)
        if not pv:
            continue
        if name == "soda":
            parts.append(f"SODA_c {pv['SODA_c']:.3f}")
        elif name == "densevid":
            parts.append(f"METEOR {np.mean(pv['METEOR']):.3f}  CIDEr {np.mean(pv['CIDEr']):.3f}")
        elif name == "etbench":
            parts.append(f"Sim {np.mean(pv['Sim']):.3f}")
    return "   ".join(parts)


def _short(text: str, n: int = 90) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"


def _timeline_png(data: EvalInput, result: dict, vid: str, path: Path, max_events: int) -> None:
    ref, pred = data.refs[vid], data.preds[vid]
    r_idx = np.argsort(ref.times[:, 0], kind="stable")[:max_events]
    p_idx = np.argsort(pred.times[:, 0], kind="stable")[:max_events] if pred.has_predictions else np.zeros(0, int)
    lanes = len(r_idx) + len(p_idx) + 1
    fig = Figure(figsize=(13, 1.2 + 0.3 * lanes))
    ax = fig.add_subplot()
    ends = [ref.times[:, 1].max()] + ([pred.times[:, 1].max()] if pred.has_predictions else [])
    span = max([ref.duration or 0.0] + ends) or 1.0
    best = np.zeros(len(pred.captions))
    if pred.has_predictions:
        from pipeline.metrics.tiou import tiou_matrix

        best = tiou_matrix(pred.times, ref.times).max(axis=1)
    cmap = colormaps["viridis"]
    y = lanes
    for i in r_idx:
        s, e = ref.times[i]
        ax.barh(y, max(e - s, span * 0.002), left=s, height=0.7, color="#2ca02c", alpha=0.8)
        ax.text(s, y, " " + _short(ref.captions[i]), va="center", ha="left", fontsize=7)
        y -= 1
    ax.axhline(y, color="grey", lw=0.8, ls="--")
    y -= 1
    for i in p_idx:
        s, e = pred.times[i]
        ax.barh(y, max(e - s, span * 0.002), left=s, height=0.7, color=cmap(float(best[i])), alpha=0.85)
        ax.text(s, y, f" [{best[i]:.2f}] " + _short(pred.captions[i]), va="center", ha="left", fontsize=7)
        y -= 1
    more = []
    if len(ref.captions) > len(r_idx):
        more.append(f"{len(ref.captions) - len(r_idx)} more references")
    if len(pred.captions) > len(p_idx):
        more.append(f"{len(pred.captions) - len(p_idx)} more predictions")
    ax.set_xlim(0, span * 1.02)
    ax.set_ylim(y + 0.3, lanes + 0.7)
    ax.set_yticks([])
    ax.set_xlabel("seconds" + (f"   (not drawn: {', '.join(more)})" if more else ""))
    status = "" if pred.has_predictions else f"   [prediction {pred.status}]"
    ax.set_title(f"{vid}   green: reference, coloured: prediction [best tIoU]   {_video_scores(result, vid)}{status}", fontsize=9, loc="left")
    fig.savefig(path, dpi=80, bbox_inches="tight")


def _html_table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def write_report(result: dict, pred: Any, ref: Any = None, out_dir: str | Path = "report", max_videos: int = 50, max_events: int = 40, ref_format: str | None = None) -> Path:
    """Write index.html, metrics.png and up to `max_videos` timeline PNGs; returns index.html's path."""
    out = Path(out_dir)
    (out / "videos").mkdir(parents=True, exist_ok=True)
    data = load_inputs(pred, ref, ref_format or result.get("inputs", {}).get("ref_format"), result.get("inputs", {}).get("max_predictions", 1000))
    _metrics_png(result, out / "metrics.png")
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>evaluation report</title>",
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;margin:0.5em 0}"
        "td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}img{max-width:100%}</style></head><body>",
        f"<h1>Evaluation: {html.escape(result['protocol'])}</h1>",
        _html_table(["setting", "value"], [[k, str(v)] for k, v in (result.get("variant") or {}).items()]),
    ]
    for title, header, rows in _sections(result):
        parts += [f"<h2>{html.escape(title)}</h2>", _html_table(header, rows)]
    parts += ["<img src='metrics.png' alt='metrics table'>", "<h2>Counts</h2>", _html_table(["count", "value"], [[k, str(v)] for k, v in result.get("counts", {}).items()])]
    problems = result.get("problems") or []
    if problems:
        rows = [[p["video_id"], p["source"], p["problem"]] for p in problems[:500]]
        parts += [f"<h2>Problems ({len(problems)}{', first 500 shown' if len(problems) > 500 else ''})</h2>", _html_table(["video", "source", "problem"], rows)]
    videos = list(data.refs)[:max_videos]
    parts.append(f"<h2>Timelines (first {len(videos)} of {len(data.refs)} videos)</h2>")
    for vid in videos:
        name = f"videos/{sample_key(vid)}.png"
        _timeline_png(data, result, vid, out / name, max_events)
        parts.append(f"<h3>{html.escape(vid)}</h3><img src='{html.escape(name)}' alt='timeline of {html.escape(vid)}'>")
    parts.append("</body></html>")
    index = out / "index.html"
    index.write_text("\n".join(parts), encoding="utf-8")
    return index
