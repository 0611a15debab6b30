"""The preprocess Ray Data job end to end: synthetic corpus -> shards + manifest (local and S3),
bad inputs as explained error rows, and resume after a run killed midway."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds

from bench.mp4 import solid_frames, tone, write_mp4
from pipeline import storage
from pipeline.config import load_config, section_hash
from pipeline.schema import FIELDS, decode
from preprocess import manifest as mf
from preprocess.job import FeaturizeVideos, chunk_size, run_preprocess
from preprocess.synthetic import generate_corpus

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]


def small_cfg(*extra):
    return load_config(ROOT / "cluster/configs/default.yaml", [
        "data.synthetic.num_videos=5", "data.synthetic.min_duration=8", "data.synthetic.max_duration=12",
        "data.synthetic.max_events=3", "features.min_frames=16", "features.max_frames=32",
        "cluster.preprocess_actors=1", *extra])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    cfg = small_cfg()
    root = tmp_path_factory.mktemp("corpus")
    info = generate_corpus(str(root / "synth"), cfg.data.synthetic, progress=False)
    return cfg, info


def read_samples(rows):
    """Every sample of the manifest's ok shards: local shards through the webdataset library,
    S3 shards through fsspec + tarfile."""
    samples = {}
    for shard in mf.ok_shards(rows):
        records = mf.iter_shard(shard) if storage.is_remote(shard) else wds.WebDataset([shard], shardshuffle=False)
        for fields in records:
            s = decode(fields)
            assert s.video_id not in samples, "duplicate sample"
            samples[s.video_id] = s
    return samples


def check_against_annotations(rows, info, cfg):
    ok = [r for r in rows if r["status"] == "ok"]
    samples = read_samples(rows)
    assert set(samples) == {r["video_id"] for r in ok}
    for split, path in info.longvale.items():
        ann = json.loads(Path(path).read_text())
        for vid, a in ann.items():
            s = samples[vid]
            assert s.split == split and s.feature_hash == section_hash(cfg.features)
            got = [(round(e.start, 3), round(e.end, 3), e.caption) for e in s.events]
            want = [(round(t[0], 3), round(t[1], 3), c) for t, c in zip(a["timestamps"], a["sentences"])]
            assert got == want
            row = next(r for r in ok if r["video_id"] == vid)
            assert row["num_segments"] == s.num_segments and row["num_events"] == len(s.events)
    return samples


def test_featurize_actor_writes_its_chunk_and_returns_rows_only(corpus, tmp_path):
    cfg, info = corpus
    vid, path = sorted(info.videos.items())[0]
    ann = json.loads(Path(info.longvale["train"]).read_text()).get(vid) or \
        json.loads(Path(info.longvale["test"]).read_text())[vid]
    events = [{"start": t[0], "end": t[1], "caption": c} for t, c in zip(ann["timestamps"], ann["sentences"])]
    video = {"video_id": vid, "uri": path, "duration": ann["duration"], "events": json.dumps(events),
             "split": "train", "source": "longvale", "clipped_events": 0, "annotation_hash": "h1"}
    missing = {**video, "video_id": "nope", "uri": path + ".missing", "annotation_hash": "h2"}
    out_dir = str(tmp_path / "out")
    actor = FeaturizeVideos(cfg.to_json(), out_dir)
    out = actor({"chunk": np.array(["c0"]), "videos": np.array([json.dumps([video, missing])])})
    assert set(out) == set(mf.COLUMNS)  # manifest rows only: no sample bytes
    assert out["status"] == ["ok", "error"] and out["annotation_hash"] == ["h1", "h2"] and out["chunk"] == ["c0", "c0"]
    assert "MediaError" in out["error"][1] and out["shard"][1] is None
    shard = out["shard"][0]
    assert shard == str(tmp_path / "out" / "shards" / "c0" / "train" / "00000.tar")
    (record,) = list(mf.iter_shard(shard))
    assert record["__key__"] == out["key"][0] and decode(record).video_id == vid


def test_chunk_shards_roll_over_at_the_target_size(tmp_path):
    def rec(key, n):
        return {"__key__": key, **{f: bytes([i]) * n for i, f in enumerate(FIELDS)}}

    records = [("train", rec("a", 10)), ("test", rec("b", 10)), ("train", rec("c", 10)), ("train", rec("d", 100))]
    where = mf.write_chunk_shards(str(tmp_path), "c7", records, target_bytes=90)
    base = tmp_path / "shards" / "c7"
    assert where == {"a": str(base / "train" / "00000.tar"), "c": str(base / "train" / "00000.tar"),
                     "d": str(base / "train" / "00001.tar"), "b": str(base / "test" / "00000.tar")}
    got = {k: r for p in sorted(set(where.values())) for r in mf.iter_shard(p) for k in [r["__key__"]]}
    assert got == {r["__key__"]: r for _, r in records}
    assert [r["__key__"] for r in mf.iter_shard(where["a"])] == ["a", "c"]  # in record order


def test_chunk_size_spreads_a_short_job_and_caps_a_long_one():
    assert chunk_size(144, 2) == 18 and chunk_size(5, 2) == 1 and chunk_size(10**6, 8) == 64 and chunk_size(0, 2) == 1


def test_local_corpus_to_shards_and_manifest(ray_local, corpus, tmp_path):
    cfg, info = corpus
    anns = {s: (p, "longvale") for s, p in info.longvale.items()}
    summary = run_preprocess(cfg, anns, info.video_dir, str(tmp_path / "out"), chunk_videos=3)
    assert summary["ok"] == 5 and summary["failed"] == 0
    rows = mf.read_table(mf.manifest_path(str(tmp_path / "out")))
    assert len(rows) == 5 and all(r["status"] == "ok" for r in rows)
    check_against_annotations(rows, info, cfg)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["features"] == json.loads(cfg.to_json())["features"]

    # Re-running with the same config does nothing new and never duplicates a sample.
    again = run_preprocess(cfg, anns, info.video_dir, str(tmp_path / "out"), chunk_videos=3)
    assert again["ok"] == 5
    rows2 = mf.read_table(mf.manifest_path(str(tmp_path / "out")))
    assert [(r["video_id"], r["shard"]) for r in rows2] == [(r["video_id"], r["shard"]) for r in rows]
    check_against_annotations(rows2, info, cfg)


def test_killed_run_resumes_to_the_same_samples(ray_local, corpus, tmp_path):
    cfg, info = corpus
    anns = {s: (p, "longvale") for s, p in info.longvale.items()}
    out = str(tmp_path / "out")
    first = run_preprocess(cfg, anns, info.video_dir, out, chunk_videos=2, max_chunks=1)  # "killed" after 1 chunk
    assert first["ok"] == 2
    # Debris of a chunk that died before committing: shards without a manifest part.
    debris = Path(out) / "shards" / "zz-dead-chunk" / "train"
    debris.mkdir(parents=True)
    shutil.copy(next((Path(out) / "shards").glob("*/*/*.tar")), debris / "partial.tar")
    final = run_preprocess(cfg, anns, info.video_dir, out, chunk_videos=2)
    assert final["ok"] == 5 and not (Path(out) / "shards" / "zz-dead-chunk").exists()
    rows = mf.read_table(mf.manifest_path(out))
    samples = check_against_annotations(rows, info, cfg)
    assert len(samples) == 5


def test_bad_inputs_become_explained_error_rows(ray_local, corpus, tmp_path):
    cfg, info = corpus
    vids = tmp_path / "videos"
    vids.mkdir()
    good_id, good_path = sorted(info.videos.items())[0]
    shutil.copy(good_path, vids / f"{good_id}.mp4")
    (vids / "zero.mp4").write_bytes(b"")
    data = Path(good_path).read_bytes()
    (vids / "truncated.mp4").write_bytes(data[: len(data) // 3])
    (vids / "text.mp4").write_text("this is not a video\n" * 100)
    write_mp4(vids / "silent.mp4", solid_frames(32, 32, 32, [(255, 0, 0)]), fps=8, audio=None)
    write_mp4(vids / "tiny.mp4", solid_frames(32, 16, 16, [(0, 255, 0)]), fps=8, audio=tone(440, 4.0))
    write_mp4(vids / "large.mp4", solid_frames(4, 1080, 1920, [(0, 0, 255)]), fps=2, audio=tone(440, 2.0))
    write_mp4(vids / "vidéo avec espaces ü.mp4", solid_frames(32, 32, 32, [(9, 9, 9)]), fps=8, audio=tone(880, 4.0))
    write_mp4(vids / "beyond.mp4", solid_frames(32, 32, 32, [(9, 9, 9)]), fps=8, audio=tone(880, 4.0))
    ev = {"timestamps": [[0.5, 2.0]], "sentences": ["something"]}
    good_ann = json.loads(Path(info.longvale["train"]).read_text()).get(good_id) or \
        json.loads(Path(info.longvale["test"]).read_text())[good_id]
    ann = {
        good_id: good_ann,
        "zero": {"duration": 4.0, **ev}, "truncated": {"duration": good_ann["duration"], **ev},
        "text": {"duration": 4.0, **ev}, "missing": {"duration": 4.0, **ev},
        "silent": {"duration": 4.0, **ev}, "tiny": {"duration": 4.0, **ev}, "large": {"duration": 2.0, **ev},
        "vidéo avec espaces ü": {"duration": 4.0, **ev},
        "beyond": {"duration": 30.0, "timestamps": [[20.0, 28.0]], "sentences": ["late"]},
        "reversed": {"duration": 4.0, "timestamps": [[3.0, 1.0]], "sentences": ["x"]},
    }
    ann_path = tmp_path / "ann.json"
    ann_path.write_text(json.dumps(ann, ensure_ascii=False))
    # A duplicate id in a second annotation file (another split).
    dup_path = tmp_path / "dup.json"
    dup_path.write_text(json.dumps({"tiny": {"duration": 4.0, **ev}}))
    summary = run_preprocess(cfg, {"train": (str(ann_path), "longvale"), "val": (str(dup_path), "longvale")},
                             str(vids), str(tmp_path / "out"), chunk_videos=4)
    rows = {r["video_id"]: r for r in mf.read_table(mf.manifest_path(str(tmp_path / "out")))}
    ok = {v for v, r in rows.items() if r["status"] == "ok"}
    assert ok == {good_id, "silent", "tiny", "large", "vidéo avec espaces ü"}, {v: r["error"] for v, r in rows.items()}
    for vid in ("zero", "truncated", "text", "missing", "beyond", "reversed"):
        assert rows[vid]["status"] == "error" and rows[vid]["error"], vid
    assert "no video file" in rows["missing"]["error"]
    assert "beyond the video" in rows["beyond"]["error"]
    assert "annotation" in rows["reversed"]["error"]
    assert summary["failed"] == 6 and summary["ok"] == 5
    samples = read_samples(list(rows.values()))
    assert samples["silent"].has_audio is False and not np.any(samples["silent"].audio)
    assert samples["tiny"].has_audio is True


def test_s3_in_and_out(ray_local, corpus, s3_server, tmp_path):
    cfg, info = corpus
    storage.upload_dir(info.video_dir, "s3://test/videos")
    anns = {}
    for split, path in info.longvale.items():
        storage.write_bytes(f"s3://test/ann/{split}.json", Path(path).read_bytes())
        anns[split] = (f"s3://test/ann/{split}.json", "longvale")
    summary = run_preprocess(cfg, anns, "s3://test/videos", "s3://test/shards", chunk_videos=5)
    assert summary["ok"] == 5 and summary["failed"] == 0
    rows = mf.read_table("s3://test/shards/manifest.parquet")
    assert all(r["shard"].startswith("s3://test/shards/shards/") for r in rows)
    check_against_annotations(rows, info, cfg)


def test_edited_annotations_redo_the_video_and_readers_take_only_the_new_sample(ray_local, corpus, tmp_path, capsys):
    from train.data import read_samples as read_current
    from train.trainer import read_train_dataset

    cfg, info = corpus
    anns = {s: json.loads(Path(p).read_text()) for s, p in info.longvale.items()}
    files = {s: tmp_path / f"{s}.json" for s in anns}
    for s, a in anns.items():
        files[s].write_text(json.dumps(a))
    spec = {s: (str(f), "longvale") for s, f in files.items()}
    out = str(tmp_path / "out")
    run_preprocess(cfg, spec, info.video_dir, out, chunk_videos=5)
    first = {r["video_id"]: r for r in mf.read_table(mf.manifest_path(out))}

    # Edit one caption; move another video from train to test (same file, new split).
    edited, moved = sorted(anns["train"])[:2]
    anns["train"][edited]["sentences"][0] = "An edited caption."
    anns["test"][moved] = anns["train"].pop(moved)
    for s, a in anns.items():
        files[s].write_text(json.dumps(a))
    capsys.readouterr()
    summary = run_preprocess(cfg, spec, info.video_dir, out, chunk_videos=5)
    assert "2 videos to process, 3 already done" in capsys.readouterr().out
    assert summary["ok"] == 5 and summary["splits"] == {"test": len(anns["test"]), "train": len(anns["train"])}
    rows = mf.read_table(mf.manifest_path(out))
    by_id = {r["video_id"]: r for r in rows}
    assert {v for v in by_id if by_id[v]["chunk"] != first[v]["chunk"]} == {edited, moved}
    assert by_id[moved]["split"] == "test" and by_id[edited]["annotation_hash"] != first[edited]["annotation_hash"]

    # The old samples are still in the first chunk's tars; readers take the current key only.
    assert len([s for s in read_current(mf.ok_shards(rows))]) == 7  # whole tars: 2 stale samples
    current = read_current(mf.current_keys(rows))
    assert sorted(s.video_id for s in current) == sorted(by_id)
    got = {s.video_id: s for s in current}
    assert got[edited].events[0].caption == "An edited caption." and got[moved].split == "test"
    ds = read_train_dataset(mf.current_keys(rows, "train"))
    train_keys = [r["__key__"] for r in ds.take_all()]
    assert train_keys == sorted(by_id[v]["key"] for v in anns["train"])  # once each, sorted, `moved` gone


def test_videos_removed_from_the_annotations_leave_the_manifest_and_every_reader(ray_local, corpus, tmp_path, capsys):
    """A re-run after deleting a train and a test video from the annotations drops their rows
    (and says how many); training, held-out/evaluation and captioning readers no longer see
    them. Put back, they return without being featurized again (their samples are still there)."""
    from pipeline.run import RunPaths, _test_samples, _test_videos
    from train.data import read_samples as read_current
    from train.trainer import read_train_dataset

    cfg, info = corpus
    anns = {s: json.loads(Path(p).read_text()) for s, p in info.longvale.items()}
    files = {s: tmp_path / f"{s}.json" for s in anns}
    spec = {s: (str(f), "longvale") for s, f in files.items()}

    def write(a):
        for s in a:
            files[s].write_text(json.dumps(a[s]))

    paths = RunPaths(str(tmp_path / "run"))
    out = paths.shards  # where pipeline/run.py's readers look
    write(anns)
    run_preprocess(cfg, spec, info.video_dir, out, chunk_videos=5)
    gone_train, gone_test = sorted(anns["train"])[0], sorted(anns["test"])[0]
    assert gone_test in {v["video_id"] for v in _test_videos(paths)}
    write({s: {v: a for v, a in anns[s].items() if v not in (gone_train, gone_test)} for s in anns})
    capsys.readouterr()
    summary = run_preprocess(cfg, spec, info.video_dir, out, chunk_videos=5)
    log = capsys.readouterr().out
    assert summary["dropped"] == 2 and "dropped 2 videos no longer in the annotations" in log, log
    assert gone_train in log and gone_test in log and "0 videos to process, 3 already done" in log
    rows = mf.read_table(mf.manifest_path(out))
    kept = {r["video_id"] for r in rows}
    assert kept == (set(anns["train"]) | set(anns["test"])) - {gone_train, gone_test} and summary["ok"] == 3
    for split in ("train", "test"):  # what training's validation, held-out evaluation and the caption stage read
        assert {s.video_id for s in read_current(mf.current_keys(rows, split))} == {v for v in kept if v in anns[split]}
    ds = read_train_dataset(mf.current_keys(rows, "train"))
    train_keys = {r["__key__"] for r in ds.take_all()}
    assert train_keys == {r["key"] for r in rows if r["split"] == "train"} and len(train_keys) == len(anns["train"]) - 1
    assert gone_test not in {v["video_id"] for v in _test_videos(paths)}
    assert gone_test not in {s.video_id for s in _test_samples(paths, limit=10)}

    write(anns)  # put back: nothing to featurize, the rows return
    capsys.readouterr()
    again = run_preprocess(cfg, spec, info.video_dir, out, chunk_videos=5)
    assert again["dropped"] == 0 and again["ok"] == 5 and "0 videos to process, 5 already done" in capsys.readouterr().out
