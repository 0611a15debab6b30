"""The release's media towers as their own batched stage: the vision tower's windows in a few SDPA calls
(pipeline/release/video.py `window_attention`), several videos per tower call (`encode_videos`), and the
engine's encoder stage (infer/engine/encoding.py) that keeps every tower call off the decode loop."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from bench.release_models import load, perturbed, random_video
from infer.engine.core import CaptionEngine
from infer.engine.requests import Request
from pipeline.config import InferConfig
from pipeline.family import DecodeError
from pipeline.release.decoding import media_tokens
from pipeline.release.video import WINDOW_ATTENTION, encode_videos


@pytest.fixture(scope="module")
def model():
    return perturbed(5, eos_gain=0.75)


def engine_for(model, **over) -> CaptionEngine:
    cfg = dict(max_events=model.max_events, max_branch_tokens=model.max_branch_tokens + 1, device="cpu")
    return CaptionEngine(model, InferConfig(**{**cfg, **over}))


def tower(model, pixels, grid, implementation: str) -> torch.Tensor:
    vis = model.visual
    vis.config._attn_implementation = implementation
    try:
        return model.encode_video(pixels, grid)
    finally:
        vis.config._attn_implementation = WINDOW_ATTENTION


def test_window_attention_equals_hfs_per_window_attention():
    """HF's own vision tower with its sdpa and eager attention (one call per window and per frame) against the
    windows grouped by length: edge windows of every shape (5 x 7 patches, windows of 4 x 4) and two videos
    in one call."""
    model = load()
    assert model.visual.config._attn_implementation == WINDOW_ATTENTION
    assert model.decoder.config._attn_implementation == "sdpa"  # the LLM keeps its own
    g = torch.Generator().manual_seed(0)
    grid = torch.tensor([[3, 10, 14], [2, 4, 6]])
    pixels = torch.randn(int(grid.prod(dim=1).sum()), 1176, generator=g)
    ours = model.encode_video(pixels, grid)
    for implementation in ("sdpa", "eager"):
        hf = tower(model, pixels, grid, implementation)
        assert torch.allclose(ours, hf, rtol=1e-5, atol=1e-6), implementation
    assert torch.equal(ours, tower(model, pixels, grid, "sdpa"))  # the same kernel, batched: bit for bit here


def test_encode_videos_batched_equals_each_alone(model):
    videos = [random_video(40 + i, timesteps=2 + i, rows=4 + 2 * (i % 2), cols=6, audio=i != 1) for i in range(4)]
    stored = encode_videos(model, [videos[3]])[0]
    batch = encode_videos(model, videos[:3] + [stored])
    assert batch[3] is stored and stored.pixel_values is None and stored.mel is None
    for v, enc in zip(videos, batch):
        vis, aud = media_tokens(model, v)  # what the program encoded before the stage
        assert torch.equal(enc.video_embeds, vis) and enc.pixel_values is None
        assert (enc.audio_embeds is None and aud.shape[0] == 0) or torch.equal(enc.audio_embeds, aud)
        assert v.tokens_to_encode == vis.shape[0] + aud.shape[0] and enc.tokens_to_encode == 0


class Counting:
    """Wraps the model's towers: which thread called them, and on how many videos."""

    def __init__(self, model, monkeypatch, fail_on: int | None = None):
        self.calls: list[tuple[str, int, int]] = []
        for name in ("encode_video", "encode_audio"):
            monkeypatch.setattr(model, name, self.wrap(name, getattr(model, name), fail_on))

    def wrap(self, name, real, fail_on):
        def call(x, *grid):
            self.calls.append((name, threading.get_ident(), grid[0].shape[0] if grid else x.shape[0]))
            if fail_on is not None and grid and fail_on in grid[0][:, 0].tolist():
                raise DecodeError(f"a tower refused a video of {fail_on} timesteps")
            return real(x, *grid)
        return call


def as_today(model, video):
    """The video as the engine's program saw it when the loop encoded: the tokens of `media_tokens`."""
    vis, aud = media_tokens(model, video)
    return dataclasses.replace(video, pixel_values=None, mel=None, video_embeds=vis,
                               audio_embeds=aud if aud.shape[0] else None)


def test_the_decode_loop_never_runs_a_tower_and_captions_are_unchanged(model, monkeypatch):
    """Two videos start; while they decode, three more arrive (a feed polled at step boundaries, as Serve's):
    every tower call is on the stage's thread, the three are encoded together, and every video's tokens
    equal decoding it alone from the tokens the loop used to encode itself (exact, fp32)."""
    videos = [random_video(60 + i, timesteps=3 + i % 3, audio=i != 2) for i in range(5)]
    today = [engine_for(model).decode(as_today(model, v)) for v in videos]
    counting = Counting(model, monkeypatch)
    eng = engine_for(model, step_tokens=64)
    first, late, arrived = videos[:2], videos[2:], []

    def feed():
        if first:
            return Request(first.pop(0))
        if late and eng.stats["steps"] >= 2:
            arrived.append(len(eng._in_flight))
            return Request(late.pop(0))
        return None

    out = {}
    eng.run(feed, lambda req, res: out.setdefault(req.sample.video_id, res))
    loop = threading.get_ident()
    assert counting.calls and all(ident != loop for _, ident, _ in counting.calls)
    assert ("encode_video", counting.calls[-1][1], 3) in counting.calls  # the late three: one tower call
    assert eng.stats["encode_batches"] == 2 and eng.stats["encoded_videos"] == 5
    assert arrived == [2, 2, 2]  # they arrived with both first videos in flight
    for v, ref in zip(videos, today):
        assert out[v.video_id].tokens == ref.tokens and out[v.video_id].intervals == ref.intervals


def test_a_tower_error_reaches_only_its_video(model, monkeypatch):
    """A batch that raises is encoded again one video at a time: the DecodeError goes to the one video, the
    others are captioned as if it had not been there."""
    videos = [random_video(80 + i, timesteps=3 + i) for i in range(3)]
    ref = engine_for(model).caption([videos[0], videos[2]])
    Counting(model, monkeypatch, fail_on=4)
    res = engine_for(model).caption(videos)
    assert res[1].error is not None and "refused a video of 4 timesteps" in res[1].error
    assert [r.events for r in (res[0], res[2])] == [r.events for r in ref]
