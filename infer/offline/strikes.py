"""Device faults of one captioning run: which videos were in the engine each time its device failed.

    strikes = DeviceStrikes(storage.join(out, "faults", run_id))
    strikes.strike(["a", "b"], "RuntimeError: CUDA error: an illegal memory access was encountered")
    strikes.of(["a", "c"])      # {"a": {"video_id": "a", "strikes": 1, "error": "RuntimeError: CUDA error: ..."}}
    strikes.all()               # every record of the run

After a CUDA error the caption actor exits and Ray restarts it and retries its calls
(infer/offline/job.py); what the next process must know survives it here, one JSON file per video under
the run's folder (local or s3://, `pipeline.storage`): how many times the device failed while the
video was in the engine, and the last error. A video with a strike is captioned alone on the retry (so
a fault then is its own), and a video with MAX_STRIKES gets an error row instead of another try, so a
video that crashes the device cannot restart the actor forever. The driver reads the records at the
end of the run, reports them and removes the folder (`report`). Pure python + pipeline.storage; no ray.
"""

from __future__ import annotations

import hashlib
from typing import Any

from pipeline import storage

MAX_STRIKES = 2  # device faults with a video in the engine before it gets an error row instead of a retry


class DeviceStrikes:
    """The strike records of one run, under `root` (module doc)."""

    def __init__(self, root: str):
        self.root = root

    def _path(self, video_id: str) -> str:
        """One file per video, named by a hash of its id (ids may hold '/', spaces, anything)."""
        return storage.join(self.root, hashlib.sha1(video_id.encode("utf-8")).hexdigest()[:24] + ".json")

    def of(self, video_ids: list[str]) -> dict[str, dict[str, Any]]:
        """The records of those of `video_ids` that have one."""
        found = {}
        for vid in video_ids:
            path = self._path(vid)
            if storage.exists(path):
                found[vid] = storage.read_json(path)
        return found

    def strike(self, video_ids: list[str], error: str) -> None:
        """One more strike for each of `video_ids` (the videos in the engine when its device failed with `error`)."""
        for vid, rec in {**{v: {"video_id": v, "strikes": 0} for v in video_ids}, **self.of(video_ids)}.items():
            storage.write_json(self._path(vid), {**rec, "strikes": int(rec["strikes"]) + 1, "error": error})

    def all(self) -> list[dict[str, Any]]:
        """Every record of the run, by video id."""
        records = [storage.read_json(p) for p in storage.list_files(self.root, (".json",))]
        return sorted(records, key=lambda r: r["video_id"])

    def remove(self) -> None:
        storage.remove(self.root, recursive=True)

    def report(self) -> int:
        """At the run's end: say which videos were in the engine when its device failed (their actor was
        restarted), and remove the run's records; -> how many videos."""
        records = self.all()
        if records:
            print(f"[caption] the engine's device failed with {len(records)} video(s) in it; their actor was "
                  f"restarted and they were retried alone: {', '.join(r['video_id'] for r in records[:10])}", flush=True)
        self.remove()
        return len(records)


def refusal(record: dict[str, Any]) -> str | None:
    """The error row's reason for a video with MAX_STRIKES strikes (None: it gets another try)."""
    if int(record.get("strikes", 0)) < MAX_STRIKES:
        return None
    return (f"the engine's device failed {record['strikes']} times with this video in it, the last time with it "
            f"alone (the caption actor was restarted each time): {record.get('error', '')}")
