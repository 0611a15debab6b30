"""The encoder stage: the media towers of raw videos run beside the decode loop, several videos per batch.

    with EncoderStage(PROGRAMS[model.program], model, budget=2048, lookahead=16, stats=stats) as stage:
        poll = stage.staged(poll, emit)     # the loop's feed: requests come back with their media encoded
        stage.busy                          # requests it holds (queued, encoding, or ready and not taken)
        stage.wait()                        # block until one is ready (the loop has nothing else to do)

A request whose sample still needs its towers (`program.tokens_to_encode(sample) > 0`: the release's raw
pixels and log-mel) goes to the stage's worker thread; any other passes straight through. The worker
takes the queued requests in order while their media tokens fit `budget` (at least one), runs
`program.encode(model, samples)` once for them (pipeline/release/video.py `encode_videos`: one
vision-tower and one Whisper call for the batch), and hands the encoded samples back; a video enters
prefill only once it is taken, so the decode loop never runs a tower. On CUDA the worker runs on its
own stream and synchronizes it before handing the features over; the loop only reads them. A batch
that raises is encoded again one video at a time, so an error reaches only its video: a ValueError
(DecodeError) is emitted for that video alone, anything else is raised on the loop's thread, as when
the loop encoded. At most `lookahead` requests are held, so a long feed is not encoded far ahead.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch

from infer.engine.requests import Request


@dataclass(eq=False)
class _Job:
    request: Request
    tokens: int  # media tokens the towers make for it (0: passes through)
    error: BaseException | None = None
    done: bool = False


class EncoderStage:
    """The encoder stage of one engine run (module doc)."""

    def __init__(self, program, model, *, budget: int, lookahead: int, stats: dict[str, Any],
                 stream: torch.cuda.Stream | None = None):
        self.program, self.model, self.budget, self.lookahead = program, model, budget, lookahead
        self.stats, self.stream = stats, stream
        self._cond = threading.Condition()
        self._held: list[_Job] = []  # submission order
        self._queue: deque[_Job] = deque()  # the worker's
        self._closed = False
        self._thread: threading.Thread | None = None

    def __enter__(self) -> EncoderStage:
        return self

    def __exit__(self, *exc) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()

    @property
    def busy(self) -> bool:
        return bool(self._held)

    def staged(self, poll, emit):
        """The loop's poll: new requests from `poll` (up to the lookahead) go in, a ready one comes out."""
        def staged_poll() -> Request | None:
            new = []
            while len(self._held) + len(new) < self.lookahead and (req := poll()) is not None:
                new.append(_Job(req, self.program.tokens_to_encode(req.sample)))
            self._submit(new)
            return self._take(emit)
        return staged_poll

    def wait(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: not self._held or any(j.done for j in self._held))

    def _submit(self, jobs: list[_Job]) -> None:
        with self._cond:  # all at once: the worker sees them together (one batch)
            for j in jobs:
                j.done = j.tokens == 0
                self._held.append(j)
                if not j.done:
                    self._queue.append(j)
            self._cond.notify_all()
        if self._queue and self._thread is None:
            self._thread = threading.Thread(target=self._work, name="encoder-stage", daemon=True)
            self._thread.start()

    def _take(self, emit) -> Request | None:
        """The oldest ready request (None if none is); one whose encoding failed with a ValueError is emitted."""
        while True:
            with self._cond:
                job = next((j for j in self._held if j.done), None)
                if job is None:
                    return None
                self._held.remove(job)
            if job.error is None:
                return job.request
            if not isinstance(job.error, ValueError):
                raise job.error
            emit(job.request, job.error)

    def _work(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if self._closed:
                    return
                batch = [self._queue.popleft()]
                while self._queue and sum(j.tokens for j in batch) + self._queue[0].tokens <= self.budget:
                    batch.append(self._queue.popleft())
            t0 = time.perf_counter()
            self._encode(batch)
            st = self.stats
            st["encode_ms"] += (time.perf_counter() - t0) * 1000.0
            st["encode_batches"] += 1
            st["encoded_videos"] += len(batch)
            with self._cond:
                for j in batch:
                    j.done = True
                self._cond.notify_all()

    def _encode(self, batch: list[_Job]) -> None:
        """The batch's samples encoded in place in their requests; on an error, each alone (module doc).
        On CUDA the stage's stream is synchronized before the loop sees the features; their memory goes
        back to that stream only when the video leaves the loop, and every step ends with a copy to the
        host, so no read of them is pending then (a video dropped before its first step is not decoded)."""
        side = torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()
        try:
            with torch.no_grad(), side:
                encoded = self.program.encode(self.model, [j.request.sample for j in batch])
                if self.stream is not None:
                    self.stream.synchronize()
        except Exception as e:  # noqa: BLE001 - handed to the video's own request
            if len(batch) == 1:
                batch[0].error = e
            else:
                for j in batch:
                    self._encode([j])
            return
        for j, sample in zip(batch, encoded):
            j.request = replace(j.request, sample=sample)
