"""Per-segment feature encoders: a registry plus the weight-free `pixels` and `mel` encoders.

An encoder turns a `DecodedVideo` into features aligned to its segments:

    enc = get_visual_encoder(cfg.features)   # by cfg.features.visual_encoder
    visual = enc.encode(decoded)             # float16 [T, frames_per_segment * enc.tokens, enc.dim]
    aenc = get_audio_encoder(cfg.features)   # by cfg.features.audio_encoder
    audio = aenc.encode(decoded)             # float16 [T, A, aenc.dim], zeros without audio

Registered here: `pixels` (visual) and `mel` (audio), weight-free, for the embedded
run; `hf_vision` and `whisper` (HF models from local paths) live in
`preprocess/hf_encoders.py` and register themselves when this module is imported, as
do `release` (visual and audio: the released PadCaptioner-3B's own towers, with their
own front end) from `preprocess/release_encoders.py`.
Add an encoder with `@register_visual("name")` / `@register_audio("name")` on a
subclass of VisualEncoder / AudioEncoder.

Audio tokens per segment (A). Segments have one fixed duration d within a video
(the fps policy's last segment may be shorter), but d differs between videos. A
is constant within a video: features.audio_tokens_per_segment if > 0, else
max(1, round(audio_tokens_per_second * d)) from the first segment. Token k of
segment t is the mean of the encoder's audio frames whose centres fall in the
k-th of A equal sub-windows of the segment (the nearest frame when a sub-window
holds none), so tokens cover the segment exactly, however long it is.

Encoders run on `features.device` (auto = CUDA if available) in batches of
`features.batch_size` frames under torch.inference_mode(). Pure torch, no ray.
"""

from __future__ import annotations

import math
from typing import Callable, TypeVar

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.config import FeaturesConfig
from preprocess.media import DecodedVideo

VISUAL_ENCODERS: dict[str, type["VisualEncoder"]] = {}
AUDIO_ENCODERS: dict[str, type["AudioEncoder"]] = {}
_T = TypeVar("_T")


def register_visual(name: str) -> Callable[[_T], _T]:
    def wrap(cls):
        VISUAL_ENCODERS[name] = cls
        cls.name = name
        return cls

    return wrap


def register_audio(name: str) -> Callable[[_T], _T]:
    def wrap(cls):
        AUDIO_ENCODERS[name] = cls
        cls.name = name
        return cls

    return wrap


def get_visual_encoder(cfg: FeaturesConfig) -> "VisualEncoder":
    if cfg.visual_encoder not in VISUAL_ENCODERS:
        raise ValueError(f"unknown visual encoder {cfg.visual_encoder!r}; registered: {sorted(VISUAL_ENCODERS)}")
    return VISUAL_ENCODERS[cfg.visual_encoder](cfg)


def get_audio_encoder(cfg: FeaturesConfig) -> "AudioEncoder":
    if cfg.audio_encoder not in AUDIO_ENCODERS:
        raise ValueError(f"unknown audio encoder {cfg.audio_encoder!r}; registered: {sorted(AUDIO_ENCODERS)}")
    return AUDIO_ENCODERS[cfg.audio_encoder](cfg)


def encoder_versions(cfg: FeaturesConfig) -> dict[str, str]:
    """{"visual": "pixels@2", "audio": "mel@1"}: what the configured encoders are, for stage hashes."""
    visual, audio = VISUAL_ENCODERS[cfg.visual_encoder], AUDIO_ENCODERS[cfg.audio_encoder]
    return {"visual": f"{visual.name}@{visual.version}", "audio": f"{audio.name}@{audio.version}"}


