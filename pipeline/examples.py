"""From shard samples to model batches: tokenise, lay out, jitter, pad.

    ex = make_example(sample, prompt, ids, tokenizer, model_cfg, generator=g)   # dense
    ex = make_example(sample, ..., response="a plain answer")                   # plain sample
    (model.layout = sequential / textual_planning: every dense sample is a plain sample whose
    response is its events as text, pipeline/textual.py)
    ex = make_example(sample, ..., with_targets=False)                          # prefix only (decoding)
    batch = collate([ex, ...])          # pack (the layouts padded) + the per-sample features

`PadCaptioner.make_example` wraps `make_example` with the model's tokenizer and prompt.
Bad input raises `ExampleError` naming the video and the reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pipeline.aggregation import jitter_intervals
from pipeline.layout import IGNORE, Layout, LayoutError, LayoutOptions, Role, dense_layout, plain_layout, prefix_layout
from pipeline.schema import Sample
from pipeline.textual import format_sequential, format_textual_planning

TEXT_LAYOUTS = {"sequential": format_sequential, "textual_planning": format_textual_planning}
"""model.layout values whose targets are plain text (pipeline/textual.py): no <G>, no branches."""


class ExampleError(ValueError):
    """A sample cannot become a training/decoding example; the message names it."""


@dataclass
class Example:
    """One sample ready for the model.

    layout         the token layout (pipeline/layout.py)
    visual         float32 [T, V, Dv]
    audio          float32 [T, A, Da]; A = 0 when the video has no audio track
    segment_times  float32 [T, 2] seconds
    intervals      float32 [K, 2] ground-truth intervals in event (= time) order
    agg_intervals  float32 [K, 2] intervals the anchors aggregate over (jittered when training)
    """

    layout: Layout
    visual: torch.Tensor
    audio: torch.Tensor
    segment_times: torch.Tensor
    intervals: torch.Tensor
    agg_intervals: torch.Tensor
    duration: float
    video_id: str


@dataclass
class Batch:
    """A padded batch (`packed`, see `Packed` below) and its examples' features."""

    packed: Packed
    examples: list[Example]

    @property
    def num_tokens(self) -> int:
        """Tokens that are not padding (what the loop counts per step)."""
        return int((self.packed.role != Role.PAD).sum())


def make_example(
    sample: Sample,
    prompt: tuple[Sequence[int], Sequence[int]],
    ids: dict[str, int],
    tokenizer,
    model_cfg,
    *,
    generator: torch.Generator | None = None,
    response: str | None = None,
    with_targets: bool = True,
) -> Example:
    """Sample -> Example. Events are sorted by (start, end); captions are cut to
    `max_caption_tokens`; with a generator, aggregation intervals get +-`aggregation_jitter`."""
    vid = sample.video_id
    if getattr(sample, "audio_counts", None) is not None:
        raise ExampleError(f"{vid}: ragged audio (the release encoders' schema-2 layout) needs the release model, "
                           "not this project's layout")
    visual = torch.from_numpy(sample.visual).float()
    audio = torch.from_numpy(sample.audio).float()
    if not sample.has_audio:
        audio = audio[:, :0]
    t, v, a = visual.shape[0], visual.shape[1], audio.shape[1]
    if t > model_cfg.max_segments:
        raise ExampleError(f"{vid}: {t} segments exceed model.max_segments={model_cfg.max_segments}")
    if visual.shape[2] != model_cfg.visual_dim or (a and audio.shape[2] != model_cfg.audio_dim):
        raise ExampleError(f"{vid}: feature dims {visual.shape[2]}/{sample.audio.shape[2]} do not match the model's "
                           f"{model_cfg.visual_dim}/{model_cfg.audio_dim}")
    preamble, instruction = prompt
    options = LayoutOptions.from_config(model_cfg)
    events = sorted(sample.events, key=lambda e: (e.start, e.end)) if (with_targets and response is None) else []
    cap_tokens = model_cfg.max_caption_tokens
    if events and model_cfg.layout in TEXT_LAYOUTS:  # the events as one text response
        response, cap_tokens = TEXT_LAYOUTS[model_cfg.layout](events), cap_tokens * len(events)
        events = []
    if not with_targets:
        layout = prefix_layout(preamble, instruction, t, v, a, options)
    elif response is not None:
        resp = tokenizer.encode(response, add_special_tokens=False)[:cap_tokens]
        layout = plain_layout(preamble, instruction, t, v, a, resp, eos_id=ids["eos"], options=options)
    else:
        captions = [tokenizer.encode(e.caption, add_special_tokens=False)[: model_cfg.max_caption_tokens] for e in events]
        layout = dense_layout(preamble, instruction, t, v, a, captions, g_id=ids["g"], s_id=ids["s"],
                              eos_id=ids["eos"], options=options)
    if len(layout) > model_cfg.max_seq_len:
        raise ExampleError(f"{vid}: sequence of {len(layout)} tokens exceeds model.max_seq_len={model_cfg.max_seq_len}")
    intervals = torch.tensor([[e.start, e.end] for e in events], dtype=torch.float32).reshape(-1, 2)
    agg = jitter_intervals(intervals, sample.duration, model_cfg.aggregation_jitter, generator) if generator is not None else intervals.clone()
    return Example(layout=layout, visual=visual, audio=audio,
                   segment_times=torch.from_numpy(sample.segment_times).float(), intervals=intervals,
                   agg_intervals=agg, duration=float(sample.duration), video_id=vid)


