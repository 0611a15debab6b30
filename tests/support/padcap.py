"""Shared helpers for the model-core tests: a tiny config and synthetic feature samples."""

from __future__ import annotations

import numpy as np
import torch

from pipeline.config import ModelConfig
from pipeline.schema import Event, Sample

# Tiny models on a shared 2-core box: one intra-op thread is ~20x faster than two
# oversubscribed ones (thread hand-offs dominate matmuls of this size).
torch.set_num_threads(1)

DV, DA = 16, 8
CAPTIONS = (
    "Visual: a red circle moves up. Audio: a high beep.",
    "Visual: a blue square grows. Audio: silence.",
    "Visual: a green triangle blinks. Audio: a low beep.",
)


def tiny_cfg(**over) -> ModelConfig:
    base = dict(backbone="tiny", tokenizer="bpe", visual_dim=DV, audio_dim=DA)
    base.update(over)
    return ModelConfig(**base)


def sample(num_segments: int = 12, intervals=((2.0, 5.0), (7.0, 10.0)), captions=CAPTIONS, *, visual_tokens: int = 2,
           audio_tokens: int = 2, has_audio: bool = True, seed: int = 0, video_id: str = "vid") -> Sample:
    """T one-second segments; each event adds its own fixed pattern to the features of its segments."""
    rng = np.random.default_rng(seed)
    t = num_segments
    times = np.stack([np.arange(t), np.arange(t) + 1], 1).astype(np.float32)
    visual = 0.3 * rng.standard_normal((t, visual_tokens, DV))
    audio = 0.3 * rng.standard_normal((t, audio_tokens, DA))
    events = []
    for i, (s, e) in enumerate(intervals):
        pv, pa = rng.standard_normal(DV) * 2, rng.standard_normal(DA) * 2
        seg = (times[:, 0] >= s) & (times[:, 1] <= e)
        visual[seg] += pv
        audio[seg] += pa
        events.append(Event(float(s), float(e), captions[i % len(captions)]))
    if not has_audio:
        audio[:] = 0
    return Sample(video_id=video_id, duration=float(t), segment_times=times, visual=visual.astype(np.float16),
                  audio=audio.astype(np.float16), has_audio=has_audio, events=events)


def randomize(m, std: float = 0.15, seed: int = 1):
    """Re-draw a PadCaptioner's matrices with a larger spread (LoRA too), so a random model grounds
    events to different intervals and its branches emit varied tokens (engine tests)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
            elif p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return m


def decoding_model(**over):
    """The engine tests' model: tiny, randomised, grounding only near-max segments, eval mode."""
    from pipeline.model import PadCaptioner

    torch.manual_seed(0)
    return randomize(PadCaptioner(tiny_cfg(grounding_threshold=0.99, **over))).eval()