def resolve_device(name: str) -> torch.device:
    """auto -> cuda if available else cpu; cuda without CUDA is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("features.device=cuda but CUDA is not available")
    return torch.device(name)


def audio_tokens_per_segment(cfg: FeaturesConfig, segment_times: np.ndarray) -> int:
    """A for one video (see the module docstring)."""
    if cfg.audio_tokens_per_segment > 0:
        return cfg.audio_tokens_per_segment
    d = float(segment_times[0, 1] - segment_times[0, 0])
    return max(1, int(math.floor(cfg.audio_tokens_per_second * d + 0.5)))


def pool_frames_to_segments(
    feats: torch.Tensor, frame_rate: float, first_centre: float, segment_times: np.ndarray, tokens: int
) -> torch.Tensor:
    """Mean-pool a frame sequence onto segment sub-windows.

    feats [F, D] with frame j centred at first_centre + j / frame_rate (seconds);
    segment_times [T, 2]. Returns [T, tokens, D] (float32): token k of segment t is the
    mean of frames centred in [s + k*(e-s)/tokens, s + (k+1)*(e-s)/tokens), or the
    nearest frame if none is.
    """
    n = feats.shape[0]
    if n == 0:
        raise ValueError("no audio frames to pool")
    seg = torch.as_tensor(segment_times, dtype=torch.float64)
    frac = torch.arange(tokens + 1, dtype=torch.float64) / tokens
    edges = seg[:, :1] + (seg[:, 1:] - seg[:, :1]) * frac  # [T, tokens + 1]
    pos = (edges - first_centre) * frame_rate  # edges in frame-index units
    lo = torch.ceil(pos[:, :-1] - 1e-9).clamp(0, n).long()
    hi = torch.ceil(pos[:, 1:] - 1e-9).clamp(0, n).long()
    nearest = torch.round((pos[:, :-1] + pos[:, 1:]) / 2).clamp(0, n - 1).long()
    empty = hi <= lo
    lo = torch.where(empty, nearest, lo)
    hi = torch.where(empty, nearest + 1, hi)
    csum = torch.cat([feats.new_zeros(1, feats.shape[1], dtype=torch.float64), feats.double().cumsum(0)])
    csum = csum.to(lo.device)
    means = (csum[hi] - csum[lo]) / (hi - lo).unsqueeze(-1)
    return means.float()


# --------------------------------------------------------------------------- base classes


class VisualEncoder:
    """Frames -> `tokens` vectors of size `dim` per frame; subclasses set both in __init__.

    `version` changes whenever the same config would give different features, so shards
    written by an older encoder are redone (it is part of the preprocess stage hash).
    """

    name = ""
    version = 1
    dim: int
    tokens: int

    def __init__(self, cfg: FeaturesConfig):
        self.cfg = cfg
        self.device = resolve_device(cfg.device)

    def encode_batch(self, frames: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
        """uint8 [B, H, W, 3] on self.device (+ the frame before them, [H, W, 3], or None) -> [B, tokens, dim]."""
        raise NotImplementedError

    def encode(self, decoded: DecodedVideo) -> np.ndarray:
        """-> float16 [T, frames_per_segment * tokens, dim]."""
        frames = torch.from_numpy(decoded.frames)
        out = []
        with torch.inference_mode():
            for i in range(0, frames.shape[0], self.cfg.batch_size):
                batch = frames[i : i + self.cfg.batch_size].to(self.device)
                previous = frames[i - 1].to(self.device) if i > 0 else None
                out.append(self.encode_batch(batch, previous).float().cpu())
        feats = torch.cat(out)  # [N, tokens, dim]
        t = decoded.num_segments
        return feats.reshape(t, -1, feats.shape[-1]).numpy().astype(np.float16)


class AudioEncoder:
    """Mono audio -> a frame sequence, pooled onto the segments; subclasses set `dim` (`version`: as VisualEncoder)."""

    name = ""
    version = 1
    dim: int

    def __init__(self, cfg: FeaturesConfig):
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        self.tokens = cfg.audio_tokens_per_second  # tokens per second (see audio_tokens_per_segment)

    def frames(self, audio: np.ndarray, sample_rate: int) -> tuple[torch.Tensor, float, float]:
        """float32 [S] -> (feats [F, dim], frame rate in Hz, centre time of frame 0 in s)."""
        raise NotImplementedError

    def encode(self, decoded: DecodedVideo) -> np.ndarray:
        """-> float16 [T, A, dim]; zeros when the video has no audio."""
        a = audio_tokens_per_segment(self.cfg, decoded.segment_times)
        t = decoded.num_segments
        if not decoded.has_audio or decoded.audio is None or decoded.audio.size == 0:
            return np.zeros((t, a, self.dim), dtype=np.float16)
        with torch.inference_mode():
            feats, rate, first = self.frames(decoded.audio, decoded.sample_rate)
            pooled = pool_frames_to_segments(feats.float().cpu(), rate, first, decoded.segment_times, a)
        return pooled.numpy().astype(np.float16)


# --------------------------------------------------------------------------- pixels


def _gaussian_blur(x: torch.Tensor, sigma: float) -> torch.Tensor:
    """[B, 1, H, W] separable Gaussian blur, replicate padding."""
    radius = max(1, int(math.ceil(2 * sigma)))
    k = torch.exp(-0.5 * (torch.arange(-radius, radius + 1, device=x.device, dtype=x.dtype) / sigma) ** 2)
    k = k / k.sum()
    x = F.conv2d(F.pad(x, (radius, radius, 0, 0), mode="replicate"), k.view(1, 1, 1, -1))
    return F.conv2d(F.pad(x, (0, 0, radius, radius), mode="replicate"), k.view(1, 1, -1, 1))


def _gradients(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., H, W] -> (d/dx, d/dy), central differences; zero on the border rows / columns."""
    ix = torch.zeros_like(x)
    iy = torch.zeros_like(x)
    ix[..., :, 1:-1] = 0.5 * (x[..., :, 2:] - x[..., :, :-2])
    iy[..., 1:-1, :] = 0.5 * (x[..., 2:, :] - x[..., :-2, :])
    return ix, iy


