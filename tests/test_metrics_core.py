"""Metrics without java: tIoU, caption pairing, detection P/R, the SODA DP, input reading."""

from __future__ import annotations

import io
import itertools
import json
import tarfile

import numpy as np
import pytest

from pipeline.metrics.common import caption_pairs, detection_pr, nonsense_reference
from pipeline.metrics.io import EMPTY, MISSING, OK, UNPARSABLE, InputError, load_inputs, read_predictions, read_references
from pipeline.metrics.soda import soda_dp
from pipeline.metrics.tiou import TIOU_EPS, tiou, tiou_matrix
from pipeline.schema import Event, Sample, encode

# ---------------------------------------------------------------- tIoU


def test_tiou_touching_intervals_is_zero():
    assert tiou([0, 5], [5, 10]) == 0.0
    assert tiou([5, 10], [0, 5]) == 0.0


def test_tiou_containment_and_identity():
    # inner [2, 4] in [0, 10]: intersection 2, union min(hull 10, 10 + 2) = 10
    assert tiou([0, 10], [2, 4]) == 2 / (10 + TIOU_EPS)
    assert tiou([0, 10], [0, 10]) == 10 / (10 + TIOU_EPS)
    assert tiou([0, 10], [0, 10]) < 1.0  # the epsilon keeps it a hair below 1


def test_tiou_disjoint_and_zero_length():
    assert tiou([0, 1], [3, 4]) == 0.0  # union = len sum 2 (< hull 4), intersection 0
    assert tiou([3, 3], [3, 3]) == 0.0  # 0 / (0 + 1e-8)
    assert tiou([0, 10], [4, 4]) == 0.0


def test_tiou_partial_overlap_hand_value():
    # [0, 6] and [4, 10]: intersection 2, hull 10, len sum 12 -> union 10
    assert tiou([0, 6], [4, 10]) == 2 / (10 + TIOU_EPS)


def test_tiou_matrix_equals_scalar_bitwise():
    rng = np.random.default_rng(0)
    a = np.sort(rng.uniform(0, 100, size=(40, 2)), axis=1)
    b = np.sort(rng.uniform(0, 100, size=(30, 2)), axis=1)
    m = tiou_matrix(a, b)
    assert m.shape == (40, 30)
    for i in range(40):
        for j in range(30):
            assert m[i, j] == tiou(a[i], b[j])


def test_ge_for_pairs_and_strict_gt_for_detection_at_exactly_the_threshold():
    pred, ref = np.array([[0.0, 10.0]]), np.array([[5.0, 10.0]])
    iou = tiou_matrix(pred, ref)
    t = float(iou[0, 0])  # exactly the pair's tIoU
    assert caption_pairs(iou, t) == [(0, 0)]  # >= : a caption pair
    assert detection_pr(iou, t) == (0.0, 0.0)  # >  : not a detection
    # half overlap is 0.4999999995 because of the epsilon: not a pair at t = 0.5
    assert caption_pairs(iou, 0.5) == [(0, -1)]


def test_caption_pairs_many_to_many_and_unmatched():
    pred = np.array([[0, 20], [50, 60], [0, 10]], float)
    ref = np.array([[0, 10], [10, 20], [30, 40]], float)
    iou = tiou_matrix(pred, ref)  # pred 0 meets ref 0 and ref 1 at 0.5 each
    assert caption_pairs(iou, 0.3) == [(0, 0), (0, 1), (1, -1), (2, 0)]
    p, r = detection_pr(iou, 0.3)
    assert (p, r) == (2 / 3, 2 / 3)


def test_nonsense_reference_is_seeded_and_lowercase():
    a = nonsense_reference(0, "vid", 3)
    assert a == nonsense_reference(0, "vid", 3)
    assert 10 <= len(a) <= 20 and a.isalpha() and a.islower()
    assert a != nonsense_reference(1, "vid", 3)
    assert a != nonsense_reference(0, "vid", 4)


# ---------------------------------------------------------------- SODA dynamic programme


