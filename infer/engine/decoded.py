"""What every decoder returns for one video (`Decoded`), and how it becomes events.

    decoded = engine.decode(sample)                   # or any infer/oracles/decoders.py decoder
    events = to_events(decoded, model.tokenizer, model.eos_id)   # sorted by (start, end)

`tokens[i]` are the generated ids of event i (planning order), including the final
<eos> when the branch ended by itself; a branch stopped by the token cap has none.
Captions drop the <eos> and special tokens and are stripped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pipeline.schema import Event


@dataclass
class Decoded:
    """One video's decode (see module doc). Logits are kept only when traced."""

    video_id: str
    duration: float
    intervals: list[tuple[float, float]]
    tokens: list[list[int]]
    steps: int  # decoder forwards of the caption phase (anchors included)
    timings: dict[str, float] = field(default_factory=dict)
    planning_logits: torch.Tensor | None = None  # [n, 2] (<G>, <S>) per planning decision
    branch_logits: list[torch.Tensor] | None = None  # per event [len_i, V], raw model logits
    grounding_logits: torch.Tensor | None = None  # [K, T]

    @property
    def num_events(self) -> int:
        return len(self.tokens)

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)


def caption_text(tokenizer, ids: list[int], eos_id: int) -> str:
    """Generated ids -> caption text (up to the first <eos>, special tokens skipped)."""
    if eos_id in ids:
        ids = ids[: ids.index(eos_id)]
    return tokenizer.decode(ids, skip_special_tokens=True).strip()


def to_events(decoded: Decoded, tokenizer, eos_id: int) -> list[Event]:
    """Decoded -> events (start, end, caption) sorted by (start, end, planning order)."""
    items = [(s, e, i, caption_text(tokenizer, toks, eos_id))
             for i, ((s, e), toks) in enumerate(zip(decoded.intervals, decoded.tokens))]
    return [Event(float(s), float(e), text) for s, e, _, text in sorted(items)]
