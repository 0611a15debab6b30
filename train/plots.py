"""The learning curve of a training run: loss components, lr and the validation numbers per step.

    learning_curve(history, "runs/default/train/learning_curve.png")
    python -m train.plots runs/default/train/history.json out.png

`history` is the list of per-step records the loop writes (train/checkpoint.py
history.json): step, total, lm, branch_lm, grounding, lr, ... and, on validation
steps, val_* numbers. Matplotlib with the Agg backend; no ray.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

COMPONENTS = (("total", "total"), ("lm", "planning / text LM"), ("branch_lm", "caption branches LM"),
              ("grounding", "grounding BCE (unweighted)"))
VAL_KEYS = (("val_grounding_f1@0.5", "grounding F1@0.5"), ("val_attr_acc", "colour/shape/sound acc"),
            ("val_token_acc", "caption token acc"), ("val_planning_acc", "planning acc (K)"))


def _smooth(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def learning_curve(history: list[dict[str, Any]], path: str | Path, title: str = "training") -> Path:
    """Write the PNG: left, loss components (raw faint + moving average) and lr; right, validation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    steps = [h["step"] for h in history]
    window = max(1, len(history) // 50)
    fig, (ax, axv) = plt.subplots(1, 2, figsize=(13, 4.8))
    for (key, label), colour in zip(COMPONENTS, ("black", "tab:blue", "tab:orange", "tab:green")):
        ys = [h.get(key) for h in history]
        if not steps or any(y is None for y in ys):
            continue
        ax.plot(steps, ys, color=colour, alpha=0.2, linewidth=0.8)
        ax.plot(steps, _smooth(ys, window), color=colour, label=label, linewidth=1.6)
    ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (log)")
    ax.grid(alpha=0.3)
    if steps:
        lr_ax = ax.twinx()
        lr_ax.plot(steps, [h.get("lr", 0.0) for h in history], color="grey", linestyle="--", linewidth=1, label="lr")
        lr_ax.set_ylabel("learning rate")
        lines = ax.get_legend_handles_labels()
        extra = lr_ax.get_legend_handles_labels()
        ax.legend(lines[0] + extra[0], lines[1] + extra[1], fontsize=8, loc="upper right")
    ax.set_title(f"{title}: training loss")
    vals = [h for h in history if any(k in h for k, _ in VAL_KEYS)]
    for key, label in VAL_KEYS:
        pts = [(h["step"], h[key]) for h in vals if key in h]
        if pts:
            axv.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    axv.set_ylim(0, 1.02)
    axv.set_xlabel("optimizer step")
    axv.set_title("held-out validation (teacher-forced)")
    axv.grid(alpha=0.3)
    if vals:
        axv.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    learning_curve(json.loads(Path(sys.argv[1]).read_text()), sys.argv[2])
