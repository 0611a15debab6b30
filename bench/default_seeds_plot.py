"""The learning curves of bench/default_seeds.py, all seeds in one picture.

    plot_seeds({seed: history}, {seed: held-out row}, "bench/results/default_seeds.png")

Four panels over optimizer steps, one line per seed: teacher-forced held-out colour / shape /
sound accuracy (the periodic validation), the branch loss on attribute-word tokens, each branch
token's attention mass on its own anchor (bench/attr_probe.py), and the total loss.
"""

from __future__ import annotations

from pathlib import Path


def _series(history: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(h["step"], h[key]) for h in history if key in h]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_seeds(histories: dict, rows: dict, path: str | Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = {"val_colour_acc": "-", "val_shape_acc": "--", "val_sound_acc": ":"}
    for i, (seed, hist) in enumerate(sorted(histories.items())):
        c = colours[i % len(colours)]
        row = rows.get(str(seed), {})
        label = f"seed {seed}"
        if row:
            label += f" (free-running c {row['colour']:.2f} s {row['shape']:.2f} snd {row['sound']:.2f})"
        for key, ls in styles.items():
            x, y = _series(hist, key)
            axes[0].plot(x, y, ls, color=c, label=label if key == "val_colour_acc" else None)
        x, y = _series(hist, "probe_branch_attr_lm")
        axes[1].plot(x, y, color=c, label=f"seed {seed}")
        x, y = _series(hist, "probe_anchor_mass")
        axes[2].plot(x, y, color=c, label=f"seed {seed}")
        x, y = _series(hist, "total")
        axes[3].plot(x[::10], y[::10], color=c, lw=0.8, label=f"seed {seed}")
    axes[0].set_title("held-out teacher-forced accuracy\n(colour -, shape --, sound :)")
    axes[0].set_ylim(0, 1)
    axes[1].set_title("branch loss on attribute-word tokens")
    axes[2].set_title("branch tokens' attention mass on own anchor\n(mean over layers and heads)")
    axes[2].set_yscale("log")
    axes[3].set_title("total training loss")
    axes[3].set_yscale("log")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="upper left")
    axes[2].legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
