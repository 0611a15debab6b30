"""The front half of decoding one video, both model families: prefill, planning, grounding, anchors.

    front = run_front(model, video, cache, opts, control)   # video: a Sample (a ReleaseVideo for the release)
    # front.cache holds prefix + serial <G>s; front.anchors [K, d] at position front.anchor_pos

The family's rules are its engine program (infer/engine/programs.py `PROGRAMS[model.program]`: the
prefix, each planning decision, the serial <G> it feeds, grounding and the anchors). This module
runs the forwards that the engine runs in its paged step through the HF decoder with a cache
instead (an HF `DynamicCache`), one video, batch 1: the cached reference decoders
(infer/oracles/decoders.py, release_loop.py, ablation.py) start from it, and
decoders.py's `full_recompute` redoes the project family's front without any cache, through
the training-time forward, and must agree with it.

  1. prefill: the program's prefix embeddings in one forward, each row seeing keys
     [0, limits[i]) (the layout's visibility rule, as an explicit additive mask), at the
     program's positions in the backbone's format; the program takes the captured
     grounding- and aggregation-layer states;
  2. planning: each decision row (the prefix's last row, then each serial <G>) gives the
     program its (<G>, <S>) logits (`plan_logits` of the final-norm state, fp32) and its
     grounding-layer state; every serial <G> the program asks for is fed at its position,
     seeing every key before it (the project family: an explicit all-visible row; the
     release: HF's own causal mask, as the release runs it);
  3. the program's `finish`: intervals, anchors [K, d] at A, the planning and grounding logits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from infer.engine.programs import PROGRAMS, Anchors, PadProgram, ReleaseProgram
from infer.engine.sampling import NO_CONTROL, DecodeControl
from pipeline.layout import Role, TokenMeta, additive_mask, cat_meta, shared_position
from pipeline.release.decoding import ReleasePrefill


@dataclass
class Front:
    """State of one video after the front half (module doc)."""

    program: PadProgram | ReleaseProgram  # the video's engine program (infer/engine/programs.py): its rules and prefix states
    cache: object  # the cache holding prefix + serial <G>s
    end: Anchors  # intervals, anchors [K, d] at anchor_pos, planning [n, 2] and grounding logits
    last_hidden: torch.Tensor  # [d] final-norm state of the prefix's last row
    last_ground: torch.Tensor  # [d] its grounding-layer state
    serial_inputs: torch.Tensor  # [K, d] the serial <G> inputs fed

    intervals = property(lambda self: self.end.intervals)  # planning order (seconds)
    anchors = property(lambda self: self.end.anchors)  # [K, d] anchor input embeddings
    anchor_pos = property(lambda self: self.end.anchor_pos)  # A
    planning_logits = property(lambda self: self.end.planning_logits)  # [n, 2] (<G>, <S>) of each decision
    grounding_logits = property(lambda self: self.end.grounding_logits)  # [K, T] (release: [calls, T] similarities)
    prefix_len = property(lambda self: self.program.length)

    @property
    def num_events(self) -> int:
        return int(self.anchors.shape[0])

    # the project family's program: its Example, and the meta of every cached token
    example = property(lambda self: self.program.example)

    @property
    def keys(self) -> TokenMeta:
        """order / role / event / plan index of every cached token: the prefix's, then the K serial <G>s (each
        where the training layout places it)."""
        keys = self.example.layout.meta()
        for k in range(self.num_events):
            keys = cat_meta(keys, TokenMeta(order=shared_position(torch.tensor([self.prefix_len + k])),
                                            role=torch.tensor([int(Role.SERIAL_G)]), event=torch.tensor([-1]),
                                            plan_index=torch.tensor([k])))
        return keys

    # the release's program: its grounded timestep intervals, and what its prefill left (the parity check)
    steps = property(lambda self: self.program.steps)

    @property
    def prefill(self) -> ReleasePrefill:
        """The release's prefill record (pipeline/release/decoding.py) from its program's prefix states."""
        p = self.program
        return ReleasePrefill(p.lay, p.positions, p.delta, p.embeds, p.h_ground, p.h_agg, self.last_hidden,
                              self.last_ground, p.attn_row, p.segments)


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


# How a serial <G> row sees the cache (module doc, step 2), the family's policy: the project family's decoder runs
# with an explicit mask always (pipeline/model.py `run_decoder`), the release's on HF's causal mask as the release
# does; the two differ in the last bits (attention with or without a mask), so each keeps its own.
SERIAL_ROW_MASK = {"pad": True, "release": False}


def hf_positions(model, positions: torch.Tensor) -> torch.Tensor:
    """Positions [3, n] (the engine's form) -> the HF decoder's ids: [3, 1, n] (M-RoPE) or [1, n] (1D RoPE)."""
    return (positions[:, None] if model.adapter.kind == "mrope" else positions[:1]).to(model.device)


def force_step(prog: ReleaseProgram, steps: list[tuple[int, int]], wanted: bool) -> bool:
    """Teacher forcing (the parity check's): the row's logits and similarities stay the model's, its interval, and
    so K, come from `steps`; keeps a bf16 run on the release's history after a near tie."""
    if wanted:
        prog.steps.pop()
    k = len(prog.steps)
    if k >= len(steps):
        return False
    prog.steps.append(tuple(steps[k]))
    prog._next = prog.steps[-1]
    return True


@torch.no_grad()
def run_front(model, video, cache, opts, control: DecodeControl = NO_CONTROL, timer: StageTimer | None = None,
              forced_steps: list[tuple[int, int]] | None = None) -> Front:
    """Prefill + planning + grounding + anchors for one video (module doc); opts: max_events, max_branch_tokens.

    forced_steps (the release's program only): take each row's grounded interval, and so K, from
    this list instead of the model's own decisions (`force_step`)."""
    timer = timer or StageTimer(model.device)
    prog = PROGRAMS[model.program](model, video, opts, control)
    dev = model.device
    mask = additive_mask(torch.arange(prog.length)[None] < prog.limits[:, None], model.dtype)[None, None]
    out = model.decoder(inputs_embeds=prog.embeds[None], attention_mask=mask.to(dev),
                        position_ids=hf_positions(model, prog.positions), cache=cache, use_cache=True,
                        output_hidden_states=True)
    prog.prefilled({i: out.hidden_states[i][0] for i in prog.capture})
    last = first = out.last_hidden_state[0, -1]
    ground = first_ground = out.hidden_states[prog.ground_layer][0, -1]
    del out
    timer.lap("prefill_ms")

    row_mask = SERIAL_ROW_MASK[model.program]
    serial = []
    while True:
        wanted = prog.decide(model.plan_logits(last[None])[0].float(), ground)
        if forced_steps is not None:
            wanted = force_step(prog, forced_steps, wanted)
        if not wanted:
            break
        x, pos = prog.plan_input()
        serial.append(x)
        seen = cache.get_seq_length() + 1
        out = model.decoder(inputs_embeds=x[None, None], position_ids=hf_positions(model, pos[:, None]), cache=cache,
                            attention_mask=torch.zeros(1, 1, 1, seen, dtype=model.dtype, device=dev) if row_mask else None,
                            use_cache=True, output_hidden_states=True)
        last, ground = out.last_hidden_state[0, -1], out.hidden_states[prog.ground_layer][0, -1]
    timer.lap("planning_ms")
    end = prog.finish()
    timer.lap("grounding_ms")
    inputs = torch.stack(serial) if serial else end.anchors.new_zeros(0, end.anchors.shape[1])
    return Front(prog, cache, end, first, first_ground, inputs)
