"""Reference decoders: slow, obviously correct; test oracles and benchmark baselines.

    decoded = full_recompute(model, sample, cfg.infer, control)     # no cache at all
    decoded = branch_sequential(model, sample, cfg.infer, control)  # one branch after another
    decoded = parallel_copy(model, sample, cfg.infer, control)      # K rows, prefix KV copied
    decoded = monolithic(model, sample, cfg.infer, control)         # one causal chain

All return infer.engine.decoded.Decoded and choose tokens with infer/engine/sampling.py, like the
engine, so with greedy decoding the factorized ones must equal the engine token for
token (tests/test_engine.py).

full_recompute   the training-time forward: at every planning decision and every
                 branch step, one forward of the WHOLE sequence built by
                 pipeline.layout.dense_layout (prefix, serial <G>s, anchors, the branches
                 so far) with its explicit layout mask and positions, no KV cache;
                 grounding and aggregation are PadCaptioner.grounding_logits /
                 anchor_features on that forward, as in forward_train.
branch_sequential  the same factorized model with an HF DynamicCache: the prefix and the
                 serial <G>s once (infer/oracles/front.py), then branch 1 (anchor + tokens, each
                 step's mask row from the layout rule), crop back to the prefix, branch
                 2, ... Sum(len_i) decoder steps.
parallel_copy    K rows in lock-step rounds (`lock_step`, also the loop of the release's
                 reference, infer/oracles/release_loop.py): the prefix KV copied per branch (batch K
                 DynamicCache), a dense additive mask rebuilt every step, finished
                 branches kept and fed <eos> until the longest ends. Max(len_i) steps.
monolithic       the standard single-chain decoder users compare against: prefix,
                 serial <G>s, then anchor 1, caption 1, anchor 2, caption 2, ... in ONE
                 causal chain with consecutive positions and a DynamicCache (each
                 caption sees the earlier ones). It is a different model semantics for a
                 factorized model (equal to the others only when K = 1); in the
                 benchmark, forced lengths make it generate the same tokens count.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers.cache_utils import DynamicCache

from infer.engine.decoded import Decoded
from infer.engine.sampling import NO_CONTROL, DecodeControl, plan_decision, planning_capped, video_chooser
from infer.oracles.front import StageTimer, run_front
from pipeline.config import InferConfig
from pipeline.decoding import decode_reserve, ground_intervals, prepare_example, token_position_ids
from pipeline.examples import collate
from pipeline.layout import Role, TokenMeta, additive_mask, branch_position, cat_meta, dense_layout, event_order, mask_between, shared_position


def finish_decoded(sample, example, intervals, tokens, steps, timer, planning, branch_logits, grounding, control) -> Decoded:
    """A reference decoder's Decoded once its branches have ended (the timer's "decode_ms" lap is taken here): its
    timings (the timer's stages, totals, counts) and, when traced, its logits."""
    timer.lap("decode_ms")
    timings = dict(timer.ms)
    timings.update(total_ms=sum(timer.ms.values()), steps=float(steps), tokens=float(sum(map(len, tokens))),
                   events=float(len(tokens)), segments_kept=float(example.layout.num_segments),
                   segments_total=float(sample.num_segments))
    keep = control.trace
    return Decoded(video_id=sample.video_id, duration=float(sample.duration), intervals=intervals, tokens=tokens,
                   steps=steps, timings=timings, planning_logits=planning if keep else None,
                   branch_logits=[torch.stack(x) for x in branch_logits] if keep else None,
                   grounding_logits=grounding if keep else None)


def branch_ended(tokens: list[int], eos_id: int, max_tokens: int) -> bool:
    """A branch's tokens so far end it: its last is <eos> (kept), or it holds `max_tokens`."""
    return tokens[-1] == eos_id or len(tokens) >= max_tokens


# --------------------------------------------------------------------------- full recompute


@torch.no_grad()
def full_recompute(model, sample, cfg: InferConfig, control: DecodeControl = NO_CONTROL) -> Decoded:
    """No cache: every decision is read off one full training-layout forward (module doc)."""
    timer = StageTimer(model.device)
    example = prepare_example(model, sample, decode_reserve(cfg))
    pre = example.layout
    dims = (pre.num_segments, pre.visual_per_segment, pre.audio_per_segment)

    def forward(captions, stage1_only: bool, anchor_feats=None):
        lay = dense_layout(model.prompt[0], model.prompt[1], *dims, captions, g_id=model.g_id, s_id=model.s_id,
                           eos_id=model.eos_id, options=model.options)
        ex = dataclasses.replace(example, layout=lay)
        pk = collate([ex]).packed
        pos = model.position_ids(pk)
        emb = model.embed(pk, [ex])
        s = lay.split
        if stage1_only:
            out = model.run_decoder(emb[:, :s], pk.mask[:, :, :s, :s], pos[:, :s], output_hidden_states=True)
        else:
            emb[0, s : s + lay.num_events] += anchor_feats.to(emb.dtype)  # anchors: <G> + aggregated feature
            out = model.run_decoder(emb, pk.mask, pos)
        return lay, pk, pos, out

    planning = []
    k = 0
    while not planning_capped(k, cfg.max_events, control):
        _, _, _, out = forward([[]] * k, stage1_only=True)
        restricted = model.lm_logits(out.last_hidden_state[0, -1:])[0, [model.g_id, model.s_id]].float()
        planning.append(restricted)
        if not plan_decision(restricted, k, cfg.max_events, control):
            break
        k += 1
    timer.lap("planning_ms")

    lay, pk, pos, out = forward([[]] * k, stage1_only=True)  # the final stage 1: prefix + K serial <G>s
    hs = out.hidden_states
    g_logits = model.grounding_logits(hs[model.cfg.grounding_layer][0], lay)
    intervals = ground_intervals(model, g_logits, example)
    s = lay.split
    keys = pk.mask[0, 0, lay.instruction_end, :s].to(model.device) == 0
    feats, _ = model.anchor_features(hs[model.aggregation_layer][0], lay, example.segment_times,
                                     torch.tensor(intervals, dtype=torch.float32), pos[0, :s], keys)
    timer.lap("grounding_ms")

    chooser = video_chooser(model.ids, cfg, sample.video_id, model.device)
    tokens: list[list[int]] = [[] for _ in range(k)]
    logits_of: list[list[torch.Tensor]] = [[] for _ in range(k)]
    active, step = list(range(k)), 0
    while active:
        lay, _, _, out = forward(tokens, stage1_only=False, anchor_feats=feats)
        rows = [int(torch.nonzero((lay.event == e) & (lay.step == step))[0, 0]) for e in active]
        logits = model.lm_logits(out.last_hidden_state[0, rows])
        chosen = chooser.branch(logits, step, active, control).tolist()
        for row, (e, tok) in enumerate(zip(active, chosen)):
            tokens[e].append(tok)
            logits_of[e].append(logits[row].float().cpu())
        active = [e for e in active if not branch_ended(tokens[e], chooser.eos_id, cfg.max_branch_tokens)]
        step += 1
    return finish_decoded(sample, example, intervals, tokens, step, timer,
                          torch.stack(planning) if planning else torch.zeros(0, 2), logits_of, g_logits, control)


# --------------------------------------------------------------------------- cached references


def _branch_meta(model, front, event: int, step: int) -> TokenMeta:
    """Meta of anchor (step 0) / branch token `step` of `event`, with the layout's order key."""
    p, k = front.prefix_len, front.num_events
    order = event_order(event, step, p + k, k, model.options.branch_order).reshape(1)
    role = Role.ANCHOR if step == 0 else Role.BRANCH
    return TokenMeta(order=order, role=torch.tensor([int(role)]), event=torch.tensor([event]))


def row_mask(model, query: TokenMeta, keys: TokenMeta) -> torch.Tensor:
    """Additive float mask [1, 1, Lq, Lk] from the layout's visibility rule."""
    return additive_mask(mask_between(query, keys, model.options))[None, None]


def _token_by_token(model, sample, cfg: InferConfig, control: DecodeControl, inputs, crop: bool) -> Decoded:
    """The cached decoders that feed one token per forward, branch after branch (`branch_sequential`,
    `monolithic`): each branch starts from its anchor and runs to <eos> or the cap; inputs(front, e, step,
    seen) -> (mask, layout position) of event e's token `step` (seen: the tokens in the cache) is where
    they differ; crop: the cache goes back to the prefix after each branch."""
    timer = StageTimer(model.device)
    front = run_front(model, sample, DynamicCache(config=model.hf_config), cfg, control, timer)
    cache, dev = front.cache, model.device
    base = cache.get_seq_length()
    chooser = video_chooser(model.ids, cfg, sample.video_id, model.device)
    k = front.num_events
    tokens: list[list[int]] = [[] for _ in range(k)]
    logits_of: list[list[torch.Tensor]] = [[] for _ in range(k)]
    steps = 0
    for e in range(k):
        embeds, step = front.anchors[e][None, None], 0
        while True:
            mask, position = inputs(front, e, step, cache.get_seq_length())
            pos = token_position_ids(model, position, 1, Role.ANCHOR if step == 0 else Role.BRANCH, dev)
            out = model.run_decoder(embeds, mask, pos, cache=cache)
            logits = model.lm_logits(out.last_hidden_state[:, -1])
            tok = int(chooser.branch(logits, step, [e], control)[0])
            tokens[e].append(tok)
            if control.trace:
                logits_of[e].append(logits[0].float().cpu())
            steps += 1
            step += 1
            if branch_ended(tokens[e], chooser.eos_id, cfg.max_branch_tokens):
                break
            embeds = model.embed_tokens(torch.tensor([[tok]], device=dev))
        if crop:
            cache.crop(base - cache.get_seq_length())  # HF 5: a negative count of tokens to drop
    return finish_decoded(sample, front.example, front.intervals, tokens, steps, timer, front.planning_logits, logits_of,
                          front.grounding_logits, control)


@torch.no_grad()
def branch_sequential(model, sample, cfg: InferConfig, control: DecodeControl = NO_CONTROL) -> Decoded:
    """One branch at a time on a DynamicCache, cropped back to the prefix after each."""
    keys: dict[int, TokenMeta] = {}  # event -> the meta of the cached tokens its next token sees

    def inputs(front, e: int, step: int, seen: int) -> tuple[torch.Tensor, int]:
        q = _branch_meta(model, front, e, step)
        keys[e] = cat_meta(keys[e] if step else front.keys, q)
        return row_mask(model, q, keys[e]), branch_position(front.anchor_pos, step)

    return _token_by_token(model, sample, cfg, control, inputs, crop=True)


def lock_step(model, anchors: torch.Tensor, forward, choose, max_tokens: int) -> tuple[list[list[int]], int]:
    """K branches in lock-step rounds, the loop of `parallel_copy` and of the release's own
    (infer/oracles/release_loop.py), which differ only in `forward` (how the K rows sit in the cache,
    their masks and positions) and `choose` (the token rule).

    Round r feeds every branch one input x [K, d] (round 0: `anchors`; then each branch's last token,
    or <eos> once it has ended) through forward(x, r) -> logits [K, V]; choose(logits, r) -> K tokens.
    A branch ends with <eos> (kept) or at `max_tokens` tokens; an ended branch's rows are ignored; the
    rounds stop when every branch has ended. -> (tokens of each branch, rounds run)."""
    k, eos = anchors.shape[0], model.eos_id
    tokens: list[list[int]] = [[] for _ in range(k)]
    ended, x, r = [False] * k, anchors, 0
    while not all(ended):
        if r:
            x = model.embed_tokens(torch.tensor([eos if e else t[-1] for e, t in zip(ended, tokens)], device=model.device))
        chosen = choose(forward(x, r), r)
        for i in range(k):
            if not ended[i]:
                tokens[i].append(int(chosen[i]))
                ended[i] = branch_ended(tokens[i], eos, max_tokens)
        r += 1
    return tokens, r


@torch.no_grad()
def parallel_copy(model, sample, cfg: InferConfig, control: DecodeControl = NO_CONTROL) -> Decoded:
    """K rows in lock-step with the prefix KV copied per row and a dense mask per step."""
    timer = StageTimer(model.device)
    front = run_front(model, sample, DynamicCache(config=model.hf_config), cfg, control, timer)
    cache, k = front.cache, front.num_events
    cache.batch_repeat_interleave(k)  # the prefix KV, copied K times
    chooser = video_chooser(model.ids, cfg, sample.video_id, model.device)
    keys, rounds = [front.keys] * k, []

    def forward(x: torch.Tensor, step: int) -> torch.Tensor:
        metas = [_branch_meta(model, front, e, step) for e in range(k)]
        keys[:] = [cat_meta(keys[e], metas[e]) for e in range(k)]
        mask = torch.cat([row_mask(model, metas[e], keys[e]) for e in range(k)])  # [K, 1, 1, L], rebuilt per step
        role = Role.ANCHOR if step == 0 else Role.BRANCH
        pos = token_position_ids(model, branch_position(front.anchor_pos, step), k, role, model.device)
        logits = model.lm_logits(model.run_decoder(x[:, None], mask, pos, cache=cache).last_hidden_state[:, -1])
        rounds.append(logits if control.trace else None)
        return logits

    tokens, steps = lock_step(model, front.anchors, forward,
                              lambda logits, step: chooser.branch(logits, step, list(range(k)), control).tolist(),
                              cfg.max_branch_tokens)
    logits_of = [[rounds[r][e].float().cpu() for r in range(len(tokens[e]))] if control.trace else [] for e in range(k)]
    return finish_decoded(sample, front.example, front.intervals, tokens, steps, timer, front.planning_logits, logits_of,
                          front.grounding_logits, control)


@torch.no_grad()
def monolithic(model, sample, cfg: InferConfig, control: DecodeControl = NO_CONTROL) -> Decoded:
    """All events in one causal chain after the serial <G>s (module doc)."""

    def inputs(front, e: int, step: int, seen: int) -> tuple[torch.Tensor, int]:
        mask = torch.zeros(1, 1, 1, seen + 1)  # a causal chain: the new token sees every earlier one (A: the first anchor)
        return mask, shared_position(seen)

    return _token_by_token(model, sample, cfg, control, inputs, crop=False)
