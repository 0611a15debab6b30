"""A contact sheet of a generated synthetic corpus, read back from the mp4 files.

For the first few videos: the decoded frame at every event's midpoint (titled with
its caption) and the decoded audio's spectrogram with the annotated event bounds.

    python -m preprocess.synthetic --out runs/synth --preview     # writes runs/synth/preview.png
    write_preview(corpus_info, "preview.png")
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np


def _decode_audio(path: str) -> tuple[np.ndarray, int]:
    import av

    with av.open(path) as c:
        stream = c.streams.audio[0]
        chunks = [f.to_ndarray().reshape(-1) for f in c.decode(stream)]
        return np.concatenate(chunks), stream.codec_context.sample_rate


def write_preview(info, out_path: str | Path, max_videos: int = 3) -> str:
    """Draw up to `max_videos` videos of `info` (a CorpusInfo) into a PNG; returns its path."""
    import decord
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    videos = json.loads(Path(info.manifest).read_text(encoding="utf-8"))["videos"][:max_videos]
    cols = max(len(v["events"]) for v in videos)
    fig, axes = plt.subplots(2 * len(videos), cols, figsize=(2.2 * cols, 4.6 * len(videos)), squeeze=False,
                             gridspec_kw={"height_ratios": [2.0, 1.0] * len(videos)})
    for row, video in enumerate(videos):
        path = info.videos[video["id"]]
        vr = decord.VideoReader(path)
        for col in range(cols):
            ax = axes[2 * row, col]
            ax.axis("off")
            if col < len(video["events"]):
                ev = video["events"][col]
                ax.imshow(vr[int((ev["start"] + ev["end"]) / 2 * video["fps"])].asnumpy())
                ax.set_title("\n".join(textwrap.wrap(ev["caption"], 26)), fontsize=6)
        for col in range(1, cols):
            axes[2 * row + 1, col].remove()
        spec_ax = fig.add_subplot(2 * len(videos), 1, 2 * row + 2)
        axes[2 * row + 1, 0].remove()
        audio, sr = _decode_audio(path)
        spec_ax.specgram(audio, NFFT=512, Fs=sr, noverlap=256, cmap="magma", vmin=-120)
        for ev in video["events"]:
            spec_ax.axvspan(ev["start"], ev["end"], color="cyan", alpha=0.15)
        spec_ax.set_xlim(0, video["duration"])
        spec_ax.set_ylim(0, min(4000, sr / 2))
        spec_ax.set_ylabel("Hz", fontsize=7)
        spec_ax.set_title(f"{video['id']} ({video['split']}, {video['duration']:.1f}s): audio, events shaded", fontsize=7)
        spec_ax.tick_params(labelsize=6)
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return str(out_path)
