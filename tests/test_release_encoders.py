"""The `release` encoders (preprocess/release_encoders.py) on the tiny release-format checkpoint and real mp4s.

Stored mode (schema-2 Samples through a real shard round trip) and online mode (a ReleaseVideo the
engine encodes itself) must feed the release model the same tokens; both caption through CaptionEngine,
and online mode through CaptionService, as a Serve replica runs it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.mp4 import solid_frames, tone, write_mp4
from infer.engine.core import CaptionEngine
from infer.engine.sampling import DecodeControl
from infer.serving.service import CaptionService, ModelCard
from pipeline.config import Config
from pipeline.release.decoding import media_tokens
from pipeline.release.video import ReleaseVideo, as_release_video
from pipeline.schema import SchemaError, decode, encode
from preprocess.encoders import encoder_dims, encoder_versions, get_audio_encoder, get_visual_encoder
from preprocess.featurize import Featurizer
from preprocess.release_encoders import ReleaseFeaturizer, release_model

GOLDEN = Path(__file__).parent / "data" / "release_golden"
CHECKPOINT = GOLDEN / "checkpoint"


@dataclasses.dataclass
class Ann:
    video_id: str
    events: list = dataclasses.field(default_factory=list)


def release_config(mode: str = "stored", **features) -> Config:
    cfg = Config()
    f = dataclasses.replace(cfg.features, visual_encoder="release", audio_encoder="release", release_path=str(CHECKPOINT),
                            release_features=mode, device="cpu", **features)
    return dataclasses.replace(cfg, features=f, infer=dataclasses.replace(cfg.infer, device="cpu"))


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    root = tmp_path_factory.mktemp("release_videos")
    colours = [(220, 30, 30), (30, 220, 30), (30, 30, 220), (220, 220, 30)]
    with_audio = write_mp4(root / "av.mp4", solid_frames(40, 64, 96, colours), fps=8, audio=tone(440, 5.0))
    silent = write_mp4(root / "silent.mp4", solid_frames(24, 56, 84, colours[:2]), fps=8)
    return {"av": str(with_audio), "silent": str(silent)}


@pytest.fixture(scope="module")
def model():
    """The whole model, as the engine holds it (featurize actors hold the towers only: `towers`)."""
    from pipeline.release.model import ReleaseCaptioner

    return ReleaseCaptioner.from_release(CHECKPOINT).eval()


@pytest.fixture(scope="module")
def towers():
    return release_model(CHECKPOINT, torch.device("cpu"))


def test_registered_and_built_without_loading_weights():
    cfg = release_config()
    vis, aud = get_visual_encoder(cfg.features), get_audio_encoder(cfg.features)
    assert (vis.name, aud.name, vis.dim, aud.dim) == ("release", "release", 16, 16)  # width from config.json
    assert encoder_versions(cfg.features) == {"visual": "release@1", "audio": "release@1"}
    assert encoder_dims(cfg.features) == (16, 16)  # what a model is sized by, from config.json too


@pytest.mark.parametrize("changes, needle", [({"audio_encoder": "mel"}, "work as a pair"),
                                             ({"release_path": ""}, "release_path must name"),
                                             ({"release_path": "/nonexistent/dir"}, "has no config.json")])
def test_misconfigured_release_encoders_are_refused(changes, needle):
    cfg = release_config()
    cfg = dataclasses.replace(cfg, features=dataclasses.replace(cfg.features, **changes))
    with pytest.raises(ValueError, match=needle):
        ReleaseFeaturizer(cfg)


def test_towers_reproduce_the_fixture(towers):
    model = towers
    assert model.decoder.layers[0].mlp.up_proj.weight.is_meta  # a featurize actor never loads the LLM
    x = torch.load(GOLDEN / "inputs.pt", weights_only=True)
    g = torch.load(GOLDEN / "golden_tensors.pt", weights_only=True)
    assert torch.allclose(model.encode_video(x["pixel_values_videos"], x["video_grid_thw"]), g["visual"], atol=1e-4)
    assert torch.allclose(model.encode_audio(x["audio_feature"]), g["audio"].flatten(0, 1), atol=1e-4)


def test_stored_features_are_schema_2_samples_and_feed_the_model_what_online_mode_does(videos, model):
    stored = Featurizer(release_config("stored"))(videos["av"], Ann("av"))
    # 40 frames at 8 fps: 20 timesteps of 56x84 px -> 4x6 patches -> 6 merged tokens, 60 audio tokens
    assert stored.visual.shape == (20, 6, 16) and stored.audio.shape == (60, 16) and stored.has_audio
    assert stored.grid_thw == (20, 4, 6) and stored.seconds_per_timestep == 0.25 and stored.duration == 5.0
    assert int(stored.audio_counts.sum()) == 60 and stored.audio_counts[-1] == 51
    back = decode(encode(stored))  # through the shard format
    video = as_release_video(back)
    online = Featurizer(release_config("online"))(videos["av"], Ann("av"))
    assert isinstance(online, ReleaseVideo) and online.pixel_values.shape == (20 * 24, 1176)
    assert online.mel.shape == (1, 128, 3000) and online.grid_thw == video.grid_thw
    vis, aud = media_tokens(model, online)  # what the engine encodes itself in online mode
    assert vis.shape == video.video_embeds.shape and aud.shape == video.audio_embeds.shape
    assert torch.allclose(vis, video.video_embeds, rtol=2e-3, atol=2e-3)  # stored as float16
    assert torch.allclose(aud, video.audio_embeds, rtol=2e-3, atol=2e-3)


def test_a_video_without_audio_gets_no_audio_tokens(videos, model):
    stored = Featurizer(release_config("stored"))(videos["silent"], Ann("silent"))
    assert stored.audio.shape == (0, 16) and not stored.has_audio and list(stored.audio_counts) == [0] * 12
    online = Featurizer(release_config("online"))(videos["silent"], Ann("silent"))
    assert online.mel is None and media_tokens(model, online)[1].shape == (0, 16)


def test_release_video_refuses_samples_of_other_encoders():
    from tests.test_schema import make_sample

    with pytest.raises(SchemaError, match="not a release-encoder sample"):
        as_release_video(make_sample())


def test_online_inputs_cannot_be_written_to_shards(videos):
    online = Featurizer(release_config("online"))(videos["silent"], Ann("silent"))
    with pytest.raises(SchemaError, match="not a Sample"):
        encode(online)


def test_both_modes_caption_through_the_engine(videos, model):
    cfg = release_config("online")
    engine = CaptionEngine(model, cfg.infer)
    online = Featurizer(cfg)(videos["av"], Ann("av"))
    stored = as_release_video(Featurizer(release_config("stored"))(videos["silent"], Ann("silent")))
    forced = DecodeControl(num_events=2, lengths=[3])  # the random tiny model plans no event by itself here
    results = engine.caption([online, stored], controls=[forced, forced])
    assert [r.error for r in results] == [None, None]
    assert results[0].duration == pytest.approx(5.0) and results[1].duration == pytest.approx(3.0)
    assert [r.segments_total for r in results] == [20, 12]
    for r in results:
        assert len(r.events) == 2 and all(0.0 <= e.start < e.end <= r.duration for e in r.events)


def test_a_serve_replica_runs_the_release_front_end_online(videos, model):
    cfg = release_config("online")
    service = CaptionService(cfg, functools.partial(CaptionEngine, model),
                             ModelCard(model_id="tiny-release", source=str(CHECKPOINT), device="cpu"))
    try:
        body = asyncio.run(service.caption_file(videos["av"], "clip one.mp4", None))
        # the decode worker sends the media preparation's arrays back; the replica makes the ReleaseVideo
        served = service._featurize(videos["av"], Ann("av"))
    finally:
        service.close()
    alone = Featurizer(cfg)(videos["av"], Ann("av"))
    assert torch.equal(served.pixel_values, alone.pixel_values) and torch.equal(served.mel, alone.mel)
    assert (served.grid_thw, served.duration, served.seconds_per_step) == (alone.grid_thw, alone.duration,
                                                                          alone.seconds_per_step)
    assert body["video_id"] == "clip_one" and body["duration"] == pytest.approx(5.0)
    assert body["model"] == "tiny-release" and body["timings"]["features_s"] > 0
    assert body["segments_total"] == 20 and body["events"] == []  # the random tiny model plans no event (K = 0)


@pytest.mark.parametrize("mode", ["online", "stored"])
def test_caption_actor_rows_feed_the_release_engine(videos, model, mode, monkeypatch):
    from infer.offline.job import RELEASE_INPUTS, FeaturizeForCaption, engine_input
    from preprocess import release_encoders

    monkeypatch.setattr(release_encoders, "_MODELS", {})  # this process's loaded towers, from none
    cfg = release_config(mode)
    stage = FeaturizeForCaption(cfg.to_json(indent=None))
    batch = {"video_id": np.array(["av", "gone"]), "uri": np.array([videos["av"], videos["av"] + ".missing"]),
             "chunk": np.array(["c0", "c0"])}
    out = stage(batch)
    assert out["status"] == ["ok", "error"] and "missing" in out["error"][1]
    loaded = list(release_encoders._MODELS.values())  # online: the media preparation alone; stored: the towers alone
    assert len(loaded) == (mode == "stored") and all(m.decoder.embed_tokens.weight.is_meta for m in loaded)
    row = {c: out[c][0] for c in out}
    assert bool(row[RELEASE_INPUTS]) == (mode == "online")  # online: the media preparation's output, not features
    video = as_release_video(engine_input(row, "av"))  # a stored sample is converted by the engine itself
    assert isinstance(video, ReleaseVideo) and video.grid_thw == (20, 4, 6)
    result = CaptionEngine(model, cfg.infer).caption([video], controls=[DecodeControl(num_events=1, lengths=[2])])[0]
    assert result.error is None and len(result.events) == 1 and result.duration == pytest.approx(5.0)


def test_a_caption_actor_loads_the_whole_model_once_and_no_other_towers(videos, monkeypatch):
    import infer.loading as loading
    from infer.offline.job import CaptionVideos, FeaturizeForCaption
    from preprocess import release_encoders

    monkeypatch.setattr(release_encoders, "_MODELS", {})
    loads, real = [], loading.load_model
    monkeypatch.setattr(loading, "load_model", lambda cfg, model_dir: loads.append(model_dir) or real(cfg, model_dir))
    cfg = release_config("online")
    rows = FeaturizeForCaption(cfg.to_json(indent=None))({"video_id": np.array(["av"]), "uri": np.array([videos["av"]]),
                                                          "chunk": np.array(["c0"])})
    actor = CaptionVideos(cfg.to_json(indent=None), str(CHECKPOINT))
    batch = {c: np.array(v, dtype=object) for c, v in rows.items()}
    first, again = asyncio.run(actor(batch)), asyncio.run(actor(batch))  # Ray Data awaits the async call
    assert first["status"] == again["status"] == ["ok"] and first["events"] == again["events"]
    assert first["segments_total"] == [20]
    assert loads == [str(CHECKPOINT)]  # once per actor, whatever the batches
    assert not any(p.is_meta for p in actor.engine.model.parameters())  # the LLM and the towers, in one model
    assert release_encoders._MODELS == {}  # no second copy of the towers, in either actor


@pytest.mark.integration
def test_offline_captioning_with_the_release_checkpoint_runs_its_encoders_online(ray_local, videos, tmp_path):
    from infer.loading import load_model
    from infer.offline.job import run_caption
    from infer.offline.results import read_results
    from preprocess.featurize import Featurizer as DirectFeaturizer

    archive = tmp_path / "archive"
    archive.mkdir()
    for name in ("av", "silent"):
        (archive / f"{name}.mp4").write_bytes(Path(videos[name]).read_bytes())
    (archive / "notes.mp4").write_text("not a video\n" * 20)
    cfg = Config()
    cfg = dataclasses.replace(cfg, infer=dataclasses.replace(cfg.infer, device="cpu", max_events=3),
                              cluster=dataclasses.replace(cfg.cluster, preprocess_actors=1, caption_actors=1))
    summary = run_caption(cfg, str(archive), str(CHECKPOINT), str(tmp_path / "out"))
    rows = {r["video_id"]: r for r in read_results(str(tmp_path / "out"))}
    assert summary["captioned"] == 2 and rows["notes"]["status"] == "error" and "text file" in rows["notes"]["error"]
    assert rows["av"]["duration"] == pytest.approx(5.0) and rows["av"]["segments_total"] == 20
    assert rows["silent"]["segments_total"] == 12
    # the same as the engine called directly on the media preparation's output
    model, _, resolved = load_model(cfg, str(CHECKPOINT))
    assert resolved.features.release_features == "online"
    direct = CaptionEngine(model, resolved.infer).caption([DirectFeaturizer(resolved)(videos["av"], Ann("av"))])[0]
    assert [(round(e.start, 4), round(e.end, 4), e.caption) for e in direct.events] == \
        [(round(e["start"], 4), round(e["end"], 4), e["caption"]) for e in rows["av"]["events"]]


def test_stored_release_features_read_back_from_shards_by_the_training_reader(videos, tmp_path):
    import webdataset as wds

    from pipeline.schema import Event
    from train.data import read_samples

    featurizer = Featurizer(release_config("stored"))
    samples = [featurizer(videos["av"], Ann("av", [Event(0.5, 2.0, "red then green")])),
               featurizer(videos["silent"], Ann("silent"))]
    with wds.TarWriter(str(tmp_path / "shard-000000.tar")) as sink:
        for s in samples:
            sink.write(encode(s))
    got = read_samples([str(tmp_path / "shard-000000.tar")])
    assert [s.video_id for s in got] == ["av", "silent"]
    assert got[0].events == [Event(0.5, 2.0, "red then green")] and got[0].ragged_audio
    assert np.array_equal(got[0].audio, samples[0].audio) and got[1].audio.shape == (0, 16)
    assert list(got[0].audio_counts) == list(samples[0].audio_counts) and got[1].grid_thw == (12, 4, 6)
