"""The front half of decoding one video with the published release model.

    front = release_front(model, video, max_events, control, timer)
    # front.cache: prefix + serial <G>s; front.anchors [K, d] at front.anchor_pos (text position)

The release's test-time rules (docs/design/release.md 2-4), one video:
  1. encoders (online when the video carries pixels / mel, else its stored tokens), the
     prompt with the AV interleave, M-RoPE ids in the settings' mode;
  2. prefill with a causal mask made bidirectional among the AV tokens; keep
     hidden_states[-2] (grounding) and hidden_states[vision_audio_layer_index]
     (aggregation), and the aggregation row (layer-6 attention probabilities of the user
     turn's <|im_end|>, fp32 softmax cast to the model dtype, mean over heads);
  3. segment keys: frm_head on every AV token, per-timestep means over the index sets;
  4. planning, one serial token at a time: at every decision row the event vector
     evi_head(hidden_states[-2][row]) is grounded (sigmoid similarity, find_and_merge);
     the logits restricted to {<G>, <S>} pick greedily (ties to <G>), <S> forced after
     max_events <G>s, K = 0 allowed; a <G> is fed as E[<G>] + agg(the interval grounded
     at the row that predicted it), at position cache index + rope delta; <S> is never fed;
  5. anchors: E[<G>] + agg(interval of event j), all at (L + K) + delta.
Branches then run in the engine's decode step (text positions: the same id on the
three M-RoPE axes is 1D RoPE), with <G>, <S>, <shift> banned and at most
1 + max_branch_tokens tokens per branch. Pure torch + HF; no ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from infer.oracles.front import DecodeError, StageTimer
from infer.engine.sampling import NO_CONTROL, DecodeControl, plan_decision, planning_capped
from pipeline.aggregation import attention_row
from pipeline.layout import additive_mask, anchor_position, shared_position
from pipeline.release.grounding import aggregate, find_and_merge
from pipeline.release.layout import LayoutError, MRope, ReleaseLayout, build_layout, mrope_ids, prompt_visible
from pipeline.release.video import ReleaseVideo, as_release_video


@dataclass
class ReleasePrefill:
    """What the prefill of one video leaves for planning (and for parity checks)."""

    layout: ReleaseLayout
    positions: torch.Tensor  # [3, L]
    delta: int
    inputs_embeds: torch.Tensor  # [L, d]
    h_ground: torch.Tensor  # [L, d] hidden_states[-2]
    h_agg: torch.Tensor  # [L, d] input of the aggregation layer
    last_hidden: torch.Tensor  # [d] final-norm state of the last row
    last_ground: torch.Tensor  # [d] hidden_states[-2] of the last row
    attn_row: torch.Tensor  # [L] aggregation probabilities (0 on hidden keys)
    segments: torch.Tensor  # [T, d] segment keys


@dataclass
class ReleaseFront:
    """State of one video after the front half (module doc); the engine's Front contract."""

    prefill: ReleasePrefill
    cache: object
    intervals: list[tuple[float, float]]  # seconds [a d, (b + 1) d] (not clipped, as the release)
    steps: list[tuple[int, int]]  # timestep intervals (a, b)
    anchors: torch.Tensor  # [K, d]
    anchor_pos: int
    planning_logits: torch.Tensor  # [K+1 (or K when capped), 2]
    grounding_logits: torch.Tensor  # [calls, T] similarities of every grounding readout
    serial_inputs: torch.Tensor  # [K, d]
    segments_total: int
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def num_events(self) -> int:
        return int(self.anchors.shape[0])

    @property
    def segments_kept(self) -> int:
        return self.prefill.layout.grid.timesteps


