"""Run a command and print the CPU time of every process it started, daemons included.

    python .ci/reap.py CMD ARGS...      # exit status: CMD's

Ray's raylets, GCS and workers outlive their parents and some are reaped by parents that
discard their usage, so neither bash's `time` nor `/usr/bin/time` counts all of them. Two
counts, the exact one on the last line:

- **cgroup** (exact): CMD starts in a CPU-accounting cgroup of its own (cgroup v1 `cpuacct`,
  else the v2 hierarchy's `cpu.stat`), made by this process for the run and removed after;
  the kernel charges every descendant's CPU to it whatever its parentage or how it was reaped.
  Needs write access to the cgroup tree (root in a container); without it this count is absent.
- **rusage**: this process is a child subreaper (prctl PR_SET_CHILD_SUBREAPER), so orphaned
  descendants are re-parented to it and reaped, and RUSAGE_CHILDREN holds every descendant
  that was reaped by a waiting parent. It misses those reaped by a parent that ignores
  SIGCHLD (their usage goes to no one), Ray's workers among them (the raylet ignores it), so it
  is a lower bound.

After CMD exits it keeps reaping until no descendant is left (at most REAP_GRACE_S, then the
ones left are named on stderr and left running).
"""

from __future__ import annotations

import ctypes
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36
REAP_GRACE_S = 60.0
CGROUP_ROOT = Path("/sys/fs/cgroup")


class CpuCgroup:
    """A cgroup made for one run that counts the CPU of every process placed in it.

    `make` returns None where the tree is not writable (the run is then counted by rusage only).
    """

    def __init__(self, path: Path, version: int):
        self.path, self.version = path, version

    @classmethod
    def make(cls, name: str, root: Path = CGROUP_ROOT) -> CpuCgroup | None:
        for version, parent in _candidate_parents(root):
            path = parent / name
            try:
                path.mkdir()
            except OSError:
                continue
            group = cls(path, version)
            if group.cpu_s() is not None:
                return group
            group.remove()
        return None

    def enter(self) -> None:
        """Move the calling process into the group (its later children are born there)."""
        (self.path / "cgroup.procs").write_text(f"{os.getpid()}\n")

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def cpu_s(self) -> tuple[float, float] | None:
        """(user s, system s) charged to the group so far, or None if unreadable."""
        try:
            if self.version == 1:
                user, sys_ = ((self.path / f"cpuacct.usage_{k}").read_text() for k in ("user", "sys"))
                return int(user) / 1e9, int(sys_) / 1e9
            stat = _keyed((self.path / "cpu.stat").read_text())
            return stat["user_usec"] / 1e6, stat["system_usec"] / 1e6
        except (OSError, KeyError, ValueError):
            return None

    def remove(self) -> bool:
        try:
            self.path.rmdir()
            return True
        except OSError:
            return False


def _keyed(text: str) -> dict[str, int]:
    return {k: int(v) for k, v in (line.split() for line in text.splitlines() if line.strip())}


def _candidate_parents(root: Path) -> list[tuple[int, Path]]:
    """This process's own cgroups that can count CPU: v1 cpuacct first, then the v2 one."""
    found: list[tuple[int, Path]] = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        rel = rel.lstrip("/")
        if "cpuacct" in controllers.split(","):
            for mount in ("cpuacct", "cpu,cpuacct", "cpuacct,cpu"):
                if (root / mount / "cpuacct.usage").exists():
                    found.insert(0, (1, root / mount / rel))
                    break
        elif controllers == "":
            for mount in (root / "unified", root):
                if (mount / "cgroup.procs").exists() and (mount / "cgroup.subtree_control").exists():
                    found.append((2, mount / rel))
                    break
    return found


def _reap(proc: subprocess.Popen, group: CpuCgroup | None) -> int | None:
    """Wait for CMD, then for every descendant still running; CMD's exit status."""
    status = None
    while True:
        try:
            pid, raw = os.wait()
        except ChildProcessError:
            break
        if pid == proc.pid:
            status = os.waitstatus_to_exitcode(raw)
            proc.returncode = status
            break
    deadline = time.monotonic() + REAP_GRACE_S
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            pid = -1
        if pid == -1 and not (group and group.pids()):
            return status
        if pid <= 0:
            time.sleep(0.05)
    left = group.pids() if group else []
    print(f"reap: descendants still running after the command exited (left running): {left or '?'}",
          file=sys.stderr)
    return status


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print("reap: prctl(PR_SET_CHILD_SUBREAPER) failed: orphans are not in rusage", file=sys.stderr)
    group = CpuCgroup.make(f"padcap-reap-{os.getpid()}")
    if group is None:
        print("reap: no writable CPU cgroup: only the rusage count (a lower bound)", file=sys.stderr)
    start = time.monotonic()
    try:
        proc = subprocess.Popen(argv, preexec_fn=group.enter if group else None)
    except subprocess.SubprocessError as err:  # the group refused the move (a v2 tree's rules)
        print(f"reap: cannot start in the CPU cgroup ({err}): only the rusage count", file=sys.stderr)
        group.remove()
        group, proc = None, subprocess.Popen(argv)
    status = _reap(proc, group)
    wall = time.monotonic() - start
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    lines = [_line("rusage (lower bound)", wall, ru.ru_utime, ru.ru_stime)]
    if group is not None:
        cpu = group.cpu_s()
        if cpu is not None:
            lines.append(_line(f"cgroup v{group.version} (every descendant)", wall, *cpu))
        group.remove()
    print("\n".join(lines), file=sys.stderr)
    return 1 if status is None else (status if status >= 0 else 128 - status)


def _line(source: str, wall: float, user: float, sys_: float) -> str:
    cpu = user + sys_
    return (f"reap: wall {wall:.1f}s, user {user:.1f}s + sys {sys_:.1f}s = {cpu:.1f}s of CPU "
            f"[{source}], wall/CPU {wall / max(cpu, 1e-9):.2f}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
