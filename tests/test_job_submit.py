"""`ray job submit` against a local head on 127.0.0.1 runs the driver end to end.

Starts a head with the environment docs/design/environment.md gives, submits
`python pipeline/run.py` with a small config through `ray job submit --working-dir .`,
waits for SUCCEEDED, checks the outputs, and stops the head.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).with_name("ray"))

SMALL = [
    "data.synthetic.num_videos=4", "data.synthetic.min_duration=8", "data.synthetic.max_duration=10",
    "data.synthetic.max_events=3", "features.min_frames=16", "features.max_frames=32",
    "train.num_workers=1", "train.max_steps=4", "train.checkpoint_every=2", "train.val_every=2",
    "train.val_samples=1", "train.log_every=1", "infer.max_events=3", "infer.max_branch_tokens=4",
    "cluster.preprocess_actors=1",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def head(own_ray_cluster, tmp_path):  # the shared local instance is stopped first (`ray stop` would kill it)
    # The job's `python` must be this venv's, as for a user who activated it.
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env = {**os.environ, "PATH": path, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
           "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    port, dash = _free_port(), _free_port()
    subprocess.run([RAY, "start", "--head", "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1",
                    f"--port={port}", f"--dashboard-port={dash}", "--num-cpus=2", "--disable-usage-stats",
                    "--include-dashboard=true"], check=True, env=env, cwd=ROOT, capture_output=True, timeout=180)
    try:
        yield f"http://127.0.0.1:{dash}", env
    finally:
        subprocess.run([RAY, "stop", "--force"], env=env, capture_output=True, timeout=120)


def test_ray_job_submit_runs_the_driver(head, tmp_path):
    address, env = head
    run_dir = tmp_path / "run"
    args = [RAY, "job", "submit", "--address", address, "--working-dir", ".", "--no-wait", "--",
            "python", "pipeline/run.py", "--set", f"run_dir={run_dir}"]
    for item in SMALL:
        args += ["--set", item]
    sub = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert sub.returncode == 0, sub.stdout + sub.stderr
    job_id = re.search(r"(raysubmit_\w+)", sub.stdout + sub.stderr).group(1)

    from ray.job_submission import JobStatus, JobSubmissionClient

    client = JobSubmissionClient(address)
    deadline = time.time() + 1200
    status = client.get_job_status(job_id)
    while status not in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED) and time.time() < deadline:
        time.sleep(0.25)  # polled: the loop ends as soon as the job does
        status = client.get_job_status(job_id)
    logs = client.get_job_logs(job_id)
    assert status == JobStatus.SUCCEEDED, logs[-5000:]
    assert "stage" in logs and "evaluate" in logs, logs[-3000:]

    # The outputs of every stage are where the driver says.
    for stage in ("synth", "preprocess", "train", "caption", "evaluate"):
        stamp = json.loads((run_dir / stage / "_STAGE.json").read_text())
        assert stamp["stage"] == stage
    assert (run_dir / "preprocess" / "manifest.parquet").exists()
    assert (run_dir / "train" / "model").is_dir()
    assert (run_dir / "caption" / "captions.jsonl").read_text().strip()
    result = json.loads((run_dir / "evaluate" / "result.json").read_text())
    assert set(result["metrics"]) >= {"F1", "Sim", "SODA_c", "CIDEr", "METEOR"}
