"""The feature encoders' registry and base classes (the encoders themselves import this, not
`preprocess/encoders.py`, which imports them all: no import circle).

    @register_visual("name") class MyEncoder(VisualEncoder): ...
    get_visual_encoder(cfg.features)  # through preprocess.encoders, which registers every built-in one

See `preprocess/encoders.py` for what an encoder produces and the audio-token rule.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import numpy as np
import torch

from pipeline.config import FeaturesConfig
from preprocess.media import DecodedVideo

VISUAL_ENCODERS: dict[str, type[VisualEncoder]] = {}
AUDIO_ENCODERS: dict[str, type[AudioEncoder]] = {}
_T = TypeVar("_T")


def _registrar(table: dict[str, Any], name: str) -> Callable[[_T], _T]:
    def wrap(cls):
        table[name] = cls
        cls.name = name
        return cls

    return wrap


register_visual = partial(_registrar, VISUAL_ENCODERS)  # @register_visual("name") on a VisualEncoder subclass
register_audio = partial(_registrar, AUDIO_ENCODERS)  # @register_audio("name") on an AudioEncoder subclass


def get_visual_encoder(cfg: FeaturesConfig) -> VisualEncoder:
    return _encoder_class(VISUAL_ENCODERS, cfg.visual_encoder, "visual")(cfg)


def get_audio_encoder(cfg: FeaturesConfig) -> AudioEncoder:
    return _encoder_class(AUDIO_ENCODERS, cfg.audio_encoder, "audio")(cfg)


def _encoder_class(table: dict[str, type], name: str, what: str) -> type:
    if name not in table:
        raise ValueError(f"unknown {what} encoder {name!r}; registered: {sorted(table)}")
    return table[name]


def encoder_dims(cfg: FeaturesConfig) -> tuple[int, int]:
    """(Dv, Da) the configured encoders produce, read from their configs where the encoder can tell
    (`config_dim`: the HF and release towers, no weights loaded), else from an encoder built here."""
    out = []
    for table, name, what, get in ((VISUAL_ENCODERS, cfg.visual_encoder, "visual", get_visual_encoder),
                                   (AUDIO_ENCODERS, cfg.audio_encoder, "audio", get_audio_encoder)):
        dim = _encoder_class(table, name, what).config_dim(cfg)
        out.append(int(dim) if dim is not None else get(cfg).dim)
    return out[0], out[1]


def encoder_versions(cfg: FeaturesConfig) -> dict[str, str]:
    """{"visual": "pixels@3", "audio": "mel@1"}: what the configured encoders are, for stage hashes."""
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


class _Encoder:
    """What both kinds of encoder share: the config, the device, the registered `name` and the `version`.

    `version` changes whenever the same config would give different features, so shards
    written by an older encoder are redone (it is part of the preprocess stage hash).
    """

    name = ""
    version = 1
    dim: int

    def __init__(self, cfg: FeaturesConfig):
        self.cfg = cfg
        self.device = resolve_device(cfg.device)

    @classmethod
    def config_dim(cls, cfg: FeaturesConfig) -> int | None:
        """`dim` without building the encoder (no weights), when the config tells it; None: build to know."""
        return None


class VisualEncoder(_Encoder):
    """Frames -> `tokens` vectors of size `dim` per frame; subclasses set both in __init__."""

    tokens: int

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


class AudioEncoder(_Encoder):
    """Mono audio -> a frame sequence, pooled onto the segments; subclasses set `dim`."""

    def __init__(self, cfg: FeaturesConfig):
        super().__init__(cfg)
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
