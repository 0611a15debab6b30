"""A Serve replica's decode workers decode media only; the replica runs the encoders, once.

infer/serving/media_pool.py workers run preprocess.featurize.MediaReader (frames and audio as arrays,
no encoder weights) and the replica's one Featurizer encodes what they send back
(infer/serving/service.py). Checked on real mp4s with the tiny HF towers (`hf_vision` + `whisper`, what
the GPU presets serve with): the workers hold no torch module, the towers are built once per
replica, and the features and captions equal the Featurizer's own in one process.
"""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from bench.serve_cases import make_video_tree, module_counting_reader, serve_test_config
from bench.serve_engine import direct_caption, synthetic_videos, tiny_engine
from infer.serving.errors import RequestError
from infer.serving.media_pool import DecodePool
from infer.serving.service import CaptionService
from preprocess.featurize import Featurizer, Unannotated
from preprocess.media import DecodedVideo, decode_video
from tests.support.hf_towers import tiny_vision_dirs, tiny_whisper_dir


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    base = tmp_path_factory.mktemp("serve_decode")
    return make_video_tree(base, synthetic_videos(base / "corpus")[0])


@pytest.fixture(scope="module")
def towers_cfg(tree, tmp_path_factory):
    """The serving config with the tiny SigLIP and Whisper towers as the encoders."""
    root = tmp_path_factory.mktemp("towers")
    cfg = serve_test_config(tree, decode_workers=1)
    features = dataclasses.replace(cfg.features, visual_encoder="hf_vision", audio_encoder="whisper",
                                   vision_path=tiny_vision_dirs(root / "vision")["siglip"],
                                   audio_path=tiny_whisper_dir(root / "whisper"), visual_tokens_per_frame=4)
    return dataclasses.replace(cfg, features=features)


def test_decode_workers_send_back_media_and_hold_no_model(tree, towers_cfg):
    pool = DecodePool(1, module_counting_reader, towers_cfg, towers_cfg.serve.max_decoded_bytes)
    try:
        media, parameters = pool.decode(str(tree.good), Unannotated("good"), timeout=60.0)
    finally:
        pool.close()
    assert parameters == 0  # no vision tower, no Whisper in the worker
    assert isinstance(media, DecodedVideo) and media.frames.dtype == np.uint8 and media.audio.dtype == np.float32
    here = decode_video(str(tree.good), towers_cfg.features)
    assert np.array_equal(media.frames, here.frames) and np.array_equal(media.audio, here.audio)
    assert np.array_equal(media.segment_times, here.segment_times) and media.duration == here.duration


def test_the_replica_builds_the_towers_once_and_gives_the_featurizers_features_and_captions(tree, towers_cfg,
                                                                                             monkeypatch):
    from preprocess.hf_encoders import HFVisionEncoder, WhisperAudioEncoder

    built = {"visual": 0, "audio": 0}
    for name, cls in (("visual", HFVisionEncoder), ("audio", WhisperAudioEncoder)):
        def counted(self, cfg, _init=cls.__init__, _name=name):
            built[_name] += 1
            _init(self, cfg)

        monkeypatch.setattr(cls, "__init__", counted)
    factory, card, cfg = tiny_engine(towers_cfg)  # the model is sized from the towers' configs, none built
    assert built == {"visual": 0, "audio": 0}
    svc = CaptionService(cfg, factory, card)
    try:
        served = svc._featurize(str(tree.good), Unannotated("good"))  # decoded in a worker, encoded here
        bodies = [asyncio.run(svc.caption_uri(str(tree.good))) for _ in range(2)]
        assert built == {"visual": 1, "audio": 1}  # one copy per replica, whatever the requests
    finally:
        svc.close()
    alone = Featurizer(cfg)(str(tree.good), Unannotated("good"))  # the old path: all in one process
    assert served.visual.shape == alone.visual.shape and served.visual.shape[-1] == 32
    assert np.array_equal(served.visual, alone.visual) and np.array_equal(served.audio, alone.audio)
    assert np.array_equal(served.segment_times, alone.segment_times) and served.duration == alone.duration
    direct = direct_caption(factory, cfg, tree.good, "good")
    want = [(e.start, e.end, e.caption) for e in direct.events]
    for body in bodies:
        assert [(e["start"], e["end"], e["caption"]) for e in body["events"]] == want


def test_a_decoded_video_over_the_limit_is_a_413_and_the_worker_stays(tree):
    factory, card, cfg = tiny_engine(serve_test_config(tree, decode_workers=1, max_decoded_bytes=10_000))
    svc = CaptionService(cfg, factory, card)
    try:
        with pytest.raises(RequestError) as info:
            asyncio.run(svc.caption_file(str(tree.good), "clip.mp4"))
        assert info.value.status == 413 and "serve.max_decoded_bytes" in info.value.message
        assert svc.decoders.killed == [] and len(svc.decoders.pids()) == 1
    finally:
        svc.close()
