"""Run a command as a child subreaper and print the CPU time of every process it started.

    python .ci/reap.py CMD ARGS...      # exit status: CMD's

Ray's raylets and workers outlive their parents (they are re-parented, by default to
init), so neither bash's `time` nor `/usr/bin/time` counts them. This process marks itself
a child subreaper (Linux prctl PR_SET_CHILD_SUBREAPER): orphaned descendants are re-parented
to it, it reaps each one, and their CPU time lands in its own RUSAGE_CHILDREN, which `time`
around this process (or the line printed at the end) then shows. After CMD exits it keeps
reaping until no descendant is left (at most REAP_GRACE_S, then they are left running and
named on stderr).
"""

from __future__ import annotations

import ctypes
import os
import resource
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36
REAP_GRACE_S = 60.0


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print("reap: prctl(PR_SET_CHILD_SUBREAPER) failed: orphans are not counted", file=sys.stderr)
    start = time.monotonic()
    proc = subprocess.Popen(argv)
    status = None
    while True:  # reap everything; note CMD's own status when it comes
        try:
            pid, raw = os.wait()
        except ChildProcessError:
            break
        if pid == proc.pid:
            status = os.waitstatus_to_exitcode(raw)
            proc.returncode = status
            break
    deadline = time.monotonic() + REAP_GRACE_S
    while time.monotonic() < deadline:  # descendants still running after CMD exited
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            time.sleep(0.05)
    else:
        print("reap: descendants still running after the command exited (not counted)", file=sys.stderr)
    wall = time.monotonic() - start
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = ru.ru_utime + ru.ru_stime
    print(f"reap: wall {wall:.1f}s, user {ru.ru_utime:.1f}s + sys {ru.ru_stime:.1f}s = {cpu:.1f}s of CPU "
          f"(all descendants), wall/CPU {wall / max(cpu, 1e-9):.2f}", file=sys.stderr)
    return 1 if status is None else (status if status >= 0 else 128 - status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
