"""Offline mass captioning with Ray Data: an archive with good and bad files, resume after a
kill, results that match CaptionEngine called directly."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from bench.mp4 import solid_frames, write_mp4
from infer.loading import RANDOM_MODEL
from infer.offline.job import list_videos, run_caption
from infer.offline.results import OncePerVideo, read_results
from pipeline.config import load_config
from preprocess.synthetic import generate_corpus

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]


PRESET = ROOT / "cluster/configs/default.yaml"
SMALL = ["data.synthetic.num_videos=4", "data.synthetic.min_duration=8", "data.synthetic.max_duration=10",
         "data.synthetic.max_events=3", "features.min_frames=16", "features.max_frames=32",
         "infer.max_events=4", "infer.max_branch_tokens=6", "infer.videos_per_call=2",
         "cluster.preprocess_actors=1", "cluster.caption_actors=1"]


def small_cfg(*extra):
    return load_config(PRESET, [*SMALL, *extra])


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


def test_same_file_name_in_several_folders_gets_distinct_ids(tmp_path):
    """camera1/0001.mp4, camera2/0001.mp4, camera3/0001.mp4: three videos, three ids (results are keyed by id)."""
    for cam in ("cam1", "cam2", "cam3"):
        (tmp_path / cam).mkdir()
        (tmp_path / cam / "0001.mp4").write_bytes(b"x")
    (tmp_path / "cam1" / "0001.mkv").write_bytes(b"x")
    listed = list_videos(str(tmp_path), [".mp4", ".mkv"])
    ids = [v["video_id"] for v in listed]
    assert len(listed) == 4 and len(set(ids)) == 4, ids
    assert ids[0] == "0001"  # the first keeps its stem, as before
    assert {v["uri"] for v in listed} == {str(p) for p in tmp_path.rglob("0001.*")}
    assert "cam3/0001.mp4" in ids  # the others are named by their path under the listed folder


def test_videos_path_that_does_not_exist_is_an_error(tmp_path, capsys):
    from infer.offline.job import main

    missing = tmp_path / "archvie"  # a typo must not look like an empty archive captioned without failures
    for spec in (str(missing), str(missing / "*.mp4"), str(tmp_path / "*.mp4")):
        with pytest.raises(FileNotFoundError, match="--videos"):
            list_videos(spec, [".mp4"])
    (tmp_path / "empty").mkdir()
    assert list_videos(str(tmp_path / "empty"), [".mp4"]) == []  # an existing, empty folder is not an error
    assert main(["--videos", str(missing), "--out", str(tmp_path / "out"), "--random-model"]) == 2
    assert "archvie" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_no_model_is_refused_before_any_work(tmp_path, capsys):
    """Without --model (or an explicit --random-model) the job refuses: never a silent random model."""
    from infer.offline.job import main

    (tmp_path / "v").mkdir()
    with pytest.raises(SystemExit) as exit_:
        main(["--videos", str(tmp_path / "v"), "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2 and "--model" in capsys.readouterr().err
    assert main(["--videos", str(tmp_path / "v"), "--out", str(tmp_path / "out"), "--model", ""]) == 2
    assert "no model given" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_cli_starts_ray_as_the_cluster_section_says(tmp_path, monkeypatch):
    """--set cluster.num_cpus=1 must reach the local Ray instance (as pipeline/run.py does), not be dropped."""
    import ray

    from infer.offline import job as batch

    calls, captioned = [], []
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.setattr(batch, "run_caption", lambda cfg, videos, *a, **kw: captioned.append(videos) or {"failed": 0})
    (tmp_path / "v").mkdir()
    (tmp_path / "v" / "a.mp4").write_bytes(b"x")
    assert batch.main(["--videos", str(tmp_path / "v"), "--out", str(tmp_path / "out"), "--set", "cluster.num_cpus=1",
                       "--random-model"]) == 0
    assert len(calls) == 1 and calls[0].get("num_cpus") == 1 and calls[0].get("_node_ip_address") == "127.0.0.1"
    assert [v["video_id"] for v in captioned[0]] == ["a"]


def test_archive_with_bad_files_resume_and_equivalence(ray_local, archive, tmp_path, capsys):
    cfg, info, vids = archive
    out = str(tmp_path / "captions")
    first = run_caption(cfg, str(vids), RANDOM_MODEL, out, chunk_videos=3, max_chunks=1)  # "killed" after one chunk
    assert first["this_run_ok"] + first["this_run_failed"] == 3
    first_chunks = {r["chunk"] for r in read_results(out)}
    summary = run_caption(cfg, str(vids), RANDOM_MODEL, out, chunk_videos=3)
    rows = read_results(out)
    # the written files have exactly the documented columns (docs/guide/output.md lists RESULT_COLUMNS)
    import pyarrow.parquet as pq

    from infer.results import RESULT_COLUMNS, CaptionResult

    assert pq.read_schema(os.path.join(out, "captions.parquet")).names == list(RESULT_COLUMNS)
    results = [CaptionResult.from_row(r) for r in rows]  # every row reads back as the API's result type
    assert {r.status for r in results} == {"ok", "error"} and all(r.error_kind in ("", "input") for r in results)
    # the second run redoes every video without an ok row: which 3 rows came back first (the bad files fail
    # fastest) is up to the scheduler, so the count comes from what the first run committed. They are
    # committed in chunks of 3, by one featurize actor and one caption actor (the model and encoders loaded
    # once per job, not once per chunk)
    later = [r for r in rows if r["chunk"] not in first_chunks]
    assert len(later) == len(info.videos) + 4 - first["this_run_ok"]
    assert len({r["chunk"] for r in later}) == -(-len(later) // 3)
    timed = [r["timings"] for r in later if r["status"] == "ok"]
    assert len({t["caption_pid"] for t in timed}) == len({t["featurize_pid"] for t in timed}) == 1
    ids = [r["video_id"] for r in rows]
    assert len(ids) == len(set(ids)) == len(info.videos) + 4  # each video exactly once
    status = {r["video_id"]: r for r in rows}
    for bad in ("empty", "corrupt", "notes"):
        assert status[bad]["status"] == "error" and status[bad]["error"], bad
    assert status["silent film"]["status"] == "ok"
    assert summary["failed"] == 3 and summary["captioned"] == len(info.videos) + 1
    # 3 of 8 is more than the default infer.max_failed_fraction (0.05): the job failed, saying why and where
    assert "3 of 8 videos failed" in summary["failure"] and "captions.jsonl" in summary["errors_in"]
    assert {status[bad]["error_kind"] for bad in ("empty", "corrupt", "notes")} == {"input"}
    for r in rows:
        if r["status"] == "ok":
            assert r["events"] and r["model_id"] and r["config_hash"]
            for e in r["events"]:
                assert 0.0 <= e["start"] < e["end"] <= r["duration"] + 1e-6 and isinstance(e["caption"], str)
    jsonl = [json.loads(line) for line in (tmp_path / "captions" / "captions.jsonl").read_text().splitlines()]
    assert [j["video_id"] for j in jsonl] == ids

    # Re-running does nothing new.
    again = run_caption(cfg, str(vids), RANDOM_MODEL, out, chunk_videos=3)
    assert again["this_run_ok"] == 0 and again["captioned"] == summary["captioned"]

    # The CLI's exit status: 0 when the recorded per-video errors are within infer.max_failed_fraction
    # (the bad files are retried, fail again, and are judged with the rows already there), else 1.
    from infer.offline.job import main

    args = ["--videos", str(vids), "--out", out, "--config", str(PRESET), "--chunk-videos", "3", "--random-model"]
    for item in SMALL:
        args += ["--set", item]
    assert main([*args, "--set", "infer.max_failed_fraction=0.5"]) == 0
    assert main([*args, "--set", "infer.max_failed_fraction=0.25"]) == 1
    assert "3 of 8 videos failed (37.5%), more than infer.max_failed_fraction=0.25" in capsys.readouterr().err
    assert [r["video_id"] for r in read_results(out)] == ids  # still each video once

    # The same video gives the same events as the engine called directly.
    from infer.engine.core import CaptionEngine
    from infer.loading import load_model
    from preprocess.featurize import Featurizer
    from preprocess.featurize import Unannotated as _Annotation

    model, _, resolved = load_model(cfg, RANDOM_MODEL)
    vid = sorted(info.videos)[0]
    sample = Featurizer(resolved)(str(vids / f"{vid}.mp4"), _Annotation(video_id=vid))
    direct = CaptionEngine(model, resolved.infer).caption([sample])[0]
    assert [(round(e.start, 4), round(e.end, 4), e.caption) for e in direct.events] == \
        [(round(e["start"], 4), round(e["end"], 4), e["caption"]) for e in status[vid]["events"]]


def test_a_cuda_error_restarts_the_caption_actor_and_a_video_that_faults_twice_is_an_error_row(ray_local, archive,
                                                                                                tmp_path):
    """The engine raises a CUDA error whenever one video is fed to it (a real Ray caption actor with the real
    engine; tests/support/caption_faults.py). The actor is not reused: it exits, Ray restarts it and retries its
    calls; the videos that were in the engine are retried alone; the faulty one faults again, alone, in another
    process, and then gets an explained error row instead of a third try. The other videos are captioned."""
    from tests.support.caption_faults import CudaFaultOn

    cfg, info, vids = archive
    good = sorted(info.videos)
    bad = good[1]
    out, markers = tmp_path / "captions", tmp_path / "markers"
    listed = [{"video_id": v, "uri": str(vids / f"{v}.mp4")} for v in good]
    summary = run_caption(cfg, listed, RANDOM_MODEL, str(out), wrap_stage=CudaFaultOn(bad, str(markers)))
    rows = {r["video_id"]: r for r in read_results(str(out))}
    assert set(rows) == set(good)
    assert all(rows[v]["status"] == "ok" and rows[v]["events"] for v in good if v != bad)
    assert rows[bad]["status"] == "error" and rows[bad]["error_kind"] == "engine"
    assert rows[bad]["error"].startswith("the engine's device failed 2 times with this video in it, the last time "
                                         "with it alone (the caption actor was restarted each time): RuntimeError: "
                                         "CUDA error: an illegal memory access was encountered")
    faults = sorted(markers.iterdir())
    assert len(faults) == 2 and len({f.name.split("-")[1] for f in faults}) == 2  # twice, in two processes
    assert summary["failed"] == 1 and "1 of 4 videos failed" in summary["failure"]
    assert not list((out / "faults").glob("*"))  # the run's strike records are removed at its end


def _rows(*kinds: str) -> list[dict]:
    return [{"status": "ok" if k == "ok" else "error", "error_kind": "" if k == "ok" else k} for k in kinds]


def test_judge_fails_a_job_only_past_the_threshold_or_when_the_engine_is_broken(tmp_path):
    from infer.offline.results import judge

    out = str(tmp_path)
    one_bad = _rows(*["ok"] * 39, "input")  # one corrupt upload in 40
    verdict = judge(one_bad, one_bad, 0.05, out)
    assert "failure" not in verdict and verdict["failed"] == 1 and verdict["failed_fraction"] == 0.025
    assert verdict["errors_in"].startswith(str(tmp_path / "captions.jsonl"))
    assert "failure" in judge(one_bad, one_bad, 0.02, out)  # 2.5% > 2%
    assert "errors_in" not in judge(_rows("ok", "ok"), [], 0.0, out)  # nothing failed, nothing to point at

    # the engine raising on one video alone is a per-video error; on every video it got, a broken engine
    one_raised = _rows(*["ok"] * 39, "engine")
    assert "failure" not in judge(one_raised, one_raised, 0.05, out)
    broken = _rows("input", "engine", "engine", "engine")
    assert "engine raised on all 3 videos" in judge(broken, broken, 1.0, out)["failure"]
    refused = _rows("refused", "refused")  # the engine worked: it refused videos that do not fit the model
    assert "failure" not in judge(refused, refused, 1.0, out)
    # rows of an earlier run count in the share, but not towards "broken" (this run's engine captioned)
    assert "failure" not in judge(_rows("engine", "ok", "ok", "ok"), _rows("ok"), 0.25, out)
    with pytest.raises(ValueError, match="max_failed_fraction"):
        judge([], [], 1.5, out)


def once_per_video(result: list[dict], listed: list[str]) -> tuple[list[dict], int]:
    """A chunk's rows through OncePerVideo -> (one row per listed video, in listing order; duplicates dropped)."""
    once = OncePerVideo()
    for r in result:
        once.take(r)
    once.check(listed)
    return [once.kept[v] for v in listed], once.dropped


def test_a_retried_video_is_committed_once_and_a_lost_one_is_an_error():
    row = lambda vid, status, chunk="c": {"video_id": vid, "status": status, "chunk": chunk}  # noqa: E731
    # b came back twice (its task re-run after a lost node): first as an error of the lost try, then ok
    got, dropped = once_per_video([row("b", "error", "lost"), row("a", "ok"), row("b", "ok"), row("a", "ok", "again")],
                                  ["a", "b"])
    assert dropped == 2 and got == [row("a", "ok"), row("b", "ok")]  # listing order; a's first row, b's ok one
    assert once_per_video([row("a", "error")], ["a"]) == ([row("a", "error")], 0)
    with pytest.raises(RuntimeError, match="no row for 1 of 2 videos: \\['b'\\]"):
        once_per_video([row("a", "ok")], ["a", "b"])
