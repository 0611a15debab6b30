"""Sequence layout of PadCaptioner: token roles, the event-factorized mask, positions.

Pure torch functions (no model, no tokenizer): token ids and sizes in, a `Layout`
out. Training (`dense_layout`, `plain_layout`; pipeline/examples.py `pack`) and decoding (infer/, which
calls `mask_between` / `shared_position` / `anchor_position` /
`branch_position` / `event_order` itself) use the SAME functions, so the two can
never disagree about who sees whom or where a token sits.

Design notes
------------
Layout order of one dense-captioning training sequence (= its causal order):

    preamble | v(0,0..V-1) a(0,0..A-1) ... v(T-1,..) a(T-1,..) | instruction    prefix, P tokens
    <G>_1 ... <G>_K                                                            serial planning
    anchor_1 ... anchor_K                                                      one per event
    b_1[0..N-2] | b_2[0..N-2] | ... | b_K[0..N-2]                              caption branches

with b_i = caption_i + <eos>, padded with <eos> to N = max_i len(b_i). Branch order
`blocked` (above) or `round_robin` (step-major: b_1[0] b_2[0] ... b_K[0] b_1[1] ...);
the anchors are the step-0 block in both.

Labels: the last instruction token predicts <G>_1, <G>_k predicts <G>_{k+1}, <G>_K
predicts <S> (K = 0: the instruction predicts <S>); <S> is never an input. Anchor i
(input: <G> embedding + aggregated audio-visual feature; never a label) predicts
b_i[0]; the input b_i[j-1] (branch step j) predicts b_i[j]. The last token b_i[N-1]
is never an input. Labels of the <eos> padding count iff `eos_padding_loss`.

Visibility rule (`mask_between`): key k is visible to query q iff
    order(k) <= order(q) and (event(k) == -1 or event(k) == event(q))
where event is -1 for the shared tokens (prefix, serial <G>, plain responses) and i
for anchor i and branch i. `mask="causal"` (ablation) drops the event condition.
With `av_bidirectional`, every audio-visual token also sees every audio-visual token.
With `g_visibility="own"` (ablation), an anchor / branch token of event i sees only
the i-th serial <G> (`plan_index` i), not the other events' serial <G>s.

Branches are padded with <eos> only under the factorized mask, where the padding is
invisible to every other branch. Under `mask="causal"` a later branch would see the
earlier branches' padding, whose length is the LONGEST caption's (later ones
included), which no decoder can know while it writes; so causal layouts keep every
branch at its own length (inputs = the caption tokens; the <eos> is its last label)
and `infer/oracles/ablation.py` decodes them in exactly this layout.

`chain=True` (model.layout=chain, "latent planning, sequential": the paper's
"+ latent planning" row, mask causal): after the serial <G>s one causal chain
anchor_1 b_1 anchor_2 b_2 ... with consecutive positions (order = position = index),
which is what infer/oracles/decoders.py `monolithic` decodes.

Positions: shared tokens sit at their index (`shared_position`); every anchor at
A = pos(<G>_K) + 1 = P + K (`anchor_position`); step j of every branch at A + j
(`branch_position`). The backbone adapter (pipeline/backbone.py) turns these into
the backbone's position ids (1D RoPE today; a 3D mRoPE adapter reads `segment`).

Masks are additive floats [1, 1, L, L]: 0 visible, finfo(float32).min hidden, built
per sample; pipeline/examples.py `pack` pads a batch keeping every sample's own mask.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Literal

import torch

IGNORE = -100  # label of positions without loss
FEATURE_ID = -1  # input id of a feature slot (the model splices a projected feature in)
STEP_SPAN = 1 << 24  # order-key stride per branch in `blocked` order (max branch steps)


class Role(enum.IntEnum):
    """What a token is; PAD only appears in packed batches."""

    PAD = -1
    PREAMBLE = 0
    VISUAL = 1
    AUDIO = 2
    INSTRUCTION = 3
    SERIAL_G = 4
    ANCHOR = 5
    BRANCH = 6
    RESPONSE = 7


class LayoutError(ValueError):
    """A layout cannot be built from these inputs; the message says why."""


@dataclass(frozen=True)
class LayoutOptions:
    """The layout choices of ModelConfig (see `from_config`)."""

    mask: Literal["factorized", "causal"] = "factorized"
    av_bidirectional: bool = True
    branch_order: Literal["blocked", "round_robin"] = "blocked"
    eos_padding_loss: bool = True
    g_visibility: Literal["all", "own"] = "all"
    chain: bool = False  # model.layout=chain: anchor_i b_i in one causal chain (module notes)

    def __post_init__(self) -> None:
        if self.g_visibility not in ("all", "own"):
            raise LayoutError(f"unknown g_visibility {self.g_visibility!r}")
        if self.chain and self.mask != "causal":
            raise LayoutError("model.layout=chain writes the events as one causal chain: set model.mask=causal")

    @property
    def padded(self) -> bool:
        """Branches padded with <eos> to one length (factorized only; module notes)."""
        return self.mask == "factorized" and not self.chain

    @classmethod
    def from_config(cls, cfg) -> LayoutOptions:
        """The ModelConfig fields of the same names; chain from model.layout."""
        same = [f.name for f in fields(cls) if f.name != "chain"]
        return cls(**{name: getattr(cfg, name) for name in same}, chain=cfg.layout == "chain")


# --------------------------------------------------------------------------- the rule


def is_av(role: torch.Tensor) -> torch.Tensor:
    """role [...] -> bool [...]: audio-visual feature slots."""
    return (role == Role.VISUAL) | (role == Role.AUDIO)


@dataclass
class TokenMeta:
    """What the rule needs about a set of tokens: order key, role, event; each [N].

    plan_index: k for the k-th serial <G> (0-based), -1 for every other token; only the
    `g_visibility="own"` rule reads it (None: not tracked).
    """

    order: torch.Tensor
    role: torch.Tensor
    event: torch.Tensor
    plan_index: torch.Tensor | None = None


def cat_meta(*parts: TokenMeta) -> TokenMeta:
    """Token sets one after the other (keys of a forward: cache then new tokens); plan_index is kept
    when every part has one, else None (untracked)."""
    plans = [p.plan_index for p in parts]
    return TokenMeta(order=torch.cat([p.order for p in parts]), role=torch.cat([p.role for p in parts]),
                     event=torch.cat([p.event for p in parts]),
                     plan_index=None if any(p is None for p in plans) else torch.cat(plans))


def mask_between(queries: TokenMeta, keys: TokenMeta, options: LayoutOptions) -> torch.Tensor:
    """THE visibility rule: bool [Lq, Lk], which keys each query sees (any query set, any key set).

    Visible iff order(k) <= order(q) and (k is shared (event -1) or same event), or
    (av_bidirectional) both are audio-visual slots. `mask="causal"` keeps only the
    order condition. `g_visibility="own"` also hides from an event-i query every serial
    <G> whose plan index (keys.plan_index) is not i. PAD tokens are never visible and see
    nothing (`pack` lets a PAD row see itself so softmax stays finite).
    """
    if options.mask not in ("factorized", "causal"):
        raise LayoutError(f"unknown mask mode {options.mask!r}")
    q_role, q_event = queries.role[:, None], queries.event[:, None]
    k_role, k_event = keys.role[None, :], keys.event[None, :]
    vis = keys.order[None, :] <= queries.order[:, None]
    if options.mask == "factorized":
        vis = vis & ((k_event < 0) | (k_event == q_event))
    if options.g_visibility == "own" and bool((q_event >= 0).any()):  # shared queries (planning) see every <G>
        if keys.plan_index is None:
            raise LayoutError("g_visibility='own' needs the keys' plan_index (TokenMeta.plan_index)")
        vis = vis & ~((k_role == Role.SERIAL_G) & (q_event >= 0) & (keys.plan_index[None, :] != q_event))
    if options.av_bidirectional:
        vis = vis | (is_av(q_role) & is_av(k_role))
    real = (q_role != Role.PAD) & (k_role != Role.PAD)
    return vis & real


def additive_mask(vis: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """bool [...] -> float [...]: 0 where visible, finfo(dtype).min where hidden."""
    zero = torch.zeros((), dtype=dtype, device=vis.device)
    return torch.where(vis, zero, torch.finfo(dtype).min)


# --------------------------------------------------------------------------- positions and order


def shared_position(index: int | torch.Tensor, delta: int = 0) -> int | torch.Tensor:
    """Position of a shared token (prefix, serial <G>, plain response) = its index (+ delta: after an M-RoPE prompt, its rope delta)."""
    return index + delta if delta else index


def anchor_position(prefix_len: int, num_events: int, delta: int = 0) -> int:
    """A = pos(last serial <G>) + 1 = P + K (+ delta, see `shared_position`): the one position all anchors share."""
    return int(shared_position(prefix_len + num_events - 1, delta)) + 1


def branch_position(anchor_pos: int | torch.Tensor, step: int | torch.Tensor) -> int | torch.Tensor:
    """Position of branch step j (anchor = step 0) in every branch: A + j."""
    return anchor_pos + step


def event_order(
    event: int | torch.Tensor, step: int | torch.Tensor, base: int, num_events: int, branch_order: str
) -> torch.Tensor:
    """Causal-order key of anchor/branch tokens (shared tokens use their index).

    base = P + K (index of the first anchor). Anchors (step 0): base + event.
    blocked: base + K + event * STEP_SPAN + (step - 1); round_robin: base + step * K + event.
    Keys are increasing along the training layout, so `k <= q` in layout order is
    `order(k) <= order(q)`; the decoder computes the same keys for its tokens.
    """
    event = torch.as_tensor(event, dtype=torch.long)
    step = torch.as_tensor(step, dtype=torch.long)
    if branch_order == "round_robin":
        return base + step * num_events + event
    if branch_order != "blocked":
        raise LayoutError(f"unknown branch order {branch_order!r}")
    if int(step.max() if step.numel() else 0) >= STEP_SPAN:
        raise LayoutError(f"branch step >= {STEP_SPAN}")
    return torch.where(step == 0, base + event, base + num_events + event * STEP_SPAN + step - 1)


# --------------------------------------------------------------------------- the layout


@dataclass
class Layout:
    """One sample's training (or prefix) sequence; every tensor is [L] unless noted.

    input_ids  token id; FEATURE_ID at audio-visual slots; <G> id at anchors
    labels     target id, IGNORE where no loss
    event      -1 shared (prefix, serial <G>, response); i for anchor i and branch i
    role       Role
    segment    time segment t of a feature slot, -1 elsewhere
    slot       index into the modality's flattened features (t * V + v / t * A + a), -1 elsewhere
    step       branch step (anchor 0, branch token j >= 1), -1 elsewhere
    order      causal-order key (strictly increasing along the layout)
    position   layout position (see module notes)
    mask       float32 [1, 1, L, L] additive mask
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
    num_segments: int
    visual_per_segment: int
    audio_per_segment: int
    num_events: int
    prefix_len: int  # P: index of <G>_1 (= first token after the instruction)
    split: int  # index of the first anchor (P + K); L when there are none
    kind: Literal["dense", "plain", "prefix"] = "dense"

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def instruction_end(self) -> int:
        """Index of the last instruction token (its attention row drives aggregation)."""
        return self.prefix_len - 1

    def meta(self, index: torch.Tensor | None = None) -> TokenMeta:
        sel = (lambda t: t) if index is None else (lambda t: t[index])
        plan = torch.where(self.role == Role.SERIAL_G, torch.arange(len(self)) - self.prefix_len, -1)
        return TokenMeta(order=sel(self.order), role=sel(self.role), event=sel(self.event), plan_index=sel(plan))

    def _slots(self, role: Role, per_segment: int) -> torch.Tensor:
        idx = torch.nonzero(self.role == role).flatten()
        out = torch.empty(self.num_segments * per_segment, dtype=torch.long)
        out[self.slot[idx]] = idx
        return out.view(self.num_segments, per_segment)

    @property
    def visual_index(self) -> torch.Tensor:
        """[T, V]: layout index of each visual slot."""
        return self._slots(Role.VISUAL, self.visual_per_segment)

    @property
    def audio_index(self) -> torch.Tensor:
        """[T, A]: layout index of each audio slot (A may be 0)."""
        return self._slots(Role.AUDIO, self.audio_per_segment)

    @property
    def event_query_index(self) -> torch.Tensor:
        """[K]: index of the token that predicts <G>_i (instruction end, then <G>_1..K-1)."""
        return torch.arange(self.num_events, dtype=torch.long) + self.prefix_len - 1

    @property
    def anchor_index(self) -> torch.Tensor:
        """[K]: index of anchor i (the first K tokens after `split`, or interleaved in a chain)."""
        idx = torch.nonzero(self.role == Role.ANCHOR).flatten()
        return idx[torch.argsort(self.event[idx], stable=True)]


