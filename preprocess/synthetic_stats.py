"""The layout statistics of a synthetic corpus's scripts (no rendering): what makes a regime hard.

    stats = script_statistics(script_corpus(cfg))
    python -m preprocess.synthetic_stats --regime hard --num-videos 50 [--seed 0]

Per corpus: events per video (mean / min / max), seconds per video, the share of events
that overlap another event of their video (intersection > 0; touching is back to back),
of consecutive event pairs that are back to back, of videos with an overlap, of videos
with a repeated colour / sound, of events whose colour / sound another event of their
video shares (the "repeated" side of the held-out unique-vs-repeated split), and of the
audio's sounds that are distractors (belong to no event). Used to report a regime's data
and by the generator's tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections import Counter

from pipeline.config import SyntheticConfig
from preprocess.synthetic import script_corpus
from preprocess.synthetic_media import VideoScript


def _overlapping(script: VideoScript) -> list[bool]:
    spans = [(e.start_frame, e.end_frame) for e in script.events]
    return [any(j != i and min(b, d) > max(a, c) for j, (c, d) in enumerate(spans)) for i, (a, b) in enumerate(spans)]


def _repeated(values: list[str]) -> list[bool]:
    count = Counter(values)
    return [count[v] > 1 for v in values]


def script_statistics(scripts: list[VideoScript]) -> dict[str, float]:
    """The module doc's numbers over `scripts` (shares in [0, 1], rounded to 4 digits)."""
    per_video = [len(p.events) for p in scripts]
    events = sum(per_video)
    pairs = sum(max(0, k - 1) for k in per_video)
    overlap = [_overlapping(p) for p in scripts]
    colour = [_repeated([e.colour for e in p.events]) for p in scripts]
    sound = [_repeated([e.sound for e in p.events]) for p in scripts]
    back = sum(a.end_frame == b.start_frame for p in scripts for a, b in zip(p.events, p.events[1:]))
    distractors = sum(len(p.distractors) for p in scripts)
    share = lambda a, b: round(a / b, 4) if b else 0.0  # noqa: E731
    return {
        "videos": len(scripts),
        "events_per_video_mean": share(events, len(scripts)),
        "events_per_video_min": min(per_video),
        "events_per_video_max": max(per_video),
        "seconds_per_video_mean": share(sum(p.duration for p in scripts), len(scripts)),
        "events_overlapping": share(sum(map(sum, overlap)), events),
        "pairs_back_to_back": share(back, pairs),
        "videos_with_overlap": share(sum(any(o) for o in overlap), len(scripts)),
        "videos_with_repeated_colour": share(sum(any(c) for c in colour), len(scripts)),
        "videos_with_repeated_sound": share(sum(any(s) for s in sound), len(scripts)),
        "events_with_repeated_colour": share(sum(map(sum, colour)), events),
        "events_with_repeated_sound": share(sum(map(sum, sound)), events),
        "distractors_per_video_mean": share(distractors, len(scripts)),
        "distractor_share_of_sounds": share(distractors, events + distractors),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m preprocess.synthetic_stats", description=__doc__.split("\n\n")[0])
    ap.add_argument("--regime", choices=("default", "hard"), default="default")
    ap.add_argument("--num-videos", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    cfg = dataclasses.replace(SyntheticConfig(), regime=a.regime, num_videos=a.num_videos, seed=a.seed)
    print(json.dumps({"regime": a.regime, "seed": a.seed, **script_statistics(script_corpus(cfg))}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
