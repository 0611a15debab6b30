"""Release-format models and videos from the copied release-golden fixture (tests/data/release_golden) and
seeded variations of it: for the release-model tests and bench/release_bf16.py (bench code, so that no
product or bench module imports test code)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from pipeline.release.model import ReleaseCaptioner, ReleaseSettings
from pipeline.release.video import ReleaseVideo

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "data" / "release_golden"
CHECKPOINT = FIXTURE / "checkpoint"


def fixture_inputs() -> dict:
    return torch.load(FIXTURE / "inputs.pt", weights_only=True)


def fixture_video(**over) -> ReleaseVideo:
    """The fixture's one video (31 s, 6 timesteps of 2 x 3 tokens, audio) as the release model takes it."""
    inp = fixture_inputs()
    kw = dict(video_id="golden", duration=31.0, seconds_per_step=float(inp["timestep_duration"]),
              grid_thw=tuple(int(x) for x in inp["video_grid_thw"][0].tolist()),
              pixel_values=inp["pixel_values_videos"], mel=inp["audio_feature"])
    kw.update(over)
    return ReleaseVideo(**kw)


def load(settings: ReleaseSettings | None = None) -> ReleaseCaptioner:
    return ReleaseCaptioner.from_release(CHECKPOINT, settings or ReleaseSettings()).eval()


def perturbed(seed: int, scale: float = 0.03, eos_gain: float = 0.5,
              settings: ReleaseSettings | None = None) -> ReleaseCaptioner:
    """The fixture model with seeded noise (scale x each matrix's std) on every matrix and its
    <|im_end|> row scaled by eos_gain (longer branches): another random release-format model
    whose decisions differ from the fixture's."""
    model = load(settings)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2 and p.numel() > 1:
                p.add_(torch.randn(p.shape, generator=g) * p.std() * scale)
        model.decoder.embed_tokens.weight[model.eos_id] *= eos_gain
    return model


def random_video(seed: int, timesteps: int = 5, rows: int = 4, cols: int = 6, seconds: float | None = None,
                 audio: bool = True, video_id: str | None = None) -> ReleaseVideo:
    """A video of `timesteps` x (rows x cols patches) with N(0, 1) pixels and random log-mel chunks."""
    g = torch.Generator().manual_seed(seed)
    d = seconds if seconds is not None else 1.0 + 4.0 * torch.rand(1, generator=g).item()
    duration = timesteps * d
    pixels = torch.randn(timesteps * rows * cols, 3 * 2 * 14 * 14, generator=g)
    chunks = max(1, math.ceil(duration / 30.0))
    mel = torch.randn(chunks, 128, 3000, generator=g) * 0.5 if audio else None
    return ReleaseVideo(video_id or f"v{seed}", duration, d, (timesteps, rows, cols), pixel_values=pixels, mel=mel)


def reshaped_checkpoint(out: Path, vision: dict, audio: dict, seed: int = 0) -> Path:
    """A random release-format checkpoint with the fixture's tokenizer and sizes but other
    `vision_config` / `audio_config` keys (the media geometry), saved as the release saves."""
    import json
    import shutil

    from transformers import AutoConfig, AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    for f in CHECKPOINT.iterdir():
        if f.name != "pytorch_model.bin":
            shutil.copy2(f, out / f.name)
    cfg = json.loads((CHECKPOINT / "config.json").read_text())
    cfg["vision_config"].update(vision)
    cfg["audio_config"].update(audio)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    torch.manual_seed(seed)
    model = ReleaseCaptioner(AutoConfig.from_pretrained(out), AutoTokenizer.from_pretrained(out))
    torch.save({k: v.contiguous() for k, v in model.release_state_dict().items()}, out / "pytorch_model.bin")
    return out
