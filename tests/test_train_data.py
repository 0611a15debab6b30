"""train/data.py: reading real WebDataset tars, corrupt records skipped and counted, segment
truncation (even, whole segments, events re-mapped), shuffling, collation into batches."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
import webdataset as wds

from pipeline.examples import ExampleError
from pipeline.fitting import drop_segments, fit_segments, fit_to_model, keep_indices, remap_interval, sequence_length
from pipeline.layout import Role
from pipeline.model import PadCaptioner
from pipeline.schema import KEY, META, TIMES, encode
from tests.support.padcap import sample, tiny_cfg
from train.data import (
    Batcher,
    DataStats,
    InMemoryEpochs,
    read_samples,
    read_shard_records,
    shuffle_buffer,
)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return PadCaptioner(tiny_cfg()).eval()


def write_tar(path, samples, corrupt: dict[int, dict] | None = None):
    with wds.TarWriter(str(path)) as sink:
        for i, s in enumerate(samples):
            fields = encode(s)
            fields.update((corrupt or {}).get(i, {}))
            sink.write(fields)
    return str(path)


def samples_n(n, **kw):
    return [sample(num_segments=12, seed=i, video_id=f"v{i}", **kw) for i in range(n)]


# --------------------------------------------------------------------------- reading


def test_read_shard_records_gives_raw_bytes_that_decode(tmp_path):
    src = samples_n(3)
    path = write_tar(tmp_path / "a.tar", src)
    recs = list(read_shard_records([path]))
    assert [r[KEY] for r in recs] == [encode(s)[KEY] for s in src]
    assert all(isinstance(r[TIMES], bytes) for r in recs)
    got = read_samples([path])
    assert [s.video_id for s in got] == ["v0", "v1", "v2"]
    assert np.array_equal(got[1].visual, src[1].visual)


def test_readers_take_only_the_manifests_current_key_per_shard(tmp_path):
    # v1 was redone (its caption edited): its old sample stays in the old tar under the same key.
    import dataclasses

    from preprocess import manifest as mf

    old = samples_n(3)
    edited = dataclasses.replace(old[1], events=[dataclasses.replace(e, caption="edited.") for e in old[1].events])
    old_tar = write_tar(tmp_path / "old.tar", [old[2], old[1], old[0]])
    new_tar = write_tar(tmp_path / "new.tar", [edited])
    rows = [mf.empty_row(video_id=f"v{i}", status="ok", split="train", shard=old_tar, key=encode(old[i])[KEY]) for i in (0, 2)]
    rows.append(mf.empty_row(video_id="v1", status="ok", split="train", shard=new_tar, key=encode(edited)[KEY]))
    rows.append(mf.empty_row(video_id="v9", status="error", split="train"))
    keys = mf.current_keys(rows, "train")
    key = [encode(s)[KEY] for s in old]
    assert keys == {old_tar: sorted([key[0], key[2]]), new_tar: [key[1]]}
    got = read_samples(keys)  # sorted by key, one sample per video, the current one
    assert [s.video_id for s in got] == ["v0", "v1", "v2"] and got[1].events[0].caption == "edited."
    assert [s.video_id for s in read_samples(keys, limit=2)] == ["v0", "v1"]
    whole = read_samples(mf.ok_shards(rows, "train"))  # whole tars: the stale v1 as well
    assert sorted(s.video_id for s in whole) == ["v0", "v1", "v1", "v2"]
    assert [r[KEY] for r in read_shard_records([old_tar], keys=keys)] == [key[2], key[0]]  # file order


def test_corrupt_records_are_skipped_and_counted(tmp_path, model):
    src = samples_n(5)
    bad_meta = json.loads(encode(src[3])[META])
    bad_meta["schema_version"] = 99
    path = write_tar(tmp_path / "b.tar", src, corrupt={
        1: {TIMES: b"not an npy file"},
        3: {META: json.dumps(bad_meta).encode()},
    })
    stats = DataStats()
    batches = list(Batcher(model, 2, stats=stats)(read_shard_records([path], stats)))
    assert stats.records == 5 and stats.used == 3 and stats.skipped == 2
    assert sum(len(b.examples) for b in batches) == 3
    reasons = " | ".join(stats.reasons)
    assert "schema version 99" in reasons and "record" in reasons


def test_truncated_tar_keeps_the_records_before_the_damage(tmp_path):
    path = write_tar(tmp_path / "c.tar", samples_n(4))
    data = open(path, "rb").read()
    cut = tmp_path / "cut.tar"
    cut.write_bytes(data[: int(len(data) * 0.6)])
    stats = DataStats()
    got = read_samples([str(cut), path], stats=stats)
    ids = [s.video_id for s in got]
    assert ids[-4:] == ["v0", "v1", "v2", "v3"]  # the whole good tar after the cut one
    before = ids[:-4]  # the complete records of the cut tar, in order
    assert 1 <= len(before) < 4 and before == ["v0", "v1", "v2"][: len(before)]
    assert stats.skipped == 1 and "unreadable shard cut.tar" in next(iter(stats.reasons))


# --------------------------------------------------------------------------- truncation


def test_keep_indices_are_even_and_distinct():
    assert keep_indices(10, 10).tolist() == list(range(10))
    assert keep_indices(10, 5).tolist() == [1, 3, 5, 7, 9]
    assert keep_indices(9, 3).tolist() == [1, 4, 7]
    for t in range(1, 40):
        for k in range(1, t + 1):
            idx = keep_indices(t, k)
            assert len(set(idx.tolist())) == k and idx.min() >= 0 and idx.max() < t
            gaps = np.diff(idx)
            assert gaps.size == 0 or gaps.max() - gaps.min() <= 1  # evenly spread
    with pytest.raises(ValueError):
        keep_indices(5, 6)


def test_remap_interval_snaps_to_kept_segments():
    times = np.array([[1, 2], [4, 5], [7, 8]], dtype=np.float32)
    assert remap_interval(1.5, 4.5, times) == (1.0, 5.0)  # overlaps the first two kept
    assert remap_interval(7.2, 9.0, times) == (7.0, 8.0)
    assert remap_interval(5.5, 6.0, times) == (4.0, 5.0)  # overlaps none: nearest centre (5.75 -> 4.5 vs 7.5)
    assert remap_interval(2.0, 4.0, times) == (1.0, 2.0)  # touching is not overlapping; tie -> first


def test_drop_segments_keeps_whole_segments_and_remaps_events():
    s = sample(num_segments=12, intervals=((2.0, 5.0), (7.0, 10.0)))
    cut = drop_segments(s, 4)  # keeps segments 1, 4, 7, 10
    assert cut.segment_times.tolist() == [[1, 2], [4, 5], [7, 8], [10, 11]]
    assert np.array_equal(cut.visual, s.visual[[1, 4, 7, 10]]) and np.array_equal(cut.audio, s.audio[[1, 4, 7, 10]])
    assert [(e.start, e.end) for e in cut.events] == [(4.0, 5.0), (7.0, 8.0)]
    assert [e.caption for e in cut.events] == [e.caption for e in s.events]
    assert drop_segments(s, 12) is s


def test_sequence_length_matches_the_real_layout(model):
    for n_seg, intervals in ((5, ((1.0, 2.0),)), (12, ((2.0, 5.0), (7.0, 10.0))), (8, ())):
        s = sample(num_segments=n_seg, intervals=intervals)
        ex = model.make_example(s)
        caps = [len(model.tokenizer.encode(e.caption, add_special_tokens=False)) for e in s.events]
        prompt = (len(model.prompt[0]), len(model.prompt[1]))
        assert sequence_length(prompt, n_seg, 2, 2, caps) == len(ex.layout)


def test_fit_segments_truncates_to_max_seq_len_and_never_cuts_a_segment(model):
    s = sample(num_segments=40, intervals=((2.0, 9.0), (20.0, 31.0)))
    full = len(model.make_example(s).layout)
    limit = full - 37  # forces dropping 10 of the 40 segments (4 tokens each)
    import dataclasses
    small = PadCaptioner.__new__(PadCaptioner)
    small.__dict__.update(model.__dict__)
    small.cfg = dataclasses.replace(model.cfg, max_seq_len=limit)
    fitted, cut = fit_to_model(s, small)
    assert cut and fitted.num_segments == 30
    ex = small.make_example(fitted)
    assert len(ex.layout) <= limit and len(ex.layout) == full - 40
    v = (ex.layout.role == Role.VISUAL).sum().item()
    a = (ex.layout.role == Role.AUDIO).sum().item()
    assert v == 30 * 2 and a == 30 * 2  # whole segments: visual and audio tokens together
    for e in fitted.events:  # every event still covers kept segments exactly
        assert any(np.isclose(fitted.segment_times[:, 0], e.start)) and any(np.isclose(fitted.segment_times[:, 1], e.end))
    same, cut2 = fit_segments(s, (3, 3), [5, 5], 10_000, 512)
    assert same is s and not cut2
    capped, cut3 = fit_segments(s, (3, 3), [5, 5], 10_000, 16)  # model.max_segments caps T too
    assert cut3 and capped.num_segments == 16
    with pytest.raises(ExampleError, match="no segment fits"):
        fit_segments(s, (3, 3), [50, 50], 100, 512)


def test_batcher_truncates_long_samples_instead_of_failing(model):
    import dataclasses
    small = PadCaptioner.__new__(PadCaptioner)
    small.__dict__.update(model.__dict__)
    small.cfg = dataclasses.replace(model.cfg, max_seq_len=120)
    stats = DataStats()
    batches = list(Batcher(small, 2, stats=stats)(samples_n(3)))
    assert stats.truncated == 3 and stats.used == 3 and [len(b.examples) for b in batches] == [2, 1]
    assert all(len(lay) <= 120 for b in batches for lay in b.packed.layouts)


# --------------------------------------------------------------------------- shuffling and batching


def test_shuffle_buffer_is_a_seeded_permutation():
    items = list(range(100))
    a = list(shuffle_buffer(items, 16, random.Random(3)))
    b = list(shuffle_buffer(items, 16, random.Random(3)))
    c = list(shuffle_buffer(items, 16, random.Random(4)))
    assert sorted(a) == items and a == b and a != c and a != items
    assert list(shuffle_buffer(items, 1, random.Random(0))) == items


def test_in_memory_epochs_are_deterministic():
    recs = list(range(10))
    e = InMemoryEpochs(recs, seed=1)
    assert list(e.epoch(0)) == list(InMemoryEpochs(recs, seed=1).epoch(0))
    assert list(e.epoch(0)) != list(e.epoch(1)) and sorted(e.epoch(1)) == recs


def test_batcher_collates_padded_batches_with_jitter(model):
    g = torch.Generator().manual_seed(0)
    batches = list(Batcher(model, 2, generator=g)(samples_n(3)))
    assert [len(b.examples) for b in batches] == [2, 1]
    b = batches[0]
    assert b.packed.input_ids.shape[0] == 2 and b.packed.mask.shape[:2] == (2, 1)
    ex = b.examples[0]
    assert not torch.equal(ex.agg_intervals, ex.intervals)  # jittered aggregation intervals
    plain = next(Batcher(model, 1)(samples_n(1)))
    assert torch.equal(plain.examples[0].agg_intervals, plain.examples[0].intervals)


# --------------------------------------------------------------------------- augmentation


def test_random_crop_cuts_only_between_events_and_shifts_times():
    from train.data import Augment, crop_cuts, feature_noise, random_crop

    s = sample(num_segments=20, intervals=((2.0, 5.0), (8.0, 11.0), (15.0, 18.0)))
    starts, ends = crop_cuts(s.segment_times, s.events, 0.5)
    assert starts == [0, 1, 2, 5, 6, 7, 8] and ends == [11, 12, 13, 14, 15, 18, 19, 20]
    rng = np.random.default_rng(0)
    seen_k = set()
    for _ in range(40):
        c = random_crop(s, 0.5, rng)
        assert c.segment_times[0, 0] == 0.0 and c.duration == pytest.approx(float(c.segment_times[-1, 1]))
        assert 1 <= len(c.events) <= 3 and c.visual.shape[0] == c.num_segments == c.audio.shape[0]
        seen_k.add(len(c.events))
        x0 = [e.caption for e in s.events].index(c.events[0].caption)
        shift = s.events[x0].start - c.events[0].start
        for e in c.events:  # whole events, same captions, same length, same offset
            orig = next(o for o in s.events if o.caption == e.caption)
            assert (e.start + shift, e.end + shift) == pytest.approx((orig.start, orig.end))
        t0 = int(round(shift))
        assert np.array_equal(c.visual, s.visual[t0:t0 + c.num_segments])
    assert len(seen_k) >= 2  # the event count changes, too
    assert random_crop(s, 0.0, rng) is s
    noisy = feature_noise(s, 0.1, np.random.default_rng(1))
    assert 0.05 < float(np.abs(noisy.visual.astype(np.float32) - s.visual).mean()) < 0.15
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    a, b = Augment(0.3, 0.05, g1)(s), Augment(0.3, 0.05, g2)(s)
    assert np.array_equal(a.visual, b.visual) and a.num_segments == b.num_segments  # seeded by the generator
