"""Fitting a sample to the model: drop whole segments evenly until the layout fits.

    sample, cut = fit_to_model(sample, model)                       # training: its own captions
    sample, cut = fit_for_decoding(sample, model, reserve)          # decoding: room for planning + a branch

A video with more segments than `model.max_segments`, or whose layout would exceed
`model.max_seq_len` tokens, keeps `keep` of its T segments spread evenly over the
video (`keep_indices`); a segment's visual and audio tokens go together, so a layout
is never cut inside a segment, and every event is re-mapped onto the kept segments'
times (`remap_interval`). Training (train/data.py) and decoding (infer/oracles/front.py) use the
same functions, so a long video is shortened the same way in both. Pure numpy; no ray.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from pipeline.examples import ExampleError
from pipeline.schema import Event, Sample


def sequence_length(prompt_lens: tuple[int, int], num_segments: int, visual: int, audio: int,
                    caption_lens: Sequence[int]) -> int:
    """Tokens of a dense training layout (pipeline.layout.dense_layout), without building it.

    preamble + T * (V + A) + instruction + K serial <G> + K anchors + K * (N - 1) branch inputs,
    N = max caption length + 1 (<eos>).
    """
    k = len(caption_lens)
    n = max((c + 1 for c in caption_lens), default=0)
    return prompt_lens[0] + num_segments * (visual + audio) + prompt_lens[1] + (2 * k + k * (n - 1) if k else 0)


def keep_indices(num_segments: int, keep: int) -> np.ndarray:
    """[keep] indices of segments spread evenly over [0, T): the centre of each of `keep` equal bins."""
    if not 1 <= keep <= num_segments:
        raise ValueError(f"keep must be in [1, {num_segments}], got {keep}")
    return np.floor((np.arange(keep) + 0.5) * num_segments / keep).astype(np.int64)


def remap_interval(start: float, end: float, times: np.ndarray) -> tuple[float, float]:
    """An interval onto kept segments [T', 2]: the span of the kept segments it overlaps
    (positive overlap), else the kept segment whose centre is nearest to its centre."""
    a, b = times[:, 0].astype(np.float64), times[:, 1].astype(np.float64)
    overlap = (np.minimum(end, b) - np.maximum(start, a)) > 0
    if overlap.any():
        idx = np.nonzero(overlap)[0]
        return float(a[idx[0]]), float(b[idx[-1]])
    i = int(np.argmin(np.abs((a + b) / 2 - (start + end) / 2)))
    return float(a[i]), float(b[i])


def drop_segments(sample: Sample, keep: int) -> Sample:
    """Keep `keep` of the T segments, spread evenly; events re-mapped to the kept times.

    visual [T, V, Dv] -> [keep, V, Dv], audio likewise, segment_times [keep, 2] (the kept
    segments' own times; the gaps are the dropped ones). Event order and captions stay.
    """
    t = sample.num_segments
    if keep >= t:
        return sample
    idx = keep_indices(t, keep)
    times = np.ascontiguousarray(sample.segment_times[idx])
    events = [Event(*remap_interval(e.start, e.end, times), e.caption, e.visual_caption, e.audio_caption)
              for e in sample.events]
    return replace(sample, segment_times=times, visual=np.ascontiguousarray(sample.visual[idx]),
                   audio=np.ascontiguousarray(sample.audio[idx]), events=events)


def fit_segments(sample: Sample, prompt_lens: tuple[int, int], caption_lens: Sequence[int], max_seq_len: int,
                 max_segments: int) -> tuple[Sample, bool]:
    """(sample, truncated): drop segments evenly until the layout fits `max_seq_len` tokens and
    at most `max_segments` segments. ExampleError when even one segment does not fit."""
    t, v = sample.num_segments, sample.visual.shape[1]
    a = sample.audio.shape[1] if sample.has_audio else 0
    if sequence_length(prompt_lens, t, v, a, caption_lens) <= max_seq_len and t <= max_segments:
        return sample, False
    fixed = sequence_length(prompt_lens, 0, v, a, caption_lens)
    keep = min(t, max_segments, (max_seq_len - fixed) // (v + a))
    if keep < 1:
        raise ExampleError(f"{sample.video_id}: prompt and {len(caption_lens)} captions take {fixed} tokens, "
                           f"no segment fits in model.max_seq_len={max_seq_len}")
    return drop_segments(sample, keep), True


def fit_to_model(sample: Sample, model) -> tuple[Sample, bool]:
    """`fit_segments` with the model's tokenizer, prompt and limits."""
    cfg = model.cfg
    lens = [min(len(model.tokenizer.encode(e.caption, add_special_tokens=False)), cfg.max_caption_tokens)
            for e in sample.events]
    return fit_segments(sample, (len(model.prompt[0]), len(model.prompt[1])), lens, cfg.max_seq_len, cfg.max_segments)


def fit_for_decoding(sample: Sample, model, reserve: int) -> tuple[Sample, bool]:
    """`fit_segments` for a prefix-only decode: the prefix plus `reserve` tokens (planning
    <G>s and the longest branch: infer.max_events + infer.max_branch_tokens) stay within
    model.max_seq_len, so every position the decoder uses is one training could use."""
    cfg = model.cfg
    prompt = (len(model.prompt[0]), len(model.prompt[1]))
    try:
        return fit_segments(sample, prompt, [], cfg.max_seq_len - reserve, cfg.max_segments)
    except ExampleError as e:
        raise ExampleError(f"{e} (after reserving {reserve} tokens for planning and one branch)") from None
