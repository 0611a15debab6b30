"""Where a video is in flight, for the node-loss tests (tests/test_cluster_sim.py) and the archive-scale
bench (bench/archive_scale.py): a wrapper of the Ray Data jobs' stages, passed through their one hook
`wrap_stage`. It lives with the benchmarks because both use it and no bench module imports test code.

    watch = InFlight(root, hold="caption", hold_s=150.0)
    run_caption(cfg, videos, model, out, wrap_stage=watch)       # or run_preprocess(..., wrap_stage=watch)
    held(root, "caption"), markers(root, "caption")             # what the markers say

The jobs call `wrap_stage(stage, cls)` on the driver for each stage class before Ray Data runs it
("preprocess": preprocess/job.py FeaturizeVideos, per video in `featurize`; "caption-featurize":
infer/offline/job.py FeaturizeForCaption and "caption": CaptionVideos, per call on the batch's
`video_id` column). `InFlight` returns a subclass that, in the worker, writes
`<root>/<stage>/<video>~<pid>.start` (JSON: node id, pid) when it starts work on a video and
`.done` beside it when that work ended (with a result or an exception): a start that never gets
its done (the process was killed with its node) proves that the node held the video when it was
lost, and the other processes' markers show who redid it. The first call of stage `hold`
anywhere (an exclusive `<root>/<stage>.held` file: once per directory, so a retry does not hold
again) waits `hold_s` seconds after writing its start markers: the window in which the test
removes its node, found in the markers. The settings travel with the pickled subclass; the
production code only calls the hook.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""


def _mark(path: Path, info: dict) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, path)  # a reader sees the whole marker or none


def _hold_once(root: Path, stage: str, hold: str) -> bool:
    """True for the first caller of `stage` under `root` when it is the held stage, False for every later one."""
    if stage != hold:
        return False
    try:
        fd = os.open(root / f"{stage}.held", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    return True


@contextlib.contextmanager
def in_flight(root: str | Path, stage: str, video_ids: Sequence[str], node_id: str = "", hold: str = "",
              hold_s: float = 120.0) -> Iterator[None]:
    """Mark `video_ids` started (and hold, if this is the first call of stage `hold`) on entry, done on
    exit (an exception too)."""
    where = Path(root) / stage
    where.mkdir(parents=True, exist_ok=True)
    holds = _hold_once(Path(root), stage, hold)
    info = {"node_id": node_id, "pid": os.getpid(), "held": holds}
    for vid in video_ids:
        _mark(where / f"{quote(vid, safe='')}~{os.getpid()}.start", info)
    if holds:
        time.sleep(hold_s)
    try:
        yield
    finally:  # finished, well or with an error: only a killed process leaves no done marker
        for vid in video_ids:
            _mark(where / f"{quote(vid, safe='')}~{os.getpid()}.done", info)


@dataclass(frozen=True)
class InFlight:
    """The `wrap_stage` hook of preprocess/job.py and infer/offline/job.py (module doc)."""

    root: str
    hold: str = ""  # the stage whose first call holds ("" = none)
    hold_s: float = 120.0

    def __call__(self, stage: str, cls: type) -> type:
        watch = self

        def marked(ids):
            return in_flight(watch.root, stage, ids, _node_id(), watch.hold, watch.hold_s)

        if stage == "preprocess":  # one chunk's videos in turn: each marked around its own featurize
            def featurize(self, video, chunk):
                with marked([str(video["video_id"])]):
                    return cls.featurize(self, video, chunk)

            body = {"featurize": featurize}
        elif inspect.iscoroutinefunction(cls.__call__):  # infer/offline/job.py CaptionVideos: several calls at once
            async def acall(self, batch):
                with marked([str(v) for v in batch["video_id"]]):
                    return await cls.__call__(self, batch)

            body = {"__call__": acall}
        else:
            def call(self, batch):
                with marked([str(v) for v in batch["video_id"]]):
                    return cls.__call__(self, batch)

            body = {"__call__": call}
        # the same class name (Ray Data and the state API name the actors after it); not importable by
        # name, so it is pickled with its settings
        return type(cls.__name__, (cls,), {**body, "__module__": __name__, "__qualname__": f"InFlight.{cls.__name__}"})


def markers(root: str | Path, stage: str) -> list[dict]:
    """Every start a stage's processes made under `root`: [{video_id, pid, node_id, held, done,
    started_at, done_at}], `done` whether that process finished the video, the times (epoch seconds)
    the markers' files were written (`done_at` None when not done)."""
    where = Path(root) / stage
    found = []
    for p in sorted(where.glob("*.start")) if where.is_dir() else []:
        vid, pid = p.name[: -len(".start")].rsplit("~", 1)
        done = p.with_suffix(".done")
        done_at = done.stat().st_mtime if done.exists() else None
        found.append({**json.loads(p.read_text()), "video_id": unquote(vid), "pid": int(pid),
                      "done": done_at is not None, "started_at": p.stat().st_mtime, "done_at": done_at})
    return found


def held(root: str | Path, stage: str) -> dict | None:
    """The marker of the video that `stage` holds now (or held), or None before it started."""
    return next((m for m in markers(root, stage) if m.get("held")), None)
