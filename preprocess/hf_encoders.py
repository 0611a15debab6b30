"""HF model encoders loaded from local paths: `hf_vision` (SigLIP / CLIP vision tower) and `whisper`.

Registered into the registry of `preprocess/encoders.py` (import that module, not
this one). Both load with the ordinary HF calls a user would make on a local
directory written by `save_pretrained` (no hub access):

  hf_vision  features.vision_path holds config.json (+ weights) of a SigLIP or CLIP
             model (the vision model alone or the full dual encoder; only the vision
             tower is loaded) and preprocessor_config.json. The class comes from the
             config's model_type. Frames go through the saved image processor; the
             patch tokens of last_hidden_state (CLIP's class token dropped) are
             average-pooled over the patch grid to sqrt(V) x sqrt(V) tokens,
             V = visual_tokens_per_frame. dim = the tower's hidden size.
             Set features.image_size to the tower's input size so frames are
             decoded at (about) the size the processor wants.
  whisper    features.audio_path holds a Whisper model (WhisperModel or
             WhisperForConditionalGeneration; only the encoder is kept) and its
             WhisperFeatureExtractor. Audio is cut into 30 s windows (the last one
             zero-padded by the extractor), encoded `audio_batch_size` windows per
             forward; the encoder's 50 frames/s outputs that cover real audio are
             concatenated and pooled onto the segments (audio_tokens_per_second,
             default 2, tokens per second). dim = d_model.

On CUDA the models run in float16, on CPU in float32.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.config import FeaturesConfig
from preprocess.encoder_base import AudioEncoder, VisualEncoder, register_audio, register_visual

_VISION_TYPES = {
    "siglip": "SiglipVisionModel",
    "siglip_vision_model": "SiglipVisionModel",
    "clip": "CLIPVisionModel",
    "clip_vision_model": "CLIPVisionModel",
}


def _dtype(device: torch.device) -> torch.dtype:
    return torch.float16 if device.type == "cuda" else torch.float32


def _need_path(path: str, key: str) -> str:
    if not path:
        raise ValueError(f"features.{key} must name a local model directory for this encoder")
    return path


@register_visual("hf_vision")
class HFVisionEncoder(VisualEncoder):
    """SigLIP / CLIP vision tower from a local directory; V pooled patch tokens per frame."""

    def __init__(self, cfg: FeaturesConfig):
        super().__init__(cfg)
        import transformers
        from transformers import AutoConfig, AutoImageProcessor

        path = _need_path(cfg.vision_path, "vision_path")
        model_type = AutoConfig.from_pretrained(path).model_type
        if model_type not in _VISION_TYPES:
            raise ValueError(f"{path}: model_type {model_type!r} is not a supported vision tower ({sorted(_VISION_TYPES)})")
        cls = getattr(transformers, _VISION_TYPES[model_type])
        self.model = cls.from_pretrained(path, dtype=_dtype(self.device)).to(self.device).eval()
        self.processor = AutoImageProcessor.from_pretrained(path)
        self.has_cls = _VISION_TYPES[model_type].startswith("CLIP")
        g = int(round(math.sqrt(cfg.visual_tokens_per_frame)))
        if g * g != cfg.visual_tokens_per_frame or g < 1:
            raise ValueError(f"hf_vision needs a square visual_tokens_per_frame (1, 4, 9, ...), got {cfg.visual_tokens_per_frame}")
        self.grid = g
        self.tokens = g * g
        self.dim = int(self.model.config.hidden_size)

    @classmethod
    def config_dim(cls, cfg: FeaturesConfig) -> int:
        """The tower's hidden size, from config.json alone (a dual encoder's vision_config)."""
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(_need_path(cfg.vision_path, "vision_path"))
        return int(getattr(hf, "vision_config", hf).hidden_size)

    @torch.inference_mode()
    def encode_batch(self, frames: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
        images = list(frames.cpu().numpy())
        pixels = self.processor(images=images, return_tensors="pt")["pixel_values"]
        hidden = self.model(pixel_values=pixels.to(self.device, _dtype(self.device))).last_hidden_state
        patches = hidden[:, 1:] if self.has_cls else hidden  # [B, P, D]
        side = int(round(math.sqrt(patches.shape[1])))
        if side * side != patches.shape[1]:
            raise ValueError(f"hf_vision: {patches.shape[1]} patch tokens do not form a square grid")
        grid = patches.transpose(1, 2).reshape(patches.shape[0], -1, side, side).float()
        pooled = F.adaptive_avg_pool2d(grid, self.grid)  # [B, D, g, g]
        return pooled.flatten(2).transpose(1, 2)  # [B, g*g, D]


@register_audio("whisper")
class WhisperAudioEncoder(AudioEncoder):
    """Whisper encoder from a local directory; 50 frames/s pooled onto the segments."""

    def __init__(self, cfg: FeaturesConfig):
        super().__init__(cfg)
        from transformers import WhisperFeatureExtractor, WhisperModel

        path = _need_path(cfg.audio_path, "audio_path")
        self.extractor = WhisperFeatureExtractor.from_pretrained(path)
        if self.extractor.sampling_rate != cfg.sample_rate:
            raise ValueError(f"{path}: the feature extractor wants {self.extractor.sampling_rate} Hz, features.sample_rate is {cfg.sample_rate}")
        self.encoder = WhisperModel.from_pretrained(path, dtype=_dtype(self.device)).get_encoder().to(self.device).eval()
        conv_stride = self.encoder.conv1.stride[0] * self.encoder.conv2.stride[0]
        self.samples_per_frame = self.extractor.hop_length * conv_stride  # 320 -> 50 frames/s
        self.window = int(self.extractor.n_samples)  # 30 s
        self.dim = int(self.encoder.config.d_model)

    @classmethod
    def config_dim(cls, cfg: FeaturesConfig) -> int:
        """d_model, from config.json alone."""
        from transformers import AutoConfig

        return int(AutoConfig.from_pretrained(_need_path(cfg.audio_path, "audio_path")).d_model)

    @torch.inference_mode()
    def frames(self, audio: np.ndarray, sample_rate: int) -> tuple[torch.Tensor, float, float]:
        pieces = [audio[i : i + self.window] for i in range(0, audio.shape[0], self.window)]
        out = []
        step = max(1, self.cfg.audio_batch_size)
        for i in range(0, len(pieces), step):
            batch = pieces[i : i + step]
            inputs = self.extractor(batch, sampling_rate=sample_rate, return_tensors="pt")["input_features"]
            hidden = self.encoder(inputs.to(self.device, _dtype(self.device))).last_hidden_state.float().cpu()
            for piece, h in zip(batch, hidden):
                out.append(h[: math.ceil(piece.shape[0] / self.samples_per_frame)])
        rate = sample_rate / self.samples_per_frame
        return torch.cat(out), rate, 0.5 / rate