def prefill_mask(lay: ReleaseLayout, dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, L, L] additive: causal, and the AV block bidirectional within itself (the project's
    visibility rule over the prompt, pipeline/release/layout.py `prompt_visible`)."""
    return additive_mask(prompt_visible(lay), dtype)[None, None]


def media_tokens(model, video: ReleaseVideo) -> tuple[torch.Tensor, torch.Tensor]:
    """(video tokens [T*V, d], audio tokens [A, d]) of a video: stored, or encoded now."""
    if video.video_embeds is not None:
        vis = video.video_embeds
    elif video.pixel_values is not None:
        vis = model.encode_video(video.pixel_values, torch.tensor([list(video.grid_thw)]))
    else:
        raise DecodeError(f"{video.video_id}: neither pixel values nor video tokens")
    if video.audio_embeds is not None:
        aud = video.audio_embeds
    elif video.mel is not None:
        aud = model.encode_audio(video.mel)
    else:
        aud = vis.new_zeros(0, vis.shape[-1])
    return vis.to(model.device, model.dtype), aud.to(model.device, model.dtype)


def prefill_inputs(model, video: ReleaseVideo, embed=None) -> tuple[ReleaseLayout, torch.Tensor, torch.Tensor, int]:
    """A video's prompt for prefill: (layout, input embeddings [L, d], M-RoPE ids [3, L], rope delta).

    embed: ids -> embeddings (default the model's table; fine-tuning passes its own, with the
    trained <G>/<S> rows); the media tokens come from the frozen towers, without gradients.
    Raises DecodeError for a video that cannot be decoded as given (the engine records it
    for that video alone): bad timing, features that do not match the grid, a prompt over
    the model's max_seq_len."""
    if not (video.duration > 0 and video.seconds_per_step > 0):
        raise DecodeError(f"{video.video_id}: duration and seconds per timestep must be positive")
    with torch.no_grad():
        vis, aud = media_tokens(model, video)
    try:
        grid = video.grid(aud.shape[0])
        lay = build_layout(model.tokenizer, model.ids, grid, video.instruction or model.settings.instruction)
    except LayoutError as e:
        raise DecodeError(f"{video.video_id}: {e}") from e
    if vis.shape[0] != grid.timesteps * grid.per_step:
        raise DecodeError(f"{video.video_id}: {vis.shape[0]} video tokens for a grid of {grid.timesteps} x "
                          f"{grid.per_step}")
    if lay.length > model.max_seq_len:
        raise DecodeError(f"{video.video_id}: prompt of {lay.length} tokens is over the model's {model.max_seq_len}")
    pos, delta = mrope_ids(lay, model.settings.positions)
    dev = model.device
    emb = (model.embed_tokens if embed is None else embed)(lay.input_ids.to(dev))
    emb = emb.index_copy(0, lay.video_slots.to(dev), vis)
    if aud.shape[0]:
        emb = emb.index_copy(0, lay.audio_slots.to(dev), aud)
    return lay, emb, pos, delta


def aggregation_row(model, lay: ReleaseLayout, pos: torch.Tensor, h_agg: torch.Tensor) -> torch.Tensor:
    """[L] aggregation probabilities of the user turn's <|im_end|> (layer-6 attention, fp32 softmax cast to
    the model dtype, mean over heads; 0 on hidden keys) from the aggregation layer's input states."""
    dev = h_agg.device
    q = lay.query_index
    keys = torch.zeros(lay.length, dtype=torch.bool, device=dev)
    keys[: q + 1] = True
    return attention_row(model.decoder, model.aggregation_layer, MRope(), h_agg, pos.T.to(dev), q, keys,
                         probs_dtype=model.dtype)


def prefill(model, video: ReleaseVideo, cache, embed=None, use_cache: bool = True) -> ReleasePrefill:
    """Steps 1-3 of the module doc for one video (HF's forward), with gradients where the caller has
    them: the one prefill of decoding and fine-tuning (pipeline/release/finetune.py passes its
    `embed` and, when it reruns the prompt under activation checkpointing, no cache)."""
    lay, emb, pos, delta = prefill_inputs(model, video, embed)
    dev = model.device
    out = model.decoder(inputs_embeds=emb[None], attention_mask=prefill_mask(lay, model.dtype).to(dev),
                        position_ids=pos[:, None].to(dev), cache=cache, use_cache=use_cache, output_hidden_states=True)
    hs = out.hidden_states
    h_ground, h_agg = hs[-2][0], hs[model.aggregation_layer][0]
    row = aggregation_row(model, lay, pos, h_agg.detach())
    segments = model.segment_vectors(h_ground, lay)
    return ReleasePrefill(lay, pos, delta, emb, h_ground, h_agg, out.last_hidden_state[0, -1], h_ground[-1], row,
                          segments)


@torch.no_grad()
def release_prefill(model, video: ReleaseVideo, cache) -> ReleasePrefill:
    """`prefill` without gradients (the reference front)."""
    return prefill(model, video, cache)


def seconds(step: tuple[int, int], d: float) -> tuple[float, float]:
    """Timestep interval (a, b) -> seconds [a d, (b + 1) d] (docs/design/release.md 4.4; not clipped)."""
    return step[0] * d, (step[1] + 1) * d


