"""`.ci/reap.py`: the CPU time of a command's whole process tree, the way Ray's daemons run.

Two shapes rusage alone gets wrong or right: a grandchild reaped by a parent that ignores
SIGCHLD (its usage is discarded by the kernel: only the cgroup count holds it), and a daemon
that outlives the command (re-parented to the reaper, waited for and counted by both).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REAP = Path(__file__).resolve().parents[1] / ".ci" / "reap.py"
BURN_S = 0.5
LINE = re.compile(r"reap: wall ([\d.]+)s, user ([\d.]+)s \+ sys ([\d.]+)s = ([\d.]+)s of CPU \[(.+?)\]")

_BURN = f"""
import time
t = time.process_time()
while time.process_time() - t < {BURN_S}:
    pass
"""
# the parent ignores SIGCHLD, so the kernel reaps the grandchild and drops its usage
IGNORING_PARENT = f"""
import os, signal, sys
signal.signal(signal.SIGCHLD, signal.SIG_IGN)
pid = os.fork()
if pid == 0:
{_BURN.replace(chr(10), chr(10) + '    ')}
    os._exit(0)
try:
    os.waitpid(pid, 0)
except ChildProcessError:
    pass
sys.exit(3)
"""
# the command exits at once; its double-forked daemon burns CPU after it is gone
DAEMON = f"""
import os
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
{_BURN.replace(chr(10), chr(10) + '        ')}
        open({{path!r}}, "w").write("done")
    os._exit(0)
"""


def _load_reap():
    spec = importlib.util.spec_from_file_location("ci_reap", REAP)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _needs_cgroup():
    group = _load_reap().CpuCgroup.make(f"padcap-reap-probe-{os.getpid()}")
    if group is None:
        pytest.skip("no writable CPU cgroup on this box (needs root in a container)")
    assert group.remove()


def _run(code: str) -> tuple[int, dict[str, float]]:
    out = subprocess.run([sys.executable, str(REAP), sys.executable, "-c", code],
                         capture_output=True, text=True, timeout=120)
    counts = {m.group(5).split(" ")[0]: float(m.group(4)) for m in LINE.finditer(out.stderr)}
    return out.returncode, counts


def _run_groups() -> set[Path]:
    """The reapers' cgroups under this process's own (an outer reaper's is this one's parent)."""
    return {g for _, parent in _load_reap()._candidate_parents(Path("/sys/fs/cgroup"))
            for g in parent.glob("padcap-reap-*")}


def test_the_cgroup_counts_a_grandchild_whose_usage_rusage_loses():
    _needs_cgroup()
    before = _run_groups()
    status, cpu = _run(IGNORING_PARENT)
    assert status == 3  # the command's own exit status
    assert cpu["cgroup"] >= BURN_S
    assert cpu["rusage"] < BURN_S  # the kernel dropped it: why the cgroup count exists
    assert _run_groups() == before, "the run's cgroup is removed after it"


def test_a_daemon_that_outlives_the_command_is_waited_for_and_counted(tmp_path):
    done = tmp_path / "daemon-done"
    status, cpu = _run(DAEMON.format(path=str(done)))
    assert status == 0
    assert done.read_text() == "done"  # the reaper returned only after the daemon ended
    assert cpu["rusage"] >= BURN_S  # re-parented to the subreaper and reaped by it
    if "cgroup" in cpu:  # both printed to 0.1 s: one rounding step apart is equal (0.549 -> 0.5, 0.551 -> 0.6)
        assert cpu["cgroup"] >= cpu["rusage"] - 0.15
