"""The PadCaptioner decoding engine: many videos per decode step (continuous batching).

    engine = CaptionEngine(model, cfg.infer)              # model: pipeline.model.PadCaptioner
    results = engine.caption(samples)                      # list[VideoResult], one per sample
    decoded = engine.decode(sample, DecodeControl(...))    # one video alone, with test/bench hooks
    engine.run(feed, emit)                                 # a stream (Serve): see `run`

Per video, on admission (infer/front.py `run_front`, HF's forward with the layout mask):
prefill, planning (<G>/<S>), grounding and aggregation give K intervals and K anchor
embeddings at position A; the prefix KV (prefix + serial <G>s) is kept as it came out of
prefill, once per video. The video's K anchor rows then join the decode step
(infer/step.py) that already carries the branch rows of other videos:

    while videos wait or rows are active:
        admit videos while a slot is free and their K rows fit (infer.max_batch_videos,
            infer.max_batch_rows): front, then K anchor rows at the end of the batch
        one step over every active row (anchors and branch tokens of all videos alike):
            positions = A_row + branch length_row, on the device
            hidden = StepRunner.step(embeds, meta); logits = head(hidden)
            scores = logits + bias (-inf at <G>, <S>), then any test processors
            next = argmax (or a seeded draw per video)       -> one device-to-host copy
        a row whose token is <eos>, or whose branch reached infer.max_branch_tokens, ends:
            rows compacted in place (stable: each video's rows stay contiguous)
        a video whose rows all ended is finished: result out, slot free

Each row's arithmetic depends only on its own video, so greedy tokens equal decoding the
video alone, whatever else shares the step or when it was admitted (tests/test_engine.py
and tests/test_engine_batch.py check this against infer/reference.py). Events come back
sorted by start with well-formed intervals (start < end inside [0, duration]); a branch cut by
the cap is marked `capped`; a video longer than the model takes is shortened as training
shortens it (pipeline/fitting.py) and says so (segments kept / total).

A sample that cannot be decoded (feature dims, bad duration, ...) gets a VideoResult
with `error` set and no events; the others go on. `infer.decoder = "monolithic"` runs
the single-chain baseline (infer/reference.py) one video at a time behind the same API.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from transformers.cache_utils import DynamicCache

from infer.attention import choose_kernel
from infer.decoded import Decoded, to_events
from infer.front import DecodeError, Front, StageTimer, decode_reserve, prepare_example, run_front, well_formed
from infer.release_front import release_front
from infer.kv_pool import StepMeta
from infer.requests import Request, VideoResult, check_config, resolve_device, resolve_dtype
from infer.sampling import NO_CONTROL, DecodeControl, TokenChooser, video_chooser
from infer.step import GraphedStep, Mode, StepRunner
from infer.step_weights import StepWeights
from pipeline.backbone import DTYPES
from pipeline.config import InferConfig
from pipeline.schema import Sample

log = logging.getLogger("padcap.infer")


class _Video:
    """A video in flight: its front, rows, tokens and timings."""

    def __init__(self, request: Request, opts: InferConfig, front: Front, timer: StageTimer, slot: int,
                 first_row: int, sampler: TokenChooser | None, eos_id: int):
        self.request, self.opts, self.front, self.timer, self.slot = request, opts, front, timer, slot
        self.first_row = first_row
        k = front.num_events
        self.events = list(range(k))  # event of each of its active rows, in row order
        self.tokens: list[list[int]] = [[] for _ in range(k)]
        self.traced: list[list[torch.Tensor]] | None = [[] for _ in range(k)] if request.control.trace else None
        self.processors = request.control.processors(eos_id)
        self.sampler = sampler  # None: greedy
        self.steps = 0  # steps taken = tokens of every active row (lock-step within a video)
        self.t_admit = time.perf_counter()

    @property
    def rows(self) -> int:
        return len(self.events)


class CaptionEngine:
    """Dense captions for a list (or a stream) of samples; see the module doc.

    Not thread-safe: one caller at a time (an actor or a replica owns its engine).
    """

    def __init__(self, model, cfg: InferConfig):
        check_config(cfg)
        from infer.ordered import engine_refusal

        refusal = engine_refusal(model, cfg.decoder)  # ablation models the engine would decode wrongly
        if refusal:
            raise ValueError(refusal)
        self.model = model
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        if self.device.type == "cpu" and cfg.cpu_threads > 0:
            torch.set_num_threads(cfg.cpu_threads)  # process-wide: an engine owns its process (actor, replica)
        self.release = is_release_model(model)
        if self.release and cfg.decoder != "parallel":
            raise ValueError("the release model decodes in parallel only (infer.decoder=parallel)")
        dtype = resolve_dtype(cfg.dtype, self.device, model.dtype)
        if model.device.type != self.device.type:
            model.to(self.device)
        if model.dtype != dtype:  # both models read it from their weights
            model.to(dtype)
            if not self.release:
                model.cfg.dtype = {v: k for k, v in DTYPES.items()}[dtype]
        model.eval()
        max_seq_len = model.max_seq_len if self.release else model.cfg.max_seq_len
        self.weights = StepWeights.of(model)
        self.kernel = choose_kernel(cfg.attention_backend, dtype, self.device, self.weights.head_dim)
        graphs = cfg.cuda_graphs and self.device.type == "cuda" and cfg.step_attention in ("auto", "padded")
        attention = cfg.step_attention if cfg.step_attention != "auto" else ("padded" if graphs else "varlen")
        self.runner = StepRunner(self.weights, self.kernel, cfg.max_batch_rows, cfg.max_branch_tokens,
                                 prefix=attention, prefix_splits=cfg.attention_prefix_splits or 0,
                                 slots=cfg.max_batch_videos, rows_per_video=cfg.max_events,
                                 prefix_cap=max_seq_len if attention == "padded" else 1)
        self.graphed: GraphedStep | None = None
        if graphs:
            # RoPE tables sized once for every position a decode can reach, so captured graphs stay valid
            self.weights.rope_tables(max_seq_len + cfg.max_events + cfg.max_branch_tokens + 2)
            self.graphed = GraphedStep(self.runner)
        self.bias = torch.zeros(self.weights.head.shape[0], device=self.device)
        banned = [model.g_id, model.s_id] + ([model.shift_id] if self.release else [])
        self.bias[banned] = float("-inf")  # structural tokens are never caption text
        rows, d = cfg.max_batch_rows, self.weights.hidden
        self._embeds = torch.zeros(rows, d, dtype=dtype, device=self.device)
        self._lengths = torch.zeros(rows, dtype=torch.long, device=self.device)
        self._caps = torch.zeros(rows, dtype=torch.long, device=self.device)  # per row: its video's token cap
        self._anchor = torch.zeros(rows, dtype=torch.long, device=self.device)
        self._slots = torch.full((rows,), cfg.max_batch_videos, dtype=torch.long, device=self.device)
        self._ranks = torch.zeros(rows, dtype=torch.long, device=self.device)
        # steps, rows summed over steps, ms in decode steps / in fronts, and ms per Mode (a step with any
        # branch token counts as BRANCH, one of anchors only as ANCHOR; grounding counts as PLAN)
        self.stats: dict[str, Any] = {"steps": 0, "row_steps": 0, "step_ms": 0.0, "front_ms": 0.0,
                                      "mode_ms": {m.value: 0.0 for m in Mode}}

    # ------------------------------------------------------------------ public API

    def decode(self, sample: Sample, control: DecodeControl = NO_CONTROL) -> Decoded:
        """One video alone -> Decoded (raises DecodeError for a sample that does not fit the model)."""
        out: list[Any] = []
        self.run(iter([Request(sample, control)]), lambda req, res: out.append(res))
        if isinstance(out[0], Exception):  # DecodeError, or per-video options out of range
            raise out[0]
        return out[0]

    def caption(self, samples: list[Sample], *, controls: Sequence[DecodeControl] | None = None) -> list[VideoResult]:
        """Samples (decoded shards, or features straight from the encoders) -> one result each, in order.

        All of them are decoded together (up to the batch caps at a time, continuous
        admission). controls: test/benchmark hooks, one per sample; serving leaves it None.
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
        if self.release:  # the release's seconds are not clipped to the video: results are
            res = replace(res, intervals=[well_formed(s, e, res.duration, 1e-3) for s, e in res.intervals])
        order = sorted(range(res.num_events), key=lambda i: (*res.intervals[i], i))
        events = to_events(res, self.model.tokenizer, self.model.eos_id)
        capped = [self.model.eos_id not in res.tokens[i] for i in order]
        return VideoResult(sample.video_id, res.duration, events, res.timings, capped=capped,
                           segments_kept=int(res.timings.get("segments_kept", 0)),
                           segments_total=int(res.timings.get("segments_total", 0)))

    def describe(self) -> dict[str, Any]:
        """The decoding settings and the kernel chosen at set-up (for logs, reports, benchmarks)."""
        return {**asdict(self.cfg), "resolved_device": str(self.device), "resolved_dtype": str(self.weights.dtype),
                "kernel": self.kernel.name, "kernel_reason": self.kernel.reason, "step_attention": self.runner.prefix.name,
                "cuda_graphs": self.graphed is not None}

    # ------------------------------------------------------------------ the loop

    @torch.no_grad()
    def run(self, feed: Iterable[Request] | Callable[[], Request | None],
            emit: Callable[[Request, Decoded | DecodeError], None]) -> None:
        """Decode every request `feed` gives, many per step; `emit(request, Decoded | DecodeError)`
        as each video finishes (in finishing order). feed: an iterator, or a function polled
        at every step boundary that returns a request or None (nothing new now): the loop
        returns when nothing is in flight and the feed has nothing. A request whose
        `cancelled()` turns true leaves the batch at the next step, without a result."""
        if self.cfg.decoder == "monolithic":
            return self._run_monolithic(feed, emit)
        poll = _poller(feed)
        active: list[_Video] = []
        free = deque(range(self.cfg.max_batch_videos))
        for slot in free:  # a run that raised may have left videos admitted: their slots start empty
            self.runner.release(slot)
        ready: _Admit | None = None
        while True:
            # admission: fronts of new videos while a slot is free and their rows fit
            while free:
                if ready is None:
                    req = poll()
                    if req is None:
                        break
                    ready = self._front(req, emit)
                    if ready is None:
                        continue
                if self._rows(active) + ready.front.num_events > self.cfg.max_batch_rows:
                    break
                active.append(self._admit(ready, free.popleft(), self._rows(active)))
                ready = None
            active = self._drop_cancelled(active, free)
            if not active:
                if ready is None:
                    return
                continue
            active = self._step(active, free, emit)

    def _rows(self, active: list[_Video]) -> int:
        return sum(v.rows for v in active)

    def _front(self, req: Request, emit) -> "_Admit | None":
        """Prefill + planning + grounding + anchors of one video (HF forward); None if refused."""
        t0 = time.perf_counter()
        timer = StageTimer(self.device)
        try:
            opts = req.options.resolve(self.cfg)
        except ValueError as e:
            emit(req, DecodeError(str(e)))
            return None
        try:
            cache = DynamicCache(config=self.model.hf_config)
            if self.release:
                front = release_front(self.model, req.sample, cache, opts.max_events, req.control, timer)
            else:
                example = prepare_example(self.model, req.sample, decode_reserve(opts))
                front = run_front(self.model, example, cache, opts.max_events, req.control, timer)
        except DecodeError as e:
            emit(req, e)
            return None
        self.stats["front_ms"] += (time.perf_counter() - t0) * 1000.0
        for mode, key in ((Mode.PREFILL, "prefill_ms"), (Mode.PLAN, "planning_ms"), (Mode.PLAN, "grounding_ms")):
            self.stats["mode_ms"][mode.value] += timer.ms.get(key, 0.0)
        if front.num_events == 0:  # the release model may plan no event: nothing to decode
            emit(req, self._finish(_Video(req, opts, front, timer, -1, 0, None, self.model.eos_id)))
            return None
        return _Admit(req, opts, front, timer)

    def _admit(self, ready: "_Admit", slot: int, first: int) -> _Video:
        front, k = ready.front, ready.front.num_events
        cache = front.cache
        prefix_kv = [(layer.keys[0], layer.values[0]) for layer in cache.layers]
        self.runner.admit(slot, prefix_kv)
        opts = ready.opts
        self.weights.rope_tables(front.anchor_pos + opts.max_branch_tokens + 1)
        rows = slice(first, first + k)
        self._embeds[rows] = front.anchors.to(self._embeds.dtype)
        self._lengths[rows] = 0
        self._caps[rows] = opts.max_branch_tokens
        self._anchor[rows] = front.anchor_pos
        self._slots[rows] = slot
        self._ranks[rows] = torch.arange(k, device=self.device)
        sampler = video_chooser(self.model.ids, opts, ready.request.sample.video_id, self.device) \
            if opts.temperature > 0 else None
        return _Video(ready.request, opts, front, ready.timer, slot, first, sampler, self.model.eos_id)

    def _drop_cancelled(self, active: list[_Video], free: deque) -> list[_Video]:
        gone = [v for v in active if v.request.cancelled()]
        if not gone:
            return active
        keep_rows = [r for v in active if v not in gone for r in range(v.first_row, v.first_row + v.rows)]
        for v in gone:
            self.runner.release(v.slot)
            free.append(v.slot)
        kept = [v for v in active if v not in gone]
        self._compact(kept, keep_rows)
        return kept

    def _choose(self, logits: torch.Tensor, active: list[_Video]) -> torch.Tensor:
        """logits [R, V] -> next tokens [R] on the device (bias, test processors, greedy or seeded draw)."""
        scores = logits.float() + self.bias
        for v in active:
            if v.processors:
                rows = slice(v.first_row, v.first_row + v.rows)
                for proc in v.processors:
                    scores[rows] = proc(scores[rows], v.steps, v.events)
        nxt = scores.argmax(dim=-1)
        for v in active:
            if v.sampler is not None:  # temperature > 0: this video's seeded draw
                rows = slice(v.first_row, v.first_row + v.rows)
                nxt[rows] = v.sampler.pick(scores[rows])
        return nxt

    def _step(self, active: list[_Video], free: deque, emit) -> list[_Video]:
        """One decode step over every active row, then terminations, compaction, finished videos."""
        t0 = time.perf_counter()
        n = self._rows(active)
        r = n
        if self.runner.padded:  # static shapes: pad to the bucket with rows of the scratch slot
            r = self.bucket_rows(n)
            self._pad_rows(n, r)
        max_len = max(v.steps for v in active)  # branch KV entries of the longest row
        meta = StepMeta(positions=self._anchor[:r] + self._lengths[:r], lengths=self._lengths[:r],
                        slots=self._slots[:r], ranks=self._ranks[:r],
                        spans=[(v.slot, v.first_row, v.rows) for v in active], max_length=max_len + 1)
        hidden = (self.graphed or self.runner.step)(self._embeds[:r], meta)
        logits = self.runner.logits(hidden)
        nxt = self._choose(logits, active)[:n]
        self._lengths[:n] += 1
        ended = (nxt == self.model.eos_id) | (self._lengths[:n] >= self._caps[:n])  # on the device
        chosen, done = torch.stack([nxt, ended.long()]).tolist()  # the step's one device-to-host copy
        keep_rows: list[int] = []
        still: list[_Video] = []
        for v in active:
            v.steps += 1
            alive = []
            for i, e in enumerate(v.events):
                row = v.first_row + i
                v.tokens[e].append(chosen[row])
                if v.traced is not None:
                    v.traced[e].append(logits[row].float().cpu())
                if not done[row]:
                    alive.append(e)
                    keep_rows.append(row)
            v.events = alive
            if alive:
                still.append(v)
            else:
                self.runner.release(v.slot)
                free.append(v.slot)
                emit(v.request, self._finish(v))
        if len(keep_rows) != n:
            self._compact(still, keep_rows, nxt)
        else:
            self._embeds[:n] = self.runner.embed(nxt)
        ms = (time.perf_counter() - t0) * 1000.0
        self.stats["steps"] += 1
        self.stats["row_steps"] += n
        self.stats["step_ms"] += ms
        self.stats["mode_ms"][(Mode.ANCHOR if max_len == 0 else Mode.BRANCH).value] += ms
        return still

    def bucket_rows(self, n: int) -> int:
        """Rows a padded step runs for n live rows: the next power of two (>= 8), at most max_batch_rows."""
        b = 8
        while b < n:
            b *= 2
        return min(b, self.cfg.max_batch_rows)

    def _pad_rows(self, n: int, r: int) -> None:
        """Rows n..r-1 of a padded step: scratch slot, branch length 0, zero input (results ignored)."""
        if r > n:
            self._slots[n:r] = self.cfg.max_batch_videos
            self._ranks[n:r] = 0
            self._lengths[n:r] = 0
            self._anchor[n:r] = 0
            self._embeds[n:r] = 0

    def _compact(self, kept: list[_Video], keep_rows: list[int], nxt: torch.Tensor | None = None) -> None:
        """Move the kept rows (in order) to the front of every per-row buffer and the branch pool."""
        idx = torch.tensor(keep_rows, dtype=torch.long, device=self.device)
        m = len(keep_rows)
        if m:
            live = max(v.steps for v in kept)
            start = next((i for i, r in enumerate(keep_rows) if r != i), m)  # rows before the first hole stay
            self.runner.branch.compact(idx, live, start)
            for buf in (self._lengths, self._caps, self._anchor, self._slots):
                buf[:m] = buf.index_select(0, idx)
            if nxt is not None:
                self._embeds[:m] = self.runner.embed(nxt.index_select(0, idx))
            else:
                self._embeds[:m] = self._embeds.index_select(0, idx)
        first = 0
        ranks = []
        for v in kept:
            v.first_row = first
            first += v.rows
            ranks.extend(range(v.rows))
        if m:
            self._ranks[:m] = torch.tensor(ranks, dtype=torch.long, device=self.device)

    def _finish(self, v: _Video) -> Decoded:
        front, req = v.front, v.request
        timings = dict(v.timer.ms)
        timings["decode_ms"] = (time.perf_counter() - v.t_admit) * 1000.0
        timings.update(total_ms=sum(timings.values()), steps=float(v.steps), tokens=float(sum(map(len, v.tokens))),
                       events=float(len(v.tokens)), segments_kept=float(front.segments_kept),
                       segments_total=float(req.sample.num_segments))
        trace = req.control.trace
        return Decoded(video_id=req.sample.video_id, duration=float(req.sample.duration), intervals=front.intervals,
                       tokens=v.tokens, steps=v.steps, timings=timings,
                       planning_logits=front.planning_logits if trace else None,
                       branch_logits=[torch.stack(t) for t in v.traced] if v.traced is not None else None,
                       grounding_logits=front.grounding_logits if trace else None)

    def _run_monolithic(self, feed, emit) -> None:
        from infer.ordered import decoder_for
        from infer.reference import monolithic

        monolithic = decoder_for(self.model, self.cfg) or monolithic  # an ablation model: its own layout
        poll = _poller(feed)
        while (req := poll()) is not None:
            if req.cancelled():
                continue
            try:
                dec = monolithic(self.model, req.sample, req.options.resolve(self.cfg), req.control)
            except ValueError as e:  # DecodeError, or options out of range
                emit(req, e)
                continue
            emit(req, dec)


def is_release_model(model) -> bool:
    """The published release's model (pipeline/release), decoded by its own front half."""
    return hasattr(model, "step_tables")


def _poller(feed: Iterable[Request] | Callable[[], Request | None]) -> Callable[[], Request | None]:
    """`run`'s feed as a function: the next request, or None when there is nothing (now)."""
    if callable(feed):
        return feed
    it = iter(feed)
    return lambda: next(it, None)


@dataclass
class _Admit:
    """A video whose front is done, waiting for room in the step."""

    request: Request
    opts: InferConfig  # the engine's settings with the request's options applied
    front: Front
    timer: StageTimer

