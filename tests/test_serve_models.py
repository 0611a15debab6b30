"""Serving a saved model: a checkpoint serves like the model that saved it, its id names its weights, and
a video longer than the model is fitted (or refused with a 422). CaptionService called directly, no Ray."""

from __future__ import annotations

import asyncio

import pytest

from bench.serve_cases import events_of, make_video_tree, serve_test_config, well_formed_body
from bench.serve_engine import direct_caption, synthetic_videos, tiny_engine
from infer.serving.errors import RequestError
from infer.serving.service import CaptionService


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    base = tmp_path_factory.mktemp("serve")
    return make_video_tree(base, synthetic_videos(base / "corpus")[0])


@pytest.fixture(scope="module")
def parts(tree):
    return tiny_engine(serve_test_config(tree))


def run(coro):
    return asyncio.run(coro)


def test_saved_checkpoint_serves_like_the_model_that_saved_it(parts, tree, tmp_path):
    import dataclasses

    from infer.loading import RANDOM_MODEL, load_engine, load_model

    _, _, cfg = parts
    model, _, _ = load_model(cfg, RANDOM_MODEL)
    model.save_pretrained(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "config.json").write_text(cfg.to_json())
    factory, card, cfg2 = load_engine(cfg, str(tmp_path / "ckpt"))
    assert card.model_id.startswith("ckpt-") and card.source == str(tmp_path / "ckpt")
    svc = CaptionService(cfg2, factory, card)
    try:
        body = run(svc.caption_uri(str(tree.good)))
        direct = direct_caption(parts[0], cfg, tree.good, "good")
        assert events_of(body) == events_of(direct)
    finally:
        svc.close()
    other = dataclasses.replace(cfg, features=dataclasses.replace(cfg.features, n_mels=16))
    (tmp_path / "ckpt" / "config.json").unlink()
    with pytest.raises(ValueError, match="features of dims"):
        load_model(other, str(tmp_path / "ckpt"))


def test_model_id_names_the_weights_not_the_directory(parts, tmp_path):
    """A model retrained into the same directory must not inherit the old id (caption resume keys on it)."""
    import torch

    from infer.loading import RANDOM_MODEL, load_model

    _, _, cfg = parts
    model, _, _ = load_model(cfg, RANDOM_MODEL)
    model.save_pretrained(tmp_path / "ckpt")
    first = load_model(cfg, str(tmp_path / "ckpt"))[1].model_id
    assert load_model(cfg, str(tmp_path / "ckpt"))[1].model_id == first  # same bytes, same id
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if "lora_B" in n).add_(1.0)  # saved with the adapter
    model.save_pretrained(tmp_path / "ckpt")
    second = load_model(cfg, str(tmp_path / "ckpt"))[1].model_id
    assert second.startswith("ckpt-") and second != first


def test_a_long_video_is_fitted_and_a_video_that_cannot_fit_is_a_422(parts, tree):
    """Over model.max_segments: shortened as training shortens it, and the response says so.
    A context too small for even one segment after the decode's reserve: 422."""
    import dataclasses

    from infer.loading import RANDOM_MODEL, load_engine

    _, _, cfg = parts
    small = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, max_segments=4))
    factory, card, small = load_engine(small, RANDOM_MODEL)
    svc = CaptionService(small, factory, card)
    try:
        body = run(svc.caption_uri(str(tree.good)))
        assert body["segments_kept"] == 4 < body["segments_total"]
        well_formed_body(body)
    finally:
        svc.close()
    tight = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, max_seq_len=cfg.infer.max_events + 20))
    factory, card, tight = load_engine(tight, RANDOM_MODEL)
    svc = CaptionService(tight, factory, card)
    try:
        with pytest.raises(RequestError) as info:
            run(svc.caption_uri(str(tree.good)))
        assert info.value.status == 422 and info.value.code == "does_not_fit_model"
        assert "no segment fits" in info.value.message
    finally:
        svc.close()
