"""The learning curves of bench/default_seeds.py, all seeds in one picture.

    plot_seeds({seed: history}, {seed: held-out row}, "bench/results/default_seeds.png")

Panels over optimizer steps, one line per run: teacher-forced held-out colour / shape / sound
accuracy (the periodic validation), the branch loss on attribute-word tokens and each branch token's
attention mass on its own anchor (bench/attr_probe.py; only where a run recorded the probe), and the
total loss.
"""

from __future__ import annotations

from pathlib import Path


def _series(history: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(h["step"], h[key]) for h in history if key in h]
    return [p[0] for p in pts], [p[1] for p in pts]


def _label(run) -> str:
    """`seed 3` for a seed number, the run's own name otherwise (`seed0`, `jitter`)."""
    return f"seed {run}" if str(run).isdigit() else str(run)


def plot_seeds(histories: dict, rows: dict, path: str | Path, title: str = "") -> Path:
    """One line per run in each panel; the probe panels only where some run recorded the probe."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    probed = [k for k in ("probe_branch_attr_lm", "probe_anchor_mass") if any(k in h for hist in histories.values()
                                                                               for h in hist)]
    panels = ["val", *probed, "total"]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4.2))
    ax_of = dict(zip(panels, axes))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = {"val_colour_acc": "-", "val_shape_acc": "--", "val_sound_acc": ":"}
    for i, (run, hist) in enumerate(sorted(histories.items(), key=lambda kv: str(kv[0]))):
        c = colours[i % len(colours)]
        row = rows.get(str(run), {})
        label = _label(run)
        if row:
            label += f" (free-running c {row['colour']:.2f} s {row['shape']:.2f} snd {row['sound']:.2f})"
        for key, ls in styles.items():
            x, y = _series(hist, key)
            ax_of["val"].plot(x, y, ls, color=c, label=label if key == "val_colour_acc" else None)
        for key in probed:
            x, y = _series(hist, key)
            ax_of[key].plot(x, y, color=c, label=_label(run))
        x, y = _series(hist, "total")
        ax_of["total"].plot(x[::10], y[::10], color=c, lw=0.8, label=_label(run))
    ax_of["val"].set_title("held-out teacher-forced accuracy\n(colour -, shape --, sound :)")
    ax_of["val"].set_ylim(0, 1)
    if "probe_branch_attr_lm" in ax_of:
        ax_of["probe_branch_attr_lm"].set_title("branch loss on attribute-word tokens")
    if "probe_anchor_mass" in ax_of:
        ax_of["probe_anchor_mass"].set_title("branch tokens' attention mass on own anchor\n(mean over layers and heads)")
        ax_of["probe_anchor_mass"].set_yscale("log")
        ax_of["probe_anchor_mass"].legend(fontsize=7)
    ax_of["total"].set_title("total training loss")
    ax_of["total"].set_yscale("log")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    ax_of["val"].legend(fontsize=7, loc="upper left")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
