"""What a captioning model family provides to decoding and to training: one interface, two families.

    model: DecodingFamily       # pipeline/model.py PadCaptioner, pipeline/release/model.py ReleaseCaptioner
    trainee: TrainingFamily     # PadCaptioner, pipeline/release/finetune.py ReleaseFinetune

Shared code (the engine in infer/engine/, the oracles, train/) calls these members and never asks
which family it holds. Where a family's arithmetic or rule must differ (the release's parity with its
published checkpoint), the member carries the family's policy: a value (`program`, `checkpoint`,
`counting`) that one shared function takes as a parameter, never a second copy of the function.

Decoding (the engine's side, infer/engine/):
  adapter              the backbone's position adapter (pipeline/backbone.py: 1D RoPE, or the release's M-RoPE)
  program              the engine's per-video program for this family ("pad" | "release",
                       infer/engine/programs.py `PROGRAMS`)
  capture_layers()     (grounding layer, aggregation layer) the program reads from the step
  step_tables()        (embed [V, d], head [V, d], head bias | None) for the decode step, <G>/<S> rows in place
  banned_ids()         tokens that are never caption text (bias -inf in branch rows)
  default_caps()       (max_events, max_branch_tokens) the family decodes with when infer.* says 0
  engine_refusal(dec)  why the engine cannot decode this model with infer.decoder=dec (None: it can)
  baseline_decoder     the oracle decoder this model needs instead of the engine, by name, or None
  final_intervals(...) a decode's intervals as results report them (clipped to the video, or as is)
  cast_to(dtype)       the whole model in `dtype`, rotary frequencies kept in fp32
  run_decoder(...)     the backbone's forward with a layout mask (pipeline/two_stage.py): what the two-stage
                       training forward runs its passes with

Training (train/):
  collate, fit, make_example, forward_train   batches, a sample fitted to the model, the loss's forward (two
                        stages, the steps both share in pipeline/two_stage.py)
  checkpoint            `CheckpointFormat`: the run config's file name, whether weights are written at the end only
  counting              how held-out batches are counted: "tokens" (per-token and attribute counts from
                        the batch) or "loss" (what the loss dict reports)
  decoding_model        the model the engine decodes for this trainee (itself, or the wrapped release model)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from pipeline.backbone import PositionAdapter

Counting = Literal["tokens", "loss"]


@dataclass(frozen=True)
class CheckpointFormat:
    """How a trainee's checkpoint is written (train/checkpoint.py).

    config_file: the run config's name inside the model dir (a release-format dir has the HF config.json
    already); merged_at_end: checkpoints keep the trained tensors only, the full model dir is written
    once at export (train/export.py)."""

    config_file: str = "config.json"
    merged_at_end: bool = False


@runtime_checkable
class DecodingFamily(Protocol):
    """What a family gives the engine and the reference decoders (module doc)."""

    program: str
    g_id: int
    s_id: int
    eos_id: int
    tokenizer: Any
    aggregation_layer: int
    adapter: PositionAdapter  # layout positions -> the backbone's position ids and its RoPE rotation

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def capture_layers(self) -> tuple[int, int]: ...

    def step_tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]: ...

    def banned_ids(self) -> list[int]: ...

    def default_caps(self) -> tuple[int, int]: ...

    def engine_refusal(self, decoder: str) -> str | None: ...

    @property
    def baseline_decoder(self) -> str | None: ...

    def final_intervals(self, intervals: list[tuple[float, float]], duration: float) -> list[tuple[float, float]]: ...

    def cast_to(self, dtype: torch.dtype) -> None: ...

    def run_decoder(self, embeds: torch.Tensor, mask: torch.Tensor, position_ids: torch.Tensor, cache=None,
                    output_hidden_states: bool = False) -> Any: ...


@runtime_checkable
class TrainingFamily(Protocol):
    """What a family gives train/ (module doc)."""

    checkpoint: CheckpointFormat
    counting: Counting

    def collate(self, examples: list) -> Any: ...

    def fit(self, sample) -> tuple[Any, bool]: ...

    def make_example(self, sample, generator: torch.Generator | None = None) -> Any: ...

    def forward_train(self, batch) -> dict: ...

    def trainable_parameters(self) -> dict[str, torch.nn.Parameter]: ...

    def save_pretrained(self, path) -> Any: ...

    @property
    def decoding_model(self) -> DecodingFamily: ...


class DecodeError(ValueError):
    """A video cannot be decoded as given (bad duration, too long, wrong features); says why."""


def well_formed(start: float, end: float, duration: float, min_len: float) -> tuple[float, float]:
    """Clip an interval to [0, duration] with start < end (widened by up to min_len when degenerate)."""
    duration = float(duration)
    s = min(max(float(start), 0.0), duration)
    e = min(max(float(end), 0.0), duration)
    if e <= s:
        e = min(duration, s + min_len)
        if e <= s:
            s = max(0.0, e - min_len)
    return s, e
