"""infer/loading.py resolve_model: the id and features load_model gives, without loading a weight (what the
captioning driver reads to resume; the caption actors load the model, once each)."""

from __future__ import annotations

import dataclasses

import pytest

from bench.release_models import CHECKPOINT
from infer.loading import RANDOM_MODEL, load_model, resolve_model
from pipeline.config import Config


def _cfg() -> Config:
    cfg = Config()
    return dataclasses.replace(cfg, infer=dataclasses.replace(cfg.infer, device="cpu"),
                               features=dataclasses.replace(cfg.features, device="cpu"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A saved PadCaptioner whose run config has other features than the serving default."""
    cfg = _cfg()
    trained = dataclasses.replace(cfg, features=dataclasses.replace(cfg.features, n_mels=16))
    model, _, _ = load_model(trained, RANDOM_MODEL)
    path = tmp_path_factory.mktemp("saved") / "model"
    model.save_pretrained(path)
    (path / "config.json").write_text(trained.to_json())
    return str(path)


@pytest.mark.parametrize("kind", ["tiny", "saved", "release"])
def test_resolve_model_gives_load_models_id_and_features_without_loading(kind, saved, monkeypatch):
    from pipeline.model import PadCaptioner
    from pipeline.release.model import ReleaseCaptioner

    model_dir = {"tiny": RANDOM_MODEL, "saved": saved, "release": str(CHECKPOINT)}[kind]
    cfg = _cfg()
    _, card, loaded = load_model(cfg, model_dir)

    def refuse(*a, **kw):
        raise AssertionError("weights loaded")

    monkeypatch.setattr(PadCaptioner, "__init__", refuse)
    monkeypatch.setattr(PadCaptioner, "from_pretrained", refuse)
    monkeypatch.setattr(ReleaseCaptioner, "from_release", refuse)
    model_id, resolved = resolve_model(cfg, model_dir)
    assert (model_id, resolved) == (card.model_id, loaded)
    assert resolved.features.n_mels == (16 if kind == "saved" else cfg.features.n_mels)
    assert resolved.features.release_features == ("online" if kind == "release" else cfg.features.release_features)


def test_a_trained_models_features_but_this_runs_device(saved):
    """What the features are comes from the saved run config; where the encoders run is this run's
    features.device (an override is not replaced by the training run's)."""
    cfg = _cfg()
    for device in ("cuda", "auto"):
        _, resolved = resolve_model(dataclasses.replace(cfg, features=dataclasses.replace(cfg.features, device=device)), saved)
        assert resolved.features.device == device and resolved.features.n_mels == 16


def _plain_fingerprint(model_dir, length=8) -> str:
    """Every file's name and bytes, hashed (what the id has always been)."""
    import hashlib

    h = hashlib.sha256()
    for f in sorted(p for p in model_dir.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(model_dir)).encode() + b"\0")
        h.update(f.read_bytes())
    return h.hexdigest()[:length]


def test_weights_fingerprint_is_cached_per_machine_and_changes_with_the_files(tmp_path, monkeypatch):
    """The id is the content hash of the directory; asked again (another actor, another replica) it comes
    from the cache without reading the weights; a rewritten file gives a new id; with no writable cache
    it is still right."""
    from pathlib import Path

    from infer.loading import weights_fingerprint

    monkeypatch.setenv("PADCAP_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / "model"
    (model / "sub").mkdir(parents=True)
    (model / "weights.bin").write_bytes(bytes(range(256)) * 4096)
    (model / "sub" / "config.json").write_text('{"a": 1}')
    first = weights_fingerprint(model)
    assert first == _plain_fingerprint(model)
    assert len(list((tmp_path / "cache" / "fingerprints").iterdir())) == 1

    real_open = Path.open

    def no_reads(self, *a, **kw):
        if self.is_relative_to(model):
            raise AssertionError(f"{self} read again")
        return real_open(self, *a, **kw)

    with monkeypatch.context() as m:
        m.setattr(Path, "open", no_reads)
        assert weights_fingerprint(model) == first

    (model / "weights.bin").write_bytes(bytes(range(256)) * 4095 + b"x")  # retrained: other bytes
    second = weights_fingerprint(model)
    assert second != first and second == _plain_fingerprint(model)

    ro = tmp_path / "ro"
    ro.write_text("a file where the cache directory would be")
    monkeypatch.setenv("PADCAP_CACHE_DIR", str(ro))
    assert weights_fingerprint(model) == second


@pytest.mark.parametrize("model_dir", ["", "   "])
def test_no_model_is_an_error_not_a_random_model(model_dir):
    from pipeline.config import ConfigError

    with pytest.raises(ConfigError, match="no model given.*--random-model"):
        resolve_model(_cfg(), model_dir)
    with pytest.raises(ConfigError, match="no model given"):
        load_model(_cfg(), model_dir)


def test_a_missing_model_dir_is_named(tmp_path):
    from pipeline.config import ConfigError

    with pytest.raises(ConfigError, match="no such directory"):
        resolve_model(_cfg(), str(tmp_path / "nope"))


def test_the_random_model_says_so_in_its_id():
    model_id, _ = resolve_model(_cfg(), RANDOM_MODEL)
    assert "random" in model_id
