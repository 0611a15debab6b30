"""The PadCaptioner decoding engine: planning, grounding, anchors, lock-step branches.

    engine = CaptionEngine(model, cfg.infer)              # model: pipeline.model.PadCaptioner
    results = engine.caption(samples)                      # list[VideoResult], one per sample
    decoded = engine.decode(sample, DecodeControl(...))    # one video, with test/bench hooks

Per video (one `CascadeCache` each, so videos of any prefix length mix in one call):
  1. prefill, planning, grounding, aggregation: infer/front.py (`run_front`);
  2. one forward over the K anchors (batch K, all at position A, attention mask None:
     in branch mode the cascade attention itself sees the whole prefix + own branch);
  3. lock-step decoding: every step feeds one token per active branch, all at position
     `branch_position(A, j)`, and reads one logit row each (infer/sampling.py: greedy by
     default, temperature / top-p with a per-video seeded torch.Generator);
  4. independent termination: a branch that emits <eos> or reaches max_branch_tokens
     leaves at once: its KV is dropped (`cache.keep`) and its row leaves the query
     batch; no padding token is ever fed.
Events come back sorted by start with well-formed intervals (start < end inside
[0, duration]) even for an untrained model. `infer.decoder = "monolithic"` runs the
single-chain baseline (infer/reference.py `monolithic`) behind the same interface.

A sample that does not fit the model (segments over model.max_segments, feature dims,
sequence length, bad duration) gets a VideoResult with `error` set and no events; the
other samples go on.

The engine sets the backbone's attention to "padcap_cascade" (infer/attention.py). In
prefix mode that is HF's sdpa with the given mask, so every other use of the model
(training forward, reference decoders) computes exactly what it did before.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from infer.attention import ATTN_IMPLEMENTATION, register
from infer.decoded import Decoded, to_events
from infer.front import DecodeError, Front, StageTimer, prepare_example, run_front, token_position_ids
from infer.kv_cache import CascadeCache
from infer.sampling import NO_CONTROL, DecodeControl, TokenChooser, video_generator
from pipeline.config import InferConfig
from pipeline.layout import Role, branch_position
from pipeline.schema import Event, Sample

log = logging.getLogger("padcap.infer")


@dataclass
class VideoResult:
    """One video's captions: events sorted by start; timings in ms (+ steps, tokens, events)."""

    video_id: str
    duration: float
    events: list[Event]
    timings: dict[str, float] = field(default_factory=dict)
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {"video_id": self.video_id, "duration": float(self.duration),
               "events": [{"start": float(e.start), "end": float(e.end), "caption": e.caption} for e in self.events],
               "timings": dict(self.timings)}
        if self.error is not None:
            out["error"] = self.error
        return out


def resolve_device(name: str) -> torch.device:
    """infer.device -> torch.device (auto = CUDA when available)."""
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def use_cascade_attention(model) -> None:
    """Register "padcap_cascade" and switch the backbone to it (idempotent)."""
    register()
    base = model.backbone.get_base_model()
    if base.config._attn_implementation != ATTN_IMPLEMENTATION:
        base.set_attn_implementation(ATTN_IMPLEMENTATION)


@torch.no_grad()
def decode_lockstep(model, front: Front, chooser: TokenChooser, max_tokens: int,
                    control: DecodeControl = NO_CONTROL) -> tuple[list[list[int]], list[torch.Tensor] | None, int]:
    """Steps 2-4 of the module doc on a front whose cache is a CascadeCache in prefix mode.

    Returns (tokens per event, raw logits per event [len_i, V] if traced, decoder steps).
    """
    cache = front.cache
    k = front.num_events
    dev = model.device
    cache.start_branches(k, capacity=max_tokens + 1)
    active = list(range(k))  # event of each query row
    tokens: list[list[int]] = [[] for _ in range(k)]
    traced: list[list[torch.Tensor]] | None = [[] for _ in range(k)] if control.trace else None
    embeds = front.anchors[:, None, :]  # [K, 1, d]: step 0 = the anchors
    role, step = Role.ANCHOR, 0
    while True:
        pos = token_position_ids(model, branch_position(front.anchor_pos, step), len(active), role, dev)
        hidden = model.decoder(inputs_embeds=embeds, position_ids=pos, cache=cache, use_cache=True).last_hidden_state
        logits = model.lm_logits(hidden[:, -1])  # [n, V]
        nxt = chooser.branch(logits, step, active, control)
        chosen = nxt.tolist()
        done = []
        for row, (event, tok) in enumerate(zip(active, chosen)):
            tokens[event].append(tok)
            if traced is not None:
                traced[event].append(logits[row].float().cpu())
            done.append(tok == chooser.eos_id or len(tokens[event]) >= max_tokens)
        step += 1
        if all(done):
            break
        if any(done):  # finished branches leave the cache and the query batch at once
            keep = [row for row, d in enumerate(done) if not d]
            cache.keep(keep)
            active = [active[row] for row in keep]
            nxt = nxt[torch.tensor(keep, device=nxt.device)]
        embeds = model.embed_tokens(nxt[:, None])  # [n, 1, d]
        role = Role.BRANCH
    cache.end_branches()
    logits_out = [torch.stack(t) for t in traced] if traced is not None else None
    return tokens, logits_out, step


