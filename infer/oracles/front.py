"""The front half of decoding one video: prefill, planning, grounding, aggregation (cached).

    front = run_front(model, sample, cache, max_events, control)
    # front.cache holds prefix + serial <G>s; front.anchors [K, d] at position front.anchor_pos

Shared by the engine and the cached reference decoders (an HF `DynamicCache`); infer/oracles/decoders.py's
`full_recompute` redoes the same steps without any cache, through the training-time
forward, and must agree with this module.

Steps, one video, batch 1:
  1. prefill: the prefix layout (pipeline/layout.py `prefix_layout`: preamble, the
     audio-visual block, the instruction) in one forward with its explicit layout mask
     and positions; keep the grounding-layer and aggregation-layer states;
  2. planning: from the last instruction row, greedy over {<G>, <S>} (infer/engine/sampling.py);
     each chosen <G> is fed at `shared_position(P + k)` with its mask row from the
     layout's visibility rule (`mask_between`); the grounding-layer state of the row that
     predicted each <G> is that event's query;
  3. grounding: event vectors x segment vectors -> logits [K, T] -> readout
     (`PadCaptioner.ground`), clipped to well-formed intervals inside [0, duration];
  4. aggregation: `PadCaptioner.anchor_embeddings` over the grounded intervals, with
     the instruction row's visible keys from the layout mask, as in training.
All anchors sit at `anchor_position(P, K)`; branch step j at `branch_position(A, j)`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from infer.engine.sampling import NO_CONTROL, DecodeControl, plan_decision, planning_capped
from pipeline.decoding import decode_reserve, ground_intervals, prepare_example, token_position_ids  # noqa: F401
from pipeline.examples import Example, collate
from pipeline.family import DecodeError, well_formed  # noqa: F401
from pipeline.grounding import similarity_logits
from pipeline.layout import Layout, Role, TokenMeta, additive_mask, anchor_position, cat_meta, mask_between, shared_position


@dataclass
class Front:
    """State of one video after the front half (module doc)."""

    example: Example
    cache: object  # the cache holding prefix + serial <G>s
    keys: TokenMeta  # order / role / event of every cached token (prefix + serial <G>s)
    intervals: list[tuple[float, float]]  # grounded interval of each event (planning order)
    anchors: torch.Tensor  # [K, d] anchor input embeddings
    anchor_pos: int  # A
    planning_logits: torch.Tensor  # [n, 2] (<G>, <S>) logits of each planning decision
    grounding_logits: torch.Tensor  # [K, T]
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def layout(self) -> Layout:
        return self.example.layout

    @property
    def prefix_len(self) -> int:
        return self.example.layout.prefix_len

    @property
    def num_events(self) -> int:
        return int(self.anchors.shape[0])

    @property
    def segments_kept(self) -> int:
        return int(self.example.layout.num_segments)


class StageTimer:
    """Wall-clock ms per stage; synchronises CUDA at each boundary so stages are honest."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.ms: dict[str, float] = {}
        self._t = self._now()

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def lap(self, name: str) -> None:
        now = self._now()
        self.ms[name] = self.ms.get(name, 0.0) + (now - self._t) * 1000.0
        self._t = now


def serial_g_meta(prefix_len: int, k: int) -> TokenMeta:
    """Meta of the k-th serial <G> (0-based), as the training layout places it."""
    idx = torch.tensor([prefix_len + k])
    return TokenMeta(order=shared_position(idx), role=torch.tensor([int(Role.SERIAL_G)]), event=torch.tensor([-1]))


def row_mask(model, query: TokenMeta, keys: TokenMeta) -> torch.Tensor:
    """Additive float mask [1, 1, Lq, Lk] from the layout's visibility rule."""
    return additive_mask(mask_between(query, keys, model.options))[None, None]


@torch.no_grad()
def run_front(model, example: Example, cache, max_events: int, control: DecodeControl = NO_CONTROL,
              timer: StageTimer | None = None) -> Front:
    """Prefill + planning + grounding + aggregation for one video (module doc)."""
    if max_events < 1:
        raise DecodeError(f"max_events must be >= 1 (every video gets at least one event), got {max_events}")
    timer = timer or StageTimer(model.device)
    layout = example.layout
    p = layout.prefix_len
    pk = collate([example]).packed
    pos = model.position_ids(pk)[:, :p]
    emb = model.embed(pk, [example], slice(0, p))
    out = model.run_decoder(emb, layout.mask, pos, cache=cache, output_hidden_states=True)
    hs = out.hidden_states
    h_ground = hs[model.cfg.grounding_layer][0]  # [P, d]
    h_agg = hs[model.aggregation_layer][0]  # [P, d]
    last, last_ground = out.last_hidden_state[0, -1], h_ground[-1]
    del out, hs
    timer.lap("prefill_ms")

    keys = layout.meta()
    g_emb = model.embed_tokens(torch.tensor([[model.g_id]], device=model.device))  # [1, 1, d]
    queries, plan_logits = [], []
    k = 0
    while not planning_capped(k, max_events, control):
        restricted = model.lm_logits(last[None])[0, [model.g_id, model.s_id]].float()
        plan_logits.append(restricted)
        if not plan_decision(restricted, k, max_events, control):
            break
        queries.append(last_ground)
        q_meta = serial_g_meta(p, k)
        keys = cat_meta(keys, q_meta)
        step = model.run_decoder(g_emb, row_mask(model, q_meta, keys),
                                 token_position_ids(model, shared_position(p + k), 1, Role.SERIAL_G, model.device),
                                 cache=cache, output_hidden_states=True)
        last, last_ground = step.last_hidden_state[0, -1], step.hidden_states[model.cfg.grounding_layer][0, -1]
        k += 1
    timer.lap("planning_ms")

    events = model.event_vectors(torch.stack(queries))  # [K, d]
    dev = h_ground.device
    segments = model.segment_vectors(h_ground, layout.visual_index.to(dev), layout.audio_index.to(dev))
    g_logits = similarity_logits(events, segments)
    intervals = ground_intervals(model, g_logits, example)
    key_visible = layout.mask[0, 0, layout.instruction_end, :p].to(dev) == 0
    anchors = model.anchor_embeddings(h_agg, layout, example.segment_times, torch.tensor(intervals, dtype=torch.float32),
                                      pos[0], key_visible)
    timer.lap("grounding_ms")
    empty = torch.zeros(0, 2)
    return Front(example=example, cache=cache, keys=keys, intervals=intervals, anchors=anchors,
                 anchor_pos=anchor_position(p, k), planning_logits=torch.stack(plan_logits) if plan_logits else empty,
                 grounding_logits=g_logits, timings=timer.ms)
