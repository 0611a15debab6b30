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

from infer.engine.programs import plan_row
from infer.engine.sampling import NO_CONTROL, DecodeControl
from infer.oracles.front import StageTimer
from pipeline.layout import anchor_position, shared_position
from pipeline.release.decoding import (  # noqa: F401
    ReleasePrefill,
    aggregation_row,
    anchor_inputs,
    decodable_video,
    media_tokens,
    prefill,
    prefill_inputs,
    prefill_mask,
    release_prefill,
    seconds,
)
from pipeline.release.grounding import aggregate
from pipeline.release.video import ReleaseVideo


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
