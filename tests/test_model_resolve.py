"""infer/loading.py resolve_model: the id and features load_model gives, without loading a weight (what the
captioning driver reads to resume; the caption actors load the model, once each)."""

from __future__ import annotations

import dataclasses

import pytest

from infer.loading import load_model, resolve_model
from pipeline.config import Config
from tests.support.release import CHECKPOINT


def _cfg() -> Config:
    cfg = Config()
    return dataclasses.replace(cfg, infer=dataclasses.replace(cfg.infer, device="cpu"),
                               features=dataclasses.replace(cfg.features, device="cpu"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A saved PadCaptioner whose run config has other features than the serving default."""
    cfg = _cfg()
    trained = dataclasses.replace(cfg, features=dataclasses.replace(cfg.features, n_mels=16))
    model, _, _ = load_model(trained, "")
    path = tmp_path_factory.mktemp("saved") / "model"
    model.save_pretrained(path)
    (path / "config.json").write_text(trained.to_json())
    return str(path)


@pytest.mark.parametrize("kind", ["tiny", "saved", "release"])
def test_resolve_model_gives_load_models_id_and_features_without_loading(kind, saved, monkeypatch):
    from pipeline.model import PadCaptioner
    from pipeline.release.model import ReleaseCaptioner

    model_dir = {"tiny": "", "saved": saved, "release": str(CHECKPOINT)}[kind]
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