def decodable_video(model, video) -> ReleaseVideo:
    """A ReleaseVideo (or a stored schema-2 sample) read with the checkpoint's media geometry;
    DecodeError when it cannot be (the engine records that for the video alone)."""
    try:
        return as_release_video(video, model.geometry)
    except ValueError as e:
        raise DecodeError(str(e)) from e


def plan_row(model, restricted: torch.Tensor, ground: torch.Tensor, segments: torch.Tensor, k: int, max_events: int,
             control: DecodeControl, sims: list, plan_logits: list) -> tuple[int, int] | None:
    """One planning decision row (module doc, step 4), for the reference front and the engine's program.

    restricted [2]: the row's (<G>, <S>) logits in fp32 (model.plan_logits of its final-norm state),
    ground: its hidden_states[-2]; k: <G>s fed so far. Appends
    the row's similarities to `sims` and, unless planning is capped, its {<G>, <S>} logits to
    `plan_logits`. Returns the interval grounded at this row when it picks <G>, None to stop."""
    s = model.settings
    sim = model.similarity(ground, segments)
    sims.append(sim)
    step = find_and_merge(sim, s.grounding_threshold, s.grounding_merge_gap)
    if planning_capped(k, max_events, control):
        return None
    plan_logits.append(restricted)
    if not plan_decision(restricted, k, max_events, control, min_events=0):
        return None
    return step


def anchor_inputs(g_emb: torch.Tensor, agg, steps: list[tuple[int, int]]) -> torch.Tensor:
    """[K, d] anchors E[<G>] + agg(interval of event j) (module doc, step 5); [0, d] when K = 0."""
    return torch.stack([g_emb + agg(st) for st in steps]) if steps else g_emb.new_zeros(0, g_emb.shape[0])


@torch.no_grad()
def release_front(model, video: ReleaseVideo, cache, max_events: int, control: DecodeControl = NO_CONTROL,
                  timer: StageTimer | None = None, forced_steps: list[tuple[int, int]] | None = None) -> ReleaseFront:
    """Prefill + planning with step-by-step grounding + anchors for one video (module doc).

    forced_steps: take each row's grounded interval, and so K, from this list instead of the
    model's own decisions (the logits and similarities of every row are still the model's):
    the parity check's teacher forcing, which keeps a bf16 run on the release's history after
    a near tie so every later row is still compared with the same computation."""
    timer = timer or StageTimer(model.device)
    video = decodable_video(model, video)
    pre = release_prefill(model, video, cache)
    timer.lap("prefill_ms")
    s = model.settings
    lay = pre.layout
    g_emb = model.embed_tokens(torch.tensor([model.g_id]))[0]  # [d]

    def agg(step: tuple[int, int]) -> torch.Tensor:
        return aggregate(pre.attn_row, pre.h_agg, lay, step, s.aggregation, model.audio_mean_weight)

    last, last_ground = pre.last_hidden, pre.last_ground
    sims, plan_logits, steps, serial = [], [], [], []
    k = 0
    while True:
        step = plan_row(model, model.plan_logits(last[None])[0].float(), last_ground, pre.segments, k, max_events,
                        control, sims, plan_logits)
        if forced_steps is not None:
            step = tuple(forced_steps[k]) if k < len(forced_steps) else None
        if step is None:
            break
        steps.append(step)
        x = g_emb + agg(step)
        serial.append(x)
        p = shared_position(lay.length + k, pre.delta)
        ids = torch.full((3, 1, 1), p, dtype=torch.long, device=model.device)
        out = model.decoder(inputs_embeds=x[None, None], position_ids=ids, cache=cache, use_cache=True,
                            output_hidden_states=True)
        last, last_ground = out.last_hidden_state[0, -1], out.hidden_states[-2][0, -1]
        k += 1
    timer.lap("planning_ms")
    anchors = anchor_inputs(g_emb, agg, steps)
    timer.lap("grounding_ms")
    d = float(video.seconds_per_step)
    return ReleaseFront(prefill=pre, cache=cache, intervals=[seconds(st, d) for st in steps], steps=steps,
                        anchors=anchors, anchor_pos=anchor_position(lay.length, k, pre.delta),
                        planning_logits=torch.stack(plan_logits) if plan_logits else torch.zeros(0, 2),
                        grounding_logits=torch.stack(sims).float(),
                        serial_inputs=torch.stack(serial) if serial else anchors.new_zeros(0, anchors.shape[1]),
                        segments_total=video.num_segments, timings=timer.ms)
