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
# each attribute's held-out accuracy (train/evaluate.py) and its chance level on the synthetic grammar
# (preprocess/synthetic.py: 8 colours, 4 shapes, 8 sounds, 8 motions): the plot's last panel
ATTRS = {"colour_acc": 1 / 8, "shape_acc": 1 / 4, "sound_acc": 1 / 8, "motion_acc": 1 / 8}


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
        stats = {c: spread([r[c] for r in runs]) for c in COLUMNS + HELD_SPLIT + PARSE + tuple(ATTRS)
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
    """Per variant (mean, sd error bars): F1 and Sim next to the paper's values (hollow markers), CIDEr,
    and each attribute's held-out accuracy against its chance level (dashes): where a table's variants
    differ in what they learnt when F1 and Sim, which score timing and the grammar too, do not."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["label"] for r in rows]
    x = list(range(len(rows)))
    stat = lambda r, c, f: r["stats"].get(c, {}).get(f, float("nan") if f == "mean" else 0.0)  # noqa: E731
    fig, axes = plt.subplots(2, 2, figsize=(13, 9.6))
    for ax, col in zip(axes.flat, ("F1", "Sim", "CIDEr")):
        ax.bar(x, [stat(r, col, "mean") * 100 for r in rows], yerr=[stat(r, col, "sd") * 100 for r in rows],
               capsize=3, color="#4c72b0", label="this bench (mean ± sd over seeds)")
        if col in ("F1", "Sim"):
            i = ("F1", "Sim").index(col)
            paper = [r["paper"][i] if r.get("paper") else float("nan") for r in rows]
            ax.scatter(x, paper, marker="D", facecolors="none", edgecolors="#c44e52", zorder=3,
                       label="paper (ChronusAV, 3B)")
        ax.set_title(col + (" (x100)" if col == "CIDEr" else ""))
    ax = axes.flat[3]
    width = 0.8 / len(ATTRS)
    colours = ("#dd8452", "#55a868", "#8172b3", "#937860")
    for j, ((col, chance), colour) in enumerate(zip(ATTRS.items(), colours)):
        at = [i - 0.4 + width * (j + 0.5) for i in x]
        ax.bar(at, [stat(r, col, "mean") for r in rows], width, yerr=[stat(r, col, "sd") for r in rows], capsize=2,
               color=colour, label=col.removesuffix("_acc"))
        ax.hlines([chance] * len(rows), [a - width / 2 for a in at], [a + width / 2 for a in at], colors="black",
                  linestyles="dashed", linewidth=0.8)
    ax.set_title("held-out attribute accuracy (dashes: chance)")
    ax.set_ylim(0, 1)
    for ax in axes.flat:
        ax.set_xticks(x)
        ax.set_xticklabels(names, rotation=40, ha="right", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def redraw(json_path: str | Path) -> None:
    """A results JSON of bench/ablation.py -> its rows re-summarized from its own runs, and its .md and .png
    rewritten beside it (the .md's header kept); nothing is trained or scored again."""
    import json

    path = Path(json_path)
    result = json.loads(path.read_text())
    result["rows"] = summarize([{k: v for k, v in r.items() if k not in ("seeds", "stats")} for r in result["rows"]],
                               result["runs"])
    path.write_text(json.dumps(result, indent=1))
    md = path.with_suffix(".md")
    header = md.read_text().split("\n\n")[0] if md.exists() else f"Ablation ({path.stem})"
    write_markdown(result["rows"], md, header)
    write_plot(result["rows"], path.with_suffix(".png"))


if __name__ == "__main__":
    import sys

    for arg in sys.argv[1:]:
        redraw(arg)
