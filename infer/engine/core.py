"""The PadCaptioner decoding engine: one token-budget step for many videos over a paged KV cache.

    engine = CaptionEngine(model, cfg.infer)              # model: PadCaptioner or the release model
    results = engine.caption(samples)                      # list[VideoResult], one per sample
    decoded = engine.decode(sample, DecodeControl(...))    # one video alone, with test/bench hooks
    engine.run(feed, emit)                                 # a stream (Serve): see `run`

Every forward of every video runs in one shared step (infer/engine/step.py), filled by the
scheduler (infer/engine/scheduler.py) under `infer.step_tokens`: every running caption-branch row,
then one planning row per planning video, then prefill chunks of newly admitted videos. A
video's program (infer/engine/programs.py) turns the step's outputs for it into its next decision
(planning over {<G>, <S>}, grounding, anchors); its branches join the next step.

    while videos wait or are in flight:
        (raw media are encoded beside the loop, several videos per batch: infer/engine/encoding.py)
        admit videos whose features are ready while the KV pool can promise their worst case (pages, not slots)
        plan = scheduler.plan(videos); hidden, states = runner.forward(plan.batch)
        prefill chunks: keep their grounding / aggregation states; the prefix's last row decides
        planning rows: decide the next <G>; the videos that stop are grounded and get their anchors
            together (batched), and their branches start next step
        branch rows: logits -> tokens (bias bans <G>/<S>; test processors; greedy or a seeded draw);
            <eos> or the cap ends a branch (its pages freed); a video whose branches all ended is done
    (what the host reads of the step comes back in one copy: infer/engine/staging.py)

KV lives in one pool of pages (infer/engine/paged.py) sized by `infer.kv_memory_gb`: a video's
branches see its prefix pages in place (no copies), ending a branch or a video frees pages.
Each token's arithmetic depends only on its own video, so greedy tokens equal decoding the
video alone, whatever shares the step and in whatever order videos arrive
(tests/test_engine.py, tests/test_engine_batch.py against infer/oracles/decoders.py).

A sample that cannot be decoded (feature dims, bad duration, a prompt over the model's
length, more KV than the pool holds) gets a VideoResult with `error` set; the others go on.
`infer.decoder = "monolithic"` runs a single-chain decoder one video at a time behind the same API:
the caller chooses it and passes it as `single_chain` (infer/oracles/ablation.py `caption_engine`
passes the model's own baseline; the engine imports no decoder of the oracles).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, replace
from typing import Any, NamedTuple

import torch

from infer.engine.decoded import Decoded, to_events
from infer.engine.encoding import EncoderStage
from infer.engine.graphs import describe_graphs, step_graphs
from infer.engine.kernels import choose_kernel
from infer.engine.memory_plan import videos_that_fit, worst_pages
from infer.engine.paged import PagePool, pages_for
from infer.engine.programs import PROGRAMS
from infer.engine.requests import Request, VideoResult, check_config, model_caps, resolve_device, resolve_dtype
from infer.engine.sampling import NO_CONTROL, DecodeControl, video_chooser
from infer.engine.scheduler import Branch, Phase, Scheduler, StepPlan, VideoState
from infer.engine.staging import to_host
from infer.engine.step import ModelRunner
from infer.engine.step_weights import StepWeights
from pipeline.config import InferConfig
from pipeline.family import DecodeError
from pipeline.schema import Sample

log = logging.getLogger("padcap.infer")


def kv_budget_bytes(cfg: InferConfig, device: torch.device) -> int:
    """The KV pool's memory budget: infer.kv_memory_gb, else a fraction of free CUDA memory, else 1 GB."""
    if cfg.kv_memory_gb > 0:
        return int(cfg.kv_memory_gb * 1e9)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * cfg.kv_memory_fraction)
    return int(1e9)


def step_defaults(cfg: InferConfig, device: torch.device) -> tuple[int, int, int]:
    """(step_tokens, page_size, q_block) with the auto values resolved for the device: on CUDA pages of
    128 keys and query blocks of 32 (prefill 128: FlexAttention's tiles), on the CPU 16 and 16 (less
    padding in the gathered pages and blocks)."""
    cuda = device.type == "cuda"
    return (cfg.step_tokens or (2048 if cuda else 512), cfg.page_size or (128 if cuda else 16),
            cfg.q_block or (32 if cuda else 16))


