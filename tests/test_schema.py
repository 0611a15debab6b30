"""Shard schema: encode/decode round trip (also through a real webdataset tar) and validation errors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds

from pipeline import schema
from pipeline.schema import Event, Sample, SchemaError, decode, encode, validate


def make_sample(video_id="vid 1/ü.mp4", t=5, v=4, a=2, has_audio=True, seed=0) -> Sample:
    rng = np.random.default_rng(seed)
    d = 2.0
    times = np.stack([np.arange(t) * d, np.arange(1, t + 1) * d], axis=1).astype(np.float32)
    audio = rng.standard_normal((t, a, 6)).astype(np.float16) if has_audio else np.zeros((t, a, 6), np.float16)
    return Sample(
        video_id=video_id,
        duration=t * d,
        segment_times=times,
        visual=rng.standard_normal((t, v, 8)).astype(np.float16),
        audio=audio,
        has_audio=has_audio,
        events=[Event(0.0, 3.5, "Visual: a red circle. Audio: a beep.", "a red circle.", "a beep."),
                Event(4.0, 9.0, "a blue square")],
        source="synthetic",
        feature_hash="abc123",
        split="train",
    )


def assert_same(a: Sample, b: Sample):
    for f in dataclasses.fields(Sample):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), f.name
        else:
            assert x == y, f.name


def test_round_trip_in_memory():
    s = make_sample()
    assert_same(decode(encode(s)), s)


def test_round_trip_without_audio():
    s = make_sample(has_audio=False)
    assert_same(decode(encode(s)), s)


def test_round_trip_through_a_webdataset_tar(tmp_path):
    samples = [make_sample(video_id=f"video {i} ü", seed=i) for i in range(3)]
    pattern = str(tmp_path / "shard-%06d.tar")
    with wds.ShardWriter(pattern, maxcount=2) as sink:
        for s in samples:
            sink.write(encode(s))
    shards = sorted(str(p) for p in tmp_path.glob("shard-*.tar"))
    assert len(shards) == 2
    got = [decode(fields) for fields in wds.WebDataset(shards, shardshuffle=False)]
    assert len(got) == 3
    for a, b in zip(got, samples):
        assert_same(a, b)


def test_keys_are_webdataset_safe_and_unique():
    k1, k2 = schema.sample_key("a.b/c d"), schema.sample_key("a_b_c_d")
    assert "." not in k1 and "/" not in k1 and k1 != k2


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda s: setattr(s, "visual", s.visual[:-1]), "visual must be"),
        (lambda s: setattr(s, "audio", s.audio[:, :, 0]), "audio must be"),
        (lambda s: setattr(s, "segment_times", s.segment_times[:, :1]), "segment_times must be"),
        (lambda s: setattr(s, "visual", s.visual.astype(np.float32)), "float16"),
        (lambda s: s.visual.__setitem__((0, 0, 0), np.nan), "NaN"),
        (lambda s: setattr(s, "events", [Event(5.0, 5.0, "x")]), "end 5.0 <= start"),
        (lambda s: setattr(s, "events", [Event(1.0, 50.0, "x")]), "outside the duration"),
        (lambda s: setattr(s, "events", [Event(-1.0, 2.0, "x")]), "outside the duration"),
        (lambda s: setattr(s, "duration", 0.0), "duration must be positive"),
        (lambda s: setattr(s, "duration", 5.0), "after the duration"),
        (lambda s: setattr(s, "has_audio", False), "has_audio is false"),
        (lambda s: s.segment_times.__setitem__((1, 1), 1.0), "end <= start"),
        (lambda s: setattr(s, "video_id", ""), "video_id"),
    ],
)
def test_validation_errors(mutate, needle):
    s = make_sample()
    mutate(s)
    with pytest.raises(SchemaError, match=needle):
        validate(s)


def test_decode_rejects_other_schema_versions_and_missing_fields():
    fields = encode(make_sample())
    broken = dict(fields)
    del broken[schema.VISUAL]
    with pytest.raises(SchemaError, match="lacks fields"):
        decode(broken)
    fields[schema.META] = fields[schema.META].replace(b'"schema_version": 2', b'"schema_version": 99')
    with pytest.raises(SchemaError, match="schema version 99"):
        decode(fields)


# --------------------------------------------------------------------------- version 2 (release layout)

V1_SHARD = Path(__file__).parent / "data" / "schema_v1_shard.tar"  # written by the version-1 code (commit f5b500d)


def make_ragged_sample(counts=(0, 3, 2, 7), gh=4, gw=6, has_audio=True, seed=1) -> Sample:
    """A release-layout sample: V = (gh/2)(gw/2) visual tokens per segment, audio ragged by `counts`."""
    rng = np.random.default_rng(seed)
    t, d = len(counts), 1.5
    counts = np.asarray(counts if has_audio else [0] * t, dtype=np.int32)
    times = np.stack([np.arange(t) * d, np.arange(1, t + 1) * d], axis=1).astype(np.float32)
    return Sample(
        video_id="release video", duration=t * d, segment_times=times,
        visual=rng.standard_normal((t, (gh // 2) * (gw // 2), 8)).astype(np.float16),
        audio=rng.standard_normal((int(counts.sum()), 8)).astype(np.float16), has_audio=has_audio,
        events=[Event(0.0, 2.0, "x")], audio_counts=counts, grid_thw=(t, gh, gw), seconds_per_timestep=d,
    )


def test_v2_ragged_round_trip():
    s = make_ragged_sample()
    got = decode(encode(s))
    assert_same(got, s)
    assert got.ragged_audio and got.grid_thw == (4, 4, 6) and got.seconds_per_timestep == 1.5
    assert b'"schema_version": 2' in encode(s)[schema.META]


def test_v2_video_without_audio_has_no_audio_tokens():
    s = make_ragged_sample(has_audio=False)
    got = decode(encode(s))
    assert got.audio.shape == (0, 8) and list(got.audio_counts) == [0, 0, 0, 0] and not got.has_audio


def test_project_encoders_keep_the_v1_layout_under_v2():
    s = make_sample()
    fields = encode(s)
    meta = json.loads(fields[schema.META])
    assert meta["schema_version"] == 2 and not {"audio_counts", "grid_thw", "seconds_per_timestep"} & set(meta)
    got = decode(fields)
    assert got.audio_counts is None and got.grid_thw is None and got.audio.shape == (5, 2, 6)
    assert np.array_equal(got.audio[1], s.audio[1])


def test_a_shard_written_by_version_1_code_still_reads():
    got = [decode(f) for f in wds.WebDataset(str(V1_SHARD), shardshuffle=False)]
    assert [s.video_id for s in got] == ["v1 with audio", "v1 silent"]
    rng = np.random.default_rng(7)  # the values the v1 writer drew
    vis0, aud0, vis1 = (rng.standard_normal(shape).astype(np.float16) for shape in ((3, 2, 4), (3, 2, 3), (3, 2, 4)))
    assert np.array_equal(got[0].visual, vis0) and np.array_equal(got[0].audio, aud0)
    assert np.array_equal(got[1].visual, vis1) and not got[1].has_audio and got[1].split == "test"
    assert got[0].events == [Event(0.5, 3.0, "a red circle", "a red circle", None)]
    assert all(s.audio_counts is None and s.grid_thw is None and s.seconds_per_timestep is None for s in got)
    assert_same(decode(encode(got[0])), got[0])  # rewritten as version 2, same content


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda s: setattr(s, "audio_counts", s.audio_counts[:-1]), "audio_counts must be integers"),
        (lambda s: setattr(s, "audio_counts", s.audio_counts.astype(np.float32)), "audio_counts must be integers"),
        (lambda s: s.audio_counts.__setitem__(0, -1), "negative"),
        (lambda s: setattr(s, "audio", s.audio[:-1]), "ragged audio must be"),
        (lambda s: setattr(s, "has_audio", False), "has_audio is false but 12 audio tokens"),
        (lambda s: setattr(s, "grid_thw", (4, 4, 8)), "visual has 6"),
        (lambda s: setattr(s, "grid_thw", (3, 4, 6)), "grid_thw must be"),
        (lambda s: setattr(s, "grid_thw", (4, 3, 6)), "grid_thw must be"),
        (lambda s: setattr(s, "seconds_per_timestep", 0.0), "seconds_per_timestep must be positive"),
    ],
)
def test_v2_validation_errors(mutate, needle):
    s = make_ragged_sample()
    mutate(s)
    with pytest.raises(SchemaError, match=needle):
        validate(s)
