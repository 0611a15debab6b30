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
