"""The Python API (`from infer import Captioner`): two real mp4 files captioned in this process, no Ray,
with the same result as the engine called directly and the same fields as an offline row."""

from __future__ import annotations

import json

import pytest

from bench.serve_engine import synthetic_videos
from infer.loading import RANDOM_MODEL
from infer.results import RESULT_COLUMNS, CaptionResult


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    return synthetic_videos(tmp_path_factory.mktemp("api"))[:2]


def test_captioner_captions_two_real_videos(videos, tmp_path):
    from infer import Captioner

    captioner = Captioner.from_pretrained(RANDOM_MODEL, device="cpu")
    broken = tmp_path / "broken.mp4"
    broken.write_bytes(b"not a video")
    results = captioner.caption([*map(str, videos), str(broken)])
    assert [r.video_id for r in results] == [p.stem for p in videos] + ["broken"]
    good, bad = results[:2], results[2]
    for r in good:
        assert r.ok and r.error == "" and r.duration > 0 and "tiny-random" in r.model_id
        assert all(0 <= e["start"] < e["end"] <= r.duration + 1e-6 and isinstance(e["caption"], str) for e in r.events)
        assert len(r.capped) == len(r.events) and r.segments_kept <= r.segments_total
    assert bad.status == "error" and bad.error_kind == "input" and bad.error and bad.events == []

    # the same captions as the engine called directly on the same features
    from infer.engine.core import CaptionEngine
    from preprocess.featurize import Unannotated

    sample = captioner.featurizer(str(videos[0]), Unannotated(video_id=videos[0].stem))
    (direct,) = CaptionEngine(captioner.model, captioner.cfg.infer).caption([sample])
    assert [(e["start"], e["end"], e["caption"]) for e in good[0].events] == [(e.start, e.end, e.caption) for e in direct.events]


def test_a_result_is_an_offline_row_and_back(videos):
    result = CaptionResult("a", uri="/v/a.mp4", duration=3.0, events=[{"start": 0.0, "end": 1.0, "caption": "x"}],
                           capped=[True], timings={"total_s": 0.1}, model_id="m", config_hash="h",
                           segments_kept=3, segments_total=3)
    row = result.to_row()
    assert list(row) == list(RESULT_COLUMNS)
    assert json.loads(row["events"]) == result.events and json.loads(row["capped"]) == [True]
    assert CaptionResult.from_row(row) == result
    assert json.loads(json.dumps(result.to_dict()))["events"] == result.events
    with pytest.raises(ValueError, match="error kind"):
        CaptionResult.failed("a", "", "bogus", "why")
