"""Token choice for planning and caption branches, shared by the engine and the reference decoders.

    chooser = TokenChooser(model.ids, temperature=0.0, top_p=1.0, generator=None)
    want_g = plan_decision(restricted_logits, k, max_events, control)   # planning: <G> or stop
    tokens = chooser.branch(logits, step, events, control)             # [n] next caption tokens

Every decoder (infer/engine/core.py, infer/oracles/decoders.py) goes through these functions, so
greedy outputs can only differ through the model arithmetic, never through the rules.

Rules
  planning   greedy over {<G>, <S>} only: <G> while it wins (ties go to <G>), at most
             `max_events` events, at least one (a leading <S> becomes <G>).
  branches   <G>/<S> are structural and never caption text: their logits are -inf.
             Greedy (argmax) at temperature 0, else softmax(logits / T) restricted to
             the smallest top-p nucleus, sampled with the given torch.Generator.

`DecodeControl` holds the test and benchmark hooks (serving never sets them): force
the number of events K, force each branch's length (eos suppressed before the last
token, which is forced to eos, so termination runs through the real eos path), or
suppress eos altogether (every branch runs to the token cap), and keep the logits.
Its branch hooks are logits processors (`ForcedLengths`, `SuppressEos`) that the
decoders apply after the production rules; a decode without a control runs none.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class DecodeControl:
    """Hooks for tests and benchmarks; the default changes nothing.

    num_events  force K events (still capped by max_events)
    lengths     branch i emits exactly lengths[i % len(lengths)] tokens, the last one
                <eos> (still capped by max_branch_tokens)
    suppress_eos  never emit <eos>: every branch runs to the token cap
    trace       keep the raw logits of every planning decision and branch step
    """

    num_events: int | None = None
    lengths: Sequence[int] | None = None
    suppress_eos: bool = False
    trace: bool = False

    def __post_init__(self) -> None:
        if self.num_events is not None and self.num_events < 1:
            raise ValueError(f"DecodeControl.num_events must be >= 1, got {self.num_events}")
        if self.lengths is not None and (len(self.lengths) == 0 or min(self.lengths) < 1):
            raise ValueError(f"DecodeControl.lengths must be non-empty and >= 1, got {list(self.lengths)}")

    def length(self, event: int) -> int | None:
        return None if self.lengths is None else int(self.lengths[event % len(self.lengths)])

    def processors(self, eos_id: int) -> list[LogitsProcessor]:
        """The branch hooks as logits processors (none for the default control)."""
        out: list[LogitsProcessor] = []
        if self.suppress_eos:
            out.append(SuppressEos(eos_id))
        if self.lengths is not None:
            out.append(ForcedLengths(self, eos_id))
        return out


NO_CONTROL = DecodeControl()


class LogitsProcessor:
    """scores [n, V] fp32 of n branch rows at branch step `step`, events `events` -> scores (in place ok)."""

    def __call__(self, scores: torch.Tensor, step: int, events: Sequence[int]) -> torch.Tensor:
        raise NotImplementedError


class SuppressEos(LogitsProcessor):
    """Never <eos>: every branch runs to the token cap."""

    def __init__(self, eos_id: int):
        self.eos_id = eos_id

    def __call__(self, scores, step, events):
        scores[:, self.eos_id] = float("-inf")
        return scores


class ForcedLengths(LogitsProcessor):
    """Branch of event e emits exactly control.length(e) tokens, the last one <eos>."""

    def __init__(self, control: DecodeControl, eos_id: int):
        self.control, self.eos_id = control, eos_id

    def __call__(self, scores, step, events):
        for row, e in enumerate(events):
            n = self.control.length(int(e))
            if step < n - 1:
                scores[row, self.eos_id] = float("-inf")
            elif step == n - 1:
                scores[row] = float("-inf")
                scores[row, self.eos_id] = 0.0
        return scores


def plan_decision(restricted: torch.Tensor, num_events: int, max_events: int, control: DecodeControl = NO_CONTROL,
                  min_events: int = 1) -> bool:
    """restricted [2] = logits of (<G>, <S>) at the current planning row -> emit another <G>?

    num_events = <G>s emitted so far. The cap is checked by the caller before computing
    the logits (`planning_capped`); here: forced K, else at least `min_events` (1: every
    video gets an event; the release allows K = 0), else greedy, ties to <G>.
    """
    if control.num_events is not None:
        return num_events < control.num_events
    if num_events < min_events:
        return True
    return bool(restricted[0] >= restricted[1])


def planning_capped(num_events: int, max_events: int, control: DecodeControl = NO_CONTROL) -> bool:
    """True when planning must stop without asking the model (cap or forced K reached)."""
    if num_events >= max_events:
        return True
    return control.num_events is not None and num_events >= control.num_events


class TokenChooser:
    """Chooses caption tokens for a batch of branch rows (module rules)."""

    def __init__(self, ids: dict[str, int], temperature: float = 0.0, top_p: float = 1.0,
                 generator: torch.Generator | None = None):
        if temperature < 0 or not 0 < top_p <= 1:
            raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1 (got {temperature}, {top_p})")
        self.eos_id = int(ids["eos"])
        self.banned = [int(ids["g"]), int(ids["s"])]
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.generator = generator

    def branch(self, logits: torch.Tensor, step: int, events: Sequence[int], control: DecodeControl = NO_CONTROL) -> torch.Tensor:
        """logits [n, V] of branch rows (event ids `events`) at branch step `step` (0 = the token the
        anchor predicts) -> [n] long: the next token of each row, on logits' device (fp32 scores with
        the bans and the control's hooks applied, then `pick`)."""
        out = logits.float().clone()
        out[:, self.banned] = float("-inf")
        for proc in control.processors(self.eos_id):
            out = proc(out, step, events)
        return self.pick(out)

    def pick(self, scores: torch.Tensor) -> torch.Tensor:
        """Processed scores [n, V] -> [n] tokens: argmax, or a seeded draw (temperature, top-p)."""
        if self.temperature == 0.0:
            return scores.argmax(dim=-1)
        probs = torch.softmax(scores / self.temperature, dim=-1)
        if self.top_p < 1.0:
            probs = top_p_filter(probs, self.top_p)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs [n, V] -> renormalised probabilities on the smallest set whose mass reaches top_p."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(dim=-1) - sorted_p  # mass strictly before each token
    sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)  # the top token always stays
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return kept / kept.sum(dim=-1, keepdim=True)


def video_chooser(ids: dict[str, int], cfg, video_id: str, device: torch.device) -> TokenChooser:
    """The chooser of one video under decoding settings `cfg` (temperature, top_p, seed): greedy,
    or sampling with the video's own generator (seeded from (seed, video id): the same draws in any batch)."""
    gen = None
    if cfg.temperature > 0:
        gen = torch.Generator(device=device)
        gen.manual_seed((int(cfg.seed) * 1_000_003 + zlib.crc32(video_id.encode("utf-8"))) % (2**63 - 1))
    return TokenChooser(ids, cfg.temperature, cfg.top_p, gen)

