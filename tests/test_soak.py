"""bench/soak.py for 60 s with one of two replicas killed mid-soak, with its targets asserted on the
JSON it writes (to a tmp path). Every target of the plain soak (no server errors, every request
answered or cancelled, hostile requests get their 4xx, flat RSS and file descriptors, nothing left
when idle) is asserted here too, through a replica loss; the plain soak itself is the 30-minute
run in bench/results/soak.json (one variant keeps the suite near its time budget). Needs Locust
(the soak's load tool); run under the Ray lock:

    flock /tmp/ray.lock .venv/bin/python -m pytest tests/test_soak.py -q -p no:cacheprovider

The script starts its own local Ray instance (in a subprocess), so the shared one is stopped first.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("locust") is None, reason="needs locust (the soak's load tool)")]
ROOT = Path(__file__).resolve().parents[1]


def soak(tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "soak.json"
    cmd = [sys.executable, "-m", "bench.soak", "--duration-s", "60", "--sample-s", "10",
           "--work-dir", str(tmp_path / "work"), "--out", str(out), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert out.exists(), done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert out.with_suffix(".png").exists()
    return report


def common_targets(r: dict) -> None:
    assert r["duration_s"] >= 55 and r["requests"] > 50
    kinds = r["status_counts_by_kind"]
    assert {"good_uri", "good_upload", "hostile", "abort_upload", "abort_decode", "client_timeout", "oversized",
            "burst"} <= set(kinds)
    assert kinds["burst"].get("503", 0) >= 1  # the bursts crossed the queue limit
    assert r["server_errors"] == 0, r["status_counts"]
    assert r["unanswered"] == 0 and r["hostile_wrong"] == 0, r["hostile_wrong_examples"]
    assert r["temp_files_left"] == 0 and r["kv_pages_left_idle"] == 0 and r["in_flight_left_idle"] == 0
    assert r["orphan_workers_left"] == 0
    assert r["rss_growth_last_20min"] <= 0.05 and r["fd_growth_last_20min"] <= 0.05
    assert "2/3" in r["growth_window"]["rule"]
    assert len(r["per_minute"]) >= 5 and all(m["good_ok"] > 0 for m in r["per_minute"])


def test_soak_with_a_replica_killed(tmp_path, own_ray_cluster):
    r = soak(tmp_path, "--kill-replica-at", "25")
    common_targets(r)
    assert r["replicas"] == 2 and r["killed_pid"] and r["replica_back_s"] is not None
    # what was in flight on the killed replica got an error the client retries (infer/serving/client.py)
    assert all(key.endswith((":ok", ":replica_lost", ":aborted", ":backpressure", ":refused")) for key in r["in_flight_at_kill"])
    after = [m for m in r["per_minute"] if m["t_s"] > r["kill_at_s"] + 30]
    assert after and all(m["good_ok"] > 0 for m in after)
    assert all(r["targets"].values()), r["targets"]