class CaptionEngine:
    """Dense captions for a list (or a stream) of samples; see the module doc.

    Not thread-safe: one caller at a time (an actor or a replica owns its engine).
    """

    def __init__(self, model, cfg: InferConfig, single_chain: Callable | None = None):
        """single_chain: (model, sample, options, control) -> Decoded, what `infer.decoder=monolithic` runs
        (required for it)."""
        check_config(cfg)
        cfg = model_caps(cfg, model)  # 0 = the model's own max_events / max_branch_tokens
        check_config(cfg)
        refusal = model.engine_refusal(cfg.decoder)  # the release off parallel; ablation models it would decode wrongly
        if refusal:
            raise ValueError(refusal)
        if cfg.decoder == "monolithic" and single_chain is None:
            raise ValueError("infer.decoder=monolithic needs the single-chain decoder: build the engine with "
                             "infer.oracles.ablation.caption_engine(model, cfg)")
        self.single_chain = single_chain
        self.model = model
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        if self.device.type == "cpu" and cfg.cpu_threads > 0:
            torch.set_num_threads(cfg.cpu_threads)  # process-wide: an engine owns its process (actor, replica)
        dtype = resolve_dtype(cfg.dtype, self.device, model.dtype)
        if model.device.type != self.device.type:
            model.to(self.device)
        if model.dtype != dtype:  # both models read it from their weights
            model.cast_to(dtype)
        model.eval()
        self.weights = w = StepWeights.of(model)
        self.kernel = choose_kernel(cfg.kernel, dtype, self.device, max_calls=cfg.attention_calls)
        self.step_tokens, page_size, self.q_block = step_defaults(cfg, self.device)
        if self.kernel.name == "flex":  # the whole step attends in blocks of the prefill size
            self.kernel.contract.check_sizes(page_size, (4 * self.q_block,), "flex")
        self.pool = PagePool.for_budget(w.num_layers, w.kv_heads, w.head_dim, dtype, self.device, page_size,
                                        kv_budget_bytes(cfg, self.device), zero=self.kernel.reads_whole_pool,
                                        max_layer_elements=self.kernel.contract.max_layer_elements)
        self.runner = ModelRunner(w, self.pool, self.kernel)
        self.scheduler = Scheduler(self.runner, self.pool, step_tokens=self.step_tokens, q_block=self.q_block)
        self.graphs = step_graphs(cfg, self.runner, self.device, tokens=self.step_tokens, q_block=self.q_block,
                                  attn_q_block=self.scheduler.prefill_block, capture_layers=model.capture_layers())
        self.bias = torch.zeros(w.head.shape[0], device=self.device)
        self.bias[model.banned_ids()] = float("-inf")  # structural tokens are never caption text
        self._in_flight: list[VideoState] = []
        self._running = False
        self.encoder_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.stats: dict[str, Any] = _zero_stats()

    # ------------------------------------------------------------------ public API

    def reset_stats(self) -> None:
        """Zero the counters and the step log (benchmarks: after a warm-up)."""
        self.stats.update(_zero_stats())
        if self.graphs is not None:
            self.graphs.reset_stats()

    def decode(self, sample: Sample, control: DecodeControl = NO_CONTROL) -> Decoded:
        """One video alone -> Decoded (raises DecodeError for a sample that does not fit the model)."""
        out: list[Any] = []
        self.run(iter([Request(sample, control)]), lambda req, res: out.append(res))
        if isinstance(out[0], Exception):  # DecodeError, or per-video options out of range
            raise out[0]
        return out[0]

    def caption(self, samples: list[Sample], *, controls: Sequence[DecodeControl] | None = None) -> list[VideoResult]:
        """Samples (decoded shards, or features straight from the encoders) -> one result each, in order.

        All of them are decoded together (continuous admission under the KV budget).
        controls: test/benchmark hooks, one per sample; serving leaves it None.
        """
        if controls is not None and len(controls) != len(samples):
            raise ValueError(f"{len(controls)} controls for {len(samples)} samples")
        results: list[VideoResult | None] = [None] * len(samples)
        reqs = [Request(s, controls[i] if controls is not None else NO_CONTROL, tag=i) for i, s in enumerate(samples)]

        def emit(req: Request, res) -> None:
            results[req.tag] = self.result(req.sample, res)

        self.run(iter(reqs), emit)
        return results  # type: ignore[return-value]

    def result(self, sample: Sample, res: Decoded | Exception) -> VideoResult:
        """A Decoded (or the DecodeError of a refused sample) -> VideoResult."""
        if isinstance(res, Exception):
            log.warning("cannot caption %s: %s", sample.video_id, res)
            return VideoResult(sample.video_id, float(sample.duration), [], {}, error=str(res),
                               segments_total=int(sample.num_segments))
        res = replace(res, intervals=self.model.final_intervals(res.intervals, res.duration))
        order = sorted(range(res.num_events), key=lambda i: (*res.intervals[i], i))
        events = to_events(res, self.model.tokenizer, self.model.eos_id)
        capped = [self.model.eos_id not in res.tokens[i] for i in order]
        return VideoResult(sample.video_id, res.duration, events, res.timings, capped=capped,
                           segments_kept=int(res.timings.get("segments_kept", 0)),
                           segments_total=int(res.timings.get("segments_total", 0)))

    def describe(self) -> dict[str, Any]:
        """The decoding settings, the kernel chosen and the KV pool with what fits in it (for logs,
        /v1/model, the offline rows, benchmarks): the same admission rule as `python -m infer.engine.memory_plan`."""
        pool, c = self.pool, self.cfg
        fit = {str(p): videos_that_fit(pool.pages, p, c.max_events, c.max_branch_tokens, pool.page_size)
               for p in (2000, 10000, 32000)}
        return {**asdict(c), "resolved_device": str(self.device), "resolved_dtype": str(self.weights.dtype),
                "kernel": self.kernel.name, "kernel_reason": self.kernel.reason,
                "graphs": describe_graphs(self.graphs, c), "resolved_step_tokens": self.step_tokens,
                "resolved_q_block": self.q_block, **{f"kv_{k}": v for k, v in pool.describe().items()},
                "kv_bytes_per_token": pool.bytes_per_page // pool.page_size, "videos_in_flight_at_prefix": fit}

    # ------------------------------------------------------------------ the loop

    @torch.no_grad()
    def run(self, feed: Iterable[Request] | Callable[[], Request | None],
            emit: Callable[[Request, Decoded | DecodeError], None]) -> None:
        """Decode every request `feed` gives, many per step; `emit(request, Decoded | DecodeError)`
        as each video finishes (in finishing order). feed: an iterator, or a function polled
        at every step boundary that returns a request or None (nothing new now): the loop
        returns when nothing is in flight and the feed has nothing. A request whose
        `cancelled()` turns true leaves at the next step, without a result."""
        if self.cfg.decoder == "monolithic":
            return self._run_monolithic(feed, emit)
        if self._running:
            raise RuntimeError("CaptionEngine.run is not re-entrant (called from inside an emit?)")
        self._running = True
        try:
            with EncoderStage(PROGRAMS[self.model.program], self.model, budget=4 * self.step_tokens,
                              lookahead=self.cfg.max_batch_videos, stats=self.stats, stream=self.encoder_stream) as stage:
                self._run(stage, stage.staged(_poller(feed), emit), emit)
        finally:
            self._running = False

    def _run(self, stage: EncoderStage, poll: Callable[[], Request | None], emit) -> None:
        for v in self._in_flight:  # a run that raised left these: their pages go back
            self._release(v)
        self._in_flight = videos = []
        waiting: VideoState | None = None
        while True:
            while len(videos) < self.cfg.max_batch_videos:
                if waiting is None:
                    req = poll()
                    if req is None:
                        break
                    waiting = self._prepare(req, emit)
                    if waiting is None:
                        continue
                if waiting.request.cancelled():
                    waiting = None
                    continue
                if not self.pool.reserve(waiting.reserved):
                    if not videos:  # nothing in flight will free pages: a leak, never user input
                        raise RuntimeError(f"{waiting.request.sample.video_id}: {waiting.reserved} pages do not fit "
                                           f"an empty pool of {self.pool.free_pages} free pages")
                    break  # its worst case does not fit now: it waits for pages to be freed
                waiting.prefix = self.pool.open(extent=waiting.extent)
                waiting.times["admit"] = time.perf_counter()
                videos.append(waiting)
                waiting = None
            for v in [v for v in videos if v.request.cancelled()]:
                videos.remove(v)
                self._release(v)
            if not videos:
                if waiting is None:
                    if not stage.busy:
                        return
                    stage.wait()  # videos being encoded, nothing to step
                continue
            self._start_branches(videos)
            # a step: its metadata, the forward, and what the videos make of it (wall and CPU time)
            t0, c0 = time.perf_counter(), time.process_time()
            plan = self.scheduler.plan(videos)
            if plan is None:
                raise RuntimeError("videos in flight but nothing to run (a scheduler bug)")
            hidden, states = (self.graphs or self.runner).forward(plan.batch)
            self._absorb(plan, hidden, states, videos, emit)
            self._account(plan, (time.perf_counter() - t0) * 1000.0, (time.process_time() - c0) * 1000.0)

    def _prepare(self, req: Request, emit) -> VideoState | None:
        """A request's program and its KV worst case; None (and the error emitted) if it cannot be decoded."""
        t0 = time.perf_counter()
        try:
            try:
                opts = req.options.resolve(self.cfg)
                prog = PROGRAMS[self.model.program](self.model, req.sample, opts, req.control)
            except ValueError as e:  # DecodeError, or per-video options out of range
                emit(req, e)
                return None
            cap = opts.max_branch_tokens
            worst = worst_pages(prog.length, opts.max_events, cap, self.pool.page_size)
            if worst > self.pool.usable:
                emit(req, DecodeError(
                    f"{req.sample.video_id}: needs up to {worst} KV pages ({prog.length} prefix tokens, {opts.max_events} "
                    f"events x {cap} tokens), the pool has {self.pool.usable}: raise infer.kv_memory_gb or lower "
                    f"infer.max_events / max_branch_tokens"))
                return None
            v = VideoState(req, prog, worst, cap, pages_for(prog.length + opts.max_events, self.pool.page_size))
            if opts.temperature > 0:
                v.sampler = video_chooser(self.model.ids, opts, req.sample.video_id, self.device)
            return v
        finally:
            self.stats["prepare_ms"] += (time.perf_counter() - t0) * 1000.0

    def _start_branches(self, videos: list[VideoState]) -> None:
        """Planned videos whose branch rows fit under the row cap start their branches (next step)."""
        rows = sum(v.rows for v in videos if v.phase is Phase.BRANCH)
        for v in videos:
            if v.phase is not Phase.READY:
                continue
            k = v.anchors.anchors.shape[0]
            if rows + k > self.cfg.max_batch_rows:
                break  # admission order: later videos do not overtake
            trace = v.request.control.trace
            v.branches = [Branch(i, self.pool.open(), traced=[] if trace else None) for i in range(k)]
            v.phase = Phase.BRANCH
            v.times["branches"] = time.perf_counter()
            rows += k

    def _absorb(self, plan: StepPlan, hidden, states, videos: list[VideoState], emit) -> None:
        """The step's outputs back into each video: prefill states, decisions, branch tokens. Everything the
        host reads of the step (branch tokens, planning logits, the programs' readouts) comes back in one copy."""
        decisions: list[tuple[VideoState, torch.Tensor, torch.Tensor]] = []  # (video, final state, grounding state)
        for v, first, lo, hi in plan.prefill:
            last = first + hi - lo - 1
            if _prefilled(v, hi, [states[i][first:last + 1] for i in v.prog.capture]):
                decisions.append((v, hidden[last], states[v.prog.ground_layer][last]))
        for v, job in plan.jobs:
            if job.hidden is None:
                continue  # more layers to go
            v.job = None
            if _prefilled(v, job.span[1], [job.states[i] for i in v.prog.capture]):
                decisions.append((v, job.hidden[-1], job.states[v.prog.ground_layer][-1]))
        decisions += [(v, hidden[row], states[v.prog.ground_layer][row]) for v, row in plan.plan]
        logits, chosen = self._choose(plan, hidden[: plan.n_branch]) if plan.n_branch else (None, None)
        # every decision row's (<G>, <S>) logits in one product
        restricted = self.model.plan_logits(torch.stack([h for _, h, _ in decisions])).float() if decisions else None
        chosen, restricted, *reads = to_host([chosen, restricted, *(v.prog.readout(g) for v, _, g in decisions)])
        planned = []
        for (v, _, ground), r, read in zip(decisions, restricted if decisions else (), reads):
            v.phase = Phase.PLAN  # another serial <G> next step, or planning ends
            v.feed_g = v.prog.decide(r, ground, read)
            if not v.feed_g:
                planned.append(v)
        if planned:
            self._ground(planned)
        if plan.n_branch:
            self._branch_tokens(plan, logits, chosen.tolist())
        for v in [v for v in videos if v.phase is Phase.BRANCH and not v.branches] + \
                [v for v in videos if v.phase is Phase.READY and v.anchors.anchors.shape[0] == 0]:
            videos.remove(v)
            self._release(v)
            emit(v.request, self._finish(v))

    def _ground(self, planned: list[VideoState]) -> None:
        """The videos whose planning ended this step: grounding and anchors, all of them at once
        (their program's `finish_all`); their branches start next step."""
        t0 = time.perf_counter()
        anchors = type(planned[0].prog).finish_all([v.prog for v in planned])
        ms = (time.perf_counter() - t0) * 1000.0
        self.stats["front_ms"] += ms
        now = time.perf_counter()
        for v, a in zip(planned, anchors):
            v.anchors = a
            v.grounding_ms = ms / len(planned)
            v.times["planned"] = now
            k = a.anchors.shape[0]
            keep = k * pages_for(v.cap, self.pool.page_size)  # the branches' worst case; the prefix is complete
            self.pool.trim(v.prefix)
            self.pool.unreserve(v.reserved - keep)
            v.reserved = keep
            v.phase = Phase.READY

    def _choose(self, plan: StepPlan, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The branch rows' logits [R, V] and next tokens [R] on the device (bias bans <G>/<S>; test processors;
        greedy, or each video's seeded draw)."""
        logits = self.runner.logits(hidden)
        scores = logits.float() + self.bias
        for v, first, k in plan.branch:
            if v.processors:
                rows = slice(first, first + k)
                events = [b.event for b in v.branches]
                for proc in v.processors:
                    scores[rows] = proc(scores[rows], v.steps, events)
        nxt = scores.argmax(dim=-1)
        for v, first, k in plan.branch:
            if v.sampler is not None:  # temperature > 0: this video's seeded draw
                nxt[first:first + k] = v.sampler.pick(scores[first:first + k])
        return logits, nxt

    def _branch_tokens(self, plan: StepPlan, logits: torch.Tensor, chosen: list[int]) -> None:
        """The branch rows' tokens (`chosen`, on the host) into their branches; ended branches leave (pages freed)."""
        eos = self.model.eos_id
        S = self.pool.page_size
        for v, first, k in plan.branch:
            v.steps += 1
            alive = []
            for i, b in enumerate(v.branches):
                tok = chosen[first + i]
                b.tokens.append(tok)
                if b.traced is not None:  # a test's trace: its own copies
                    b.traced.append(logits[first + i].float().cpu())
                if tok == eos or v.steps >= v.cap:
                    unused = pages_for(v.cap, S) - len(b.seq.pages)
                    self.pool.close(b.seq)
                    self.pool.unreserve(unused)
                    v.reserved -= unused
                    v.finished.append(b)
                else:
                    alive.append(b)
            v.branches = alive

    def _account(self, plan: StepPlan, ms: float, cpu_ms: float) -> None:
        st = self.stats
        st["steps"] += 1
        st["step_ms"] += ms
        if len(st["step_log"]) < 100_000:
            videos = {id(v) for v, *_ in plan.branch + plan.plan + plan.prefill + plan.jobs}
            st["step_log"].append(StepRecord(plan.tokens, plan.n_branch, len(plan.plan),
                                             sum(h - lo for _, _, lo, h in plan.prefill), len(videos), ms,
                                             plan.layer_tokens, cpu_ms, self.graphs.last if self.graphs else "",
                                             len(plan.branch)))

    def _release(self, v: VideoState) -> None:
        """All of v's pages and promises back to the pool."""
        for b in v.branches:
            self.pool.close(b.seq)
        v.branches = []
        if v.prefix is not None:
            self.pool.close(v.prefix)
        self.pool.unreserve(v.reserved)
        v.reserved = 0

    def _finish(self, v: VideoState) -> Decoded:
        req, a, t = v.request, v.anchors, v.times
        now = time.perf_counter()
        by_event = sorted(v.finished, key=lambda b: b.event)
        tokens = [b.tokens for b in by_event]
        timings = {"prefill_ms": (t.get("prefilled", now) - t["admit"]) * 1000.0,
                   "planning_ms": (t.get("planned", now) - t.get("prefilled", now)) * 1000.0,
                   "grounding_ms": v.grounding_ms, "decode_ms": (now - t.get("branches", now)) * 1000.0,
                   "total_ms": (now - t["admit"]) * 1000.0, "steps": float(v.steps), "tokens": float(sum(map(len, tokens))),
                   "events": float(len(tokens)), "segments_kept": float(a.segments_kept),
                   "segments_total": float(req.sample.num_segments)}
        trace = req.control.trace
        return Decoded(video_id=req.sample.video_id, duration=float(req.sample.duration), intervals=a.intervals,
                       tokens=tokens, steps=v.steps, timings=timings,
                       planning_logits=a.planning_logits if trace else None,
                       branch_logits=[torch.stack(b.traced) for b in by_event] if trace else None,
                       grounding_logits=a.grounding_logits if trace else None)

    def _run_monolithic(self, feed, emit) -> None:
        poll = _poller(feed)
        while (req := poll()) is not None:
            if req.cancelled():
                continue
            try:
                dec = self.single_chain(self.model, req.sample, req.options.resolve(self.cfg), req.control)
            except ValueError as e:  # DecodeError, or options out of range
                dec = e
            emit(req, dec)


class StepRecord(NamedTuple):
    """One step as `stats["step_log"]` keeps it."""

    tokens: int
    branch_rows: int
    plan_rows: int
    prefill_tokens: int
    videos: int
    ms: float
    layer_tokens: int = 0  # what the layered blocks' parts cost, in tokens (token-layers / layers)
    cpu_ms: float = 0.0  # the process's CPU time in the step (on a shared CPU box: the step's own work)
    graph: str = ""  # how it ran with CUDA graphs (infer/engine/graphs.py GraphPlan.route: full, pieces, eager)
    decoding: int = 0  # videos with branch rows in the step (decoding their captions)


def _zero_stats() -> dict[str, Any]:
    """`CaptionEngine.stats` at zero: steps, ms in steps (metadata + forward + decisions), of that in planning
    ends (grounding, anchors), ms building programs (inputs of the prefix), ms in the encoder stage's batches
    (beside the steps) and the videos in them, the step log (StepRecord)."""
    return {"steps": 0, "step_ms": 0.0, "front_ms": 0.0, "prepare_ms": 0.0, "encode_ms": 0.0, "encode_batches": 0,
            "encoded_videos": 0, "step_log": []}


def _prefilled(v: VideoState, cursor: int, captured: list[torch.Tensor]) -> bool:
    """v's prefix has run up to `cursor` (`captured`: the new states, in `v.prog.capture` order); True when
    that completes it (its program then gets every captured state)."""
    for i, s in zip(v.prog.capture, captured):
        v.chunks[i].append(s)
    v.cursor = cursor
    if cursor != v.prog.length:
        return False
    v.prog.prefilled({i: torch.cat(c) for i, c in v.chunks.items()})
    v.chunks = {}
    v.times["prefilled"] = time.perf_counter()
    return True


def _poller(feed: Iterable[Request] | Callable[[], Request | None]) -> Callable[[], Request | None]:
    """`run`'s feed as a function: the next request, or None when there is nothing (now)."""
    if callable(feed):
        return feed
    it = iter(feed)
    return lambda: next(it, None)
