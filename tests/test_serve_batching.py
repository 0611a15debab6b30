"""EngineBatcher (infer/serving/engine_loop.py): concurrent requests share engine calls, keys never mix.

The engine here is a recording stand-in with the real engine's serving interface
(bench/serve_engine.py StandInEngine), driven through production's one path
(`run(feed, emit)`): these tests are about the queueing rule (which requests go into which
decode), not about decoding.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from bench.serve_engine import StandInEngine
from infer.serving.engine_loop import EngineBatcher
from tests.support.waiting import until


class Recorder(StandInEngine):
    """decode(samples) -> [(tag, sample)]; the first call blocks until `gate` is set."""

    def __init__(self, tag: str, gate: threading.Event | None = None, fail_on: object = None):
        self.tag, self.gate, self.fail_on = tag, gate, fail_on
        self.fault = "bad batch"  # what the engine raises on `fail_on`
        self.calls: list[list] = []

    def decode(self, samples):
        if self.gate is not None and not self.calls:
            self.calls.append(list(samples))
            self.gate.wait(10)
        else:
            self.calls.append(list(samples))
        if self.fail_on in samples:
            raise RuntimeError(self.fault)
        return [(self.tag, s) for s in samples]


def pending(batcher: EngineBatcher) -> int:
    """Requests queued for the engine (not yet taken into a run)."""
    with batcher._lock:
        return len(batcher._pending)



def test_waiting_requests_are_batched_by_key():
    gate = threading.Event()
    a, b = Recorder("a", gate), Recorder("b")
    batcher = EngineBatcher(max_batch=3)

    async def scenario():
        first = asyncio.ensure_future(batcher.submit("A", a, 0))
        await until(lambda: a.calls, "the engine to be busy with [0]")
        rest = [asyncio.ensure_future(batcher.submit("A" if i % 3 else "B", a if i % 3 else b, i)) for i in range(1, 8)]
        await until(lambda: pending(batcher) == 7, "the other seven to be queued")
        gate.set()
        return await first, await asyncio.gather(*rest)

    first, rest = asyncio.run(scenario())
    batcher.close()
    assert first == ("a", 0)
    assert rest == [("a", 1), ("a", 2), ("b", 3), ("a", 4), ("a", 5), ("b", 6), ("a", 7)]
    assert a.calls == [[0], [1, 2, 4], [5, 7]]  # oldest first, same key, at most 3
    assert b.calls == [[3, 6]]
    assert sorted(batcher.batch_sizes) == [2, 6]  # requests per engine run: key A's run took 0 and, as it went, 1 2 4 5 7


def test_lone_request_is_decoded_at_once():
    batcher = EngineBatcher(max_batch=8)
    eng = Recorder("x")
    assert asyncio.run(batcher.submit("k", eng, 1)) == ("x", 1)
    assert asyncio.run(batcher.submit("k", eng, 2)) == ("x", 2)
    assert eng.calls == [[1], [2]]
    batcher.close()


def test_engine_error_fails_only_its_request_and_cancelled_requests_are_dropped():
    gate = threading.Event()
    eng = Recorder("e", gate, fail_on=2)
    batcher = EngineBatcher(max_batch=2)

    async def scenario():
        first = asyncio.ensure_future(batcher.submit("k", eng, 0))
        await until(lambda: eng.calls, "the engine to be busy with 0")
        gone = asyncio.ensure_future(batcher.submit("k", eng, 1))
        bad = asyncio.ensure_future(batcher.submit("k", eng, 2))
        late = asyncio.ensure_future(batcher.submit("k", eng, 3))
        good = asyncio.ensure_future(batcher.submit("k", eng, 4))
        await until(lambda: pending(batcher) == 4, "the other four to be queued")
        gone.cancel()
        gate.set()
        out = await asyncio.gather(first, bad, late, good, return_exceptions=True)
        return out

    first, bad, late, good = asyncio.run(scenario())
    batcher.close()
    assert first == ("e", 0)
    assert isinstance(bad, RuntimeError)
    assert late == ("e", 3)  # [2, 3] failed together, then each alone: only 2 is at fault
    assert good == ("e", 4)
    assert eng.calls == [[0], [2, 3], [2], [3], [4]]  # 1 was cancelled before its batch


def test_one_bad_video_does_not_fail_the_others_in_its_batch():
    """A request whose video makes the engine raise must not take its batch-mates down with it."""
    gate = threading.Event()
    eng = Recorder("e", gate, fail_on="bad")
    batcher = EngineBatcher(max_batch=4)

    async def scenario():
        first = asyncio.ensure_future(batcher.submit("k", eng, "first"))
        await until(lambda: eng.calls, "the engine to be busy with the first")  # the next four wait and go in together
        rest = [asyncio.ensure_future(batcher.submit("k", eng, s)) for s in ("a", "bad", "b", "c")]
        await until(lambda: pending(batcher) == 4, "the other four to be queued")
        gate.set()
        return await first, await asyncio.gather(*rest, return_exceptions=True)

    first, (a, bad, b, c) = asyncio.run(scenario())
    batcher.close()
    assert first == ("e", "first")
    assert (a, b, c) == (("e", "a"), ("e", "b"), ("e", "c"))
    assert isinstance(bad, RuntimeError) and str(bad) == "bad batch"
    assert eng.calls[1] == ["a", "bad", "b", "c"] and eng.calls[2:] == [["a"], ["bad"], ["b"], ["c"]]


def test_bad_batch_size():
    with pytest.raises(ValueError):
        EngineBatcher(0)


def test_a_device_fault_is_not_retried_and_ends_the_batcher():
    """A CUDA error poisons the process's context: no video is retried on it. Every request of the run and
    every queued one gets the error, the batcher keeps it with the samples the run held, and refuses what comes
    after; a plain error in another batcher is still retried alone (the test above)."""
    gate = threading.Event()
    eng = Recorder("e", gate, fail_on="bad")
    eng.fault = "CUDA error: an illegal memory access was encountered"
    batcher = EngineBatcher(max_batch=3)

    async def scenario():
        first = asyncio.ensure_future(batcher.submit("k", eng, "first"))
        await until(lambda: eng.calls, "the engine to be busy with the first")
        run = [asyncio.ensure_future(batcher.submit("k", eng, s)) for s in ("a", "bad", "b")]
        queued = asyncio.ensure_future(batcher.submit("k", eng, "c"))
        await until(lambda: pending(batcher) == 4, "the other four to be queued")
        gate.set()
        got = await first, await asyncio.gather(*run, queued, return_exceptions=True)
        with pytest.raises(RuntimeError, match="CUDA error"):
            await batcher.submit("k", eng, "later")
        return got

    first, rest = asyncio.run(scenario())
    batcher.close()
    assert first == ("e", "first")
    assert all(isinstance(r, RuntimeError) and "illegal memory access" in str(r) for r in rest)
    assert eng.calls == [["first"], ["a", "bad", "b"]]  # nothing retried on the poisoned device, "c" never ran
    assert batcher.fault is not None and batcher.fault.samples == ("a", "bad", "b")
    assert batcher.fault.describe() == "RuntimeError: CUDA error: an illegal memory access was encountered"
