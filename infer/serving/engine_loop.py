"""Continuous batching of concurrent requests into the engine's decode loop, off the event loop.

    batcher = EngineBatcher(max_batch=16)
    result = await batcher.submit(key, engine, sample)    # key: the engine's settings

All engine work runs in one worker thread (the model is not shared between threads).
The thread drives `engine.run(feed, emit)` (infer/engine/core.py): the engine polls `feed`
at every decode-step boundary while it has room, so a request that arrives while
others are being decoded joins the running batch at the next step and shares its decode
steps; `emit` hands each video's result to its waiting request as soon as that video
finishes. At most `max_batch` requests are in the engine at once; the oldest waiting
request goes first, and only requests with the same key (the same engine) share a run
(per-request decoding options travel with each request, infer.engine.core.VideoOptions): when the key's queue is empty and its last video is done, the thread moves
on to the oldest other key.

A request whose client goes away (its task cancelled) leaves the batch at the next step.
When a run raises (a server bug on some input), each request that was in it and has no
result yet is retried alone, so the exception reaches only the request whose video caused
it. A device fault (a CUDA error, infer/engine/faults.py) is not retried: the process's CUDA
context is poisoned, so every request in the run and every queued one gets the error, the
batcher keeps it (`fault`: the error and the requests the run held) and refuses every later
request with it; its owner replaces the process (a Serve replica fails its health check, the
offline caption actor exits). Every engine is driven the one way: `run(feed, emit)` and
`result(sample, decoded)`, the interface of infer.engine.core.CaptionEngine (test stand-ins implement
it too: bench/serve_engine.py). Used by infer/serving/service.py (one request at a time per client)
and infer/offline/job.py (the videos of several Ray Data batches at once, fed into one engine);
asyncio + one thread, no ray.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from infer.engine.faults import is_device_fault
from infer.engine.requests import Request, VideoOptions


@dataclass(eq=False)
class _Item:
    key: Hashable
    engine: Any
    sample: Any
    options: VideoOptions
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    cancelled: bool = False
    settled: bool = False

    def gone(self) -> bool:
        return self.cancelled or self.future.cancelled()

    def settle(self, result: Any = None, error: BaseException | None = None) -> None:
        """Hand a result (or exception) to the waiting request, from any thread."""
        self.settled = True

        def put() -> None:
            if self.future.done():
                return
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(result)

        self.loop.call_soon_threadsafe(put)


@dataclass(frozen=True)
class EngineFault:
    """A device fault that ended an engine run: the error, and the samples the run held without a result."""

    error: BaseException
    samples: tuple[Any, ...]

    def describe(self) -> str:
        return f"{type(self.error).__name__}: {self.error}"


class EngineBatcher:
    """Queue of (engine, sample) requests, fed continuously into one engine thread."""

    def __init__(self, max_batch: int = 1, fatal: Callable[[BaseException], bool] = is_device_fault):
        """max_batch: the most requests in the engine at once; fatal: which errors end the batcher (module doc)."""
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.max_batch = max_batch
        self.fatal = fatal
        self.fault: EngineFault | None = None  # set once a run raised a fatal error: no run after it
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="padcap-engine")
        self._lock = threading.Lock()
        self._pending: list[_Item] = []
        self._running = False
        self.batch_sizes: list[int] = []  # requests per engine run (for tests and stats)
        self.in_flight = 0  # requests in the engine now
        self.max_in_flight = 0  # most requests in the engine at once

    async def submit(self, key: Hashable, engine: Any, sample: Any, options: VideoOptions | None = None) -> Any:
        """The engine's result for `sample` (options: the request's infer.engine.core.VideoOptions)."""
        loop = asyncio.get_running_loop()
        item = _Item(key, engine, sample, options or VideoOptions(), loop.create_future(), loop)
        with self._lock:
            if self.fault is not None:  # the engine's device is poisoned: nothing more runs on it
                raise self.fault.error
            self._pending.append(item)
            start = not self._running
            self._running = True
        if start:
            loop.run_in_executor(self._pool, self._drain)
        try:
            return await item.future
        except asyncio.CancelledError:
            item.cancelled = True  # the engine drops it at its next step
            raise

    # ------------------------------------------------------------------ the engine thread

    def _take(self, key: Hashable | None) -> _Item | None:
        """The oldest live pending request (of `key`, if given), removed from the queue."""
        with self._lock:
            self._pending = [p for p in self._pending if not p.gone()]
            for i, p in enumerate(self._pending):
                if key is None or p.key == key:
                    return self._pending.pop(i)
        return None

    def _drain(self) -> None:
        while True:
            first = self._take(None)
            if first is None:
                with self._lock:
                    if not self._pending:  # checked under the lock: a new submit starts a new drain
                        self._running = False
                        return
                continue
            taken = self._run(first)
            if self.fault is not None:
                self._fail_all(taken)
                return
            left = [p for p in taken if not p.settled and not p.gone()]
            if len(taken) > 1:  # the run raised: each unfinished request alone, so only the culprit fails
                for p in left:
                    self._run(p, alone=True)

    def _run(self, first: _Item, alone: bool = False) -> list[_Item]:
        """One engine run starting with `first` (then the same key's queue unless `alone`);
        returns the requests it took."""
        queue, taken = [first], []
        self.in_flight = 0

        def feed():
            if self.in_flight >= (1 if alone else self.max_batch):
                return None
            item = queue.pop() if queue else (None if alone else self._take(first.key))
            if item is None:
                return None
            taken.append(item)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            return Request(item.sample, cancelled=item.gone, tag=item, options=item.options)

        def emit(req, result) -> None:
            self.in_flight -= 1
            item = req.tag
            item.settle(item.engine.result(item.sample, result))

        try:
            first.engine.run(feed, emit)
        except Exception as e:  # noqa: BLE001 - handed to the waiting request
            if self.fatal(e):  # no retry on this device: _drain fails every request (module doc)
                self.fault = EngineFault(e, tuple(p.sample for p in taken if not p.settled))
            elif len(taken) == 1 and not first.settled:
                first.settle(error=e)
        self.in_flight = 0  # the run is over: whatever it did not emit is out of the engine too
        self.batch_sizes.append(len(taken))
        return taken

    def _fail_all(self, taken: list[_Item]) -> None:
        """After a fault: the run's requests without a result and every queued one get its error; the
        batcher stops (a later `submit` raises it too)."""
        assert self.fault is not None
        with self._lock:
            waiting, self._pending = self._pending, []
            self._running = False
        for p in [*taken, *waiting]:
            if not p.settled:
                p.settle(error=self.fault.error)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

