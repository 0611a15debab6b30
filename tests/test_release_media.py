"""The release's media preparation (preprocess/release_media.py) against the release-golden fixture and
docs/design/release.md."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from bench.mp4 import solid_frames, tone, write_mp4
from pipeline.release.layout import audio_counts, index_sets
from preprocess import release_media as rf
from preprocess.media import MediaError

GOLDEN = Path(__file__).parent / "data" / "release_golden"  # the fixture copied from shared/release-golden
CFG = rf.MediaConfig()


def golden_inputs():
    path = GOLDEN / "inputs.pt"
    if not path.exists():
        pytest.skip("release-golden fixture not present")
    return torch.load(path, weights_only=True)


def unpatchify(rows: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
    """Inverse of rf.patchify: [T*gh*gw, 3*2*14*14] -> [2T, 3, 14 gh, 14 gw]."""
    t, gh, gw = grid
    x = rows.reshape(t, gh // 2, gw // 2, 2, 2, 3, 2, 14, 14)
    x = x.permute(0, 6, 5, 1, 3, 7, 2, 4, 8)  # the inverse of (0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(2 * t, 3, 14 * gh, 14 * gw)


# --------------------------------------------------------------------------- frames


@pytest.mark.parametrize("length, n", [(32.25, 64), (32.75, 66), (33.25, 66), (12.0, 64), (100.0, 200),
                                       (128.25, 256), (600.0, 256), (0.1, 64)])
def test_frame_count_rule_uses_bankers_rounding(length, n):
    # 32.25 / 0.5 = 64.5 -> 64 (half to even), 32.75 -> 65.5 -> 66, 33.25 -> 66.5 -> 66
    assert rf.frame_count(length, CFG) == n


def test_sample_indices_match_the_fixture_and_numpy_linspace():
    idx, length = rf.sample_indices(12, 12 / 31, CFG)  # the fixture's decoder: 12 frames at 12/31 fps
    assert length == pytest.approx(31.0) and idx.tolist() == list(range(12))
    idx, length = rf.sample_indices(1000, 25.0, CFG)  # 40 s -> 80 frames
    assert length == 40.0 and len(idx) == 80 and idx[0] == 0 and idx[-1] == 999
    assert idx.tolist() == np.linspace(0, 999, 80).astype(int).tolist()
    with pytest.raises(rf.FrontendError):
        rf.sample_indices(10, 0.0, CFG)


def test_pixel_budget_scales_below_max_frames():
    assert rf.pixel_budget(256, CFG) == (61250, 784)
    assert rf.pixel_budget(255, CFG)[0] == pytest.approx(0.95 * 256 / 255 * 61250)
    assert rf.pixel_budget(255, CFG)[0] < 61250  # 255 frames get less than 256 do
    assert rf.pixel_budget(12, CFG)[0] == pytest.approx(1241333.3333333333)  # inputs.json processor.max_pixels


@pytest.mark.parametrize("hw, kept, out", [((720, 1280), 256, (168, 308)), ((720, 1280), 64, (336, 616)),
                                           ((56, 84), 12, (56, 84)), ((10, 10), 256, (28, 28))])
def test_smart_resize_release_examples(hw, kept, out):
    top, bottom = rf.pixel_budget(kept, CFG)
    assert rf.smart_resize(*hw, 28, bottom, top) == out


def test_smart_resize_refuses_extreme_aspect_ratios():
    with pytest.raises(rf.FrontendError, match="aspect ratio"):
        rf.smart_resize(2, 500)


def test_resize_is_bicubic_antialiased_on_uint8():
    rng = np.random.default_rng(0)
    frames = torch.from_numpy(rng.integers(0, 256, (2, 3, 100, 150), dtype=np.uint8))
    out = rf.resize_frames(frames, 56, 84)
    ref = torch.nn.functional.interpolate(frames.float(), size=(56, 84), mode="bicubic", antialias=True,
                                          align_corners=False).clamp(0, 255).round()
    assert out.dtype == torch.uint8 and out.shape == (2, 3, 56, 84)
    diff = (out.float() - ref).abs()  # the native uint8 kernel rounds (and clamps) between its two passes
    assert (diff <= 1).float().mean() > 0.99 and diff.mean() < 0.3
    flat = torch.full((1, 3, 90, 60), 77, dtype=torch.uint8)
    assert (rf.resize_frames(flat, 56, 28) == 77).all()
    assert rf.resize_frames(frames, 100, 150) is frames  # same size: untouched, as torchvision does


def test_normalize_is_the_fused_clip_rescale():
    x = torch.tensor([0, 255], dtype=torch.uint8).view(2, 1, 1, 1).expand(2, 3, 1, 1)
    out = rf.normalize(x)
    for c in range(3):
        assert out[0, c, 0, 0].item() == pytest.approx(-rf.CLIP_MEAN[c] / rf.CLIP_STD[c], rel=1e-6)
        assert out[1, c, 0, 0].item() == pytest.approx((1 - rf.CLIP_MEAN[c]) / rf.CLIP_STD[c], rel=1e-6)
    assert out.dtype == torch.float32


def test_patchify_layout_round_trips_and_puts_channels_then_time_in_a_row():
    grid_frames = torch.randn(4, 3, 56, 84)
    rows, grid = rf.patchify(grid_frames)
    assert grid == (2, 4, 6) and rows.shape == (48, 1176)
    assert torch.equal(unpatchify(rows, grid), grid_frames)
    # row 0: timestep 0, merge window (0, 0), its top-left patch; [channel, frame, 14, 14]
    assert torch.equal(rows[0].view(3, 2, 14, 14), grid_frames[0:2, :, :14, :14].transpose(0, 1))
    # rows 1-3: the other patches of that 2x2 window (top-right, bottom-left, bottom-right)
    assert torch.equal(rows[1].view(3, 2, 14, 14)[:, 0], grid_frames[0, :, :14, 14:28])
    assert torch.equal(rows[2].view(3, 2, 14, 14)[:, 0], grid_frames[0, :, 14:28, :14])
    # row 4: the next merge window to the right
    assert torch.equal(rows[4].view(3, 2, 14, 14)[:, 1], grid_frames[1, :, :14, 28:42])
    with pytest.raises(rf.FrontendError):
        rf.patchify(torch.randn(3, 3, 56, 84))


def test_odd_frame_counts_repeat_the_last_frame():
    frames = np.stack([np.full((56, 84, 3), v, np.uint8) for v in (10, 20, 30)])
    resized, grid, d = rf.prepare_frames(frames, 3, 6.0, CFG)
    assert grid == (2, 4, 6) and d == pytest.approx(4.0)
    pixels = rf.pad_temporal(rf.normalize(resized))
    assert pixels.shape[0] == 4 and torch.equal(pixels[3], pixels[2])
    inputs = rf.build_inputs(frames, np.arange(3), 3, 0.5, None, CFG)
    back = unpatchify(inputs.pixel_values(), inputs.grid_thw)
    assert torch.equal(back[3], back[2]) and not torch.equal(back[1], back[2])
    # segment_times: the last segment ([4, 8] s) is clipped to L = 6 s
    assert inputs.segment_times().tolist() == [[0.0, 4.0], [4.0, 6.0]]


def test_fixture_grid_and_timestep_length():
    x = golden_inputs()
    frames = np.zeros((12, 56, 84, 3), np.uint8)  # the fixture's 12 frames of 56x84
    inputs = rf.build_inputs(frames, np.arange(12), 12, 12 / 31, None, CFG)
    assert list(inputs.grid_thw) == x["video_grid_thw"][0].tolist() == [6, 4, 6]
    assert inputs.seconds_per_timestep == x["second_per_grid_ts"][0] == x["timestep_duration"]
    assert inputs.tokens_per_timestep == 6
    assert inputs.pixel_values().shape == tuple(x["pixel_values_videos"].shape) == (144, 1176)


# --------------------------------------------------------------------------- interleave and index sets


def counts_and_sets(grid_thw, d, audio_total):
    grid = rf.av_grid(grid_thw, d, audio_total)
    return audio_counts(grid), *index_sets(grid)


def test_interleave_counts_and_index_sets_match_the_fixture():
    x = golden_inputs()
    d = x["second_per_grid_ts"][0]
    counts, video, audio = counts_and_sets((6, 4, 6), d, x["audio_lengths"][0])
    assert counts == [10, 10, 11, 10, 10, 69]
    assert rf.audio_token_total(496000) == x["audio_lengths"][0] == 120
    as_ranges = lambda sets: [[[min(s), max(s) + 1]] if s else [] for s in sets]  # noqa: E731
    assert as_ranges(video) == [[list(r) for r in rs] for rs in x["video_token_indices_per_timestep"]]
    assert as_ranges(audio) == [[list(r) for r in rs] for rs in x["audio_token_indices_per_timestep"]]
    assert max(max(s) for s in audio) == 61  # tokens 62..119 (padding of chunk 2) are in no set


def test_interleave_counts_of_a_12_second_video():
    # docs/design/release.md §2: 12 s, 64 frames -> d = 0.375 s, T = 32: counts [0, 1, 1, 1, 0, ...] ending in 37
    idx, length = rf.sample_indices(300, 25.0, CFG)
    d = rf.timestep_seconds(len(idx), length)
    counts = counts_and_sets((32, 4, 4), d, rf.audio_token_total(12 * 16000))[0]
    assert d == 0.375 and counts[:5] == [0, 1, 1, 1, 0] and counts[-1] == 37 and sum(counts) == 60
    assert counts[:-1] == [int(0.75 * (t + 1)) - int(0.75 * t) for t in range(31)]
    assert counts_and_sets((32, 4, 4), d, 0)[0] == [0] * 32  # no audio: no audio tokens anywhere


def test_index_sets_keep_the_two_segment_float_quirk():
    # d = 2 * 29.32 / 64 = 0.91625 s: ceil((t+1)*d/d) exceeds t+1 by float error for 4 of the 32
    # timesteps (docs/design/release.md §4.3), which then cover two segments
    _, video, _ = counts_and_sets((32, 2, 2), 2 * 29.32 / 64, 60)
    assert sum(len(s) == 2 for s in video) == 4 and all(len(s) in (1, 2) for s in video)


# --------------------------------------------------------------------------- audio


def test_mel_chunks_cut_30_second_pieces_like_the_fixture():
    x = golden_inputs()
    noise = np.random.default_rng(0).standard_normal(31 * 16000).astype(np.float32) * 0.1
    mel, samples = rf.mel_chunks(noise)
    assert mel.shape == tuple(x["audio_feature"].shape) == (2, 128, 3000) and mel.dtype == np.float32
    assert samples == 496000 and rf.audio_token_total(samples) == 120
    # the second piece holds 1 s of audio: constant (the log floor) from column 102 on, as in the fixture
    for m in (mel[1], x["audio_feature"][1].numpy()):
        assert (m[:, 102:] == m[0, 102]).all() and not (m[:, 101] == m[0, 102]).all()
    assert m[0, 102] == pytest.approx(m.max() - 2.0, abs=1e-5)  # (max - 8 + 4) / 4 - (max + 4) / 4


@pytest.mark.parametrize("seconds, chunks", [(0.4, 1), (30.0, 1), (30.01, 2), (61.0, 3)])
def test_mel_chunk_count_and_short_audio_padding(seconds, chunks):
    wave = np.random.default_rng(1).standard_normal(int(round(seconds * 16000))).astype(np.float32) * 0.1
    mel, samples = rf.mel_chunks(wave)
    assert mel.shape == (chunks, 128, 3000) and samples == max(16000, wave.shape[0])
    assert rf.audio_token_total(samples) == 60 * chunks


# --------------------------------------------------------------------------- real files


def test_reads_a_real_video_with_audio(tmp_path):
    colours = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0), (0, 255, 255)]
    frames = solid_frames(40, 64, 96, colours)
    path = write_mp4(tmp_path / "a.mp4", frames, fps=8, audio=tone(440, 5.0))
    inputs = rf.read_release_inputs(str(path), CFG)
    # 40 frames at 8 fps: L = 5 s, n = 64 > 40 so every frame is kept, d = 2 / 8
    assert inputs.length_s == 5.0 and rf.read_frames(str(path), str(path), CFG)[1].tolist() == list(range(40))
    assert inputs.grid_thw == (20, 4, 6) and inputs.seconds_per_timestep == 0.25
    assert inputs.frames.shape == (40, 3, 56, 84)
    mean_rgb = inputs.frames.float().mean((2, 3))
    for i in (0, 8, 16, 24, 32):
        assert (mean_rgb[i] - torch.tensor(colours[i // 8], dtype=torch.float32)).abs().max() < 12
    assert inputs.has_audio and inputs.mel.shape == (1, 128, 3000) and inputs.audio_total == 60
    assert inputs.audio_counts[:4] == [0, 1, 0, 1] and inputs.audio_counts[-1] == 60 - 9
    assert sum(inputs.audio_counts) == 60 and len(index_sets(inputs.layout_grid)[1]) == 20
    assert abs(len(rf.read_audio(str(path))) - 5 * 16000) < 2048  # the whole stream at 16 kHz (AAC adds priming)


def test_a_video_without_audio_gets_no_audio_tokens(tmp_path):
    path = write_mp4(tmp_path / "silent.mp4", solid_frames(16, 56, 56, [(9, 9, 9)]), fps=8)
    inputs = rf.read_release_inputs(str(path), CFG)
    assert not inputs.has_audio and inputs.mel is None and inputs.audio_total == 0
    assert inputs.audio_counts == [0] * 8 and index_sets(inputs.layout_grid)[1] == [[]] * 8
    assert inputs.grid_thw == (8, 4, 4) and inputs.pixel_values().shape == (128, 1176)


def test_a_text_file_is_refused_with_a_reason(tmp_path):
    bad = tmp_path / "notes.mp4"
    bad.write_text("not a video at all\n")
    with pytest.raises(MediaError, match="text file") as e:
        rf.read_release_inputs(str(bad), CFG)
    assert e.value.kind == "not_media"


def test_inputs_survive_serialisation(tmp_path):
    path = write_mp4(tmp_path / "b.mp4", solid_frames(18, 56, 84, [(200, 10, 10), (10, 10, 200)]), fps=6,
                     audio=tone(300, 3.0))
    inputs = rf.read_release_inputs(str(path), CFG)
    back = rf.ReleaseInputs.from_bytes(inputs.to_bytes())
    assert torch.equal(back.frames, inputs.frames) and np.array_equal(back.mel, inputs.mel)
    assert torch.equal(back.pixel_values(), inputs.pixel_values())
    for name in ("grid_thw", "seconds_per_timestep", "length_s", "audio_total", "audio_counts", "layout_grid", "geometry"):
        assert getattr(back, name) == getattr(inputs, name), name
    silent = rf.build_inputs(np.zeros((4, 56, 56, 3), np.uint8), np.arange(4), 4, 2.0, None, CFG)
    assert rf.ReleaseInputs.from_bytes(silent.to_bytes()).mel is None


def test_stereo_is_downmixed_by_ffmpeg_not_averaged(tmp_path):
    # swresample's stereo -> mono matrix is (L + R) / sqrt(2): +3 dB over the channel mean that
    # preprocess/media.py takes (docs/design/release.md §5.4); the release's torchcodec decoder goes through it too
    frames = solid_frames(16, 56, 56, [(5, 5, 5)])
    stereo = rf.read_audio(str(write_mp4(tmp_path / "s.mp4", frames, fps=8, audio=tone(440, 2.0), layout="stereo")))
    mono = rf.read_audio(str(write_mp4(tmp_path / "m.mp4", frames, fps=8, audio=tone(440, 2.0), layout="mono")))
    peak = lambda a: float(np.abs(a[4000:20000]).max())  # noqa: E731
    assert peak(stereo) == pytest.approx(0.5 * 2 ** 0.5, rel=0.05) and peak(mono) == pytest.approx(0.5, rel=0.05)


def write_uneven_mp4(path: Path, n: int = 40) -> Path:
    """H.264 mp4 whose first half runs at 8 fps and second half at 4 fps (pts in 1/8 s ticks)."""
    from fractions import Fraction

    import av

    frames = solid_frames(n, 56, 56, [(250, 0, 0), (0, 0, 250)])
    with av.open(str(path), mode="w", format="mp4") as out:
        vs = out.add_stream("libx264", rate=Fraction(8))
        vs.height, vs.width, vs.pix_fmt = 56, 56, "yuv420p"
        vs.options = {"preset": "ultrafast", "bf": "0"}
        for i, img in enumerate(frames):
            vf = av.VideoFrame.from_ndarray(img, format="rgb24")
            vf.pts, vf.time_base = (i if i < n // 2 else n // 2 + 2 * (i - n // 2)), Fraction(1, 8)
            out.mux(vs.encode(vf))
        out.mux(vs.encode(None))
    return path


def test_length_is_torchcodecs_scanned_content_duration(tmp_path):
    path = write_uneven_mp4(tmp_path / "uneven.mp4")
    count, fps = rf.scan_metadata(str(path))
    # 40 packets; the last pts is 58 ticks of 1/8 s, plus its duration of one tick: L = 59 / 8 s
    assert count == 40 and count / fps == pytest.approx(59 / 8)
    inputs = rf.read_release_inputs(str(path), CFG)
    assert inputs.length_s == pytest.approx(count / fps)
    assert inputs.seconds_per_timestep == pytest.approx(2 / (40 / inputs.length_s))