class _Builder:
    """Accumulates tokens column-wise, starting with the prefix (P = `prefix_len` tokens); `finish` sorts
    by order and builds the mask (the Layout's sizes and P come from the prefix)."""

    def __init__(self, preamble_ids, instruction_ids, num_segments: int, visual: int, audio: int) -> None:
        self.cols: dict[str, list[int]] = {k: [] for k in ("input_ids", "labels", "event", "role", "segment", "slot", "step", "order", "position")}
        if num_segments < 1 or visual < 1 or audio < 0:
            raise LayoutError(f"need T >= 1, V >= 1, A >= 0 (got T={num_segments}, V={visual}, A={audio})")
        if len(instruction_ids) < 1:
            raise LayoutError("the instruction must have at least one token (its last token predicts <G>/<S>)")
        self.add(preamble_ids, Role.PREAMBLE)
        for t in range(num_segments):
            self.add([FEATURE_ID] * visual, Role.VISUAL, segment=t, slot=range(t * visual, (t + 1) * visual))
            if audio:
                self.add([FEATURE_ID] * audio, Role.AUDIO, segment=t, slot=range(t * audio, (t + 1) * audio))
        self.add(instruction_ids, Role.INSTRUCTION)
        self.prefix_len = len(self)
        self.sizes = dict(num_segments=num_segments, visual_per_segment=visual, audio_per_segment=audio, prefix_len=self.prefix_len)

    def add(self, ids, role, *, labels=None, event=-1, segment=-1, slot=-1, step=-1, order=None, position=None) -> None:
        ids = list(ids)
        n = len(ids)
        start = len(self.cols["input_ids"])

        def col(v, default):
            if v is None:
                v = default
            return list(v) if isinstance(v, (list, tuple, range)) else [v] * n

        self.cols["input_ids"] += ids
        self.cols["labels"] += col(labels, IGNORE)
        self.cols["event"] += col(event, -1)
        self.cols["role"] += [int(role)] * n
        self.cols["segment"] += col(segment, -1)
        self.cols["slot"] += col(slot, -1)
        self.cols["step"] += col(step, -1)
        self.cols["order"] += col(order, range(start, start + n))
        self.cols["position"] += col(position, [shared_position(i) for i in range(start, start + n)])

    def __len__(self) -> int:
        return len(self.cols["input_ids"])

    def finish(self, options: LayoutOptions, **attrs) -> Layout:
        t = {k: torch.tensor(v, dtype=torch.long) for k, v in self.cols.items()}
        perm = torch.argsort(t["order"], stable=True)
        t = {k: v[perm] for k, v in t.items()}
        if (t["order"][1:] <= t["order"][:-1]).any():
            raise LayoutError("duplicate order keys in layout")
        layout = Layout(**t, mask=torch.empty(0), **self.sizes, **attrs)  # the columns are Layout's tensor fields
        meta = layout.meta()
        layout.mask = additive_mask(mask_between(meta, meta, options))[None, None]
        return layout


