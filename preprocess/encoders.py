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
own media preparation) from `preprocess/release_encoders.py`.
Add an encoder with `@register_visual("name")` / `@register_audio("name")` on a
subclass of VisualEncoder / AudioEncoder, all from `preprocess/encoder_base.py` (the
registry lives there, so the encoder modules import it and this module imports them:
no import circle); callers import them from here, which registers every built-in one.

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

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.config import FeaturesConfig
from preprocess.encoder_base import (  # noqa: F401  (re-exported: the registry's home is encoder_base)
    AudioEncoder,
    VisualEncoder,
    encoder_dims,
    encoder_versions,
    get_audio_encoder,
    get_visual_encoder,
    register_audio,
    register_visual,
)

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

    Per patch (dim 17), all mapped to about [-1, 1] by fixed scalings (no per-video
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
      10-13 edge orientation histogram (HOG-like): the fraction f of that energy whose
           edge runs horizontally, along the rising diagonal, vertically, along the
           falling diagonal (soft bins of the doubled angle of each pixel's colour
           structure tensor), as 4*f - 1: 0 where the energy is spread evenly (f = 0.25,
           as on flat patches), -1 for a bin with none of it, +1 for half of it (why scaled:
           docs/benchmarks.md, "the scale of its channels"). Contrast-invariant and
           non-negative, so it survives averaging over patches and frames: squares
           and stripes put their energy in the horizontal/vertical bins, triangles in
           the horizontal and both diagonal bins, circles spread it over all four
           (the means and stds alone confuse shape with size and position).
      14-16 chroma-weighted mean R, G, B: 2*m - 1, m = the patch mean of each pixel's colour
           weighted by its chroma (max - min of its R, G, B), plus CHROMA_EPS of the plain mean:
           the colour of the patch's coloured pixels whatever fraction of the patch they
           cover (the plain mean mixes it with the background by coverage: docs/benchmarks.md,
           "the rows that decide it"). Grey and white pixels weigh ~nothing, so
           a patch with no coloured pixel gives its plain mean.
    """

    version = 4  # 4: + chroma-weighted colour (dim 14 -> 17)
    LK_REG = 1e-3  # ridge on the 2x2 LK system (flat patches give ~zero motion)
    EDGE_GAIN = 150.0  # the edge energy of a patch crossed by one full-contrast edge is ~0.005-0.01
    EDGE_EPS = 1e-4  # patches with less energy read as flat (uniform histogram)
    CHROMA_EPS = 0.01  # below this patch-mean chroma (grey noise is ~0.02) the plain mean dominates

    def __init__(self, cfg: FeaturesConfig):
        super().__init__(cfg)
        g = int(round(math.sqrt(cfg.visual_tokens_per_frame)))
        if g * g != cfg.visual_tokens_per_frame or g < 1:
            raise ValueError(f"pixels needs a square visual_tokens_per_frame (1, 4, 9, ...), got {cfg.visual_tokens_per_frame}")
        self.grid = g
        self.tokens = g * g
        self.dim = 17

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
            for v in (rms, dx, dy):
                v[0] = 0
        feats = torch.cat(
            [
                2 * mean - 1,
                4 * std - 1,
                2 * torch.tanh(4 * rms) - 1,
                torch.tanh(4 * dx * g / w),
                torch.tanh(4 * dy * g / h),
                self._orientation(x, sigma),
                2 * self._chroma_mean(x, mean) - 1,
            ],
            dim=1,
        )  # [B, 17, g, g]
        return feats.flatten(2).transpose(1, 2)  # [B, g*g, 17], row-major patches

    def _chroma_mean(self, x: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
        """frames [B, 3, H, W] in [0, 1], their patch means [B, 3, g, g] -> [B, 3, g, g]: each patch's
        chroma-weighted mean colour (channels 14-16 of the class doc)."""
        chroma = x.amax(1, keepdim=True) - x.amin(1, keepdim=True)  # [B, 1, H, W]
        g = self.grid
        return (F.adaptive_avg_pool2d(chroma * x, g) + self.CHROMA_EPS * mean) / (
            F.adaptive_avg_pool2d(chroma, g) + self.CHROMA_EPS)

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
        return torch.cat([2 * torch.tanh(self.EDGE_GAIN * e) - 1, 4 * hist - 1], dim=1)


# --------------------------------------------------------------------------- mel


def mel_filterbank(n_mels: int, n_fft: int, sample_rate: int) -> torch.Tensor:
    """Slaney-style triangular mel filters, area-normalised, from 0 Hz to Nyquist: [n_mels, n_fft // 2 + 1]."""
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel, logstep = min_log_hz / f_sp, math.log(6.4) / 27.0

    def hz_to_mel(f: torch.Tensor) -> torch.Tensor:
        return torch.where(f < min_log_hz, f / f_sp, min_log_mel + torch.log(f.clamp_min(1e-9) / min_log_hz) / logstep)

    def mel_to_hz(m: torch.Tensor) -> torch.Tensor:
        return torch.where(m < min_log_mel, m * f_sp, min_log_hz * torch.exp(logstep * (m - min_log_mel)))

    mels = torch.linspace(float(hz_to_mel(torch.tensor(0.0))), float(hz_to_mel(torch.tensor(sample_rate / 2))), n_mels + 2, dtype=torch.float64)
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