def collate(examples: Sequence[Example]) -> Batch:
    """Pad examples into one batch; every sample keeps its own mask (`pack` below)."""
    return Batch(packed=pack([ex.layout for ex in examples]), examples=list(examples))


# --------------------------------------------------------------------------- padding layouts into a batch


@dataclass
class Packed:
    """A padded batch of layouts; tensors [B, L] unless noted, mask [B, 1, L, L].

    Two stages per sample: tokens before its first anchor (`layout.split`) go to
    columns [0, split_b), the anchors and branches to [S, S + L_b - split_b) where
    S = `split` = max_b split_b. So columns [0, S) can run first (prefill, planning,
    grounding, aggregation) and [S, L) after, with the first stage as KV cache.
    `columns[b]` maps sample b's layout index -> batch column. Every sample keeps its
    own mask; PAD columns are hidden and PAD rows see only themselves.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    event: torch.Tensor
    role: torch.Tensor
    segment: torch.Tensor
    slot: torch.Tensor
    step: torch.Tensor
    order: torch.Tensor
    position: torch.Tensor
    mask: torch.Tensor
    split: int
    columns: list[torch.Tensor]
    layouts: list[Layout]


_PAD_VALUES = {"input_ids": 0, "labels": IGNORE, "event": -1, "role": int(Role.PAD), "segment": -1,
               "slot": -1, "step": -1, "order": -1, "position": 0}


def pack(layouts: Sequence[Layout]) -> Packed:
    """Pad a batch of layouts (module notes); each keeps its own mask."""
    if not layouts:
        raise LayoutError("cannot pack an empty batch")
    s = max(lay.split for lay in layouts)
    total = s + max(len(lay) - lay.split for lay in layouts)
    bsz = len(layouts)
    out = {k: torch.full((bsz, total), v, dtype=torch.long) for k, v in _PAD_VALUES.items()}
    mask = torch.full((bsz, 1, total, total), torch.finfo(torch.float32).min)
    diag = torch.arange(total)
    columns = []
    for b, lay in enumerate(layouts):
        idx = torch.arange(len(lay))
        col = torch.where(idx < lay.split, idx, idx - lay.split + s)
        columns.append(col)
        for k in _PAD_VALUES:
            out[k][b, col] = getattr(lay, k)
        mask[b, 0, diag, diag] = 0.0  # PAD rows see themselves
        mask[b, 0, col[:, None], col[None, :]] = lay.mask[0, 0]
    return Packed(mask=mask, split=s, columns=columns, layouts=list(layouts), **out)


