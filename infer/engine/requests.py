"""What the engine takes and gives per video, and how its settings resolve.

    Request(sample, control, cancelled, tag, options)   # one video to decode (infer/engine/core.py `run`)
    VideoOptions(max_events=5).resolve(cfg.infer)       # a request's options over the engine's settings
    VideoResult                                          # one video's events, timings, capped marks

Pure python + torch types; no ray.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from infer.engine.sampling import DecodeControl
from pipeline.backbone import DTYPES
from pipeline.config import InferConfig
from pipeline.schema import Event, Sample


@dataclass
class VideoResult:
    """One video's captions: events sorted by start; timings in ms (+ steps, tokens, events).

    capped[i]: event i's caption was cut at infer.max_branch_tokens (no <eos>).
    segments_kept / segments_total: time segments the model saw / the video has (fewer
    when a long video was shortened to fit the model).
    """

    video_id: str
    duration: float
    events: list[Event]
    timings: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    capped: list[bool] = field(default_factory=list)
    segments_kept: int = 0
    segments_total: int = 0

    def to_dict(self) -> dict[str, Any]:
        capped = self.capped or [False] * len(self.events)
        out = {"video_id": self.video_id, "duration": float(self.duration),
               "events": [{"start": float(e.start), "end": float(e.end), "caption": e.caption, "capped": bool(c)}
                          for e, c in zip(self.events, capped)],
               "timings": dict(self.timings), "segments_kept": self.segments_kept, "segments_total": self.segments_total}
        if self.error is not None:
            out["error"] = self.error
        return out


@dataclass(frozen=True)
class VideoOptions:
    """Per-video decoding options (a Serve request's); None fields take the engine's infer.* value.

    max_events / max_branch_tokens may only lower the engine's own (its buffers are sized by them).
    """

    max_events: int | None = None
    max_branch_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None

    def resolve(self, cfg: InferConfig) -> InferConfig:
        """The engine's `cfg` with these options applied (ValueError when one is out of range)."""
        out = dataclasses.replace(cfg, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                                          if getattr(self, f.name) is not None})
        if not (1 <= out.max_events <= cfg.max_events and 1 <= out.max_branch_tokens <= cfg.max_branch_tokens):
            raise ValueError(f"per-video max_events / max_branch_tokens must be in [1, the engine's "
                             f"{cfg.max_events} / {cfg.max_branch_tokens}], got {out.max_events} / {out.max_branch_tokens}")
        if out.temperature < 0 or not 0 < out.top_p <= 1:
            raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1 (got {out.temperature}, {out.top_p})")
        return out


@dataclass
class Request:
    """One video to decode: its sample, options, test hooks, and a cancellation check (Serve)."""

    sample: Sample
    control: DecodeControl = field(default_factory=DecodeControl)
    cancelled: Callable[[], bool] = lambda: False
    tag: Any = None
    options: VideoOptions = field(default_factory=VideoOptions)


def resolve_device(name: str) -> torch.device:
    """infer.device -> torch.device (auto = CUDA when available)."""
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def resolve_dtype(name: str, device: torch.device, model_dtype: torch.dtype) -> torch.dtype:
    """infer.dtype -> torch dtype (auto = bfloat16 on CUDA, the model's own on the CPU)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else model_dtype
    return DTYPES[name]


def model_caps(cfg: InferConfig, model) -> InferConfig:
    """cfg with max_events / max_branch_tokens of 0 replaced by the model's own caps: the release
    checkpoint's (max_planning_events; 1 + max_branch_tokens, its first token comes from the
    anchor step), else 30 events and what training teaches (model.max_caption_tokens + 1)."""
    events, tokens = model.default_caps()
    return dataclasses.replace(cfg, max_events=cfg.max_events or events, max_branch_tokens=cfg.max_branch_tokens or tokens)


def check_config(cfg: InferConfig) -> None:
    if cfg.max_events < 0 or cfg.max_branch_tokens < 0:
        raise ValueError(f"infer.max_events and infer.max_branch_tokens must be >= 1, or 0 for the model's own "
                         f"(got {cfg.max_events}, {cfg.max_branch_tokens})")
    if cfg.temperature < 0 or not 0 < cfg.top_p <= 1:
        raise ValueError(f"need infer.temperature >= 0 and 0 < infer.top_p <= 1 (got {cfg.temperature}, {cfg.top_p})")
    if min(cfg.step_tokens, cfg.page_size, cfg.q_block) < 0 or cfg.kv_memory_gb < 0 \
            or not 0 < cfg.kv_memory_fraction <= 1:
        raise ValueError(f"infer.step_tokens, page_size, q_block and kv_memory_gb must be >= 0 (0 = auto) and "
                         f"0 < kv_memory_fraction <= 1; got {cfg.step_tokens}, {cfg.page_size}, {cfg.q_block}, "
                         f"{cfg.kv_memory_gb}, {cfg.kv_memory_fraction}")
    if cfg.cuda_graphs not in ("auto", "off", "static") or cfg.graph_tokens < 1:
        raise ValueError(f"infer.cuda_graphs must be auto, off or static and infer.graph_tokens >= 1; got "
                         f"{cfg.cuda_graphs!r}, {cfg.graph_tokens}")
    if cfg.max_batch_videos < 1 or cfg.max_batch_rows < cfg.max_events:
        raise ValueError(f"need infer.max_batch_videos >= 1 and infer.max_batch_rows >= infer.max_events (one video's "
                         f"rows must fit a step); got {cfg.max_batch_videos}, {cfg.max_batch_rows} < {cfg.max_events}")
