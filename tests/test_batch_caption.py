"""Offline mass captioning with Ray Data: an archive with good and bad files, resume after a
kill, results that match CaptionEngine called directly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from infer.batch import list_videos, read_results, run_caption
from pipeline.config import load_config
from preprocess.synthetic import generate_corpus
from tests.support.mp4 import solid_frames, tone, write_mp4

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]


def small_cfg(*extra):
    return load_config(ROOT / "cluster/configs/default.yaml", [
        "data.synthetic.num_videos=4", "data.synthetic.min_duration=8", "data.synthetic.max_duration=10",
        "data.synthetic.max_events=3", "features.min_frames=16", "features.max_frames=32",
        "infer.max_events=4", "infer.max_branch_tokens=6", "infer.videos_per_call=2",
        "cluster.preprocess_actors=1", "cluster.caption_actors=1", *extra])


@pytest.fixture(scope="module")
def archive(tmp_path_factory):
    cfg = small_cfg()
    root = tmp_path_factory.mktemp("archive")
    info = generate_corpus(str(root / "synth"), cfg.data.synthetic, progress=False)
    vids = root / "videos"
    vids.mkdir()
    for vid, path in info.videos.items():
        shutil.copy(path, vids / f"{vid}.mp4")
    (vids / "empty.mp4").write_bytes(b"")
    data = Path(next(iter(info.videos.values()))).read_bytes()
    (vids / "corrupt.mp4").write_bytes(data[: len(data) // 4])
    (vids / "notes.mp4").write_text("not a video at all\n" * 50)
    write_mp4(vids / "silent film.mp4", solid_frames(48, 32, 32, [(200, 10, 10), (10, 10, 200)]), fps=8, audio=None)
    return cfg, info, vids


def test_listing_dir_glob_and_manifest(archive, tmp_path):
    cfg, info, vids = archive
    by_dir = list_videos(str(vids), cfg.data.video_extensions)
    assert {v["video_id"] for v in by_dir} == set(info.videos) | {"empty", "corrupt", "notes", "silent film"}
    by_glob = list_videos(str(vids / "*.mp4"), cfg.data.video_extensions)
    assert by_glob == by_dir


def test_archive_with_bad_files_resume_and_equivalence(ray_local, archive, tmp_path):
    cfg, info, vids = archive
    out = str(tmp_path / "captions")
    first = run_caption(cfg, str(vids), "", out, chunk_videos=3, max_chunks=1)  # "killed" after one chunk
    assert first["this_run_ok"] + first["this_run_failed"] == 3
    summary = run_caption(cfg, str(vids), "", out, chunk_videos=3)
    rows = read_results(out)
    ids = [r["video_id"] for r in rows]
    assert len(ids) == len(set(ids)) == len(info.videos) + 4  # each video exactly once
    status = {r["video_id"]: r for r in rows}
    for bad in ("empty", "corrupt", "notes"):
        assert status[bad]["status"] == "error" and status[bad]["error"], bad
    assert status["silent film"]["status"] == "ok"
    assert summary["failed"] == 3 and summary["captioned"] == len(info.videos) + 1
    for r in rows:
        if r["status"] == "ok":
            assert r["events"] and r["model_id"] and r["config_hash"]
            for e in r["events"]:
                assert 0.0 <= e["start"] < e["end"] <= r["duration"] + 1e-6 and isinstance(e["caption"], str)
    jsonl = [json.loads(line) for line in (tmp_path / "captions" / "captions.jsonl").read_text().splitlines()]
    assert [j["video_id"] for j in jsonl] == ids

    # Re-running does nothing new.
    again = run_caption(cfg, str(vids), "", out, chunk_videos=3)
    assert again["this_run_ok"] == 0 and again["captioned"] == summary["captioned"]

    # The same video gives the same events as the engine called directly.
    from infer.engine import CaptionEngine
    from infer.loading import load_model
    from preprocess.featurize import Featurizer
    from infer.batch import _Annotation

    model, _, resolved = load_model(cfg, "")
    vid = sorted(info.videos)[0]
    sample = Featurizer(resolved)(str(vids / f"{vid}.mp4"), _Annotation(video_id=vid))
    direct = CaptionEngine(model, resolved.infer).caption([sample])[0]
    assert [(round(e.start, 4), round(e.end, 4), e.caption) for e in direct.events] == \
        [(round(e["start"], 4), round(e["end"], 4), e["caption"]) for e in status[vid]["events"]]
