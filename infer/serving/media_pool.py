"""Decoding untrusted media where it can be stopped: worker processes, killed on timeout.

A Serve replica decodes files its clients send. A hostile or broken file can keep
PyAV / decord busy in C code for as long as it likes; a thread cannot be stopped, so a
decode that passed `serve.decode_timeout_s` kept its thread (and the file's memory) for
good, and a few such files occupied every decode thread of the replica. Here each
decode runs in a worker process (multiprocessing "spawn": no fork of a threaded replica
with a loaded model) that builds its reader once and then serves jobs over a pipe:

    pool = DecodePool(size=4, factory=MediaReader, cfg=cfg, max_reply_bytes=cfg.serve.max_decoded_bytes)
    media = pool.decode(path, annotation, timeout=120.0)   # blocks the calling thread
    pool.close()

The workers decode media only (the service's default reader: preprocess/featurize.py
`MediaReader`, no encoder weights, no CUDA): the frames and audio come back as arrays and the
replica runs its one copy of the encoders (towers) on them.

- A job not answered within `timeout` (counted from when the worker is ready: a worker's
  own start-up is not the file's fault) kills its worker (SIGKILL) and raises DecodeTimeout; the pool starts another worker in its place at once, so the next
  request finds a worker (booting it costs the imports and the reader's set-up).
- A worker that dies during a job (a segfault in a decoder) is replaced the same way, and
  the job fails with a `DecodeFailure` of kind "undecodable".
- An exception in the reader comes back as a `DecodeFailure` carrying the original
  exception's class name, `kind` and `reason` (MediaError's), which is what the service's
  error mapping reads; exceptions themselves are not pickled (MediaError's constructor
  takes two arguments, pickling would lose the kind).
- The result travels as one plain pickle (numpy arrays and torch tensors copied into it, not
  shared memory); one larger than `max_reply_bytes` (0: no limit) is not sent: a
  `DecodeFailure` of kind "too_large", so a reply is bounded whatever the file.
- Workers start on demand, up to `size` (one per concurrent decode), or all at once with
  `warm()` (a Serve replica does, at start-up: the boot runs while the model loads).

`factory(cfg)` runs inside each worker and must be picklable (a module-level function).
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import threading
import time
from collections.abc import Callable
from typing import Any

from pipeline.config import Config

BOOT_TIMEOUT_S = 300.0  # a worker's start (imports, reader set-up); not counted in a job's timeout


class DecodeTimeout(TimeoutError):
    """The worker did not answer within the timeout; it was killed."""


class DecodeFailure(Exception):
    """The reader raised in the worker (or the worker died, or its result was too large): its class, kind and reason."""

    def __init__(self, error_type: str, reason: str, kind: str | None = None):
        super().__init__(reason)
        self.error_type, self.reason, self.kind = error_type, reason, kind


def _worker_main(conn, factory: Callable[[Config], Callable], cfg_json: str, max_reply_bytes: int = 0) -> None:
    """The worker process: build the reader once, then answer (path, annotation) jobs."""
    read = factory(Config.from_json(cfg_json))
    conn.send(("ready", None))
    while True:
        try:
            path, annotation = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reply = ("ok", pickle.dumps(read(path, annotation), protocol=pickle.HIGHEST_PROTOCOL))
            if max_reply_bytes and len(reply[1]) > max_reply_bytes:
                reply = ("error", ("DecodedTooLarge", f"the decoded media is {len(reply[1])} bytes, over the limit "
                                   f"of {max_reply_bytes} (serve.max_decoded_bytes)", "too_large"))
        except Exception as e:  # sent back as data: the parent maps it to the client's error
            reply = ("error", (type(e).__name__, str(getattr(e, "reason", None) or e), getattr(e, "kind", None)))
        conn.send(reply)
        reply = None  # the last result is not kept while the worker waits


class _Worker:
    def __init__(self, ctx, factory, cfg_json: str, max_reply_bytes: int = 0):
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child, factory, cfg_json, max_reply_bytes), daemon=True,
                                   name="padcap-decode-worker")
        self.process.start()
        child.close()
        self.ready = False

    def wait_ready(self) -> None:
        """Block until the worker has built its reader (its boot is not the job's time)."""
        if self.ready:
            return
        if not self.conn.poll(BOOT_TIMEOUT_S):
            raise DecodeTimeout(f"the decode worker did not start within {BOOT_TIMEOUT_S} s")
        status, _ = self.conn.recv()  # EOFError when the worker died while starting
        self.ready = status == "ready"
        if not self.ready:
            raise EOFError("decode worker sent no ready message")

    def call(self, job: tuple[str, Any], timeout: float) -> Any:
        self.wait_ready()
        self.conn.send(job)
        if not self.conn.poll(timeout):
            raise DecodeTimeout(f"no answer within {timeout} s")
        return self.conn.recv()  # EOFError when the worker died

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)
        self.conn.close()


