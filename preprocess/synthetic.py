"""A deterministic synthetic omni-modal dense-captioning corpus (real mp4s, no downloads).

Each video is a dark-grey noisy background with 2-8 timed events separated by
background gaps. An event is a visual pattern (colour x shape x motion) plus a
sound, and its caption names both:

    "Visual: a red circle moves to the left. Audio: a high beep."

8 colours x 4 shapes x 8 motions x 8 sounds = 2,048 captions; within a video the
colours and the sounds of the events are all different. That is the default regime;
`regime="hard"` (preprocess/synthetic_hard.py) scripts 8-16 events per video, some
overlapping, some back to back, with repeated colours and sounds and distractor sounds
that belong to no event, in the same grammar and files. Event bounds are snapped
to frame boundaries, so annotations match the media to the sample. The same seed
gives the same annotation bytes and the same decoded frames (and, with the pinned
PyAV/x264, the same mp4 bytes).

Written under DIR:
    videos/<id>.mp4                          H.264 + AAC (mono)
    longvale_{train,test}.json               {"<id>": {"duration", "timestamps", "sentences"}}
    chronusav_{train,test}.json              [{"id", "duration", "category", "segment_num",
                                               "seg_time", "video_captions", "audio_captions"}]
    synthetic_manifest.json                  config + every event's attributes

    python -m preprocess.synthetic --out runs/synth --num-videos 48 --seed 0 [--preview] [--regime hard]
    info = generate_corpus(out_dir, cfg.data.synthetic)   # the driver's entry point
    parse_caption("Visual: a red circle ... Audio: a high beep.")  # -> attribute dict
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.caption_grammar import (  # noqa: F401  (re-exported: the corpus's grammar)
    ATTRIBUTES,
    COLOURS,
    MOTIONS,
    SHAPES,
    SOUNDS,
    audio_caption,
    dense_caption,
    parse_caption,
    visual_caption,
)
from pipeline.config import SyntheticConfig
from preprocess.synthetic_hard import min_frames, script_hard_video, validate_hard
from preprocess.synthetic_media import EventSpec, VideoScript, render_audio, render_frames, write_mp4

GENERATOR_VERSION = 4  # of the files a config gives (2: "the <colour> <shape>" captions; 3: frames handed to the encoder as yuv420p;
# 4: libx264 without its assembly, the same bytes on every x86 CPU)

# --------------------------------------------------------------------------- grammar (pipeline/caption_grammar.py)

CATEGORY = "synthetic"
MAX_EVENTS = min(len(COLOURS), len(SOUNDS))  # colours and sounds are distinct within a video


# --------------------------------------------------------------------------- scripts


@dataclass
class CorpusInfo:
    """What `generate_corpus` wrote (absolute paths)."""

    root: str
    video_dir: str
    videos: dict[str, str]  # video_id -> mp4 path
    splits: dict[str, list[str]]  # "train"/"test" -> video ids
    longvale: dict[str, str]  # split -> LongVALE-format annotation file
    chronusav: dict[str, str]  # split -> ChronusAV-format annotation file
    manifest: str
    reused: bool = False  # True when an identical corpus was already there

    @property
    def num_videos(self) -> int:
        return len(self.videos)

    @property
    def num_train(self) -> int:
        return len(self.splits.get("train", []))

    @property
    def num_test(self) -> int:
        return len(self.splits.get("test", []))

    def annotations(self, fmt: str = "longvale") -> dict[str, str]:
        """split -> annotation file in `fmt` ('longvale' or 'chronusav')."""
        return {"longvale": self.longvale, "chronusav": self.chronusav}[fmt]


def validate_config(cfg: SyntheticConfig) -> None:
    """Raise ValueError naming the first impossible setting (the hard regime's: synthetic_hard.py)."""
    if cfg.regime == "hard":
        validate_hard(cfg)
    if cfg.num_videos < 1:
        raise ValueError(f"synthetic.num_videos must be >= 1, got {cfg.num_videos}")
    if not 0.0 <= cfg.test_fraction < 1.0:
        raise ValueError(f"synthetic.test_fraction must be in [0, 1), got {cfg.test_fraction}")
    if cfg.regime == "default" and not 1 <= cfg.min_events <= cfg.max_events <= MAX_EVENTS:
        raise ValueError(f"synthetic events must satisfy 1 <= min_events <= max_events <= {MAX_EVENTS}, "
                         f"got {cfg.min_events}..{cfg.max_events}")
    if cfg.regime == "default" and not 0 < cfg.min_duration <= cfg.max_duration:
        raise ValueError(f"synthetic durations must satisfy 0 < min <= max, got {cfg.min_duration}..{cfg.max_duration}")
    if cfg.width % 2 or cfg.height % 2 or min(cfg.width, cfg.height) < 16:
        raise ValueError(f"synthetic frame size must be even and >= 16, got {cfg.width}x{cfg.height}")
    if cfg.fps < 1 or cfg.sample_rate not in (16000, 22050, 44100, 48000):
        raise ValueError(f"synthetic fps must be >= 1 and sample_rate one of 16000/22050/44100/48000, "
                         f"got {cfg.fps} / {cfg.sample_rate}")
    min_ev, min_gap = min_frames(cfg)
    shortest = int(round(cfg.min_duration * cfg.fps))
    if cfg.regime == "default" and shortest < cfg.min_events * (min_ev + min_gap) + min_gap:
        raise ValueError(f"synthetic.min_duration {cfg.min_duration}s cannot hold {cfg.min_events} events of "
                         f">= {cfg.min_event_seconds}s with gaps of >= {cfg.min_gap_seconds}s")


def script_video(cfg: SyntheticConfig, index: int, split: str) -> VideoScript:
    """The deterministic script of video `index`: length, event layout and attributes
    (`cfg.regime == "hard"`: preprocess/synthetic_hard.py's planner)."""
    if cfg.regime == "hard":
        return script_hard_video(cfg, index, split)
    rng = np.random.default_rng([cfg.seed, index, 0])
    n = int(round(rng.uniform(cfg.min_duration, cfg.max_duration) * cfg.fps))
    min_ev, min_gap = min_frames(cfg)
    fit = (n - min_gap) // (min_ev + min_gap)
    k = int(min(rng.integers(cfg.min_events, cfg.max_events + 1), fit))
    free = n - k * min_ev - (k + 1) * min_gap
    free_ev = int(round(free * rng.uniform(0.6, 0.85)))
    ev_len = min_ev + rng.multinomial(free_ev, rng.dirichlet(np.full(k, 3.0)))
    gap_len = min_gap + rng.multinomial(free - free_ev, rng.dirichlet(np.full(k + 1, 3.0)))
    colours = rng.choice(len(COLOURS), size=k, replace=False)
    sounds = rng.choice(len(SOUNDS), size=k, replace=False)
    shapes = rng.integers(len(SHAPES), size=k)
    motions = rng.integers(len(MOTIONS), size=k)
    events, cursor = [], int(gap_len[0])
    for i in range(k):
        start, end = cursor, cursor + int(ev_len[i])
        events.append(EventSpec(start, end, COLOURS[colours[i]], SHAPES[shapes[i]], MOTIONS[motions[i]], SOUNDS[sounds[i]]))
        cursor = end + int(gap_len[i + 1])
    assert cursor == n, (cursor, n)
    return VideoScript.of(cfg, index, split, n, events)


def script_corpus(cfg: SyntheticConfig) -> list[VideoScript]:
    """All video scripts; the last round(num_videos * test_fraction) videos form the test split."""
    validate_config(cfg)
    n_test = int(round(cfg.num_videos * cfg.test_fraction))
    if cfg.test_fraction > 0 and cfg.num_videos >= 2:
        n_test = min(max(n_test, 1), cfg.num_videos - 1)
    n_train = cfg.num_videos - n_test
    return [script_video(cfg, i, "train" if i < n_train else "test") for i in range(cfg.num_videos)]


# --------------------------------------------------------------------------- writing


def _seconds(frame: int, fps: int) -> float:
    return round(frame / fps, 6)


def render_video(script: VideoScript, path: str) -> str:
    """Render and encode one scripted video to `path` (atomically). Returns the path."""
    rng = np.random.default_rng(list(script.entropy))
    frames = render_frames(script, rng)
    audio = render_audio(script, rng)
    tmp = f"{path}.tmp-{os.getpid()}.mp4"
    write_mp4(tmp, frames, audio, script.fps, script.sample_rate)
    os.replace(tmp, path)
    return path


def _write_json(path: Path, data) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=False, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def write_annotations(scripts: list[VideoScript], root: Path) -> tuple[dict[str, str], dict[str, str]]:
    """Write the LongVALE and ChronusAV files for every split; returns (longvale, chronusav) paths."""
    longvale = {s: str(root / f"longvale_{s}.json") for s in ("train", "test")}
    chronusav = {s: str(root / f"chronusav_{s}.json") for s in ("train", "test")}
    for split in ("train", "test"):
        chosen = [p for p in scripts if p.split == split]
        _write_json(Path(longvale[split]), {
            p.video_id: {
                "duration": _seconds(p.num_frames, p.fps),
                "timestamps": [[_seconds(e.start_frame, p.fps), _seconds(e.end_frame, p.fps)] for e in p.events],
                "sentences": [dense_caption(e.colour, e.shape, e.motion, e.sound) for e in p.events],
            }
            for p in chosen
        })
        _write_json(Path(chronusav[split]), [
            {
                "id": p.video_id,
                "duration": _seconds(p.num_frames, p.fps),
                "category": CATEGORY,
                "segment_num": len(p.events),
                "seg_time": [[_seconds(e.start_frame, p.fps), _seconds(e.end_frame, p.fps)] for e in p.events],
                "video_captions": [visual_caption(e.colour, e.shape, e.motion) for e in p.events],
                "audio_captions": [audio_caption(e.sound) for e in p.events],
            }
            for p in chosen
        ])
    return longvale, chronusav


def _manifest(cfg: SyntheticConfig, scripts: list[VideoScript]) -> dict:
    return {
        "generator_version": GENERATOR_VERSION,
        "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "num_workers"},  # output-relevant only
        "videos": [
            {
                "id": p.video_id,
                "split": p.split,
                "path": f"videos/{p.video_id}.mp4",
                "duration": _seconds(p.num_frames, p.fps),
                "num_frames": p.num_frames,
                "fps": p.fps,
                "sample_rate": p.sample_rate,
                "num_samples": p.num_samples,
                "width": p.width,
                "height": p.height,
                "events": [
                    {
                        "start": _seconds(e.start_frame, p.fps),
                        "end": _seconds(e.end_frame, p.fps),
                        "start_frame": e.start_frame,
                        "end_frame": e.end_frame,
                        "colour": e.colour,
                        "shape": e.shape,
                        "motion": e.motion,
                        "sound": e.sound,
                        "caption": dense_caption(e.colour, e.shape, e.motion, e.sound),
                    }
                    for e in p.events
                ],
                "distractors": [{"start": _seconds(d.start_frame, p.fps), "end": _seconds(d.end_frame, p.fps),
                                 "sound": d.sound} for d in p.distractors],
            }
            for p in scripts
        ],
    }


def generate_corpus(out_dir: str | os.PathLike, cfg: SyntheticConfig, overwrite: bool = False,
                    progress: bool = True) -> CorpusInfo:
    """Generate (or reuse, when an identical corpus is already in `out_dir`) the corpus.

    The manifest is written last, so a corpus whose manifest matches `cfg` is complete.
    """
    from tqdm import tqdm

    root = Path(out_dir).resolve()
    scripts = script_corpus(cfg)
    manifest = _manifest(cfg, scripts)
    man_path = root / "synthetic_manifest.json"
    info = CorpusInfo(
        root=str(root),
        video_dir=str(root / "videos"),
        videos={p.video_id: str(root / "videos" / f"{p.video_id}.mp4") for p in scripts},
        splits={s: [p.video_id for p in scripts if p.split == s] for s in ("train", "test")},
        longvale={s: str(root / f"longvale_{s}.json") for s in ("train", "test")},
        chronusav={s: str(root / f"chronusav_{s}.json") for s in ("train", "test")},
        manifest=str(man_path),
    )
    if not overwrite and man_path.exists():
        try:
            old = json.loads(man_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            old = None
        files = list(info.videos.values()) + list(info.longvale.values()) + list(info.chronusav.values())
        if old == json.loads(json.dumps(manifest)) and all(os.path.exists(f) for f in files):
            return dataclasses.replace(info, reused=True)
    (root / "videos").mkdir(parents=True, exist_ok=True)
    man_path.unlink(missing_ok=True)
    paths = [info.videos[p.video_id] for p in scripts]
    workers = cfg.num_workers or max(1, min(os.cpu_count() or 1, len(scripts), 8))  # 0: one per core, at most 8
    bar = tqdm(total=len(scripts), desc="synthetic videos", unit="video", disable=not progress)
    if workers <= 1:
        for script, path in zip(scripts, paths):
            render_video(script, path)
            bar.update(1)
    else:
        with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as pool:
            for _ in pool.map(render_video, scripts, paths):
                bar.update(1)
    bar.close()
    write_annotations(scripts, root)
    _write_json(man_path, manifest)
    return info


# --------------------------------------------------------------------------- CLI

# the SyntheticConfig fields set by an option of the same name (--num-videos -> num_videos), typed as their defaults
CLI_FIELDS = ("num_videos", "seed", "min_duration", "max_duration", "min_events", "max_events", "test_fraction", "width",
              "height", "fps", "sample_rate")


def main(argv: list[str] | None = None) -> int:
    d = SyntheticConfig()
    ap = argparse.ArgumentParser(prog="python -m preprocess.synthetic", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output directory")
    for name in CLI_FIELDS:
        ap.add_argument(f"--{name.replace('_', '-')}", type=type(getattr(d, name)), default=getattr(d, name))
    ap.add_argument("--regime", choices=("default", "hard"), default=d.regime,
                    help="hard: 8-16 overlapping, look-alike events and distractor sounds (data.synthetic.hard's "
                         "defaults; the duration and event options above then do not apply)")
    ap.add_argument("--workers", type=int, default=d.num_workers, help="0 = one per core (max 8)")
    ap.add_argument("--overwrite", action="store_true", help="regenerate even if an identical corpus exists")
    ap.add_argument("--preview", action="store_true", help="also write DIR/preview.png (frames + spectrograms)")
    a = ap.parse_args(argv)
    cfg = dataclasses.replace(d, num_workers=a.workers, regime=a.regime, **{name: getattr(a, name) for name in CLI_FIELDS})
    t0 = time.perf_counter()
    try:
        info = generate_corpus(a.out, cfg, overwrite=a.overwrite)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary = {
        "root": info.root,
        "videos": len(info.videos),
        "splits": {k: len(v) for k, v in info.splits.items()},
        "reused": info.reused,
        "seconds": round(time.perf_counter() - t0, 2),
    }
    if a.preview:
        from preprocess.synthetic_preview import write_preview

        summary["preview"] = write_preview(info, Path(info.root) / "preview.png")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
