"""bench/archive_scale.py at N = 200: the archive flow on the simulated cluster (videos on the tests' S3
server, a CPU node lost while it holds a video in each stage, the captioning driver killed half-way and
run again) ends with every video exactly once and nothing committed redone.

    flock /tmp/ray.lock .venv/bin/python -m pytest tests/test_archive_scale.py -q -p no:cacheprovider

The script runs as CI runs it, in a process of its own (it starts its own cluster and S3 server); the
test reads the JSON it writes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[1]
N = 200


def test_archive_of_200_exactly_once_through_a_node_loss_per_stage_and_a_killed_driver(own_ray_cluster, tmp_path):
    out = tmp_path / "archive_scale.json"
    proc = subprocess.run([sys.executable, "-m", "bench.archive_scale", "--n", str(N), "--small-n", "0",
                           "--distinct", "40", "--bad", "2", "--work", str(tmp_path / "work"), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["videos"] == N and res["manifest_rows"] == N and res["caption_rows"] == N
    assert res["lost"] == 0 and res["duplicated"] == 0
    assert res["node_loss_proved"] == {"preprocess": True, "caption": True}  # a node went while it held a video
    cap = res["runs"]["n"]["caption"]
    assert res["driver_killed"] and 0 < cap["rows_committed_at_kill"] < N  # killed part-way, then run again
    assert res["rerun_redone"] == 0  # nothing committed before the kill was done again
    assert cap["redone_in_flight"] == cap["in_flight_at_kill"]  # what was in flight was done by the rerun
    for stage in ("preprocess", "caption"):  # the two broken files: one explained error row each
        assert sum(res["error_rows"][stage].values()) == 2, res["error_rows"]
        assert res["runs"]["n"][stage]["ok"] == N - 2
