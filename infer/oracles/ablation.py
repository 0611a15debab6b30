"""Decoders for the ablation models, each in exactly the layout its model was trained on.

    decoded = layout_ordered(model, sample, cfg.infer)     # model.mask=causal, model.g_visibility=own
    decoded = text_chain(model, sample, cfg.infer)         # model.layout=sequential / textual_planning
    decoder = decoder_for(model)                           # the right one for any model (or None: the engine)

layout_ordered  for the parallel layout under any mask rule the engine cannot run (the
                causal ablation, own-<G> visibility): the front half as every decoder
                (infer/oracles/front.py), then the K anchors in ONE forward at their shared
                position A (each sees what the layout lets it see: under the causal mask
                the earlier anchors), then every branch token one forward at a time in
                the layout's causal order (blocked: branch 1 to its <eos>, then branch
                2, ...; round_robin: step-major over the live branches), at
                `branch_position(A, step)` with its mask row from the layout rule
                (`mask_between` with the model's own options). No cache is cropped:
                whatever the rule hides stays hidden. Given the same captions, its logits
                equal the training forward's (tests/test_ordered.py), which `monolithic`
                (consecutive positions, a1 b1 a2 b2) does not for a causal model.
text_chain      the single causal chain of the sequential baselines: the prefix, then
                greedy text at consecutive positions until <eos> or max_events x max_branch_tokens; the
                text goes to the metrics as `{"text": ...}` and is parsed there
                (pipeline/textual.py).
The chain model (model.layout=chain) is what infer/oracles/decoders.py `monolithic` decodes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import DynamicCache

from infer.engine.core import CaptionEngine
from infer.engine.decoded import Decoded, caption_text, to_events
from infer.engine.requests import model_caps
from infer.engine.sampling import NO_CONTROL, DecodeControl, video_chooser
from infer.oracles.decoders import branch_ended, finish_decoded, monolithic, row_mask
from infer.oracles.front import StageTimer, run_front
from pipeline.config import InferConfig
from pipeline.decoding import prepare_example, token_position_ids
from pipeline.examples import collate
from pipeline.layout import Role, TokenMeta, branch_position, cat_meta, event_order
from pipeline.textual import parse_events_text


def _meta(order, role: Role, event) -> TokenMeta:
    order = torch.as_tensor(order, dtype=torch.long).reshape(-1)
    event = torch.as_tensor(event, dtype=torch.long).reshape(-1).expand(order.shape[0])
    return TokenMeta(order=order, role=torch.full_like(order, int(role)), event=event.clone(),
                     plan_index=torch.full_like(order, -1))


def _schedule(k: int, branch_order: str, live) -> list[tuple[int, int]]:
    """The (event, step) of the next branch tokens to feed, in layout order (live: event -> step)."""
    if branch_order == "round_robin":
        step = min(live.values())
        return [(e, step) for e in sorted(live) if live[e] == step]
    e = min(live)
    return [(e, live[e])]


@torch.no_grad()
def layout_ordered(model, sample, cfg: InferConfig, control: DecodeControl = NO_CONTROL) -> Decoded:
    """Anchors at A in one forward, then branch tokens one at a time in layout order (module doc)."""
    timer = StageTimer(model.device)
    cache = DynamicCache(config=model.hf_config)
    front = run_front(model, sample, cache, cfg, control, timer)
    opts, dev = model.options, model.device
    p, k = front.prefix_len, front.num_events
    base = p + k
    keys = front.keys  # with each serial <G>'s plan index (the own-<G> rule reads it)
    chooser = video_chooser(model.ids, cfg, sample.video_id, dev)

    anchors = _meta(event_order(torch.arange(k), 0, base, k, opts.branch_order), Role.ANCHOR, torch.arange(k))
    keys = cat_meta(keys, anchors)
    mask = row_mask(model, anchors, keys)
    pos = token_position_ids(model, branch_position(front.anchor_pos, 0), k, Role.ANCHOR, dev).transpose(-1, -2)  # [.., 1, K]
    out = model.run_decoder(front.anchors[None], mask, pos, cache=cache)
    logits = model.lm_logits(out.last_hidden_state[0])
    first = chooser.branch(logits, 0, list(range(k)), control).tolist()
    tokens = [[t] for t in first]
    logits_of = [[logits[e].float().cpu()] if control.trace else [] for e in range(k)]
    steps = 1

    # event -> the branch step its next input takes
    live = {e: 1 for e in range(k) if not branch_ended(tokens[e], chooser.eos_id, cfg.max_branch_tokens)}
    while live:
        for e, step in _schedule(k, opts.branch_order, live):
            q = _meta(event_order(e, step, base, k, opts.branch_order), Role.BRANCH, e)
            keys = cat_meta(keys, q)
            emb = model.embed_tokens(torch.tensor([[tokens[e][-1]]], device=dev))
            pos = token_position_ids(model, branch_position(front.anchor_pos, step), 1, Role.BRANCH, dev)
            out = model.run_decoder(emb, row_mask(model, q, keys), pos, cache=cache)
            logits = model.lm_logits(out.last_hidden_state[:, -1])
            tokens[e].append(int(chooser.branch(logits, step, [e], control)[0]))
            if control.trace:
                logits_of[e].append(logits[0].float().cpu())
            steps += 1
            live[e] = step + 1
            if branch_ended(tokens[e], chooser.eos_id, cfg.max_branch_tokens):
                del live[e]
    return finish_decoded(sample, front.example, front.intervals, tokens, steps, timer, front.planning_logits, logits_of,
                          front.grounding_logits, control)


# --------------------------------------------------------------------------- the text chain


@dataclass
class TextDecoded:
    """One video's text-chain decode: the generated ids and text, and the timings."""

    video_id: str
    duration: float
    token_ids: list[int]
    text: str
    capped: bool
    timings: dict[str, float] = field(default_factory=dict)
    logits: torch.Tensor | None = None  # [n, V] when traced


