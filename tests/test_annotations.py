"""Annotation readers: every format, every kind of bad record, time strings, clipping.

    .venv/bin/python -m pytest tests/test_annotations.py -q
    (the s3:// test is marked `integration`: it starts a SeaweedFS server on 127.0.0.1)
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import fsspec
import pytest

from pipeline.config import SyntheticConfig
from preprocess import annotations as A
from preprocess import synthetic as syn


def write(tmp_path: Path, name: str, data) -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def by_id(records):
    return {r.video_id: r for r in records}


# --------------------------------------------------------------------------- times


@pytest.mark.parametrize(
    "value, seconds",
    [(12, 12.0), (12.5, 12.5), ("12.5", 12.5), (" 7 ", 7.0), ("01:15.5", 75.5), ("00:01:15.500", 75.5),
     ("1:02:03", 3723.0), ("00:00:00.000", 0.0), ("10:00:00", 36000.0), ("-0.25", -0.25)],
)
def test_parse_time_accepts(value, seconds):
    assert A.parse_time(value) == pytest.approx(seconds)


@pytest.mark.parametrize("value", ["abc", "", "1:75", "1:60:00", "1::2", "12:xx", "1:2:3:4", "1e", True, None,
                                   float("nan"), math.inf, [1], "nan"])
def test_parse_time_rejects(value):
    with pytest.raises(ValueError):
        A.parse_time(value)


# --------------------------------------------------------------------------- good files


LONGVALE = {
    "vid_b": {"duration": 30.0, "timestamps": [[10.0, 20.0], [0.0, 5.5]],
              "sentences": ["  A man   speaks.", "Music plays."]},
    "vid_a": {"duration": "00:01:00.000", "timestamps": [["00:00:01.0", "2.5"]], "sentences": ["Dog barks."]},
}


def test_longvale(tmp_path):
    anns, errors = A.read_annotations(write(tmp_path, "longvale_train.json", LONGVALE), "longvale")
    assert errors == []
    assert [a.video_id for a in anns] == ["vid_b", "vid_a"]  # file order
    b = by_id(anns)["vid_b"]
    assert (b.duration, b.split, b.source, b.clipped) == (30.0, "train", "longvale", 0)
    assert [(e.start, e.end, e.caption) for e in b.events] == [(0.0, 5.5, "Music plays."), (10.0, 20.0, "A man speaks.")]
    a = by_id(anns)["vid_a"]
    assert a.duration == 60.0 and (a.events[0].start, a.events[0].end) == (1.0, 2.5)
    assert a.events[0].visual_caption is None and a.events[0].audio_caption is None


def test_activitynet_same_form_and_detection(tmp_path):
    data = {"v_QOlSCBRmfWY": {"duration": 82.73, "timestamps": [[0.83, 19.86], [17.37, 60.81]],
                              "sentences": [" A young woman is seen standing.", " She then begins to dance."]}}
    anns, errors = A.read_annotations(write(tmp_path, "activitynet_val_1.json", data), "auto")
    assert errors == [] and anns[0].source == "activitynet" and anns[0].split == "val"
    assert anns[0].events[1].caption == "She then begins to dance."
    anns2, _ = A.read_annotations(write(tmp_path, "x.json", data), "activitynet", "test")
    assert anns2[0].split == "test" and anns2[0].events == anns[0].events


CHRONUSAV = [
    {"id": "c1", "duration": 95.2, "category": "music", "segment_num": 2,
     "seg_time": [["00:00:00.000", "00:00:12.500"], ["00:00:12.500", "00:01:35.200"]],
     "video_captions": ["A band sets up on stage.", "The singer performs."],
     "audio_captions": ["Instruments tune.", "A rock song plays."]},
    {"id": 7, "duration": 20, "category": "pets", "segment_num": 1, "seg_time": [[2, 8.25]],
     "video_captions": ["A cat jumps."], "audio_captions": ["It meows."]},
]


def test_chronusav_seconds_and_time_strings(tmp_path):
    anns, errors = A.read_annotations(write(tmp_path, "chronusav_test.json", CHRONUSAV), "chronusav")
    assert errors == []
    c1 = by_id(anns)["c1"]
    assert c1.split == "test" and c1.source == "chronusav" and c1.duration == pytest.approx(95.2)
    assert [(e.start, e.end) for e in c1.events] == [(0.0, 12.5), (12.5, pytest.approx(95.2))]
    assert c1.events[0].caption == "Visual: A band sets up on stage. Audio: Instruments tune."
    assert (c1.events[1].visual_caption, c1.events[1].audio_caption) == ("The singer performs.", "A rock song plays.")
    assert by_id(anns)["7"].events[0].caption == "Visual: A cat jumps. Audio: It meows."


def test_chronusav_json_lines_and_keyed_object(tmp_path):
    jsonl = "\n".join(json.dumps(r) for r in CHRONUSAV) + "\n"
    anns, errors = A.read_annotations(write(tmp_path, "chronus.jsonl", jsonl), "auto", "train")
    assert errors == [] and [a.video_id for a in anns] == ["c1", "7"]
    keyed = {str(r["id"]): {k: v for k, v in r.items() if k != "id"} for r in CHRONUSAV}
    anns2, errors2 = A.read_annotations(write(tmp_path, "chronus_keyed.json", keyed), "auto", "train")
    assert errors2 == [] and [(a.video_id, a.events) for a in anns2] == [(a.video_id, a.events) for a in anns]


YOUCOOK2 = {"database": {
    "GLd3aX16zBg": {"duration": 241.62, "subset": "training", "recipe_type": "113",
                    "annotations": [{"segment": [90, 102], "id": 0, "sentence": "spread margarine on two slices"},
                                    {"segment": [114, 127], "id": 1, "sentence": "place a slice of cheese"}]},
    "xHr8X2Wpmno": {"duration": 162.0, "subset": "validation",
                    "annotations": [{"segment": [5, 20], "id": 0, "sentence": "cut the tomato"}]},
    "zzTest": {"duration": 50.0, "subset": "testing", "annotations": [{"segment": [1, 2], "sentence": "stir"}]},
}}


def test_youcook2_subsets(tmp_path):
    path = write(tmp_path, "youcookii_annotations_trainval.json", YOUCOOK2)
    train, errors = A.read_annotations(path, "youcook2", "train")
    assert errors == [] and [a.video_id for a in train] == ["GLd3aX16zBg"]
    assert [e.caption for e in train[0].events] == ["spread margarine on two slices", "place a slice of cheese"]
    val, _ = A.read_annotations(path, "youcook2", "validation")
    assert [(a.video_id, a.split) for a in val] == [("xHr8X2Wpmno", "validation")]
    every, _ = A.read_annotations(path, "auto")
    assert [(a.video_id, a.split, a.source) for a in every] == [
        ("GLd3aX16zBg", "train", "youcook2"), ("xHr8X2Wpmno", "val", "youcook2"), ("zzTest", "test", "youcook2")]
    custom, _ = A.read_annotations(path, "youcook2", "all")
    assert len(custom) == 3 and {a.split for a in custom} == {"all"}


# --------------------------------------------------------------------------- bad records


def _good_lv(d=10.0):
    return {"duration": d, "timestamps": [[1, 2]], "sentences": ["ok"]}


@pytest.mark.parametrize(
    "record, kind, words",
    [
        ({"timestamps": [[1, 2]], "sentences": ["x"]}, "missing_field", "'duration'"),
        ({"duration": 10, "sentences": ["x"]}, "missing_field", "'timestamps'"),
        ({"duration": 10, "timestamps": [[1, 2]]}, "missing_field", "'sentences'"),
        ({"duration": 10, "timestamps": [[5, 5]], "sentences": ["x"]}, "end_before_start", "end 5 <= start 5"),
        ({"duration": 10, "timestamps": [[6, 3]], "sentences": ["x"]}, "end_before_start", "event 0"),
        ({"duration": 10, "timestamps": [[12, 13]], "sentences": ["x"]}, "out_of_range", "beyond the duration"),
        ({"duration": 10, "timestamps": [[10, 10.5]], "sentences": ["x"]}, "out_of_range", "beyond the duration"),
        ({"duration": 10, "timestamps": [[1, 2], ["abc", 3]], "sentences": ["x", "y"]}, "bad_time", "event 1"),
        ({"duration": 10, "timestamps": [[1, None]], "sentences": ["x"]}, "bad_time", "non-numeric"),
        ({"duration": 10, "timestamps": [[True, 2]], "sentences": ["x"]}, "bad_time", "non-numeric"),
        ({"duration": 10, "timestamps": [[1, 2, 3]], "sentences": ["x"]}, "bad_time", "pair"),
        ({"duration": "long", "timestamps": [[1, 2]], "sentences": ["x"]}, "bad_time", "duration"),
        ({"duration": 0, "timestamps": [[1, 2]], "sentences": ["x"]}, "bad_time", "positive"),
        ({"duration": 10, "timestamps": [[1, 2]], "sentences": ["x", "y"]}, "count_mismatch", "1 time intervals"),
        ({"duration": 10, "timestamps": [], "sentences": []}, "empty", "no events"),
        ({"duration": 10, "timestamps": [[1, 2]], "sentences": ["   "]}, "empty", "sentence 0"),
        ({"duration": 10, "timestamps": [[1, 2]], "sentences": [3]}, "bad_record", "sentence 0"),
        ({"duration": 10, "timestamps": "1-2", "sentences": ["x"]}, "bad_record", "'timestamps'"),
        ({"duration": 10, "timestamps": [[1, 12]], "sentences": ["x"]}, "out_of_range", "tolerance"),
        ({"duration": 10, "timestamps": [[-3, 2]], "sentences": ["x"]}, "out_of_range", "negative"),
        (["not", "an", "object"], "bad_record", "list"),
    ],
)
def test_longvale_bad_record_is_explained_and_others_survive(tmp_path, record, kind, words):
    path = write(tmp_path, "lv.json", {"good1": _good_lv(), "bad": record, "good2": _good_lv(20)})
    anns, errors = A.read_annotations(path, "longvale", "train")
    assert [a.video_id for a in anns] == ["good1", "good2"]
    assert len(errors) == 1 and errors[0].video_id == "bad" and errors[0].kind == kind, errors
    assert words in errors[0].reason and errors[0].source == "longvale"


def test_duplicate_ids_in_every_format(tmp_path):
    raw = '{"v": %s, "w": %s, "v": %s}' % (json.dumps(_good_lv(10)), json.dumps(_good_lv()), json.dumps(_good_lv(99)))
    anns, errors = A.read_annotations(write(tmp_path, "lv.json", raw), "longvale")
    assert [(a.video_id, a.duration) for a in anns] == [("v", 10.0), ("w", 10.0)]  # first record kept
    assert [(e.video_id, e.kind) for e in errors] == [("v", "duplicate_id")] and "duplicate" in errors[0].reason

    ch = [CHRONUSAV[0], CHRONUSAV[1], dict(CHRONUSAV[0], duration=500)]
    anns, errors = A.read_annotations(write(tmp_path, "ch.json", ch), "chronusav")
    assert [a.video_id for a in anns] == ["c1", "7"] and by_id(anns)["c1"].duration == pytest.approx(95.2)
    assert [(e.video_id, e.kind) for e in errors] == [("c1", "duplicate_id")]

    yc = json.dumps(YOUCOOK2)
    dup = json.dumps(YOUCOOK2["database"]["zzTest"])
    yc = yc.replace('"database": {', '"database": {"zzTest": %s, ' % dup, 1)
    anns, errors = A.read_annotations(write(tmp_path, "yc.json", yc), "youcook2", "test")
    assert [a.video_id for a in anns] == ["zzTest"] and [(e.video_id, e.kind) for e in errors] == [("zzTest", "duplicate_id")]
    anns, errors = A.read_annotations(write(tmp_path, "yc.json", yc), "youcook2", "train")
    assert errors == []  # the duplicate belongs to another subset


@pytest.mark.parametrize(
    "change, kind, words",
    [
        ({"id": None}, "missing_field", "'id'"),
        ({"seg_time": None}, "missing_field", "'seg_time'"),
        ({"audio_captions": None}, "missing_field", "'audio_captions'"),
        ({"audio_captions": ["only one"]}, "count_mismatch", "2 video captions but 1 audio"),
        ({"segment_num": 3}, "count_mismatch", "segment_num 3"),
        ({"seg_time": [["00:00:00.000", "00:00:12.500"], ["00:00:1x.5", "00:01:00"]]}, "bad_time", "event 1"),
        ({"seg_time": [["00:00:20.000", "00:00:12.500"], [13, 14]]}, "end_before_start", "event 0"),
        ({"seg_time": [[0, 5], ["00:01:40.000", "00:01:50.000"]]}, "out_of_range", "beyond the duration"),
        ({"duration": "01:xx"}, "bad_time", "duration"),
    ],
)
def test_chronusav_bad_records(tmp_path, change, kind, words):
    bad = {k: v for k, v in dict(CHRONUSAV[0], **change).items() if v is not None}
    anns, errors = A.read_annotations(write(tmp_path, "ch.json", [bad, CHRONUSAV[1]]), "chronusav")
    assert [a.video_id for a in anns] == ["7"]
    assert len(errors) == 1 and errors[0].kind == kind and words in errors[0].reason, errors
    assert errors[0].video_id == ("<record 0>" if "id" in change else "c1")


def test_chronusav_non_object_record(tmp_path):
    anns, errors = A.read_annotations(write(tmp_path, "ch.json", [CHRONUSAV[1], "oops", 3]), "chronusav")
    assert len(anns) == 1 and [(e.video_id, e.kind) for e in errors] == [("<record 1>", "bad_record"), ("<record 2>", "bad_record")]


def test_youcook2_bad_records(tmp_path):
    db = json.loads(json.dumps(YOUCOOK2))
    db["database"]["GLd3aX16zBg"]["annotations"][1].pop("segment")
    db["database"]["xHr8X2Wpmno"]["annotations"][0]["segment"] = [20, 5]
    del db["database"]["zzTest"]["subset"]
    anns, errors = A.read_annotations(write(tmp_path, "yc.json", db), "youcook2")
    assert anns == []
    got = {e.video_id: (e.kind, e.reason) for e in errors}
    assert got["GLd3aX16zBg"] == ("missing_field", "missing field 'segment' in annotation 1")
    assert got["xHr8X2Wpmno"][0] == "end_before_start"
    assert got["zzTest"] == ("missing_field", "missing field 'subset'")


def test_lone_surrogates_are_explained_errors_not_job_crashes(tmp_path):
    # JSON allows "\ud83d" (half an emoji, e.g. a caption cut in UTF-16 by a JavaScript tool);
    # Python reads it, but it is not encodable as UTF-8, so Arrow (the Ray rows, the Parquet
    # manifest) and the shard's meta.json would raise later and take the whole run down.
    from preprocess import manifest as mf

    raw = ('{"good": %s, "cut": {"duration": 10, "timestamps": [[1, 2]], "sentences": ["nice \\ud83d"]},'
           ' "id \\udc00": %s}') % (json.dumps(_good_lv()), json.dumps(_good_lv()))
    anns, errors = A.read_annotations(write(tmp_path, "lv.json", raw), "longvale", "train")
    assert [a.video_id for a in anns] == ["good"]
    got = {e.video_id: (e.kind, e.reason) for e in errors}
    assert set(got) == {"cut", "id \\udc00"}, got
    assert got["cut"][0] == "bad_record" and "sentence 0" in got["cut"][1] and "surrogate" in got["cut"][1]
    assert got["id \\udc00"][0] == "bad_record" and "video id" in got["id \\udc00"][1]
    mf.write_table(str(tmp_path / "m.parquet"), [mf.empty_row(video_id=e.video_id, error=e.reason) for e in errors])

    ch = [dict(CHRONUSAV[0], audio_captions=["Instruments tune.", "A rock \udc80song plays."]), CHRONUSAV[1]]
    anns, errors = A.read_annotations(write(tmp_path, "ch.json", json.dumps(ch)), "chronusav")
    assert [a.video_id for a in anns] == ["7"]
    assert [(e.video_id, e.kind) for e in errors] == [("c1", "bad_record")] and "audio caption 1" in errors[0].reason


@pytest.mark.parametrize("bad_id", [["c1"], {"x": 1}, True, 1.5])
def test_chronusav_id_of_a_wrong_type_is_an_error(tmp_path, bad_id):
    anns, errors = A.read_annotations(write(tmp_path, "ch.json", [dict(CHRONUSAV[0], id=bad_id), CHRONUSAV[1]]), "chronusav")
    assert [a.video_id for a in anns] == ["7"]
    assert [(e.video_id, e.kind) for e in errors] == [("<record 0>", "bad_record")] and "'id'" in errors[0].reason


# --------------------------------------------------------------------------- clipping


def test_small_overshoots_are_clipped_and_counted(tmp_path):
    data = {
        "one": {"duration": 10.0, "timestamps": [[1, 10.5], [2, 3]], "sentences": ["a", "b"]},
        "two": {"duration": 10.0, "timestamps": [[-0.2, 4], [5, 11.0], [6, 7]], "sentences": ["a", "b", "c"]},
        "frac": {"duration": 100.0, "timestamps": [[50, 102.9]], "sentences": ["a"]},  # 3% of 100 s = 3 s
        "far": {"duration": 10.0, "timestamps": [[5, 11.2]], "sentences": ["a"]},
        "none": {"duration": 10.0, "timestamps": [[0, 10]], "sentences": ["a"]},
    }
    path = write(tmp_path, "lv.json", data)
    anns, errors = A.read_annotations(path, "longvale")
    got = by_id(anns)
    assert {k: a.clipped for k, a in got.items()} == {"one": 1, "two": 2, "frac": 1, "none": 0}
    assert max(e.end for e in got["one"].events) == 10.0 and got["two"].events[0].start == 0.0
    assert got["frac"].events[0].end == 100.0
    assert [(e.video_id, e.kind) for e in errors] == [("far", "out_of_range")]

    strict, errors = A.read_annotations(path, "longvale", overshoot_s=0.0, overshoot_frac=0.0)
    assert [a.video_id for a in strict] == ["none"] and len(errors) == 4
    loose, errors = A.read_annotations(path, "longvale", overshoot_s=1.5)
    assert errors == [] and by_id(loose)["far"].clipped == 1


# --------------------------------------------------------------------------- files, detection, fsspec


def test_detection_and_file_level_errors(tmp_path):
    assert A.detect_format(LONGVALE, "longvale_train.json") == "longvale"
    assert A.detect_format(LONGVALE, "s3://b/anet_captions_val.json") == "activitynet"
    assert A.detect_format(CHRONUSAV) == "chronusav"
    assert A.detect_format(YOUCOOK2) == "youcook2"
    with pytest.raises(A.AnnotationFormatError, match="cannot detect"):
        A.read_annotations(write(tmp_path, "odd.json", {"a": 1}), "auto")
    with pytest.raises(A.AnnotationFormatError, match="not found"):
        A.read_annotations(str(tmp_path / "missing.json"), "longvale")
    with pytest.raises(A.AnnotationFormatError, match="neither JSON"):
        A.read_annotations(write(tmp_path, "broken.json", '{"a": '), "longvale")
    with pytest.raises(A.AnnotationFormatError, match="unknown annotation format"):
        A.read_annotations(write(tmp_path, "lv.json", LONGVALE), "msrvtt")
    with pytest.raises(A.AnnotationFormatError, match="expected an object"):
        A.read_annotations(write(tmp_path, "lv.json", [1, 2]), "longvale")
    assert A.guess_split("data/longvale_train.json") == "train" and A.guess_split("anet_val_2.json") == "val"
    assert A.guess_split("s3://x/y/testing.json") == "test" and A.guess_split("captions.json") == ""


def test_fsspec_uri(tmp_path):
    fs = fsspec.filesystem("memory")
    with fs.open("/ann/chronusav_train.json", "w") as f:
        json.dump(CHRONUSAV, f)
    anns, errors = A.read_annotations("memory://ann/chronusav_train.json", "auto")
    assert errors == [] and [a.video_id for a in anns] == ["c1", "7"] and anns[0].split == "train"
    local, _ = A.read_annotations("file://" + write(tmp_path, "chronusav_train.json", CHRONUSAV), "auto")
    assert [a.events for a in local] == [a.events for a in anns]


@pytest.mark.integration
def test_s3_uri(s3_server):
    from pipeline import storage

    storage.write_bytes("s3://test/ann/longvale_val.json", json.dumps(LONGVALE).encode())
    anns, errors = A.read_annotations("s3://test/ann/longvale_val.json", "longvale")
    assert errors == [] and [a.video_id for a in anns] == ["vid_b", "vid_a"] and anns[0].split == "val"
    with pytest.raises(A.AnnotationFormatError, match="not found"):
        A.read_annotations("s3://test/ann/none.json", "longvale")


def test_synthetic_corpus_formats_read_back_identically(tmp_path):
    cfg = SyntheticConfig(num_videos=6, seed=2, max_events=6)
    plans = syn.script_corpus(cfg)
    longvale, chronusav = syn.write_annotations(plans, tmp_path)
    for split in ("train", "test"):
        lv, e1 = A.read_annotations(longvale[split], "auto")
        ch, e2 = A.read_annotations(chronusav[split], "auto")
        assert e1 == e2 == [] and {a.split for a in lv + ch} == {split}
        assert [(a.video_id, a.duration, [(e.start, e.end, e.caption) for e in a.events]) for a in lv] == \
               [(a.video_id, a.duration, [(e.start, e.end, e.caption) for e in a.events]) for a in ch]
        for ann in ch:
            plan = next(p for p in plans if p.video_id == ann.video_id)
            for ev, spec in zip(ann.events, plan.events):
                assert ev.start == spec.start_frame / cfg.fps and ev.end == spec.end_frame / cfg.fps
                assert syn.parse_caption(ev.caption) == {"colour": spec.colour, "shape": spec.shape,
                                                         "motion": spec.motion, "sound": spec.sound}