def test_soda_dp_hand_computed_3x3():
    # refs x preds. Crossing r0-p1 (0.9) with r1-p0 (0.8) is forbidden; the best
    # order-preserving choice is r0-p1 + r2-p2 = 0.9 + 0.3 = 1.2.
    s = np.array([[0.1, 0.9, 0.0], [0.8, 0.0, 0.0], [0.0, 0.0, 0.3]])
    best, matches = soda_dp(s)
    assert best == pytest.approx(1.2, abs=1e-12)
    assert matches == [(0, 1), (2, 2)]


def _brute_force(s: np.ndarray) -> float:
    n_ref, n_pred = s.shape
    best = 0.0
    for k in range(1, min(n_ref, n_pred) + 1):
        for rs in itertools.combinations(range(n_ref), k):
            for ps in itertools.combinations(range(n_pred), k):
                best = max(best, sum(s[r, p] for r, p in zip(rs, ps)))
    return best


def test_soda_dp_matches_brute_force_on_random_matrices():
    rng = np.random.default_rng(1)
    for _ in range(40):
        s = rng.uniform(0, 1, size=(rng.integers(1, 6), rng.integers(1, 6))) * (rng.uniform(size=1) > 0.2)
        best, matches = soda_dp(s)
        assert best == pytest.approx(_brute_force(s), abs=1e-12)
        assert sum(s[r, p] for r, p in matches) == pytest.approx(best, abs=1e-12)
        assert all(r1 < r2 and p1 < p2 for (r1, p1), (r2, p2) in zip(matches, matches[1:]))


def test_soda_dp_empty():
    assert soda_dp(np.zeros((0, 3))) == (0.0, [])
    assert soda_dp(np.zeros((3, 0))) == (0.0, [])


def test_soda_dp_1000_events_no_recursion():
    rng = np.random.default_rng(2)
    s = rng.uniform(0, 0.5, size=(1000, 1000))
    s[np.arange(1000), np.arange(1000)] = 1.0
    best, matches = soda_dp(s)
    assert len(matches) <= 1000
    assert best >= 1000.0  # the diagonal is feasible
    assert sum(s[r, p] for r, p in matches) == pytest.approx(best, rel=1e-12)
    assert all(r1 < r2 and p1 < p2 for (r1, p1), (r2, p2) in zip(matches, matches[1:]))


# ---------------------------------------------------------------- inputs

REF = {
    "v1": {"duration": 30.0, "timestamps": [[0, 10], [10, 20]], "sentences": ["a b", "c d"]},
    "v2": {"duration": 20.0, "timestamps": [[0, 5]], "sentences": ["e f"]},
    "v3": {"duration": 20.0, "timestamps": [[5, 1]], "sentences": ["reversed reference"]},
}


def test_read_longvale_references_and_problems():
    refs, problems, fmt = read_references(REF)
    assert fmt == "longvale"
    assert refs["v1"].times.tolist() == [[0, 10], [10, 20]] and refs["v1"].captions == ["a b", "c d"]
    assert len(refs["v3"].captions) == 0
    assert any(p["video_id"] == "v3" and "reversed" in p["problem"] for p in problems)
    data = load_inputs({"results": {}}, REF)
    assert list(data.refs) == ["v1", "v2"]  # v3 has no valid reference event
    assert any(p["video_id"] == "v3" and "not evaluated" in p["problem"] for p in data.problems)


def test_read_chronusav_references(tmp_path):
    recs = [{"id": "c1", "duration": 100.0, "category": "x", "segment_num": 2,
             "seg_time": [["00:00:01.500", "00:01:02.250"], [70, 80]],
             "video_captions": ["a dog runs", "a cat sleeps"], "audio_captions": ["barking", "silence"]}]
    path = tmp_path / "chronus.json"
    path.write_text(json.dumps(recs))
    refs, problems, fmt = read_references(str(path))
    assert fmt == "chronusav" and not problems
    assert refs["c1"].times.tolist() == [[1.5, 62.25], [70.0, 80.0]]
    assert refs["c1"].captions == ["Visual: a dog runs Audio: barking", "Visual: a cat sleeps Audio: silence"]


