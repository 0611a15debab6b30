"""The hard synthetic regime: dense, overlapping, look-alike events and distractor sounds.

    .venv/bin/python -m pytest tests/test_synthetic_hard.py -q
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from pipeline.config import FeaturesConfig, HardOptions, SyntheticConfig, load_config
from preprocess import synthetic as syn
from preprocess import synthetic_media as media
from preprocess.media import decode_video, frame_schedule
from preprocess.synthetic_media import SoundSpec
from preprocess.synthetic_stats import script_statistics

HARD = SyntheticConfig(regime="hard", num_videos=50, seed=0)
BG = np.asarray(media.BACKGROUND_RGB, dtype=np.float64)


@pytest.fixture(scope="module")
def scripts() -> list[media.VideoScript]:
    return syn.script_corpus(HARD)


def _overlap(a, b) -> bool:
    return min(a.end_frame, b.end_frame) > max(a.start_frame, b.start_frame)


def test_event_counts_durations_and_times_inside_the_video(scripts):
    h, min_ev = HARD.hard, int(HARD.min_event_seconds * HARD.fps)
    counts = [len(p.events) for p in scripts]
    assert all(h.min_events <= k <= h.max_events for k in counts)
    assert len(set(counts)) >= 5  # the range is used, not one value
    for p in scripts:
        assert h.min_duration * p.fps - 1 <= p.num_frames <= h.max_duration * p.fps + 1
        starts = [e.start_frame for e in p.events]
        assert starts == sorted(starts)
        for e in p.events:
            assert 0 < e.start_frame < e.end_frame < p.num_frames and e.end_frame - e.start_frame >= min_ev
        for d in p.distractors:
            assert 0 <= d.start_frame < d.end_frame <= p.num_frames


def test_overlaps_and_back_to_back_are_present_and_at_most_two_events_at_once(scripts):
    stats = script_statistics(scripts)
    assert stats["events_overlapping"] > 0.2 and stats["pairs_back_to_back"] > 0.1
    for p in scripts:
        active = np.zeros(p.num_frames, dtype=int)
        for e in p.events:
            active[e.start_frame:e.end_frame] += 1
        assert active.max() <= 2
        for a, b in zip(p.events, p.events[1:]):
            if _overlap(a, b):  # partial: the later one starts inside and ends after the earlier
                assert a.start_frame < b.start_frame < a.end_frame < b.end_frame
                assert a.lane != b.lane
                assert b.start_frame - a.start_frame >= (a.end_frame - a.start_frame) / 2
    assert {e.lane for p in scripts for e in p.events} == {0, 1}


def test_attributes_repeat_within_videos_but_events_stay_distinguishable(scripts):
    stats = script_statistics(scripts)
    assert stats["videos_with_repeated_colour"] > 0.9 and stats["videos_with_repeated_sound"] > 0.9
    assert 0.1 < stats["events_with_repeated_colour"] < 0.95  # both sides of the unique/repeated split exist
    for p in scripts:
        full = [(e.colour, e.shape, e.motion, e.sound) for e in p.events]
        assert len(set(full)) == len(full)
        for i, a in enumerate(p.events):
            for b in p.events[i + 1:]:
                if _overlap(a, b):
                    assert a.sound != b.sound and (a.colour, a.shape) != (b.colour, b.shape)


def test_distractor_sounds_belong_to_no_event(scripts):
    h = HARD.hard
    assert all(h.min_distractors <= len(p.distractors) <= h.max_distractors for p in scripts)
    for p in scripts:
        edges = {f for e in p.events for f in (e.start_frame, e.end_frame)}
        for i, d in enumerate(p.distractors):
            assert d.sound != "silence" and d.start_frame not in edges and d.end_frame not in edges
            assert all(not _overlap(d, o) for o in p.distractors[i + 1:])
            for e in p.events:
                if _overlap(d, e):
                    assert e.sound not in (d.sound, "silence")
    assert 0.1 < script_statistics(scripts)["distractor_share_of_sounds"] < 0.3


def test_deterministic_under_a_seed(scripts):
    assert syn.script_corpus(HARD) == scripts
    assert syn.script_corpus(dataclasses.replace(HARD, seed=1)) != scripts


def test_the_default_regime_is_untouched():
    script = syn.script_corpus(SyntheticConfig(num_videos=3))
    assert all(e.lane == -1 for p in script for e in p.events) and all(p.distractors == () for p in script)
    assert all(len(p.events) <= 5 for p in script)


def test_config_selects_the_regime():
    cfg = load_config(None, ["data.synthetic.regime=hard", "data.synthetic.hard.max_events=9"])
    assert cfg.data.synthetic.regime == "hard" and cfg.data.synthetic.hard == HardOptions(max_events=9)
    assert json.loads(cfg.to_json())["data"]["synthetic"]["hard"]["min_events"] == 8


@pytest.mark.parametrize("bad", [{"max_overlap": 0.6}, {"min_events": 9, "max_events": 8}, {"min_duration": 10.0},
                                 {"overlap_prob": 0.8, "back_to_back_prob": 0.3}, {"max_distractor_seconds": 99.0}])
def test_impossible_hard_settings_are_explained(bad):
    cfg = dataclasses.replace(HARD, hard=dataclasses.replace(HARD.hard, **bad))
    with pytest.raises(ValueError, match="synthetic.hard"):
        syn.validate_config(cfg)


# --------------------------------------------------------------------------- rendered


def _lane_colour(frame: np.ndarray, lane: int) -> str | None:
    """The palette colour of the pixels far from the background in `lane`'s quadrant (None: none)."""
    h, w, _ = frame.shape
    quad = frame[: h // 2, : w // 2] if lane == 0 else frame[h // 2:, w // 2:]
    flat = quad.reshape(-1, 3).astype(np.float64)
    far = flat[np.abs(flat - BG).max(axis=1) > 60]
    if len(far) < 30:
        return None
    return Counter(min(media.COLOUR_RGB, key=lambda n: np.linalg.norm(px - media.COLOUR_RGB[n])) for px in far).most_common(1)[0][0]


SMALL = dataclasses.replace(HARD, num_videos=1, test_fraction=0.0, num_workers=1,
                            hard=dataclasses.replace(HARD.hard, min_events=8, max_events=8,
                                                     min_duration=40.0, max_duration=40.0))


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> syn.CorpusInfo:
    return syn.generate_corpus(tmp_path_factory.mktemp("synth_hard"), SMALL, progress=False)


def test_a_hard_video_renders_and_reads_back_through_the_media_reader(rendered):
    cfg, info = SMALL, rendered
    video = json.loads(Path(info.manifest).read_text())["videos"][0]
    script = syn.script_corpus(cfg)[0]
    ann = json.loads(Path(info.longvale["train"]).read_text())[video["id"]]
    assert len(ann["timestamps"]) == len(video["events"]) == 8 and len(video["distractors"]) >= 2
    fcfg = FeaturesConfig(frame_policy="fps", fps=8.0, max_frames=512, image_size=0, device="cpu")
    dec = decode_video(info.videos[video["id"]], fcfg)
    assert dec.duration == pytest.approx(40.0) and dec.has_audio and dec.frames.shape[1:] == (96, 96, 3)

    def frame_at(t: float) -> np.ndarray:  # the decoded frame that stands for the time nearest t
        return dec.frames[int(np.argmin(np.abs(frame_schedule(dec.duration, fcfg)[0] - t)))]

    def rms(t: float) -> float:
        a = int(round((t - 0.2) * dec.sample_rate))
        return float(np.sqrt(np.mean(dec.audio[a:a + int(0.4 * dec.sample_rate)] ** 2)))

    checked = 0
    for ev in script.events:  # every event's colour in its own lane at its midpoint (unless blinking off)
        t = (ev.start_frame + ev.end_frame) / 2 / script.fps
        if ev.motion != "blinks" and not any(_overlap(ev, o) for o in script.events if o is not ev):
            assert _lane_colour(frame_at(t), ev.lane) == ev.colour, ev
            assert _lane_colour(frame_at(t), 1 - ev.lane) is None, ev
            mid = SoundSpec(int(t * script.fps) - 2, int(t * script.fps) + 2, "")
            if not any(_overlap(mid, d) for d in script.distractors):  # the event's own sound alone
                assert (rms(t) > 0.03) == (ev.sound != "silence"), ev
            checked += 1
    assert checked >= 2
    both = [(a, b) for a, b in zip(script.events, script.events[1:]) if _overlap(a, b)
            and "blinks" not in (a.motion, b.motion)]
    for a, b in both:  # two events at once: both colours, one per lane
        f = frame_at((b.start_frame + a.end_frame) / 2 / script.fps)
        assert (_lane_colour(f, a.lane), _lane_colour(f, b.lane)) == (a.colour, b.colour)
    alone = [d for d in script.distractors if not any(_overlap(d, e) for e in script.events)]
    for d in alone:  # a distractor: sound with an empty picture
        t = (d.start_frame + d.end_frame) / 2 / script.fps
        assert rms(t) > 0.03 and _lane_colour(frame_at(t), 0) is None and _lane_colour(frame_at(t), 1) is None
    assert both and alone  # this seed's video has both (3 overlapping pairs, 1 lone distractor)


def test_a_hard_video_goes_through_the_preprocess_featurizer(rendered):
    from preprocess.annotations import read_annotations
    from preprocess.featurize import Featurizer

    cfg = load_config("cluster/configs/default.yaml", ["data.synthetic.regime=hard", "features.min_frames=8"])
    anns, bad = read_annotations(rendered.longvale["train"], "longvale", "train")
    assert len(anns) == 1 and not bad
    sample = Featurizer(cfg)(rendered.videos[anns[0].video_id], anns[0])
    script = syn.script_corpus(SMALL)[0]
    want = [t for e in script.events for t in (e.start_frame / script.fps, e.end_frame / script.fps)]
    assert [t for e in sample.events for t in (e.start, e.end)] == pytest.approx(want)  # overlaps kept as annotated
    assert sample.has_audio and sample.visual.shape[0] == sample.audio.shape[0] == 20  # 40 s of 2 s segments