@torch.no_grad()
def text_chain(model, sample, cfg: InferConfig, control: DecodeControl = NO_CONTROL,
               forced: list[int] | None = None) -> TextDecoded:
    """Prefix, then greedy text at consecutive positions to <eos> or max_events x max_branch_tokens
    tokens. `forced`: feed these ids instead of the chosen ones (tests compare the logits with the
    training forward)."""
    cap = int(cfg.max_events * cfg.max_branch_tokens)
    t0 = time.perf_counter()
    example = prepare_example(model, sample, cap)
    lay = example.layout
    pk = collate([example]).packed
    cache = DynamicCache(config=model.hf_config)
    out = model.run_decoder(model.embed(pk, [example]), lay.mask, model.position_ids(pk), cache=cache)
    t_prefill = time.perf_counter()
    chooser = video_chooser(model.ids, cfg, sample.video_id, model.device)
    ids: list[int] = []
    kept = []
    index = len(lay)
    hidden = out.last_hidden_state[:, -1]
    while True:
        logits = model.lm_logits(hidden)
        if control.trace:
            kept.append(logits[0].float().cpu())
        tok = int(chooser.branch(logits, len(ids), [0], control)[0])
        if forced is not None:
            tok = forced[len(ids)]
        ids.append(tok)
        if tok == chooser.eos_id or len(ids) >= (len(forced) if forced is not None else cap):
            break
        emb = model.embed_tokens(torch.tensor([[tok]], device=model.device))
        pos = token_position_ids(model, index, 1, Role.RESPONSE, model.device)
        step = model.run_decoder(emb, torch.zeros(1, 1, 1, index + 1), pos, cache=cache)
        hidden = step.last_hidden_state[:, -1]
        index += 1
    t_end = time.perf_counter()
    capped = ids[-1] != chooser.eos_id
    timings = {"prefill_ms": (t_prefill - t0) * 1000.0, "decode_ms": (t_end - t_prefill) * 1000.0,
               "total_ms": (t_end - t0) * 1000.0, "tokens": float(len(ids)), "steps": float(len(ids))}
    return TextDecoded(video_id=sample.video_id, duration=float(sample.duration), token_ids=ids,
                       text=caption_text(model.tokenizer, ids, model.eos_id), capped=capped, timings=timings,
                       logits=torch.stack(kept) if kept else None)


# --------------------------------------------------------------------------- which decoder


def decoder_for(model):
    """The reference-style decoder a model must use instead of the engine, or None (the engine).

    parallel layout + factorized + global <G>: None (the engine); chain: monolithic;
    causal mask or own-<G> visibility: layout_ordered; text layouts: text_chain (the model's
    `baseline_decoder` names it).
    """
    name = model.baseline_decoder
    decoders = {"monolithic": monolithic, "text_chain": text_chain, "layout_ordered": layout_ordered}
    return None if name is None else decoders[name]


def caption_engine(model, cfg: InferConfig):
    """The engine for `model` under `cfg`, with the single-chain decoder `infer.decoder=monolithic` runs:
    the model's own baseline (`decoder_for`: an ablation model decodes in its own layout), else
    infer/oracles/decoders.py `monolithic`."""
    return CaptionEngine(model, cfg, single_chain=decoder_for(model) or monolithic)


def decode_events(model, decoder, sample, cfg: InferConfig) -> tuple[dict, dict[str, float]]:
    """One video through `decoder` (from `decoder_for`) -> (its output as the metrics read it:
    {"events": [...]} or, for a text chain, {"text": ...}; the decode's timings)."""
    got = decoder(model, sample, model_caps(cfg, model))  # 0 = the model's own caps
    if isinstance(got, TextDecoded):
        return {"text": got.text, "capped": got.capped}, got.timings
    events = [{"start": e.start, "end": e.end, "caption": e.caption} for e in to_events(got, model.tokenizer, model.eos_id)]
    return {"events": events}, got.timings


def output_events(output: dict) -> list[tuple[float, float, str]]:
    """A `decode_events` output -> (start, end, caption) triples (a text is parsed as the metrics parse it)."""
    if "text" in output:
        return parse_events_text(output["text"])[0]
    return [(float(e["start"]), float(e["end"]), str(e["caption"])) for e in output["events"]]
