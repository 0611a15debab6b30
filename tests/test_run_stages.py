"""Stage hashes (pipeline/run.py) and the Ray Train run name: config sections, upstream, code versions."""

from __future__ import annotations

from pipeline.config import Config, apply_overrides
from pipeline.run import _available_stages, stage_hash
from preprocess.encoders import PixelsEncoder, encoder_versions

STAGES = {s.name: s for s in _available_stages()}


def test_encoder_versions_name_the_configured_encoders():
    cfg = Config()
    assert encoder_versions(cfg.features) == {"visual": f"pixels@{PixelsEncoder.version}", "audio": "mel@1"}


def test_preprocess_hash_follows_config_upstream_and_encoder_version(monkeypatch):
    cfg = Config()
    pre = STAGES["preprocess"]
    base = stage_hash(cfg, pre, "up")
    assert stage_hash(cfg, pre, "up") == base
    assert stage_hash(cfg, pre, "other") != base
    assert stage_hash(apply_overrides(Config(), ["features.min_frames=8"]), pre, "up") != base
    assert stage_hash(apply_overrides(Config(), ["train.max_steps=8"]), pre, "up") == base  # not its section
    # shards from an older pixels encoder are redone, not reused
    monkeypatch.setattr(PixelsEncoder, "version", PixelsEncoder.version + 1)
    assert stage_hash(cfg, pre, "up") != base


def test_synth_hash_follows_the_generator_version(monkeypatch):
    import preprocess.synthetic as synthetic

    cfg = Config()
    base = stage_hash(cfg, STAGES["synth"], "")
    monkeypatch.setattr(synthetic, "GENERATOR_VERSION", synthetic.GENERATOR_VERSION + 1)
    assert stage_hash(cfg, STAGES["synth"], "") != base


def test_train_run_name_follows_config_and_encoder_version(monkeypatch):
    from train.trainer import train_run_name

    base = train_run_name(Config())
    assert train_run_name(Config()) == base
    assert train_run_name(apply_overrides(Config(), ["train.lr=0.1"])) != base
    assert train_run_name(apply_overrides(Config(), ["infer.max_events=3"])) == base  # decoding only
    monkeypatch.setattr(PixelsEncoder, "version", PixelsEncoder.version + 1)
    assert train_run_name(Config()) != base  # no resuming from checkpoints trained on older features


# --------------------------------------------------------------------------- the driver's stamps


def _stub_stages(monkeypatch, calls: list[str], fail: set[str] | None = None):
    """Replace the real stages by stubs that record their runs (and fail when asked)."""
    import pipeline.run as run_mod

    def make(name):
        def fn(cfg, paths):
            calls.append(name)
            if fail and name in fail:
                raise RuntimeError(f"{name} failed")
            return {"ran": name}
        return fn

    stubs = [run_mod.Stage(s.name, s.sections, make(s.name)) for s in _available_stages()]
    monkeypatch.setattr(run_mod, "_available_stages", lambda: stubs)


def test_unchanged_rerun_skips_every_stage(monkeypatch, tmp_path):
    from pipeline.run import run

    calls: list[str] = []
    _stub_stages(monkeypatch, calls)
    cfg = apply_overrides(Config(), [f"run_dir={tmp_path}"])
    run(cfg)
    assert calls == ["synth", "preprocess", "train", "caption", "evaluate"]
    calls.clear()
    assert all(r["cached"] for r in run(cfg).values()) and calls == []


def test_forced_stage_redoes_the_stages_that_read_its_outputs(monkeypatch, tmp_path):
    """`--stages preprocess --force` makes new shards: the model, captions and scores made
    from the old ones are stale, so the next plain run redoes them (not synth)."""
    from pipeline.run import run

    calls: list[str] = []
    _stub_stages(monkeypatch, calls)
    cfg = apply_overrides(Config(), [f"run_dir={tmp_path}"])
    run(cfg)
    calls.clear()
    run(cfg, ["preprocess"], force=True)
    assert calls == ["preprocess"]
    calls.clear()
    results = run(cfg)
    assert calls == ["train", "caption", "evaluate"]
    assert results["synth"]["cached"] and results["preprocess"]["cached"]


def test_a_failed_stage_does_not_leave_an_earlier_configs_stamp(monkeypatch, tmp_path):
    """Config A completes; config B's preprocess starts over A's outputs and fails; back on
    config A the stage must be redone, not skipped on A's stamp over B's half-written outputs."""
    import pytest

    from pipeline.run import run

    calls: list[str] = []
    cfg_a = apply_overrides(Config(), [f"run_dir={tmp_path}"])
    cfg_b = apply_overrides(cfg_a, ["features.min_frames=8"])
    _stub_stages(monkeypatch, calls)
    run(cfg_a, ["synth", "preprocess"])
    _stub_stages(monkeypatch, calls, fail={"preprocess"})
    with pytest.raises(RuntimeError, match="preprocess failed"):
        run(cfg_b, ["synth", "preprocess"])
    _stub_stages(monkeypatch, calls)
    calls.clear()
    results = run(cfg_a, ["synth", "preprocess"])
    assert calls == ["preprocess"] and not results["preprocess"]["cached"]


def _manifest(shards_dir, rows):
    from preprocess import manifest as mf

    mf.write_table(mf.manifest_path(str(shards_dir)), [mf.empty_row(**r) for r in rows])


