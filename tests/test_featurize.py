"""preprocess.featurize: one mp4 + annotation -> a valid Sample; the duration-mismatch policy."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import pytest

from bench.mp4 import solid_frames, tone, write_mp4
from pipeline.config import Config, SyntheticConfig, section_hash
from pipeline.schema import Event, decode, encode
from preprocess.events import align_events
from preprocess.featurize import Featurizer
from preprocess.media import MediaError


@dataclass
class Ann:  # the fields featurize reads (preprocess.annotations.VideoAnnotation has them)
    video_id: str
    duration: float
    events: list[Event] = field(default_factory=list)
    split: str = "train"
    source: str = "longvale"


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    d = tmp_path_factory.mktemp("feat")
    frames = solid_frames(32, 32, 32, [(255, 0, 0), (0, 0, 255)])
    return {
        "av": str(write_mp4(d / "v 1.mp4", frames, audio=tone(440, 4.0))),
        "mute": str(write_mp4(d / "v2.mp4", frames)),
    }


def test_featurize_builds_a_valid_sample(clip):
    cfg = Config()
    ann = Ann("vid/1", 4.2, [Event(0.5, 2.0, "a red square"), Event(2.0, 4.3, "a blue square", "blue", "a beep")])
    sample = Featurizer(cfg)(clip["av"], ann)
    assert sample.video_id == "vid/1" and sample.duration == pytest.approx(4.0)
    assert sample.visual.shape == (32, 8, 17) and sample.audio.shape == (32, 1, 34)
    assert sample.has_audio and sample.feature_hash == section_hash(cfg.features)
    assert (sample.split, sample.source) == ("train", "longvale")
    assert [(e.start, e.end) for e in sample.events] == [(0.5, 2.0), (2.0, 4.0)]  # 0.3 s overshoot clipped
    assert sample.events[1].visual_caption == "blue" and sample.events[1].audio_caption == "a beep"
    back = decode(encode(sample))  # the shard round trip validates too
    np.testing.assert_array_equal(back.visual, sample.visual)
    mute = Featurizer(cfg)(clip["mute"], Ann("v2", 4.0, [Event(0.0, 1.0, "x")], source=""))
    assert not mute.has_audio and not mute.audio.any() and mute.source == cfg.data.dataset


def test_annotation_beyond_the_video_is_an_error(clip):
    cfg = Config()
    with pytest.raises(MediaError, match="annotation points beyond the video") as err:
        Featurizer(cfg)(clip["av"], Ann("v", 9.0, [Event(1.0, 2.0, "ok"), Event(5.0, 9.0, "too late")]))
    assert err.value.kind == "annotation" and "event 1" in str(err.value)
    with pytest.raises(MediaError, match="empty once clipped"):
        align_events([Event(4.5, 5.0, "after the end")], 4.0, 2.0, "v")
    assert align_events([Event(-0.01, 1.0, "x")], 4.0, 2.0, "v")[0].start == 0.0


def test_featurize_synthetic_corpus_videos(tmp_path):
    from preprocess.synthetic import generate_corpus, parse_caption

    syn = SyntheticConfig(num_videos=2, test_fraction=0.0, min_duration=12.0, max_duration=12.0, min_events=2,
                          max_events=2, width=32, height=32, num_workers=1)
    info = generate_corpus(tmp_path, syn, progress=False)
    records = json.loads(open(info.longvale["train"], encoding="utf-8").read())
    featurizer = Featurizer(Config())
    directions = {"moves to the right": (7, 1), "moves to the left": (7, -1), "moves down": (8, 1), "moves up": (8, -1)}
    checked = 0
    for video_id, uri in sorted(info.videos.items()):
        record = records[video_id]
        events = [Event(s, e, c) for (s, e), c in zip(record["timestamps"], record["sentences"])]
        sample = featurizer(uri, Ann(video_id, record["duration"], events))
        assert sample.duration == pytest.approx(record["duration"], abs=1e-3)
        assert sample.num_segments == 32 and sample.has_audio
        assert [(e.start, e.end) for e in sample.events] == [(e.start, e.end) for e in events]
        # segments inside an event look (colour) and sound (energy) different from the background
        mid = sample.segment_times.mean(1)
        inside = np.zeros(len(mid), bool)
        for e in events:
            inside |= (mid > e.start + 0.3) & (mid < e.end - 0.3)
        vis = sample.visual.astype(np.float32)
        energy = sample.audio.astype(np.float32)[:, :, -2].mean(1)
        assert np.abs(vis[inside][..., :3].mean((1, 2)) - vis[~inside][..., :3].mean()).mean() > 0.05
        assert energy[inside].mean() > energy[~inside].mean() + 0.3
        # the pixels motion channels point the way the caption says the shape moves
        for e in events:
            motion = parse_caption(e.caption)["motion"]
            if motion in directions:
                channel, sign = directions[motion]
                during = (mid > e.start) & (mid < e.end)
                assert sign * vis[during][..., channel].mean() > 0.01, (video_id, e.caption)
                checked += 1
    assert checked >= 1
