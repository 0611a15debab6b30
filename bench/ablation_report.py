"""The ablation's summary: seeds -> mean and spread, the Markdown table, the PNG.

    rows = summarize(VARIANT_ROWS, scored)        # scored: {variant: [per-seed dicts]}
    write_markdown(rows, path, header) ; write_plot(rows, path)

Per variant and number: the mean over seeds and the spread as the sample standard
deviation (n - 1), plus min and max in the JSON. Caption metrics are shown x100 like the
paper's table; ms are the wall clock of one video decoded alone in its run's process, with
other runs sharing the box when bench/ablation.py runs `--jobs` > 1 (latencies only with
`--jobs 1` on an idle box).
"""

from __future__ import annotations

import math
from pathlib import Path

METRICS = ("F1", "Sim", "SODA_c", "CIDEr", "METEOR")
COSTS = ("ms_per_video", "ms_per_token")
HELD = ("attr_acc", "planning_acc", "grounding_f1@0.5")
COLUMNS = METRICS + COSTS + HELD
# held-out numbers a run has only when its corpus has them (train/evaluate.py: repeated attributes,
# overlapping events) and a text baseline's parse failures (pipeline/textual.py): in the JSON stats
HELD_SPLIT = ("attr_acc_unique", "attr_acc_repeated", "colour_acc_unique", "colour_acc_repeated", "sound_acc_unique",
              "sound_acc_repeated", "overlap_grounding_f1@0.5", "overlap_events")
PARSE = ("parse_unparsable_videos", "parse_problems", "parse_unparsable_share")


def spread(values: list[float]) -> dict[str, float]:
    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return {"mean": mean, "sd": sd, "min": min(values), "max": max(values), "n": n}


def summarize(rows: list[dict], scored: dict[str, list[dict]]) -> list[dict]:
    """rows: [{"name", "label", "variant", "paper": (F1, Sim)}] -> the same with "stats" per column."""
    out = []
    for row in rows:
        runs = scored.get(row["variant"], [])
        stats = {c: spread([r[c] for r in runs]) for c in COLUMNS + HELD_SPLIT + PARSE
                 if runs and all(c in r for r in runs)}
        out.append({**row, "seeds": [r["seed"] for r in runs], "stats": stats})
    return out


def _cell(stats: dict, col: str) -> str:
    s = stats.get(col)
    if s is None:
        return "-"
    scale = 100.0 if col in METRICS else 1.0
    digits = 0 if col == "ms_per_video" else (2 if col == "ms_per_token" or col in HELD else 1)
    return f"{s['mean'] * scale:.{digits}f} ± {s['sd'] * scale:.{digits}f}"


def markdown_table(rows: list[dict]) -> str:
    head = ("| variant | paper F1 / Sim | F1 | Sim | SODA_c | CIDEr | METEOR | decode ms / video | ms / token "
            "| attr acc | planning acc | F1@0.5 (grounding) |")
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        paper = f"{r['paper'][0]} / {r['paper'][1]}" if r.get("paper") else "-"
        lines.append(f"| {r['label']} | {paper} | " + " | ".join(_cell(r["stats"], c) for c in COLUMNS) + " |")
    return "\n".join(lines)


def write_markdown(rows: list[dict], path: str | Path, header: str) -> None:
    Path(path).write_text(header.rstrip() + "\n\n" + markdown_table(rows) + "\n")


def write_plot(rows: list[dict], path: str | Path) -> None:
    """F1 and Sim (mean, sd error bars) per variant next to the paper's values (hollow markers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["label"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), sharey=False)
    for ax, (i, col) in zip(axes, enumerate(("F1", "Sim"))):
        mean = [r["stats"].get(col, {}).get("mean", float("nan")) * 100 for r in rows]
        sd = [r["stats"].get(col, {}).get("sd", 0.0) * 100 for r in rows]
        x = range(len(rows))
        ax.bar(x, mean, yerr=sd, capsize=3, color="#4c72b0", label="this bench (mean ± sd over seeds)")
        paper = [r["paper"][i] if r.get("paper") else float("nan") for r in rows]
        ax.scatter(x, paper, marker="D", facecolors="none", edgecolors="#c44e52", zorder=3, label="paper (ChronusAV, 3B)")
        ax.set_xticks(list(x))
        ax.set_xticklabels(names, rotation=40, ha="right", fontsize=8)
        ax.set_title(col)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
