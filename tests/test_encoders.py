"""preprocess.encoders: registry, segment pooling, pixels/mel on real mp4s, HF towers from save_pretrained dirs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from bench.mp4 import moving_square, solid_frames, tone, write_mp4
from pipeline.config import FeaturesConfig
from preprocess.encoder_base import AUDIO_ENCODERS, VISUAL_ENCODERS, audio_tokens_per_segment, pool_frames_to_segments
from preprocess.encoders import (
    VisualEncoder,
    get_audio_encoder,
    get_visual_encoder,
    mel_filterbank,
    register_visual,
)
from preprocess.media import DecodedVideo, decode_video, frame_schedule
from preprocess.synthetic_media import BACKGROUND_RGB, COLOUR_RGB, _shape_mask
from tests.support.hf_towers import tiny_vision_dirs, tiny_whisper_dir


def _decoded(duration: float, cfg: FeaturesConfig, audio: np.ndarray | None, frames: np.ndarray | None = None) -> DecodedVideo:
    times, segs = frame_schedule(duration, cfg)
    if frames is None:
        frames = np.zeros((times.shape[0], cfg.image_size, cfg.image_size, 3), np.uint8)
    return DecodedVideo(frames=frames, segment_times=segs, audio=audio, sample_rate=cfg.sample_rate, duration=duration,
                        has_audio=audio is not None)


# --------------------------------------------------------------------------- registry and pooling


def test_registry_and_custom_encoder():
    assert {"pixels", "hf_vision"} <= set(VISUAL_ENCODERS) and {"mel", "whisper"} <= set(AUDIO_ENCODERS)
    with pytest.raises(ValueError, match="unknown visual encoder"):
        get_visual_encoder(dataclasses.replace(FeaturesConfig(), visual_encoder="nope"))

    @register_visual("test_ones")
    class Ones(VisualEncoder):
        def __init__(self, cfg):
            super().__init__(cfg)
            self.dim, self.tokens = 3, 2

        def encode_batch(self, frames, previous):
            return torch.ones(frames.shape[0], self.tokens, self.dim)

    try:
        cfg = dataclasses.replace(FeaturesConfig(), visual_encoder="test_ones", batch_size=5)
        out = get_visual_encoder(cfg).encode(_decoded(10.0, cfg, None))
        assert out.shape == (32, 4, 3) and out.dtype == np.float16 and (out == 1).all()
    finally:
        del VISUAL_ENCODERS["test_ones"]


def test_audio_tokens_per_segment_rule():
    cfg = FeaturesConfig()  # 2 tokens per second
    assert audio_tokens_per_segment(cfg, np.array([[0.0, 0.125]])) == 1  # max(1, round(0.25))
    assert audio_tokens_per_segment(cfg, np.array([[0.0, 1.0]])) == 2
    assert audio_tokens_per_segment(cfg, np.array([[0.0, 3.9]])) == 8
    assert audio_tokens_per_segment(dataclasses.replace(cfg, audio_tokens_per_segment=3), np.array([[0.0, 1.0]])) == 3


def test_pool_frames_to_segments_exact_means():
    feats = torch.arange(100, dtype=torch.float32)[:, None]  # frame j centred at 0.05 + j / 10
    segs = np.array([[0.0, 1.0], [1.0, 2.5]], np.float32)
    out = pool_frames_to_segments(feats, 10.0, 0.05, segs, 2)
    np.testing.assert_allclose(out[..., 0].numpy(), [[2.0, 7.0], [13.0, 20.5]])
    tiny = pool_frames_to_segments(feats, 10.0, 0.05, np.array([[0.01, 0.02], [9.99, 10.5]]), 1)
    np.testing.assert_allclose(tiny[:, 0, 0].numpy(), [0.0, 99.0])  # nearest frame / clipped at the end


def test_mel_filterbank_shape_and_peaks():
    fb = mel_filterbank(32, 400, 16000)
    assert fb.shape == (32, 201) and (fb >= 0).all()
    peaks = fb.argmax(1)
    assert (peaks[1:] >= peaks[:-1]).all() and peaks[-1] > 150  # ordered, covering up to Nyquist


# --------------------------------------------------------------------------- pixels


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    d = tmp_path_factory.mktemp("enc")
    out = {}
    for name, colour in [("red", (230, 20, 20)), ("green", (20, 200, 40))]:
        out[name] = write_mp4(d / f"{name}.mp4", solid_frames(16, 48, 48, [colour]), fps=8)
    for name, (dx, dy) in {"right": (2, 0), "left": (-2, 0), "down": (0, 2), "up": (0, -2)}.items():
        out[name] = write_mp4(d / f"{name}.mp4", moving_square(24, 64, 64, dx, dy, size=20), fps=8)
    for name, freq in [("low", 250.0), ("high", 2000.0)]:
        out[name] = write_mp4(d / f"{name}.mp4", solid_frames(16, 32, 32, [(0, 0, 0)]), audio=tone(freq, 2.0), fps=8)
    out["silent"] = write_mp4(d / "silent.mp4", solid_frames(16, 32, 32, [(0, 0, 0)]), audio=tone(440, 2.0, amplitude=0.0), fps=8)
    out["mute"] = write_mp4(d / "mute.mp4", solid_frames(16, 32, 32, [(0, 0, 0)]), fps=8)
    return {k: str(v) for k, v in out.items()}


def test_pixels_shape_and_colours(clips):
    cfg = FeaturesConfig()
    enc = get_visual_encoder(cfg)
    assert (enc.dim, enc.tokens) == (17, 4)
    red = enc.encode(decode_video(clips["red"], cfg))
    green = enc.encode(decode_video(clips["green"], cfg))
    assert red.shape == (32, 8, 17) and red.dtype == np.float16
    rgb_red = (red[..., :3].astype(np.float32).mean((0, 1)) + 1) / 2 * 255
    rgb_green = (green[..., :3].astype(np.float32).mean((0, 1)) + 1) / 2 * 255
    np.testing.assert_allclose(rgb_red, (230, 20, 20), atol=10)
    np.testing.assert_allclose(rgb_green, (20, 200, 40), atol=10)
    assert np.abs(red[..., 3:6].astype(np.float32) + 1).max() < 0.1  # flat colour: ~zero std
    assert np.abs(red[..., 6:9].astype(np.float32) - [-1, 0, 0]).max() < 0.05  # static: no change, no motion
    edges = red[..., 9:14].astype(np.float32)  # flat frames: no edge energy, a uniform orientation histogram
    assert np.abs(edges - [-1, 0, 0, 0, 0]).max() < 0.05
    np.testing.assert_allclose(red[..., 14:].astype(np.float32), red[..., :3].astype(np.float32), atol=0.02)  # one colour


@pytest.mark.parametrize("side", [0.9, 0.5, 0.25])
def test_pixels_chroma_colour_ignores_coverage(tmp_path, side):
    """Channels 14-16 give the colour of a patch's coloured pixels whatever share of the patch they
    cover (real mp4 round trip), where the plain mean (0-2) fades to the grey background with coverage."""
    h = w = 64
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32) + 0.5
    frame = np.full((h, w, 3), 48, np.uint8)
    frame[_shape_mask("square", xx, yy, w / 2, h / 2, side * w)] = (250, 135, 20)  # orange
    path = write_mp4(tmp_path / "orange.mp4", np.repeat(frame[None], 16, 0), fps=8)
    cfg = FeaturesConfig()
    v = get_visual_encoder(cfg).encode(decode_video(str(path), cfg)).astype(np.float32)
    chroma_rgb = (v[..., 14:].mean((0, 1)) + 1) / 2 * 255
    plain_rgb = (v[..., :3].mean((0, 1)) + 1) / 2 * 255
    palette = {**COLOUR_RGB, "background": BACKGROUND_RGB}
    nearest = min(palette, key=lambda c: np.linalg.norm(chroma_rgb - np.array(palette[c])))
    assert nearest == "orange", (side, chroma_rgb)  # at 6 % of each patch (side 0.25) too
    if side >= 0.5:
        np.testing.assert_allclose(chroma_rgb, (250, 135, 20), atol=25)
    cover = side * side  # the square's share of the frame
    np.testing.assert_allclose(plain_rgb, 48 + cover * (np.array([250, 135, 20]) - 48), atol=25)


@pytest.mark.parametrize("shape", ["square", "stripes", "circle", "triangle"])
def test_pixels_edge_orientation_tells_shapes_apart(tmp_path, shape):
    """The orientation histogram (channels 10-13: horizontal, rising, vertical, falling edges)
    of a centred shape after a real mp4 round trip, averaged over frames and patches."""
    h = w = 64
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32) + 0.5
    frame = np.full((h, w, 3), 30, np.uint8)
    frame[_shape_mask(shape, xx, yy, w / 2, h / 2, 0.55 * w)] = (40, 200, 60)
    path = write_mp4(tmp_path / f"{shape}.mp4", np.repeat(frame[None], 16, 0), fps=8)
    cfg = FeaturesConfig()
    v = get_visual_encoder(cfg).encode(decode_video(str(path), cfg)).astype(np.float32)
    energy = v[..., 9].mean()
    hor, rise, ver, fall = (v[..., 10:14].mean((0, 1)) + 1) / 4  # the fractions of the energy
    assert energy > -0.5  # a full-contrast outline crosses every patch
    if shape == "square":  # sides only: horizontal and vertical, and the two balanced
        assert min(hor, ver) > 2 * max(rise, fall) and abs(hor - ver) < 0.1
    elif shape == "stripes":  # five horizontal bands
        assert hor > 0.5 and hor > 3 * max(rise, ver, fall)
    elif shape == "circle":  # every orientation, the diagonals (the arcs' middles) a little ahead
        assert min(hor, rise, ver, fall) > 0.15 and abs(rise - fall) < 0.05 and min(rise, fall) > max(hor, ver)
    else:  # triangle: steep sides, so diagonals well above a square's corners and vertical ahead of horizontal
        assert min(rise, fall) > 0.15 and abs(rise - fall) < 0.05 and ver > hor + 0.03


def test_pixels_motion_direction(clips):
    cfg = dataclasses.replace(FeaturesConfig(), batch_size=7)  # motion must carry across batch borders
    enc = get_visual_encoder(cfg)
    motion = {}
    for name in ("right", "left", "down", "up"):
        v = enc.encode(decode_video(clips[name], cfg)).astype(np.float32)
        assert v[..., 6].max() > -0.9  # the change channel sees the motion
        motion[name] = v[..., 7:9].mean((0, 1))  # mean (dx, dy) over the video
    assert motion["right"][0] > 0.05 and motion["left"][0] < -0.05
    assert motion["down"][1] > 0.05 and motion["up"][1] < -0.05
    assert abs(motion["right"][1]) < 0.01 and abs(motion["down"][0]) < 0.01
    # batch size does not change the features
    a = enc.encode(decode_video(clips["right"], cfg))
    b = get_visual_encoder(dataclasses.replace(cfg, batch_size=64)).encode(decode_video(clips["right"], cfg))
    np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), atol=2e-3)


# --------------------------------------------------------------------------- mel


def test_mel_low_vs_high_tone_and_no_audio(clips):
    cfg = dataclasses.replace(FeaturesConfig(), audio_tokens_per_segment=2)
    enc = get_audio_encoder(cfg)
    assert enc.dim == cfg.n_mels + 2
    low = enc.encode(decode_video(clips["low"], cfg)).astype(np.float32)
    high = enc.encode(decode_video(clips["high"], cfg)).astype(np.float32)
    silent = enc.encode(decode_video(clips["silent"], cfg)).astype(np.float32)
    assert low.shape == (32, 2, 34) and np.isfinite(low).all()
    mid = slice(4, 28)  # away from the AAC edges
    low_band = low[mid, :, : cfg.n_mels].mean((0, 1)).argmax()
    high_band = high[mid, :, : cfg.n_mels].mean((0, 1)).argmax()
    assert high_band > low_band + 5
    assert high[mid, :, -1].mean() > low[mid, :, -1].mean() + 0.1  # spectral centroid
    assert low[mid, :, -2].mean() > silent[mid, :, -2].mean() + 0.5  # energy
    mute_dec = decode_video(clips["mute"], cfg)
    mute = enc.encode(mute_dec)
    assert mute.shape == (32, 2, 34) and not mute.any() and not mute_dec.has_audio


def test_mel_long_audio_is_chunked_consistently():
    cfg = FeaturesConfig()
    enc = get_audio_encoder(cfg)
    rng = np.random.default_rng(0)
    audio = (0.1 * rng.standard_normal(16000 * 70)).astype(np.float32)  # 70 s: two STFT chunks
    feats, rate, first = enc.frames(audio, 16000)
    assert feats.shape == (1 + audio.size // 160, 34) and rate == 100 and first == 0
    whole = torch.stft(torch.from_numpy(np.pad(audio, 200)), 400, 160, window=torch.hann_window(400), center=False,
                       return_complex=True).abs().square()
    ref = (torch.log10((enc.filters @ whole).clamp_min(1e-8)) + 4) / 4
    np.testing.assert_allclose(feats[:, :32].numpy(), ref.T.numpy(), atol=1e-4)


# --------------------------------------------------------------------------- HF towers


@pytest.fixture(scope="module")
def vision_dirs(tmp_path_factory):
    return tiny_vision_dirs(tmp_path_factory.mktemp("vision"))


@pytest.mark.parametrize("kind", ["siglip", "siglip_full", "clip"])
def test_hf_vision_loads_and_pools(vision_dirs, clips, kind):
    from transformers import AutoImageProcessor, CLIPVisionModel, SiglipVisionModel

    cfg = dataclasses.replace(FeaturesConfig(), visual_encoder="hf_vision", vision_path=vision_dirs[kind], batch_size=16)
    enc = get_visual_encoder(cfg)
    assert (enc.dim, enc.tokens) == (32, 4)
    decoded = decode_video(clips["right"], cfg)
    out = enc.encode(decoded)
    assert out.shape == (32, 8, 32) and out.dtype == np.float16 and np.isfinite(out.astype(np.float32)).all()
    # V = 16 equals the 4x4 patch grid: tokens must be the tower's own patch outputs
    full = get_visual_encoder(dataclasses.replace(cfg, visual_tokens_per_frame=16)).encode(decoded)
    model = (CLIPVisionModel if kind == "clip" else SiglipVisionModel).from_pretrained(vision_dirs[kind]).eval()
    pixels = AutoImageProcessor.from_pretrained(vision_dirs[kind])(images=list(decoded.frames[:4]), return_tensors="pt")
    with torch.no_grad():
        hidden = model(**pixels).last_hidden_state
    patches = hidden[:, 1:] if kind == "clip" else hidden
    np.testing.assert_allclose(full.reshape(-1, 16, 32)[:4].astype(np.float32), patches.numpy(), atol=1e-2)
    # V = 4 is the 2x2 average of those
    pooled = patches.reshape(4, 2, 2, 2, 2, 32).mean((2, 4)).reshape(4, 4, 32)
    np.testing.assert_allclose(out.reshape(-1, 4, 32)[:4].astype(np.float32), pooled.numpy(), atol=1e-2)


@pytest.fixture(scope="module")
def whisper_dir(tmp_path_factory):
    return tiny_whisper_dir(tmp_path_factory.mktemp("whisper"))


def test_whisper_loads_and_pools(whisper_dir, clips):
    from transformers import WhisperFeatureExtractor, WhisperModel

    cfg = dataclasses.replace(FeaturesConfig(), audio_encoder="whisper", audio_path=whisper_dir, audio_batch_size=1)
    enc = get_audio_encoder(cfg)
    assert enc.dim == 32 and enc.tokens == 2
    decoded = decode_video(clips["low"], cfg)
    out = enc.encode(decoded)
    assert out.shape == (32, 1, 32) and out.dtype == np.float16
    # 35 s of audio: two 30 s windows; 50 encoder frames per second of real audio
    rng = np.random.default_rng(0)
    audio = (0.1 * rng.standard_normal(16000 * 35)).astype(np.float32)
    feats, rate, first = enc.frames(audio, 16000)
    assert feats.shape == (1750, 32) and rate == 50 and first == pytest.approx(0.01)
    ref_model = WhisperModel.from_pretrained(whisper_dir).get_encoder().eval()
    inputs = WhisperFeatureExtractor.from_pretrained(whisper_dir)([audio[480000:]], sampling_rate=16000, return_tensors="pt")
    with torch.no_grad():
        ref = ref_model(inputs["input_features"]).last_hidden_state[0, :250]
    np.testing.assert_allclose(feats[1500:].numpy(), ref.numpy(), atol=1e-4)
    long = get_audio_encoder(dataclasses.replace(cfg, audio_batch_size=4)).encode(_decoded(35.0, cfg, audio))
    assert long.shape == (35, 2, 32)  # 70 frames -> 35 segments of 1 s -> 2 tokens each
    np.testing.assert_allclose(long[0, 0].astype(np.float32), feats[:25].mean(0).numpy(), atol=2e-3)
    no_audio = enc.encode(_decoded(35.0, cfg, None))
    assert no_audio.shape == (35, 2, 32) and not no_audio.any()


@pytest.mark.gpu
def test_encoders_on_cuda_match_cpu(vision_dirs, whisper_dir):
    base = dataclasses.replace(FeaturesConfig(), vision_path=vision_dirs["siglip"], audio_path=whisper_dir)
    frames = moving_square(64, 32, 32, 1, 0, size=10)
    frames[..., 0] = np.linspace(0, 255, 64, dtype=np.uint8)[:, None, None]
    decoded = _decoded(10.0, base, tone(440.0, 10.0, 16000), frames)
    for field, names in (("visual_encoder", ("pixels", "hf_vision")), ("audio_encoder", ("mel", "whisper"))):
        for name in names:
            cpu_cfg = dataclasses.replace(base, **{field: name, "device": "cpu"})
            get = get_visual_encoder if field == "visual_encoder" else get_audio_encoder
            gpu_enc = get(dataclasses.replace(cpu_cfg, device="auto"))
            assert gpu_enc.device.type == "cuda"
            on_gpu = gpu_enc.encode(decoded).astype(np.float32)
            on_cpu = get(cpu_cfg).encode(decoded).astype(np.float32)
            assert on_gpu.shape == on_cpu.shape, name
            np.testing.assert_allclose(on_gpu, on_cpu, atol=3e-2, rtol=3e-2, err_msg=name)


@pytest.mark.parametrize("kind", ["siglip", "siglip_full", "clip"])
def test_tower_dims_come_from_the_configs_without_loading_weights(vision_dirs, whisper_dir, kind, monkeypatch):
    # what infer/loading.py load_model reads when a caption actor or a replica sizes its model
    from preprocess.encoders import encoder_dims
    from preprocess.hf_encoders import HFVisionEncoder, WhisperAudioEncoder

    cfg = dataclasses.replace(FeaturesConfig(), visual_encoder="hf_vision", vision_path=vision_dirs[kind],
                              audio_encoder="whisper", audio_path=whisper_dir)
    built = (get_visual_encoder(cfg).dim, get_audio_encoder(cfg).dim)

    def refuse(self, cfg):
        raise AssertionError("a tower was built (its weights loaded) to read its width")

    monkeypatch.setattr(HFVisionEncoder, "__init__", refuse)
    monkeypatch.setattr(WhisperAudioEncoder, "__init__", refuse)
    assert encoder_dims(cfg) == built == (32, 32)
    assert encoder_dims(FeaturesConfig()) == (17, FeaturesConfig().n_mels + 2)  # pixels / mel: built, no weights