class DecodePool:
    """Up to `size` decode worker processes; see the module docstring."""

    def __init__(self, size: int, factory: Callable[[Config], Callable], cfg: Config, max_reply_bytes: int = 0):
        self.size = max(1, int(size))
        self._factory, self._cfg_json = factory, cfg.to_json(indent=None)
        self._max_reply_bytes = int(max_reply_bytes)
        self._ctx = mp.get_context("spawn")
        self._idle: list[_Worker] = []
        self._count = 0
        self._cond = threading.Condition()
        self._closed = False
        self.killed: list[int] = []  # pids of the workers killed for a timeout or a crash

    def _new_worker(self) -> _Worker:
        return _Worker(self._ctx, self._factory, self._cfg_json, self._max_reply_bytes)

    def _counted_worker(self) -> _Worker:
        """A new worker for a slot already counted; if it cannot start, the slot goes back (and a waiter wakes)."""
        try:
            return self._new_worker()
        except BaseException:
            with self._cond:
                self._count -= 1
                self._cond.notify()
            raise

    def _take(self, timeout: float) -> _Worker:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if self._closed:
                    raise RuntimeError("decode pool is closed")
                if self._idle:
                    return self._idle.pop()
                if self._count < self.size:
                    self._count += 1
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DecodeTimeout(f"no decode worker free within {timeout} s")
                self._cond.wait(left)
        return self._counted_worker()

    def _give_back(self, worker: _Worker) -> None:
        with self._cond:
            if self._closed:
                worker.kill()
                return
            self._idle.append(worker)
            self._cond.notify()

    def _replace(self, worker: _Worker) -> None:
        """Kill a worker and start its successor now (it boots while the pool serves others)."""
        self.killed.append(worker.process.pid)
        worker.kill()
        with self._cond:
            if self._closed:
                self._count -= 1
                return
        self._give_back(self._counted_worker())

    def decode(self, path: str, annotation: Any, timeout: float) -> Any:
        """The reader's result for (path, annotation), from a worker, within `timeout` s."""
        worker = self._take(BOOT_TIMEOUT_S + timeout)
        try:
            status, payload = worker.call((path, annotation), timeout)
        except DecodeTimeout:
            self._replace(worker)
            raise
        except (EOFError, OSError, BrokenPipeError):
            code = worker.process.exitcode
            self._replace(worker)
            raise DecodeFailure("WorkerDied", f"the decoder process died while reading the file (exit code {code})",
                                "undecodable") from None
        self._give_back(worker)
        if status == "error":
            raise DecodeFailure(*payload)
        return pickle.loads(payload)  # our own worker pickled it (as conn.recv would unpickle a reply)

    def warm(self, count: int | None = None, wait: bool = False) -> None:
        """Start workers until `count` (default: size) exist, so the first requests do not pay
        for a worker's start; `wait`: also block until every idle one is ready."""
        want = self.size if count is None else min(self.size, count)
        while True:
            with self._cond:
                if self._closed or self._count >= want:
                    break
                self._count += 1
            self._give_back(self._new_worker())
        if wait:
            with self._cond:
                idle = list(self._idle)
            for w in idle:
                w.wait_ready()

    def count(self) -> int:
        """Workers started and not killed yet (idle, busy or booting)."""
        with self._cond:
            return self._count

    def pids(self) -> list[int]:
        """The live workers' process ids (idle ones)."""
        with self._cond:
            return [w.process.pid for w in self._idle if w.process.is_alive()]

    def close(self) -> None:
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._cond.notify_all()
        for w in idle:
            w.kill()
