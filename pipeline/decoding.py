"""The project family's (pipeline/model.py) decoding rules, shared by the engine's program
(infer/engine/programs.py) and the reference front half (infer/oracles/front.py).

    ex = prepare_example(model, sample, decode_reserve(opts))    # prefix-only Example (DecodeError)
    intervals = ground_intervals(model, logits [K, T], ex)       # readout, clipped to the video
    pos [rows, 1] = token_position_ids(model, position, rows, Role.SERIAL_G, device)

Pure torch; no ray.
"""

from __future__ import annotations

import torch

from pipeline.examples import Example
from pipeline.family import DecodeError, well_formed
from pipeline.fitting import fit_for_decoding
from pipeline.layout import Role


def decode_reserve(cfg) -> int:
    """Tokens a decode adds after the prefix at most: the planning <G>s and one branch."""
    return int(cfg.max_events) + int(cfg.max_branch_tokens)


def prepare_example(model, sample, reserve: int = 0) -> Example:
    """Sample -> prefix-only Example (raises DecodeError with the reason for bad input).

    A video too long for the model (over model.max_segments, or prefix + `reserve` tokens
    over model.max_seq_len) is shortened as training shortens it (pipeline/fitting.py:
    whole segments dropped evenly); `example.layout.num_segments` is what was kept.
    """
    if not (sample.duration > 0 and float(sample.duration) < float("inf")):
        raise DecodeError(f"{sample.video_id}: duration must be a positive finite number of seconds, got {sample.duration}")
    try:
        sample, _ = fit_for_decoding(sample, model, reserve)
        return model.make_example(sample, with_targets=False)
    except ValueError as e:  # ExampleError, LayoutError: the sample does not fit the model
        raise DecodeError(str(e)) from e


def ground_intervals(model, logits: torch.Tensor, example: Example) -> list[tuple[float, float]]:
    """Grounding logits [K, T] -> K well-formed intervals (readout, then clipped)."""
    times = example.segment_times
    lengths = (times[:, 1] - times[:, 0]).float()
    positive = lengths[lengths > 0]
    min_len = float(positive.min()) if positive.numel() else 1e-3
    min_len = min(max(min_len, 1e-3), example.duration)
    return [well_formed(s, e, example.duration, min_len) for s, e in model.ground(logits, times)]


def token_position_ids(model, position: int, rows: int, role: Role, device) -> torch.Tensor:
    """Backbone position ids [rows, 1] for `rows` tokens of one role at one layout position."""
    pos = torch.full((rows, 1), int(position), dtype=torch.long)
    seg = torch.full((rows, 1), -1, dtype=torch.long)
    return model.adapter.position_ids(pos, seg, torch.full((rows, 1), int(role), dtype=torch.long)).to(device)
