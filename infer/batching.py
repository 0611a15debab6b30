"""Natural micro-batching of concurrent requests into one engine call, off the event loop.

    batcher = EngineBatcher(max_batch=4)
    result = await batcher.submit(key, engine, sample)    # key: the engine's settings

All engine calls run in one worker thread (the model is not shared between
threads), so a replica decodes one batch at a time. Requests that arrive while a
batch runs wait in a list; when the engine frees up, the oldest waiting request
and up to max_batch - 1 others with the same key (the same decoding options) go
in together as `engine.caption([s1, s2, ...])`. Nothing waits on purpose: a lone
request is decoded at once (batch of one). A cancelled request (client gone) is
dropped before its batch starts. When a batch of several raises, each of its
requests is retried alone, so the exception reaches only the request whose video
caused it (the others still get their captions; infer/batch.py does the same
offline). Used by infer/service.py; pure asyncio, no ray.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Hashable


@dataclass
class _Item:
    key: Hashable
    engine: Any
    sample: Any
    future: asyncio.Future


class EngineBatcher:
    """Queue of (engine, sample) requests, drained in same-key batches by one thread."""

    def __init__(self, max_batch: int = 1):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.max_batch = max_batch
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="padcap-engine")
        self._pending: list[_Item] = []
        self._runner: asyncio.Task | None = None
        self.batch_sizes: list[int] = []  # one entry per engine call (for tests and stats)

    async def submit(self, key: Hashable, engine: Any, sample: Any) -> Any:
        loop = asyncio.get_running_loop()
        item = _Item(key, engine, sample, loop.create_future())
        self._pending.append(item)
        if self._runner is None or self._runner.done():
            self._runner = loop.create_task(self._drain())
        return await item.future

    def _next_batch(self) -> list[_Item]:
        self._pending = [p for p in self._pending if not p.future.done()]
        if not self._pending:
            return []
        key = self._pending[0].key
        batch = [p for p in self._pending if p.key == key][: self.max_batch]
        taken = {id(p) for p in batch}
        self._pending = [p for p in self._pending if id(p) not in taken]
        return batch

    async def _drain(self) -> None:
        while batch := self._next_batch():
            if not await self._run(batch) and len(batch) > 1:
                for p in batch:  # which one was it? each alone, so only the culprit fails
                    if not p.future.done():
                        await self._run([p])

    async def _run(self, batch: list[_Item]) -> bool:
        """One engine call in the engine thread. On success every future gets its result (True);
        on an exception (False) a lone request gets it, a larger batch is left to the caller."""
        self.batch_sizes.append(len(batch))
        try:
            results = await asyncio.get_running_loop().run_in_executor(
                self._pool, batch[0].engine.caption, [p.sample for p in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"engine returned {len(results)} results for {len(batch)} samples")
        except Exception as e:  # noqa: BLE001 - handed to the waiting request
            if len(batch) == 1 and not batch[0].future.done():
                batch[0].future.set_exception(e)
            return False
        for p, r in zip(batch, results):
            if not p.future.done():
                p.future.set_result(r)
        return True

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
