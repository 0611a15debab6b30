"""What the archive-scale bench counts, from the jobs' outputs and the in-flight markers (pure functions).

    once = exactly_once(listed_ids, rows)             # {"rows", "lost", "duplicated"}
    rates = tenths([t_done, ...])                     # videos/min over the first and the last tenth
    reasons = error_reasons(rows)                     # {"MediaError: zero-byte file: <path>": 3, ...}
    redo = rerun_redone(committed_before, started_after, started_before)

`lost`: listed videos with no row; `duplicated`: videos with more than one row where one is allowed.
Throughput per tenth is measured between completions (the first tenth from the first video done, so
actor start-up is not in it; the last tenth up to the last video done).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from typing import Any

from bench import inflight


def exactly_once(listed: Iterable[str], ids: Iterable[str]) -> dict[str, int]:
    """`ids`: the video id of every row written (one expected per listed video) -> counts."""
    seen = Counter(ids)
    listed = set(listed)
    return {"rows": sum(seen.values()), "lost": sum(1 for v in listed if v not in seen),
            "duplicated": sum(1 for _, c in seen.items() if c > 1),
            "unlisted": sum(1 for v in seen if v not in listed)}


def tenths(done_times: Iterable[float]) -> dict[str, float | None]:
    """Completion times (one per video, any order) -> {"first_tenth", "last_tenth"} in videos/min and
    their ratio; None when there are too few videos (under 20) to cut in tenths."""
    t = sorted(done_times)
    k = len(t) // 10
    if k < 2:
        return {"first_tenth": None, "last_tenth": None, "ratio": None}

    def rate(a: float, b: float, n: int) -> float:
        return 60.0 * n / max(b - a, 1e-6)

    first, last = rate(t[0], t[k], k), rate(t[-k - 1], t[-1], k)
    return {"first_tenth": round(first, 2), "last_tenth": round(last, 2), "ratio": round(last / first, 3)}


def done_times(root: str, stage: str) -> dict[str, float]:
    """{video id: when a process of `stage` first finished it} from the markers under `root`."""
    out: dict[str, float] = {}
    for m in inflight.markers(root, stage):
        if m["done"] and m.get("done_at") is not None:
            out[m["video_id"]] = min(out.get(m["video_id"], m["done_at"]), m["done_at"])
    return out


def started(root: str, stage: str) -> set[str]:
    """The videos some process of `stage` started under `root`."""
    return {m["video_id"] for m in inflight.markers(root, stage)}


_PATHS = re.compile(r"(s3://|/)[^\s:,'\"]*")


def error_reasons(rows: Iterable[dict[str, Any]]) -> dict[str, int]:
    """Error rows -> {reason: count}, the reason being the error text with its paths and URIs elided."""
    return dict(Counter(_PATHS.sub("<path>", r["error"] or "?") for r in rows if r["status"] != "ok").most_common())


def rerun_redone(committed_ok: set[str], committed_error: set[str], started_before: set[str],
                 started_after: set[str]) -> dict[str, int]:
    """After a killed driver: what the second run did again.

    committed_ok / committed_error: the videos with an ok / an error row committed when the first run
    was killed; started_before / started_after: the videos the first / the second run started.
    -> {"rerun_redone": ok-committed videos done again (target 0), "in_flight_at_kill": started but not
    committed, "redone_in_flight": of those, done by the second run, "retried_errors": error rows the
    second run tried again (a re-run retries failures by design)}."""
    in_flight = started_before - committed_ok - committed_error
    return {"rerun_redone": len(committed_ok & started_after), "in_flight_at_kill": len(in_flight),
            "redone_in_flight": len(in_flight & started_after),
            "retried_errors": len((committed_error - committed_ok) & started_after)}
