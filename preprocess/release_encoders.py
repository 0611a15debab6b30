"""The released PadCaptioner-3B's own encoders, registered as `release`: its vision tower, Whisper + Q-Former.

    features.visual_encoder = features.audio_encoder = "release"; features.release_path = the checkpoint dir
    featurizer = Featurizer(cfg)          # preprocess/featurize.py hands a release config to ReleaseFeaturizer
    item = featurizer(uri, annotation)

The media preparation is preprocess/release_media.py (the release's frame and audio rules); the towers are the
checkpoint's (pipeline/release/model.py `ReleaseCaptioner.encode_video` / `encode_audio`). Two ways to use
them, by features.release_features:

  stored  the featurizer encodes: a schema-2 `Sample` (pipeline/schema.py) with visual float16 [T, V, d]
          (V = (gh/2)(gw/2) merged tokens per timestep, LLM width d), ragged audio float16 [A_total, d] with
          per-segment counts a_t (all 60 tokens per started 30 s chunk, padding included; none without
          audio), grid_thw and seconds_per_timestep. ~35 MB per 256-frame video at d = 2048
          (docs/design/release.md §5.7).
  online  the featurizer runs only the media preparation: a `pipeline.release.video.ReleaseVideo` holding
          pixel_values and mel, which the captioning engine encodes with its own model on its own device
          (pipeline/release/decoding.py `media_tokens`), so a Serve replica or caption actor holds one copy of
          the towers and nothing is stored. Not storable in shards (schema.encode refuses it).

`pipeline.release.video.as_release_video(sample)` turns a stored schema-2 Sample into the ReleaseVideo the
engine takes. The encoders load the checkpoint lazily, on first use, once per process and device (`release_model`),
on features.device (auto = CUDA when present), in bfloat16 on CUDA (as the release runs) and float32 on
CPU. `dim` is read from config.json without loading weights. Pure torch, no ray.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.config import Config, FeaturesConfig, section_hash
from pipeline.schema import COUNT_DTYPE, FEATURE_DTYPE
from preprocess.encoder_base import AudioEncoder, VisualEncoder, register_audio, register_visual
from preprocess.events import annotated_sample
from preprocess.media import DecodedVideo
from preprocess.release_media import MediaConfig, ReleaseInputs, read_release_inputs, whisper_extractor

_MODELS: dict[tuple[str, str], Any] = {}
_LOCK = threading.Lock()


def uses_release(cfg: FeaturesConfig) -> bool:
    """True when either encoder is `release` (then both must be: one timeline, the release's)."""
    return "release" in (cfg.visual_encoder, cfg.audio_encoder)


def _need_release_path(cfg: FeaturesConfig) -> Path:
    if cfg.visual_encoder != "release" or cfg.audio_encoder != "release":
        raise ValueError(f"the release encoders work as a pair: features.visual_encoder={cfg.visual_encoder!r}, "
                         f"audio_encoder={cfg.audio_encoder!r}; set both to 'release'")
    if not cfg.release_path:
        raise ValueError("features.release_path must name the release checkpoint directory for the release encoders")
    path = Path(cfg.release_path).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(f"features.release_path={cfg.release_path!r} has no config.json")
    return path.resolve()


def release_model(path: str | Path, device: torch.device):
    """The checkpoint's two towers (a towers-only ReleaseCaptioner: the LLM is never read nor put on
    `device`), loaded once per process (shared by both encoders)."""
    from pipeline.release.model import ReleaseCaptioner, ReleaseSettings

    key = (str(Path(path).resolve()), str(device))
    with _LOCK:
        if key not in _MODELS:
            dtype = "bfloat16" if device.type == "cuda" else "float32"
            model = ReleaseCaptioner.from_release(key[0], ReleaseSettings(dtype=dtype), device=device,
                                                  towers_only=True).eval()
            for p in model.parameters():
                p.requires_grad_(False)
            _MODELS[key] = model
        return _MODELS[key]


class _ReleaseTower:
    """What the two release encoders share: the checkpoint path, its width, the lazily loaded model."""

    version = 1

    def __init__(self, cfg: FeaturesConfig):
        super().__init__(cfg)  # the encoder kind's set-up (VisualEncoder / AudioEncoder, next in the MRO), then the checkpoint's
        self.path = _need_release_path(cfg)
        self.dim = self.config_dim(cfg)

    @classmethod
    def config_dim(cls, cfg: FeaturesConfig) -> int:
        """The LLM width d (what both towers output), from config.json alone."""
        return int(json.loads((_need_release_path(cfg) / "config.json").read_text())["hidden_size"])

    @property
    def model(self):
        return release_model(self.path, self.device)

    def encode(self, decoded: DecodedVideo) -> np.ndarray:
        raise TypeError("the release encoders take the release media's ReleaseInputs (encode_inputs), not a "
                        "DecodedVideo: its frames and audio follow other rules; Featurizer routes a release config")


@register_visual("release")
class ReleaseVisualEncoder(_ReleaseTower, VisualEncoder):
    """The checkpoint's Qwen2.5-VL vision tower + merger: V merged tokens of width d per timestep."""

    @torch.inference_mode()
    def encode_inputs(self, inputs: ReleaseInputs) -> np.ndarray:
        """-> float16 [T, V, d]."""
        grid = torch.tensor([list(inputs.grid_thw)])
        tokens = self.model.encode_video(inputs.pixel_values(), grid).float().cpu()
        t, v = inputs.num_timesteps, inputs.tokens_per_timestep
        if tokens.shape != (t * v, self.dim):
            raise ValueError(f"the vision tower gave {list(tokens.shape)} tokens for grid {list(inputs.grid_thw)}, "
                             f"expected [{t * v}, {self.dim}]")
        return tokens.reshape(t, v, self.dim).numpy().astype(FEATURE_DTYPE)


@register_audio("release")
class ReleaseAudioEncoder(_ReleaseTower, AudioEncoder):
    """The checkpoint's Whisper encoder + window Q-Former: 60 tokens of width d per 30 s chunk."""

    @torch.inference_mode()
    def encode_inputs(self, inputs: ReleaseInputs) -> np.ndarray:
        """-> float16 [A_total, d] (all audio tokens in order), [0, d] without audio.

        Chunks are encoded `features.audio_batch_size` at a time (Whisper sees each alone, as in the release).
        """
        if inputs.mel is None:
            return np.zeros((0, self.dim), dtype=FEATURE_DTYPE)
        mel = torch.from_numpy(inputs.mel)
        step = max(1, self.cfg.audio_batch_size)
        tokens = torch.cat([self.model.encode_audio(mel[i:i + step]).float().cpu() for i in range(0, mel.shape[0], step)])
        if tokens.shape != (inputs.audio_total, self.dim):
            raise ValueError(f"the audio tower gave {list(tokens.shape)} tokens for {mel.shape[0]} chunks, "
                             f"expected [{inputs.audio_total}, {self.dim}]")
        return tokens.numpy().astype(FEATURE_DTYPE)


class ReleaseReader:
    """The release media preparation alone: a video -> its `ReleaseInputs` (resized uint8 frames, log-mel chunks), no
    weights (what a Serve decode worker runs, infer/serving/media_pool.py)."""

    def __init__(self, cfg: Config):
        self.path = _need_release_path(cfg.features)
        self.cfg = cfg
        self.media = MediaConfig.from_features(cfg.features)
        self.extractor = whisper_extractor()

    def __call__(self, uri: str) -> ReleaseInputs:
        f = self.cfg.features
        return read_release_inputs(uri, self.media, None, f.max_media_bytes, f.decode_threads, self.extractor)


class ReleaseFeaturizer:
    """A video (+ annotation) -> schema-2 Sample (stored) or ReleaseVideo (online); see the module doc.
    `inputs(uri)` is the media preparation (`ReleaseReader`), `encode(inputs, annotation)` the rest."""

    def __init__(self, cfg: Config, reader: ReleaseReader | None = None):
        features = cfg.features
        self.reader = reader or ReleaseReader(cfg)
        self.cfg = cfg
        self.online = features.release_features == "online"
        self.feature_hash = section_hash(features)
        self.visual = self.audio = None
        if not self.online:
            self.visual = ReleaseVisualEncoder(features)
            self.audio = ReleaseAudioEncoder(features)

    def inputs(self, uri: str) -> ReleaseInputs:
        """The media preparation alone (infer/offline/job.py's front end with online release features)."""
        return self.reader(uri)

    def encode(self, inputs: ReleaseInputs, annotation: Any):
        """Prepared media -> a ReleaseVideo (online) or a schema-2 Sample through the towers (stored)."""
        if self.online:
            return inputs_video(inputs, annotation.video_id)
        return annotated_sample(annotation, float(inputs.length_s), self.cfg, self.feature_hash, lambda: dict(
            segment_times=inputs.segment_times(), visual=self.visual.encode_inputs(inputs),
            audio=self.audio.encode_inputs(inputs), has_audio=inputs.has_audio,
            audio_counts=np.asarray(inputs.audio_counts, dtype=COUNT_DTYPE), grid_thw=tuple(inputs.grid_thw),
            seconds_per_timestep=float(inputs.seconds_per_timestep)))


def inputs_video(inputs: ReleaseInputs, video_id: str):
    """Front-end output -> a ReleaseVideo with pixel_values and mel (encoded later, by the engine's model)."""
    from pipeline.release.video import ReleaseVideo

    mel = None if inputs.mel is None else torch.from_numpy(inputs.mel)
    return ReleaseVideo(video_id=video_id, duration=float(inputs.length_s),
                        seconds_per_step=float(inputs.seconds_per_timestep), grid_thw=tuple(inputs.grid_thw),
                        pixel_values=inputs.pixel_values(), mel=mel, geometry=inputs.geometry)
