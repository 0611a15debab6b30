"""The media geometry comes from the checkpoint's config.json (pipeline/release/geometry.py), with the
3B's values when a key is absent: a checkpoint with other patch / temporal / merge sizes, token rate
and audio window is prepared, laid out, encoded and decoded by its own numbers."""

from __future__ import annotations

import json

import pytest
import torch

from bench.mp4 import solid_frames, tone, write_mp4
from bench.release_models import CHECKPOINT, reshaped_checkpoint
from infer.engine.core import CaptionEngine
from pipeline.config import FeaturesConfig, InferConfig
from pipeline.release.geometry import RELEASE, Geometry
from pipeline.release.layout import build_layout, mrope_ids, tau
from pipeline.release.model import ReleaseCaptioner
from preprocess import release_media as rf
from preprocess.release_encoders import inputs_video

# 8 px patches, one frame per timestep, 2x2 merge, 1 temporal position per second, 1 s audio tokens
OTHER = dict(vision={"patch_size": 8, "temporal_patch_size": 1, "spatial_merge_size": 2, "tokens_per_second": 1,
                     "window_size": 32},
             audio={"second_per_window": 1.0, "second_stride": 1.0})


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    return reshaped_checkpoint(tmp_path_factory.mktemp("geo") / "checkpoint", **OTHER)


def test_geometry_is_read_from_the_config_with_the_3b_defaults(other, tmp_path):
    assert Geometry.from_dir(CHECKPOINT) == RELEASE == Geometry.from_config({})
    assert (RELEASE.factor, RELEASE.audio_tokens_per_chunk) == (28, 60)
    geo = Geometry.from_dir(other)
    assert geo == Geometry(patch_size=8, temporal_patch_size=1, spatial_merge_size=2, tokens_per_second=1.0,
                           audio_seconds_per_token=1.0)
    assert (geo.factor, geo.audio_tokens_per_chunk) == (16, 30)
    bare = json.loads((CHECKPOINT / "config.json").read_text())
    for key in ("patch_size", "temporal_patch_size", "spatial_merge_size", "tokens_per_second"):
        bare["vision_config"].pop(key)
    bare["audio_config"].pop("second_per_window")
    assert Geometry.from_config(bare) == RELEASE


def test_a_differently_shaped_checkpoint_runs_by_its_own_geometry(other, tmp_path):
    path = write_mp4(tmp_path / "a.mp4", solid_frames(40, 64, 96, [(200, 30, 30), (30, 200, 30)]), fps=8,
                     audio=tone(440, 5.0))
    cfg = rf.MediaConfig.from_features(FeaturesConfig(release_path=str(other)))
    assert cfg.geometry == Geometry.from_dir(other)
    inputs = rf.read_release_inputs(str(path), cfg)
    # 40 frames kept, 64x96 px (multiples of 16): 40 timesteps of 8 x 12 patches, d = 1 / 8 fps
    assert inputs.grid_thw == (40, 8, 12) and inputs.seconds_per_timestep == 0.125
    assert inputs.pixel_values().shape == (40 * 96, 192) and inputs.tokens_per_timestep == 24
    assert inputs.audio_total == 30 and sum(inputs.audio_counts) == 30
    back = rf.ReleaseInputs.from_bytes(inputs.to_bytes())  # the geometry travels with the inputs
    assert back.geometry == inputs.geometry and torch.equal(back.pixel_values(), inputs.pixel_values())

    model = ReleaseCaptioner.from_release(other).eval()
    assert model.geometry == cfg.geometry
    video = inputs_video(inputs, "a")
    vis = model.encode_video(video.pixel_values, torch.tensor([list(video.grid_thw)]))
    aud = model.encode_audio(video.mel)
    assert vis.shape == (40 * 24, model.hidden_size) and aud.shape == (30, model.hidden_size)
    grid = video.grid(aud.shape[0])
    assert (grid.rows, grid.cols, grid.tokens_per_second, grid.audio_seconds_per_token) == (4, 6, 1.0, 1.0)
    assert tau(grid).tolist() == [int(t * 0.125) for t in range(40)]  # 1 position per second, not the 3B's 2
    lay = build_layout(model.tokenizer, model.ids, grid, model.settings.instruction)
    pos, _ = mrope_ids(lay, "release")
    first = lay.video_slots.reshape(40, 24)[:, 0]
    assert (pos[0, first] - pos[0, first[0]]).tolist() == tau(grid).tolist()
    res = CaptionEngine(model, InferConfig(max_events=2, max_branch_tokens=3, device="cpu")).caption([video])
    assert res[0].error is None

    # the 3B's geometry does not fit this checkpoint's vision tower
    wrong = rf.read_release_inputs(str(path), rf.MediaConfig())
    assert wrong.pixel_values().shape[1] == 1176
    with pytest.raises(RuntimeError):
        model.encode_video(wrong.pixel_values(), torch.tensor([list(wrong.grid_thw)]))
