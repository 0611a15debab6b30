"""The release's own decoding loop, re-done with HF forwards: the slow reference for the engine.

    ref = release_reference(model, video, max_events, max_branch_tokens)
    ref.decoded (Decoded), ref.calls (one record per decoder forward: inputs, positions, mask, logits)

After the front half (infer/oracles/front.py, the engine's program for the release), the release
runs the K branches in lock-step through the HF decoder with an explicit 4D mask
(docs/design/release.md 2, M:4499-4616): one forward of the K anchors at position (L + K) + delta,
each seeing the prefix and itself; then round r feeds every branch's previous token
(a finished branch is fed <|im_end|> and its output ignored) at position
(L + K) + 1 + r + delta, each row seeing the prefix and its own branch's cache slots
(slot i after the prefix belongs to branch i mod K); <G>, <S>, <shift> banned, argmax;
a branch ends with <|im_end|> (kept) and holds at most 1 + max_branch_tokens tokens;
the loop (infer/oracles/decoders.py `lock_step`) stops when every branch has ended.
The engine's cascade step must give the same tokens (tests/test_release.py); the parity
command compares these records with a release trace (infer/parity/check.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.cache_utils import DynamicCache

from infer.engine.decoded import Decoded
from infer.oracles.decoders import lock_step
from infer.oracles.front import Front, run_front
from pipeline.config import InferConfig
from pipeline.layout import additive_mask, branch_position, cat_meta
from pipeline.release.decoding import seconds
from pipeline.release.layout import event_meta, release_visible, shared_meta
from pipeline.release.video import ReleaseVideo


@dataclass
class Call:
    """One decoder forward of the caption phase."""

    phase: str
    position_ids: torch.Tensor  # [3, n]
    allowed: torch.Tensor  # [n, kv] bool
    logits: torch.Tensor  # [n, V] raw (before bans)


@dataclass
class Reference:
    front: Front
    decoded: Decoded
    calls: list[Call] = field(default_factory=list)


def branch_mask(prefix_len: int, k: int, rounds: int) -> torch.Tensor:
    """[K, prefix_len + K * rounds] bool: the prefix, then slot i belongs to branch i mod K.

    The project's visibility rule over the lock-step cache: the prefix (prompt + serial <G>s) is
    shared, slot i is step i // K of event i mod K in round-robin order (pipeline/layout.py
    `event_order`), and the queries are the last round's K slots."""
    slots = torch.arange(k * rounds)
    keys = cat_meta(shared_meta(prefix_len), event_meta(prefix_len, k, (slots % k).tolist(), (slots // k).tolist(),
                                                        "round_robin"))
    queries = event_meta(prefix_len, k, list(range(k)), [rounds - 1] * k, "round_robin")
    return release_visible(queries, keys)


@torch.no_grad()
def release_reference(model, video: ReleaseVideo, max_events: int, max_branch_tokens: int,
                      forced_steps: list[tuple[int, int]] | None = None) -> Reference:
    """Decode one video as the release does (module doc); forced_steps: see infer/oracles/front.py `run_front`."""
    cache = DynamicCache(config=model.hf_config)
    opts = InferConfig(max_events=max_events, max_branch_tokens=max_branch_tokens)
    front = run_front(model, video, cache, opts, forced_steps=forced_steps)
    k, dev = front.num_events, model.device
    ref = Reference(front, Decoded(video.video_id, float(video.duration), front.intervals, [], 0))
    banned = torch.tensor([model.g_id, model.s_id, model.shift_id], device=dev)

    def forward(x: torch.Tensor, r: int) -> torch.Tensor:
        pos = torch.full((3, k), branch_position(front.anchor_pos, r), dtype=torch.long)
        allowed = branch_mask(front.prefix_len + k, k, r + 1)
        mask = additive_mask(allowed, model.dtype)[None, None].to(dev)
        out = model.decoder(inputs_embeds=x[None], attention_mask=mask, position_ids=pos[:, None].to(dev), cache=cache,
                            use_cache=True)
        logits = model.lm_logits(out.last_hidden_state[0]).float()
        ref.calls.append(Call("anchors" if r == 0 else f"branch_step{r - 1}", pos, allowed, logits.cpu()))
        return logits

    def choose(logits: torch.Tensor, r: int) -> list[int]:
        scores = logits.clone()
        scores[:, banned] = float("-inf")
        return scores.argmax(dim=-1).tolist()

    ref.decoded.tokens, ref.decoded.steps = lock_step(model, front.anchors, forward, choose, max_branch_tokens + 1)
    return ref


def release_text(tokenizer, decoded: Decoded, steps: list[tuple[int, int]], d: float, eos_id: int) -> str:
    """The release test script's final text: per event "s - e" seconds then its caption, one per line.

    The caption (special tokens dropped) gets a leading space unless it starts with one of
    " ;,.<"; an empty one becomes "; " unless it is the last (tests/data/release_golden/README.md, fixture fact 14).
    """
    lines = []
    for i, ((a, b), toks) in enumerate(zip(steps, decoded.tokens)):
        text = tokenizer.decode([t for t in toks if t != eos_id], skip_special_tokens=True)
        if not text:
            text = "" if i == len(steps) - 1 else "; "
        elif text[0] not in " ;,.<":
            text = " " + text
        start, end = seconds((a, b), d)
        lines.append(f"{round(start, 2)} - {round(end, 2)}{text}")
    return "\n".join(lines)
