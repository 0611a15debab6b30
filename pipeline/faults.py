"""Where a video is in flight, for the node-loss tests (tests/test_cluster_sim.py): off unless asked for.

    with in_flight("preprocess", [video_id]):   # around a stage's work on some videos
        ...

With `PADCAP_INFLIGHT_DIR` set, a process of a stage writes `<dir>/<stage>/<video>~<pid>.start`
(JSON: node id, pid) when it starts work on a video and `.done` beside it when that work
ended (with a result or an exception): a start that never gets its done (the process was killed with its node) proves that
the node held the video when it was lost, and the other processes' markers show who redid it. With `PADCAP_HOLD_STAGE=<stage>` too, the first
call of that stage anywhere (an exclusive `<dir>/<stage>.held` file: once per directory, so a
retry does not hold again) waits `PADCAP_HOLD_S` seconds (default 120) after writing its start
markers: the window in which the test removes its node, found in the markers. Unset, each
call costs one environment lookup. `forwarded_env()` hands the variables to Ray workers'
runtime_env (raylets started before the test set them do not have them).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from urllib.parse import quote, unquote

DIR_ENV, STAGE_ENV, HOLD_ENV = "PADCAP_INFLIGHT_DIR", "PADCAP_HOLD_STAGE", "PADCAP_HOLD_S"
ENV = (DIR_ENV, STAGE_ENV, HOLD_ENV)


def forwarded_env() -> dict[str, str]:
    """The in-flight variables of this process, for a runtime_env's env_vars."""
    return {k: os.environ[k] for k in ENV if k in os.environ}


def _mark(path: Path, info: dict) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, path)  # a reader sees the whole marker or none


def _hold_once(root: Path, stage: str) -> bool:
    """True for the first caller of `stage` under `root` (it holds), False for every later one."""
    if os.environ.get(STAGE_ENV) != stage:
        return False
    try:
        fd = os.open(root / f"{stage}.held", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    return True


@contextlib.contextmanager
def in_flight(stage: str, video_ids: Sequence[str], node_id: str = "") -> Iterator[None]:
    """Mark `video_ids` started (and maybe hold, see the module doc) on entry, done on exit (an exception too).
    node_id: the Ray node the caller runs on (the Ray wrapper passes it; this module imports no Ray)."""
    root = os.environ.get(DIR_ENV)
    if not root:
        yield
        return
    where = Path(root) / stage
    where.mkdir(parents=True, exist_ok=True)
    hold = _hold_once(Path(root), stage)
    info = {"node_id": node_id, "pid": os.getpid(), "held": hold}
    for vid in video_ids:
        _mark(where / f"{quote(vid, safe='')}~{os.getpid()}.start", info)
    if hold:
        time.sleep(float(os.environ.get(HOLD_ENV, "120")))
    try:
        yield
    finally:  # finished, well or with an error: only a killed process leaves no done marker
        for vid in video_ids:
            _mark(where / f"{quote(vid, safe='')}~{os.getpid()}.done", info)


def markers(root: str | Path, stage: str) -> list[dict]:
    """Every start a stage's processes made under `root`: [{video_id, pid, node_id, held, done}], `done`
    whether that process finished the video."""
    where = Path(root) / stage
    found = []
    for p in sorted(where.glob("*.start")) if where.is_dir() else []:
        vid, pid = p.name[: -len(".start")].rsplit("~", 1)
        found.append({**json.loads(p.read_text()), "video_id": unquote(vid), "pid": int(pid),
                      "done": p.with_suffix(".done").exists()})
    return found


def held(root: str | Path, stage: str) -> dict | None:
    """The marker of the video that `stage` holds now (or held), or None before it started."""
    return next((m for m in markers(root, stage) if m.get("held")), None)