def test_train_run_name_follows_the_training_shards(tmp_path):
    """Shards made again (preprocess forced, annotations changed) are other data: the run must
    not resume a checkpoint trained on the old ones."""
    from preprocess import manifest as mf
    from train.trainer import train_run_name, training_data_id

    cfg = Config()
    data_id = lambda shards_dir: training_data_id(cfg, mf.read_table(mf.manifest_path(str(shards_dir))))  # noqa: E731
    row = {"video_id": "v1", "split": "train", "status": "ok", "shard": "/s/a/train/000.tar", "key": "v1"}
    a, b = tmp_path / "a", tmp_path / "b"
    _manifest(a, [row, {**row, "video_id": "v2", "split": "test", "key": "v2"}])
    _manifest(b, [{**row, "shard": "/s/b/train/000.tar"}, {**row, "video_id": "v2", "split": "test", "key": "v2"}])
    id_a = data_id(a)
    assert id_a == data_id(a)
    assert id_a != data_id(b)
    assert train_run_name(cfg, id_a) != train_run_name(cfg, data_id(b))
    # rows of splits training does not read do not matter
    _manifest(b, [row, {**row, "video_id": "v2", "split": "test", "key": "v2"},
                  {**row, "video_id": "v3", "split": "extra", "key": "v3"}])
    assert data_id(b) == id_a


def test_a_finished_run_is_not_resumed_but_an_interrupted_one_is(tmp_path):
    """Training again with the same config and data (`--force`) must train, not resume the
    finished run's last checkpoint at max_steps; a run cut short resumes."""
    from train.trainer import FINISHED_FILE, clear_finished_run, mark_finished

    ray_dir = str(tmp_path / "ray")
    run = tmp_path / "ray" / "padcap-x"
    (run / "checkpoint_0000002").mkdir(parents=True)
    assert clear_finished_run(ray_dir, "padcap-x") is False  # interrupted: kept, Ray Train resumes it
    assert (run / "checkpoint_0000002").exists()
    mark_finished(ray_dir, "padcap-x", {"steps": 4})
    assert (run / FINISHED_FILE).exists()
    assert clear_finished_run(ray_dir, "padcap-x") is True
    assert not run.exists()
    assert clear_finished_run(ray_dir, "padcap-never") is False


def test_eval_missing_zero_outside_densevid_is_an_error_before_any_stage(monkeypatch, tmp_path):
    """eval.missing=zero only exists in densevid; with the paper's protocol it was dropped
    without a word (after hours of training). Now the run stops first, naming both keys."""
    import pytest

    from pipeline.config import ConfigError
    from pipeline.run import run

    calls: list[str] = []
    _stub_stages(monkeypatch, calls)
    cfg = apply_overrides(Config(), [f"run_dir={tmp_path}", "eval.missing=zero"])
    with pytest.raises(ConfigError, match="eval.missing.*eval.protocol"):
        run(cfg)
    assert calls == []
    run(cfg, ["synth"])  # a run without the evaluate stage does not care
    run(apply_overrides(cfg, ["eval.protocol=densevid"]), ["synth"])


def test_evaluate_passes_eval_missing_to_densevid():
    from pipeline.evaluate import missing_policy

    assert missing_policy(apply_overrides(Config(), ["eval.protocol=densevid", "eval.missing=zero"])) == "zero"
    assert missing_policy(apply_overrides(Config(), ["eval.protocol=densevid"])) == "skip"
    assert missing_policy(Config()) is None


def test_no_test_split_stops_the_run_before_preprocess_and_train(monkeypatch, tmp_path):
    """caption and evaluate read the `test` split of data.annotations; without one they found it
    only after preprocess and train, and renaming the split then redoes both."""
    import pytest

    from pipeline.run import run

    calls: list[str] = []
    _stub_stages(monkeypatch, calls)
    cfg = apply_overrides(Config(), [f"run_dir={tmp_path}", "data.dataset=activitynet", "data.video_root=/v",
                                     "data.annotations={train: t.json, val: v.json}", "train.val_split=val"])
    with pytest.raises(SystemExit, match="test"):
        run(cfg)
    assert calls == []
    run(cfg, ["synth", "preprocess", "train"])  # no caption / evaluate: no test split needed
    assert calls == ["synth", "preprocess", "train"]


def test_caption_stage_fails_the_run_only_when_captioning_judged_the_job_failed(monkeypatch, tmp_path):
    """The caption stage passes infer.offline.job's verdict on: per-video errors within
    infer.max_failed_fraction are rows, more (or a broken engine) stop the run with the reason."""
    import pytest

    from infer.offline import job as batch
    from pipeline import run as run_mod

    monkeypatch.setattr(run_mod, "_test_videos", lambda paths: [])
    failure = "3 of 8 videos failed (37.5%), more than infer.max_failed_fraction=0.05; the reasons are in X"
    monkeypatch.setattr(batch, "run_caption", lambda *a, **kw: {"captioned": 5, "failed": 3, "failure": failure})
    with pytest.raises(SystemExit, match=r"caption: 3 of 8 videos failed .* the reasons are in X"):
        run_mod.stage_caption(Config(), run_mod.RunPaths(str(tmp_path)))
