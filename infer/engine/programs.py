"""What one video asks of the scheduler, model by model: its prefix, planning rules and anchors.

    prog = PadProgram(model, sample, opts, control)      # the project's model
    prog = ReleaseProgram(model, video, opts, control)   # the published release model
    prog.embeds [P, d], prog.positions [3, P], prog.limits [P], prog.cuts   # the prefix to prefill
    prog.prefilled(h_states)                              # the prefix's captured states, once
    read = prog.readout(ground)                           # what a decision reads on the host (None: nothing)
    want_g = prog.decide(restricted, ground, read)        # at every decision row ((<G>, <S>) logits)
    x, pos = prog.plan_input()                            # the serial <G> to feed next
    prog.finish() -> Anchors                              # intervals, anchors [K, d], position A
    Program.tokens_to_encode(sample), Program.encode(model, samples)   # the encoder stage's (infer/engine/encoding.py)
    PadProgram.finish_all(progs) -> [Anchors]             # the same for every video whose planning ended in a step

The scheduler (infer/engine/scheduler.py) runs every forward in the shared step (infer/engine/step.py);
a program only turns the step's outputs for its own video into the next decision; the reference
front half (infer/oracles/front.py) drives the same programs through HF forwards, one video.

PadCaptioner: the prefix layout of pipeline/layout.py with its
mask and positions; planning greedy over {<G>, <S>} from the last instruction row, each
<G> fed at shared_position(P + k); the grounding-layer state of the row that predicted a
<G> is its event query; then grounding and attention-guided anchors at A = P + K.

Release (docs/design/release.md 2-4): the release prompt with its M-RoPE ids, the AV block
bidirectional; at every decision row the event vector is grounded; a <G> is fed as
E[<G>] + agg(the interval grounded at the row that predicted it), at L + k + delta;
K = 0 allowed; anchors E[<G>] + agg(interval) at L + K + delta (pipeline/layout.py's
`shared_position` / `anchor_position` with the rope delta); the prompt's mask is
pipeline/release/layout.py `prompt_visible` (the project's visibility rule).

Prefix visibility must be "keys [0, limit)" per row (causal, or a bidirectional block):
`row_limits` reads the limits off the layout's own mask and refuses any other shape.
Pure torch + HF; no ray.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from infer.engine.sampling import DecodeControl, plan_decision, planning_capped
from pipeline.decoding import decode_reserve, ground_intervals, prepare_example, token_position_ids
from pipeline.examples import collate
from pipeline.family import DecodeError
from pipeline.grounding import segment_hidden, similarity_logits
from pipeline.layout import Role, anchor_position, shared_position
from pipeline.release.decoding import aggregation_row, anchor_inputs, decodable_video, prefill_inputs, seconds
from pipeline.release.grounding import aggregate, find_and_merge
from pipeline.release.layout import prompt_visible
from pipeline.release.video import ReleaseVideo, encode_videos


def row_limits(visible: torch.Tensor) -> torch.Tensor:
    """visible [P, P] bool (query, key) -> limits [P] long: row i sees keys [0, limits[i]).

    Raises ValueError if some row is not of that form (a mask the paged step cannot express)."""
    p = visible.shape[0]
    idx = torch.arange(p)
    lim = torch.where(visible, idx[None] + 1, torch.zeros_like(idx)[None]).amax(dim=1)
    if not torch.equal(visible, idx[None] < lim[:, None]) or bool((lim < idx + 1).any()):
        raise ValueError("the prefix mask is not 'each row sees a leading run of keys including itself'")
    return lim


def legal_cuts(limits: torch.Tensor) -> list[int]:
    """Chunk boundaries c (1..P) such that no row before c sees a key at or after c."""
    reach = torch.cummax(limits, dim=0).values  # furthest key seen by rows 0..i
    ends = torch.arange(1, limits.shape[0] + 1)
    return ends[reach <= ends].tolist()


def _plan_position(value: int) -> torch.Tensor:
    return torch.full((3,), int(value), dtype=torch.long)


@dataclass
class Anchors:
    """The end of planning: intervals (seconds, planning order), anchors [K, d] at position A."""

    intervals: list[tuple[float, float]]
    anchors: torch.Tensor
    anchor_pos: int
    planning_logits: torch.Tensor
    grounding_logits: torch.Tensor
    segments_kept: int


class PadProgram:
    """A sample for the project's PadCaptioner (module doc)."""

    def __init__(self, model, sample, opts, control: DecodeControl):
        if opts.max_events < 1:
            raise DecodeError(f"max_events must be >= 1 (every video gets at least one event), got {opts.max_events}")
        self.model, self.opts, self.control = model, opts, control
        self.example = prepare_example(model, sample, decode_reserve(opts))
        lay = self.example.layout
        self.length = p = lay.prefix_len
        pk = collate([self.example]).packed
        self._pos = model.position_ids(pk)[:, :p]
        self.embeds = model.embed(pk, [self.example], slice(0, p))[0]
        self.positions = self._pos[0].cpu().expand(3, -1)  # host: the scheduler copies a step's at once
        try:
            self.limits = row_limits(lay.mask[0, 0, :p, :p] == 0)
        except ValueError as e:
            raise DecodeError(f"{sample.video_id}: {e}") from e
        self.cuts = legal_cuts(self.limits)
        self.capture = model.capture_layers()
        self.ground_layer, self.agg_layer = self.capture
        self.k = 0
        self.queries: list[torch.Tensor] = []
        self.plan_logits: list[torch.Tensor] = []
        self.g_emb = model.embed_tokens(torch.tensor([[model.g_id]], device=model.device))[0, 0]

    @staticmethod
    def tokens_to_encode(sample) -> int:
        """Tokens the model's towers still have to make for `sample`: none, this family's samples carry features."""
        return 0

    @staticmethod
    def encode(model, samples: list) -> list:
        return samples

    def prefilled(self, states: dict[int, torch.Tensor]) -> None:
        """The prefix is done: what grounding and the anchors need of it alone (segment states, the
        aggregation's attention row) is taken now, once."""
        self.h_ground, self.h_agg = states[self.ground_layer], states[self.agg_layer]
        lay, dev = self.example.layout, self.h_ground.device
        self.seg_hidden = segment_hidden(self.h_ground, lay.visual_index.to(dev), lay.audio_index.to(dev))  # [T, d]
        self.key_visible = lay.mask[0, 0, lay.instruction_end, :self.length].to(dev) == 0
        self.agg_row = self.model.aggregation_row(self.h_agg, lay, self._pos[0], self.key_visible)

    def readout(self, ground: torch.Tensor) -> None:
        """Nothing of a decision row but its logits is read on the host (the queries stay on the device)."""
        return None

    def decide(self, restricted: torch.Tensor, ground: torch.Tensor, read: None = None) -> bool:
        """At a decision row (its (<G>, <S>) logits [2] fp32 on the host, its grounding-layer state):
        feed another <G>?"""
        if planning_capped(self.k, self.opts.max_events, self.control):
            return False
        self.plan_logits.append(restricted)
        if not plan_decision(restricted, self.k, self.opts.max_events, self.control):
            return False
        self.queries.append(ground)
        return True

    def plan_input(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(embedding [d], positions [3]) of the next serial <G>."""
        pos = token_position_ids(self.model, shared_position(self.length + self.k), 1, Role.SERIAL_G, "cpu")
        self.k += 1
        return self.g_emb, _plan_position(int(pos.flatten()[0]))

    def finish(self) -> Anchors:
        return PadProgram.finish_all([self])[0]

    @staticmethod
    def finish_all(progs: Sequence[PadProgram]) -> list[Anchors]:
        """Grounding and anchors of the videos whose planning ended in one step, batched: the event and
        segment heads run once over every video's rows, the similarities are one padded batched product
        with one copy to the host (the readout is host work), then each video's anchors."""
        model = progs[0].model
        ks = [len(p.queries) for p in progs]
        ts = [p.seg_hidden.shape[0] for p in progs]
        events = model.event_vectors(torch.stack([q for p in progs for q in p.queries]))  # [sum K, d]
        segments = model.segment_head(torch.cat([p.seg_hidden for p in progs]))  # [sum T, d]
        ev = pad_sequence(list(events.split(ks)), batch_first=True)  # [B, Kmax, d]
        seg = pad_sequence(list(segments.split(ts)), batch_first=True)  # [B, Tmax, d]
        sims = similarity_logits(ev, seg).cpu()  # [B, Kmax, Tmax] fp32
        out = []
        for p, k, t, g in zip(progs, ks, ts, sims):
            ex, lay = p.example, p.example.layout
            g_logits = g[:k, :t]
            intervals = ground_intervals(model, g_logits, ex)
            anchors = model.anchor_embeddings(p.h_agg, lay, ex.segment_times, torch.tensor(intervals, dtype=torch.float32),
                                              p._pos[0], p.key_visible, p.agg_row)
            out.append(Anchors(intervals, anchors, anchor_position(p.length, p.k), _stack(p.plan_logits), g_logits,
                               int(lay.num_segments)))
        return out


class ReleaseProgram:
    """A video for the published release model (module doc)."""

    def __init__(self, model, video, opts, control: DecodeControl):
        self.model, self.opts, self.control = model, opts, control
        self.video = video = decodable_video(model, video)  # the checkpoint's media geometry
        self.lay, self.embeds, pos, self.delta = prefill_inputs(model, video)
        self._pos = pos
        self.positions = pos.cpu()
        self.length = self.lay.length
        self.limits = row_limits(prompt_visible(self.lay))
        self.cuts = legal_cuts(self.limits)
        self.capture = model.capture_layers()
        self.ground_layer, self.agg_layer = self.capture
        self.k = 0
        self.steps: list[tuple[int, int]] = []
        self.sims: list[torch.Tensor] = []
        self.plan_logits: list[torch.Tensor] = []
        self.g_emb = model.embed_tokens(torch.tensor([model.g_id]))[0]
        self._next: tuple[int, int] | None = None

    @staticmethod
    def tokens_to_encode(sample) -> int:
        """Tokens the release's towers still have to make for a raw video (0 for stored tokens)."""
        return sample.tokens_to_encode if isinstance(sample, ReleaseVideo) else 0

    @staticmethod
    def encode(model, samples: list[ReleaseVideo]) -> list[ReleaseVideo]:
        return encode_videos(model, samples)

    def prefilled(self, states: dict[int, torch.Tensor]) -> None:
        self.h_ground, self.h_agg = states[self.ground_layer], states[self.agg_layer]
        self.attn_row = aggregation_row(self.model, self.lay, self._pos, self.h_agg)
        self.segments = self.model.segment_vectors(self.h_ground, self.lay)

    def _agg(self, step: tuple[int, int]) -> torch.Tensor:
        s = self.model.settings
        return aggregate(self.attn_row, self.h_agg, self.lay, step, s.aggregation, self.model.audio_mean_weight)

    def readout(self, ground: torch.Tensor) -> torch.Tensor:
        """The decision row's similarities [T] to the segments (the engine reads them with the step's one copy)."""
        return self.model.similarity(ground, self.segments)

    def decide(self, restricted: torch.Tensor, ground: torch.Tensor, read: torch.Tensor | None = None) -> bool:
        """One planning decision row (module doc, step 4). restricted [2]: the row's (<G>, <S>) logits in
        fp32 (model.plan_logits of its final-norm state), ground: its hidden_states[-2]; read: its
        `readout` on the host (None: computed now). Keeps the row's similarities and, unless planning is
        capped, its {<G>, <S>} logits; on <G>, the interval grounded at this row is the next event's
        (True), else planning stops (False)."""
        s = self.model.settings
        sim = self.readout(ground) if read is None else read
        self.sims.append(sim)
        step = find_and_merge(sim, s.grounding_threshold, s.grounding_merge_gap)
        if planning_capped(self.k, self.opts.max_events, self.control):
            return False
        self.plan_logits.append(restricted)
        if not plan_decision(restricted, self.k, self.opts.max_events, self.control, min_events=0):
            return False
        self.steps.append(step)
        self._next = step
        return True

    def plan_input(self) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.g_emb + self._agg(self._next)
        pos = shared_position(self.length + self.k, self.delta)
        self.k += 1
        return x, _plan_position(pos)

    @staticmethod
    def finish_all(progs: Sequence[ReleaseProgram]) -> list[Anchors]:
        """`finish` of each (the release's anchors come from states taken at prefill: nothing to batch)."""
        return [p.finish() for p in progs]

    def finish(self) -> Anchors:
        anchors = anchor_inputs(self.g_emb, self._agg, self.steps)
        d = float(self.video.seconds_per_step)
        return Anchors([seconds(st, d) for st in self.steps], anchors, anchor_position(self.length, self.k, self.delta),
                       _stack(self.plan_logits), torch.stack(self.sims).float(), self.lay.grid.timesteps)


def _stack(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(rows) if rows else torch.zeros(0, 2)


PROGRAMS = {"pad": PadProgram, "release": ReleaseProgram}  # a family's `program` -> its per-video program