class CaptionEngine:
    """Dense captions for a list of samples (module doc). Not thread-safe: one caller at a time."""

    def __init__(self, model, cfg: InferConfig):
        if cfg.max_events < 1 or cfg.max_branch_tokens < 1:
            raise ValueError(f"infer.max_events and infer.max_branch_tokens must be >= 1 "
                             f"(got {cfg.max_events}, {cfg.max_branch_tokens})")
        if cfg.temperature < 0 or not 0 < cfg.top_p <= 1:
            raise ValueError(f"need infer.temperature >= 0 and 0 < infer.top_p <= 1 (got {cfg.temperature}, {cfg.top_p})")
        if cfg.attention_prefix_splits < 0:
            raise ValueError(f"infer.attention_prefix_splits must be >= 0 (0 = auto), got {cfg.attention_prefix_splits}")
        if cfg.decoder == "parallel" and model.options.mask != "factorized":
            raise ValueError(f"parallel decoding needs a model trained with the factorized mask (model.mask="
                             f"{model.options.mask!r}); use infer.decoder=monolithic")
        self.model = model
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        if self.device.type == "cpu" and cfg.cpu_threads > 0:
            torch.set_num_threads(cfg.cpu_threads)  # process-wide: an engine owns its process (actor, replica)
        if model.device.type != self.device.type:
            model.to(self.device)
        model.eval()
        use_cascade_attention(model)

    def chooser(self, video_id: str) -> TokenChooser:
        gen = None
        if self.cfg.temperature > 0:
            gen = video_generator(self.cfg.seed, video_id, self.device)
        return TokenChooser(self.model.ids, self.cfg.temperature, self.cfg.top_p, gen)

    @torch.no_grad()
    def decode(self, sample: Sample, control: DecodeControl = NO_CONTROL) -> Decoded:
        """One video -> Decoded (raises DecodeError for a sample that does not fit the model)."""
        if self.cfg.decoder == "monolithic":
            from infer.reference import monolithic

            return monolithic(self.model, sample, self.cfg, control)
        timer = StageTimer(self.device)
        example = prepare_example(self.model, sample)
        cache = CascadeCache(self.model.hf_config, backend=self.cfg.attention_backend,
                             prefix_splits=self.cfg.attention_prefix_splits)
        front = run_front(self.model, example, cache, self.cfg.max_events, control, timer)
        tokens, logits, steps = decode_lockstep(self.model, front, self.chooser(sample.video_id),
                                                self.cfg.max_branch_tokens, control)
        timer.lap("decode_ms")
        timings = dict(timer.ms)
        timings.update(total_ms=sum(timer.ms.values()), steps=float(steps),
                       tokens=float(sum(len(t) for t in tokens)), events=float(len(tokens)))
        return Decoded(video_id=sample.video_id, duration=float(sample.duration), intervals=front.intervals,
                       tokens=tokens, steps=steps, timings=timings,
                       planning_logits=front.planning_logits if control.trace else None, branch_logits=logits,
                       grounding_logits=front.grounding_logits if control.trace else None)

    def caption(self, samples: list[Sample], *, controls: Sequence[DecodeControl] | None = None) -> list[VideoResult]:
        """Samples (decoded shards, or features straight from the encoders) -> one result each.

        controls: test/benchmark hooks, one per sample (infer/sampling.py); serving leaves it None.
        """
        if controls is not None and len(controls) != len(samples):
            raise ValueError(f"{len(controls)} controls for {len(samples)} samples")
        results = []
        for i, sample in enumerate(samples):
            try:
                decoded = self.decode(sample, controls[i] if controls is not None else NO_CONTROL)
            except DecodeError as e:
                log.warning("cannot caption %s: %s", sample.video_id, e)
                results.append(VideoResult(sample.video_id, float(sample.duration), [], {}, error=str(e)))
                continue
            events = to_events(decoded, self.model.tokenizer, self.model.eos_id)
            results.append(VideoResult(sample.video_id, decoded.duration, events, decoded.timings))
        return results

    def describe(self) -> dict[str, Any]:
        """The decoding settings (for logs and reports)."""
        return {**asdict(self.cfg), "resolved_device": str(self.device), "attention": ATTN_IMPLEMENTATION}