def test_read_youcook2_references():
    obj = {"database": {"y1": {"duration": 50, "subset": "validation", "annotations": [{"segment": [1, 9], "sentence": "cut the onion"}]}}}
    refs, _, fmt = read_references(obj)
    assert fmt == "youcook2" and refs["y1"].captions == ["cut the onion"]


def _sample(vid: str) -> Sample:
    return Sample(
        video_id=vid, duration=20.0,
        segment_times=np.array([[0, 10], [10, 20]], np.float32),
        visual=np.zeros((2, 1, 4), np.float16), audio=np.zeros((2, 1, 4), np.float16), has_audio=False,
        events=[Event(0.0, 8.0, "a man talks"), Event(9.0, 20.0, "a man walks")],
    )


def test_read_shard_references_from_samples_and_tar(tmp_path):
    refs, _, fmt = read_references([_sample("s1")])
    assert fmt == "shards" and refs["s1"].captions == ["a man talks", "a man walks"]
    tar_path = tmp_path / "shard-000000.tar"
    with tarfile.open(tar_path, "w") as tar:
        fields = encode(_sample("s2"))
        for name, data in fields.items():
            if name == "__key__":
                continue
            info = tarfile.TarInfo(f"{fields['__key__']}.{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    refs, _, fmt = read_references(str(tmp_path))
    assert fmt == "shards" and refs["s2"].times.tolist() == [[0.0, 8.0], [9.0, 20.0]]


def test_prediction_forms_agree():
    anet = {"results": {"v1": [{"timestamp": [0, 10], "sentence": "x y"}]}}
    engine = {"v1": {"events": [{"start": 0, "end": 10, "caption": "x y"}], "latency_ms": 3}}
    listed = [{"video_id": "v1", "events": [{"start": 0, "end": 10, "caption": "x y"}]}]
    for obj, fmt in ((anet, "activitynet"), (engine, "engine"), (listed, "engine")):
        preds, problems, got = read_predictions(obj)
        assert got == fmt and not problems
        assert preds["v1"].times.tolist() == [[0, 10]] and preds["v1"].captions == ["x y"]


def test_bad_predictions_are_reported_not_raised():
    pred = {"results": {
        "v1": [
            {"timestamp": [-1, 3], "sentence": "negative"},
            {"timestamp": [8, 2], "sentence": "reversed"},
            {"timestamp": ["a", 3], "sentence": "non-number"},
            {"timestamp": [True, 3], "sentence": "bool"},
            {"timestamp": [float("nan"), 3], "sentence": "nan"},
            {"timestamp": [1, 3], "sentence": "   "},
            {"timestamp": [1, 3]},
            {"timestamp": [1], "sentence": "short"},
            "not an event",
            {"timestamp": [1, 4], "sentence": "the only good one"},
        ],
        "v2": "garbage",
        "ghost": [{"timestamp": [0, 1], "sentence": "unknown video"}],
    }}
    data = load_inputs(pred, REF)
    p1, p2 = data.preds["v1"], data.preds["v2"]
    assert p1.status == OK and p1.captions == ["the only good one"] and p1.raw_count == 10
    assert len(p1.problems) == 9
    for word in ("negative", "reversed", "non-numeric", "empty caption", "caption is missing", "not [start, end]", "not an object"):
        assert any(word in msg for msg in p1.problems), word
    assert p2.status == UNPARSABLE and not p2.has_predictions
    assert any(p["video_id"] == "ghost" and "not in the references" in p["problem"] for p in data.problems)


def test_prediction_statuses_and_truncation():
    events = [{"timestamp": [i, i + 1], "sentence": f"event {i}"} for i in range(1005)]
    bad_only = [{"timestamp": [5, 1], "sentence": "x"}]
    preds = {"results": {"v1": events, "v2": bad_only}}
    ref = dict(REF, v4={"duration": 9, "timestamps": [[0, 1]], "sentences": ["q"]}, v5={"duration": 9, "timestamps": [[0, 1]], "sentences": ["q"]})
    preds["results"]["v5"] = []
    data = load_inputs(preds, ref)
    assert data.preds["v1"].times.shape == (1000, 2) and data.preds["v1"].captions[-1] == "event 999"
    assert any("kept the first 1000" in m for m in data.preds["v1"].problems)
    assert data.preds["v2"].status == UNPARSABLE
    assert data.preds["v4"].status == MISSING
    assert data.preds["v5"].status == EMPTY


def test_unreadable_input_raises_input_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(InputError):
        load_inputs(str(bad), REF)
    with pytest.raises(InputError):
        load_inputs({"results": {}}, str(tmp_path / "missing.json"), ref_format="longvale")


def test_references_without_any_valid_video_raise():
    with pytest.raises(InputError, match="swapped"):
        load_inputs({"results": {}}, {"results": {"v1": [{"timestamp": [0, 1], "sentence": "x"}]}})


def test_missing_policy_zero_is_densevid_only():
    from pipeline.metrics import evaluate

    for protocol in ("soda", "etbench", "padcaptioner"):
        with pytest.raises(ValueError, match="densevid"):
            evaluate({"results": {}}, REF, protocol, missing="zero")
    with pytest.raises(ValueError, match="unknown protocol"):
        evaluate({"results": {}}, REF, "bleu")


GOOD = {"duration": 20.0, "timestamps": [[0, 5]], "sentences": ["a dog barks"]}


@pytest.mark.parametrize("bad, field", [
    ({"duration": 9, "timestamps": 5, "sentences": ["x"]}, "timestamps"),
    ({"duration": 9, "timestamps": [[0, 5]], "sentences": "A dog sleeps."}, "sentences"),
    ({"duration": 9, "timestamps": "0-5", "sentences": ["x"]}, "timestamps"),
])
def test_longvale_fields_of_the_wrong_type_are_problems_not_crashes(bad, field):
    """A field that is not a list is a problem of its video (not a TypeError, and a string is
    not read as one sentence per character)."""
    data = load_inputs({"results": {}}, {"ok": GOOD, "bad": bad})
    assert list(data.refs) == ["ok"]
    assert any(p["video_id"] == "bad" and f"'{field}' is" in p["problem"] for p in data.problems)


def test_youcook2_and_chronusav_fields_of_the_wrong_type_are_problems_not_crashes():
    yc = {"database": {"ok": {"duration": 9, "annotations": [{"segment": [0, 5], "sentence": "x"}]},
                       "bad": {"duration": 9, "annotations": 5}}}
    data = load_inputs({"results": {}}, yc)
    assert list(data.refs) == ["ok"] and any(p["video_id"] == "bad" and "'annotations' is" in p["problem"] for p in data.problems)
    ok = {"id": "ok", "seg_time": [[0, 1]], "video_captions": ["x"], "audio_captions": ["y"]}
    for field, value in (("seg_time", 3), ("audio_captions", "a bark")):
        data = load_inputs({"results": {}}, [ok, {**ok, "id": "bad", field: value}])
        assert list(data.refs) == ["ok"]
        assert any(p["video_id"] == "bad" and f"'{field}' is" in p["problem"] for p in data.problems)


def test_predictions_for_none_of_the_reference_videos_are_an_error():
    """Predictions whose video ids all differ from the references' (an id prefix, another split)
    would score 0 with exit status 0; it is an input error that shows ids of both."""
    pred = {"results": {"v_v1": [{"timestamp": [0, 10], "sentence": "a b"}]}}
    with pytest.raises(InputError, match="v_v1") as err:
        load_inputs(pred, REF)
    assert "v1" in str(err.value)
    # no prediction records at all (every video failed) is still a result: all missing
    assert set(load_inputs({"results": {}}, REF).refs) == {"v1", "v2"}


def test_unreadable_shard_tar_raises_input_error_naming_it(tmp_path):
    bad = tmp_path / "shard-000000.tar"
    bad.write_bytes(b"not a tar" * 100)
    with pytest.raises(InputError, match="shard-000000.tar"):
        read_references(str(bad))