@register_visual("pixels")
class PixelsEncoder(VisualEncoder):
    """Weight-free patch statistics: a g x g grid (g = sqrt(visual_tokens_per_frame)) per frame.

    Per patch (dim 14), all mapped to about [-1, 1] by fixed scalings (no per-video
    statistics, so colours compare across videos):
      0-2  mean R, G, B                    2*m - 1
      3-5  std R, G, B                     4*s - 1
      6    RMS change from the previous sampled frame   2*tanh(4*rms) - 1
      7-8  motion (dx, dy) from the previous sampled frame, Lucas-Kanade on the
           blurred grey image, pooled over the patch; pixels per frame scaled by the
           patch size: tanh(4*dx/patch_w), tanh(4*dy/patch_h). x grows rightwards,
           y downwards. The first frame of a video has zero change and motion.
      9    edge energy: 2*tanh(EDGE_GAIN * e) - 1, e = the patch mean of the colour
           gradient energy |grad R|^2 + |grad G|^2 + |grad B|^2 on the blurred frame
      10-13 edge orientation histogram (HOG-like): the fraction of that energy whose
           edge runs horizontally, along the rising diagonal, vertically, along the
           falling diagonal (soft bins of the doubled angle of each pixel's colour
           structure tensor); all ~0.25 on flat patches. Contrast-invariant and
           non-negative, so it survives averaging over patches and frames: squares
           and stripes put their energy in the horizontal/vertical bins, triangles in
           the horizontal and both diagonal bins, circles spread it over all four
           (the means and stds alone confuse shape with size and position).
    """

    version = 2  # 2: + edge energy and orientation histogram (dim 9 -> 14)
    LK_REG = 1e-3  # ridge on the 2x2 LK system (flat patches give ~zero motion)
    EDGE_GAIN = 150.0  # the edge energy of a patch crossed by one full-contrast edge is ~0.005-0.01
    EDGE_EPS = 1e-4  # patches with less energy read as flat (uniform histogram)

    def __init__(self, cfg: FeaturesConfig):
        super().__init__(cfg)
        g = int(round(math.sqrt(cfg.visual_tokens_per_frame)))
        if g * g != cfg.visual_tokens_per_frame or g < 1:
            raise ValueError(f"pixels needs a square visual_tokens_per_frame (1, 4, 9, ...), got {cfg.visual_tokens_per_frame}")
        self.grid = g
        self.tokens = g * g
        self.dim = 14

    def encode_batch(self, frames: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
        b, h, w, _ = frames.shape
        g = self.grid
        x = frames.permute(0, 3, 1, 2).float() / 255.0  # [B, 3, H, W]
        prev_first = x[:1] if previous is None else previous.permute(2, 0, 1).unsqueeze(0).float() / 255.0
        prev = torch.cat([prev_first, x[:-1]])  # the frame before each one (the first: itself or `previous`)
        mean = F.adaptive_avg_pool2d(x, g)
        std = (F.adaptive_avg_pool2d(x * x, g) - mean * mean).clamp_min(0).sqrt()
        diff = x - prev
        rms = F.adaptive_avg_pool2d((diff * diff).mean(1, keepdim=True), g).sqrt()
        sigma = max(1.0, min(h, w) / 32.0)
        cur_g = _gaussian_blur(x.mean(1, keepdim=True), sigma)
        prev_g = _gaussian_blur(prev.mean(1, keepdim=True), sigma)
        avg = 0.5 * (cur_g + prev_g)
        ix, iy = _gradients(avg)
        it = cur_g - prev_g
        sxx, syy, sxy = (F.adaptive_avg_pool2d(v, g) for v in (ix * ix, iy * iy, ix * iy))
        bx, by = (-F.adaptive_avg_pool2d(v, g) for v in (ix * it, iy * it))
        sxx, syy = sxx + self.LK_REG, syy + self.LK_REG
        det = sxx * syy - sxy * sxy
        dx = (syy * bx - sxy * by) / det
        dy = (sxx * by - sxy * bx) / det
        if previous is None:  # the first frame of the video has nothing before it
            rms[0] = 0
            dx[0] = 0
            dy[0] = 0
        feats = torch.cat(
            [
                2 * mean - 1,
                4 * std - 1,
                2 * torch.tanh(4 * rms) - 1,
                torch.tanh(4 * dx * g / w),
                torch.tanh(4 * dy * g / h),
                self._orientation(x, sigma),
            ],
            dim=1,
        )  # [B, 14, g, g]
        return feats.flatten(2).transpose(1, 2)  # [B, g*g, 14], row-major patches

    def _orientation(self, x: torch.Tensor, sigma: float) -> torch.Tensor:
        """frames [B, 3, H, W] in [0, 1] -> [B, 5, g, g]: edge energy + 4-bin orientation histogram."""
        b, c, h, w = x.shape
        xb = _gaussian_blur(x.reshape(b * c, 1, h, w), sigma).reshape(b, c, h, w)
        ix, iy = _gradients(xb)
        jxx, jyy, jxy = (v.sum(1, keepdim=True) for v in (ix * ix, iy * iy, ix * iy))  # per pixel [B, 1, H, W]
        energy = jxx + jyy
        # doubled angle of the dominant gradient direction; an edge runs across its gradient,
        # so phi = 0 is a vertical edge and phi = pi a horizontal one
        phi = torch.atan2(2 * jxy, jxx - jyy)
        centres = torch.tensor([math.pi, math.pi / 2, 0.0, -math.pi / 2], dtype=x.dtype, device=x.device)
        weights = torch.cos(phi - centres.view(1, 4, 1, 1)).clamp_min(0)  # [B, 4, H, W]; sums to 1..1.41
        weights = weights / weights.sum(1, keepdim=True)
        g = self.grid
        e = F.adaptive_avg_pool2d(energy, g)
        hist = F.adaptive_avg_pool2d(weights * energy, g)
        hist = (hist + 0.25 * self.EDGE_EPS) / (e + self.EDGE_EPS)
        return torch.cat([2 * torch.tanh(self.EDGE_GAIN * e) - 1, hist], dim=1)


# --------------------------------------------------------------------------- mel


def mel_filterbank(n_mels: int, n_fft: int, sample_rate: int, fmin: float = 0.0, fmax: float | None = None) -> torch.Tensor:
    """Slaney-style triangular mel filters, area-normalised: [n_mels, n_fft // 2 + 1]."""
    fmax = sample_rate / 2 if fmax is None else fmax
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel, logstep = min_log_hz / f_sp, math.log(6.4) / 27.0

    def hz_to_mel(f: torch.Tensor) -> torch.Tensor:
        return torch.where(f < min_log_hz, f / f_sp, min_log_mel + torch.log(f.clamp_min(1e-9) / min_log_hz) / logstep)

    def mel_to_hz(m: torch.Tensor) -> torch.Tensor:
        return torch.where(m < min_log_mel, m * f_sp, min_log_hz * torch.exp(logstep * (m - min_log_mel)))

    mels = torch.linspace(float(hz_to_mel(torch.tensor(fmin))), float(hz_to_mel(torch.tensor(fmax))), n_mels + 2, dtype=torch.float64)
    hz = mel_to_hz(mels)
    bins = torch.linspace(0, sample_rate / 2, n_fft // 2 + 1, dtype=torch.float64)
    lower, centre, upper = hz[:-2, None], hz[1:-1, None], hz[2:, None]
    up = (bins[None] - lower) / (centre - lower)
    down = (upper - bins[None]) / (upper - centre)
    weights = torch.clamp(torch.minimum(up, down), min=0.0)
    weights = weights * (2.0 / (upper - lower))
    return weights.float()


@register_audio("mel")
class MelEncoder(AudioEncoder):
    """Weight-free log-mel features at 100 frames/s (25 ms Hann window, 10 ms hop).

    Per frame (dim n_mels + 2), by fixed scalings:
      0..n_mels-1  (log10(max(mel power, 1e-8)) + 4) / 4   (Whisper's scaling, no per-clip max)
      n_mels       frame energy: (10*log10(Hann-weighted mean square of the samples) + 50) / 50
      n_mels+1     spectral centroid as a fraction of Nyquist, 2*c - 1
    then pooled onto the segments (module docstring).
    """

    N_FFT = 400
    HOP = 160
    CHUNK_FRAMES = 6000  # one STFT per 60 s of audio bounds memory on long videos

    def __init__(self, cfg: FeaturesConfig):
        super().__init__(cfg)
        if cfg.n_mels < 1:
            raise ValueError(f"n_mels must be positive, got {cfg.n_mels}")
        self.dim = cfg.n_mels + 2
        self.window = torch.hann_window(self.N_FFT, periodic=True, device=self.device)
        self.filters = mel_filterbank(cfg.n_mels, self.N_FFT, cfg.sample_rate).to(self.device)
        self.bin_hz = torch.linspace(0, 1, self.N_FFT // 2 + 1, device=self.device)

    def frames(self, audio: np.ndarray, sample_rate: int) -> tuple[torch.Tensor, float, float]:
        if sample_rate != self.cfg.sample_rate:
            raise ValueError(f"mel expects {self.cfg.sample_rate} Hz audio, got {sample_rate}")
        x = torch.from_numpy(np.ascontiguousarray(audio, dtype=np.float32))
        half = self.N_FFT // 2
        x = F.pad(x, (half, half))  # frame j is centred on sample j * HOP
        total = 1 + audio.shape[0] // self.HOP
        out = []
        for f0 in range(0, total, self.CHUNK_FRAMES):
            f1 = min(total, f0 + self.CHUNK_FRAMES)
            piece = x[f0 * self.HOP : (f1 - 1) * self.HOP + self.N_FFT].to(self.device)
            spec = torch.stft(piece, self.N_FFT, self.HOP, window=self.window, center=False, return_complex=True)
            power = spec.abs().square()  # [bins, frames]
            mel = self.filters @ power
            logmel = (torch.log10(mel.clamp_min(1e-8)) + 4) / 4
            frames = piece.unfold(0, self.N_FFT, self.HOP)  # [frames, N_FFT]
            mean_square = (frames.square() * self.window).sum(1) / self.window.sum()
            energy = (10 * torch.log10(mean_square + 1e-10) + 50) / 50
            centroid = (self.bin_hz[:, None] * power).sum(0) / (power.sum(0) + 1e-10)
            out.append(torch.cat([logmel, energy[None], 2 * centroid[None] - 1]).T.float().cpu())
        return torch.cat(out), sample_rate / self.HOP, 0.0


# The HF encoders register themselves (transformers is imported only when one is built).
from preprocess import hf_encoders as _hf_encoders  # noqa: E402,F401
from preprocess import release_encoders as _release_encoders  # noqa: E402,F401