def prefix_layout(preamble_ids, instruction_ids, num_segments: int, visual_per_segment: int,
                  audio_per_segment: int, options: LayoutOptions = LayoutOptions()) -> Layout:
    """The prefix alone (what decoding starts from): no labels, no events."""
    b = _Builder(preamble_ids, instruction_ids, num_segments, visual_per_segment, audio_per_segment)
    return b.finish(options, num_events=0, split=b.prefix_len, kind="prefix")


def dense_layout(
    preamble_ids: Sequence[int],
    instruction_ids: Sequence[int],
    num_segments: int,
    visual_per_segment: int,
    audio_per_segment: int,
    captions: Sequence[Sequence[int]],
    *,
    g_id: int,
    s_id: int,
    eos_id: int,
    options: LayoutOptions = LayoutOptions(),
) -> Layout:
    """A dense-captioning training sequence with K = len(captions) events (module notes)."""
    b = _Builder(preamble_ids, instruction_ids, num_segments, visual_per_segment, audio_per_segment)
    p = b.prefix_len
    k = len(captions)
    b.cols["labels"][p - 1] = g_id if k else s_id
    if k:
        b.add([g_id] * k, Role.SERIAL_G, labels=[g_id] * (k - 1) + [s_id])
    if k and options.chain:
        for i, cap in enumerate(captions):  # anchor_i caption_i, one chain at consecutive positions
            tgt = list(cap) + [eos_id]
            b.add([g_id], Role.ANCHOR, labels=tgt[:1], event=i, step=0)
            if cap:
                b.add(cap, Role.BRANCH, labels=tgt[1:], event=i, step=list(range(1, len(tgt))))
    elif k:
        lengths = [len(c) + 1 for c in captions]  # the real lengths of b_i = caption_i + eos
        n = max(lengths)  # N: options.padded pads every b_i with eos to it (module notes)
        targets = [list(c) + [eos_id] * ((n if options.padded else len(c) + 1) - len(c)) for c in captions]
        base = p + k
        a_pos = anchor_position(p, k)
        ev = torch.arange(k)
        b.add([g_id] * k, Role.ANCHOR, labels=[t[0] for t in targets], event=range(k), step=0,
              order=event_order(ev, 0, base, k, options.branch_order).tolist(), position=a_pos)
        for i, (tgt, real) in enumerate(zip(targets, lengths)):
            n = len(tgt)
            steps = torch.arange(1, n)
            labels = [tgt[j] if (j < real or options.eos_padding_loss) else IGNORE for j in range(1, n)]
            b.add(tgt[: n - 1], Role.BRANCH, labels=labels, event=i, step=steps.tolist(),
                  order=event_order(i, steps, base, k, options.branch_order).tolist(),
                  position=branch_position(a_pos, steps).tolist())
    return b.finish(options, num_events=k, split=p + k, kind="dense")


def plain_layout(
    preamble_ids: Sequence[int],
    instruction_ids: Sequence[int],
    num_segments: int,
    visual_per_segment: int,
    audio_per_segment: int,
    response_ids: Sequence[int],
    *,
    eos_id: int,
    options: LayoutOptions = LayoutOptions(),
) -> Layout:
    """A plain instruction-response sample: the response (+ eos) is ordinary causal text."""
    b = _Builder(preamble_ids, instruction_ids, num_segments, visual_per_segment, audio_per_segment)
    target = list(response_ids) + [eos_id]
    b.cols["labels"][b.prefix_len - 1] = target[0]
    b.add(target[:-1], Role.RESPONSE, labels=target[1:])
    return b.finish(options, num_events=0, split=len(b), kind="plain")
