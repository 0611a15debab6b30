"""A device fault in the offline caption actor, for tests/test_batch_caption.py: a `wrap_stage` hook.

    run_caption(cfg, videos, model, out, wrap_stage=CudaFaultOn("v03", marker_dir=tmp / "faults"))

infer/offline/job.py calls the hook with ("caption", CaptionVideos); it returns a subclass whose engine is
the real one with one change: when the engine takes video `video_id` from its feed (other videos may be in
flight), it raises `message`, a CUDA error's text, as a kernel fault on that video would, and writes
`<marker_dir>/fault-<pid>-<n>` first (which process faulted, how many times). Everything else (the
model, the steps, the batcher, the restart) is the production code's. Picklable with its settings (the
subclass travels by value, as bench/inflight.py's does).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class CudaFaultOn:
    """The hook (module doc)."""

    video_id: str
    marker_dir: str
    message: str = "CUDA error: an illegal memory access was encountered"

    def __call__(self, stage: str, cls: type) -> type:
        if stage != "caption":
            return cls
        fault = self

        def __init__(self, *args, **kwargs):
            cls.__init__(self, *args, **kwargs)
            self.engine = FaultyEngine(self.engine, fault)

        return type(cls.__name__, (cls,), {"__init__": __init__, "__module__": __name__,
                                           "__qualname__": f"CudaFaultOn.{cls.__name__}"})


class FaultyEngine:
    """The real engine, whose run raises the fault's message when the faulty video is fed (module doc)."""

    def __init__(self, engine: Any, fault: CudaFaultOn):
        self.engine, self.fault = engine, fault

    def run(self, feed: Callable[[], Any], emit: Callable[[Any, Any], None]) -> None:
        def faulty_feed():
            req = feed()
            if req is not None and req.sample.video_id == self.fault.video_id:
                where = Path(self.fault.marker_dir)
                where.mkdir(parents=True, exist_ok=True)
                (where / f"fault-{os.getpid()}-{len(list(where.iterdir()))}").write_text(self.fault.video_id)
                raise RuntimeError(self.fault.message)
            return req

        self.engine.run(faulty_feed, emit)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)
