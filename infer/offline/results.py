"""The offline job's results: committed parts, their consolidation, and the job's verdict.

Rows are committed in parts (`<out>/parts/<chunk>.parquet`, one file written last per chunk);
`consolidate` keeps each listed video's latest row and writes `captions.parquet` and
`captions.jsonl`; `OncePerVideo` keeps one row per video of what Ray Data hands back (a retried task
can hand a video back twice); `judge` says whether the job failed. Pure pyarrow + pipeline.storage
(local or s3://); no ray.

    >>> once = OncePerVideo()
    >>> [once.take({"video_id": "a", "status": s}) for s in ("error", "ok", "error")]
    ['new', 'replaces', 'dropped']
"""

from __future__ import annotations

import io
import json
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from infer.results import RESULT_COLUMNS
from pipeline import storage
from preprocess import manifest as mf


def parts_dir(out: str) -> str:
    return storage.join(out, "parts")


def read_parts(out: str) -> list[dict[str, Any]]:
    return [row for p in storage.list_files(parts_dir(out), (".parquet",)) for row in mf.read_table(p)]


def write_parquet(path: str, rows: list[dict[str, Any]]) -> None:
    table = pa.Table.from_pylist([{c: r.get(c) for c in RESULT_COLUMNS} for r in rows], schema=pa.schema(RESULT_COLUMNS))
    buf = io.BytesIO()
    pq.write_table(table, buf)
    storage.write_bytes(path, buf.getvalue())


def consolidate(out: str, keep: set[str] | None = None) -> list[dict[str, Any]]:
    """Latest row per video across committed parts -> captions.parquet + captions.jsonl.
    `keep`: the ids listed this run; rows of videos no longer listed (deleted from the archive,
    removed from the test split) are left out."""
    latest: dict[str, dict[str, Any]] = {}
    for row in read_parts(out):
        if keep is None or row["video_id"] in keep:
            latest[row["video_id"]] = row
    rows = sorted(latest.values(), key=lambda r: r["video_id"])
    write_parquet(storage.join(out, "captions.parquet"), rows)
    lines = [json.dumps(_parsed(r), ensure_ascii=False) for r in rows]
    storage.write_bytes(storage.join(out, "captions.jsonl"), ("\n".join(lines) + "\n").encode("utf-8"))
    return rows


def _parsed(row: dict[str, Any]) -> dict[str, Any]:
    """A stored row with its JSON columns (events, timings, capped) parsed."""
    return {**row, "events": json.loads(row["events"] or "[]"), "timings": json.loads(row["timings"] or "{}"),
            "capped": json.loads(row.get("capped") or "[]")}


def read_results(out: str) -> list[dict[str, Any]]:
    """The consolidated rows, events and timings parsed."""
    return [_parsed(r) for r in mf.read_table(storage.join(out, "captions.parquet"))]


class OncePerVideo:
    """Rows as Ray Data hands them back -> one per video: its first ok row, else its first.

    A task retried after its actor or node was lost (fault tolerance: Ray re-runs it) can hand
    back a video twice. `take(row)` says what to do with each row: "new" (keep it), "replaces"
    (keep it instead of the video's earlier error row) or "dropped"."""

    def __init__(self):
        self.kept: dict[str, dict[str, Any]] = {}
        self.dropped = 0

    def take(self, row: dict[str, Any]) -> str:
        seen = self.kept.get(row["video_id"])
        if seen is not None and (seen["status"] == "ok" or row["status"] != "ok"):
            self.dropped += 1
            return "dropped"
        self.kept[row["video_id"]] = row
        if seen is None:
            return "new"
        self.dropped += 1
        return "replaces"

    def check(self, listed: list[str]) -> None:
        """A listed video with no row at all is an error (a re-run redoes it)."""
        missing = [v for v in listed if v not in self.kept]
        if missing:
            raise RuntimeError(f"captioning returned no row for {len(missing)} of {len(listed)} videos: {missing[:5]}")


def judge(rows: list[dict[str, Any]], this_run: list[dict[str, Any]], max_failed_fraction: float,
          out: str) -> dict[str, Any]:
    """Whether a captioning job succeeded, from its consolidated `rows` (one per video) and the
    rows `this_run` wrote -> {"failed", "failed_fraction", "errors_in" (where the reasons are,
    when any failed), "failure" (why the job failed; absent when it did not)}.

    Every failed video is a row with its reason; they fail the job only past
    `max_failed_fraction` of the videos, or when the engine raised on every video this run gave
    it (then the engine is what is broken, whatever the share)."""
    if not 0.0 <= max_failed_fraction <= 1.0:
        raise ValueError(f"infer.max_failed_fraction must be in [0, 1], got {max_failed_fraction}")
    failed = [r for r in rows if r["status"] != "ok"]
    fraction = len(failed) / len(rows) if rows else 0.0
    verdict: dict[str, Any] = {"failed": len(failed), "failed_fraction": round(fraction, 4)}
    if failed:
        verdict["errors_in"] = f"{storage.join(out, 'captions.jsonl')} (status=error rows: error, error_kind)"
    given = [r for r in this_run if r["status"] == "ok" or r.get("error_kind") in ("refused", "engine")]
    raised = sum(r.get("error_kind") == "engine" for r in given)
    if given and raised == len(given):
        verdict["failure"] = (f"the engine raised on all {raised} videos it was given this run (a broken model or "
                              f"engine, not bad files); the errors are in {verdict['errors_in']}")
    elif fraction > max_failed_fraction:
        verdict["failure"] = (f"{len(failed)} of {len(rows)} videos failed ({100 * fraction:.1f}%), more than "
                              f"infer.max_failed_fraction={max_failed_fraction:g}; the reasons are in "
                              f"{verdict['errors_in']}")
    return verdict
