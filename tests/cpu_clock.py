"""Where the suite waits: each test's wall time beside the machine's busy CPU time over it.

`.ci/reap.py` gives the suite's wall/CPU as one number; this says which tests it comes from.
CPU is read machine-wide from /proc/stat (user + nice + system + irq + softirq; not steal, the
hypervisor's time given to other guests), so Ray's
raylets, GCS and workers, which are not this process's children, are counted; on a box running
nothing else that is the suite's own CPU. A test's time includes its fixtures' set-up and
tear-down (a module's Ray cluster start-up is charged to its first test). Linux only: elsewhere
nothing is recorded.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

_STAT = Path("/proc/stat")
_BUSY_FIELDS = (0, 1, 2, 5, 6)  # user nice system [idle iowait] irq softirq (not steal)


def busy_cpu_s() -> float | None:
    """Seconds of CPU the whole machine has spent busy since boot, or None without /proc/stat."""
    try:
        fields = _STAT.read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    ticks = sum(int(fields[i]) for i in _BUSY_FIELDS if i < len(fields))
    return ticks / os.sysconf("SC_CLK_TCK")


@dataclass
class CpuClock:
    """Per-test (wall s, busy CPU s), and the session's totals."""

    tests: dict[str, tuple[float, float]] = field(default_factory=dict)
    start: tuple[float, float] | None = None

    def now(self) -> tuple[float, float] | None:
        cpu = busy_cpu_s()
        return None if cpu is None else (time.monotonic(), cpu)

    def record(self, nodeid: str, before: tuple[float, float] | None) -> None:
        after = self.now()
        if before is not None and after is not None:
            self.tests[nodeid] = (after[0] - before[0], after[1] - before[1])

    def summary(self, top: int = 10) -> list[str]:
        """Lines for the terminal: the session's wall/CPU and the tests that waited longest."""
        end = self.now()
        if self.start is None or end is None or not self.tests:
            return []
        wall, cpu = end[0] - self.start[0], end[1] - self.start[1]
        modules: dict[str, tuple[float, float]] = {}
        for nodeid, (w, c) in self.tests.items():
            mw, mc = modules.get(nodeid.split("::", 1)[0], (0.0, 0.0))
            modules[nodeid.split("::", 1)[0]] = (mw + w, mc + c)
        total_wait = sum(max(w - c, 0.0) for w, c in self.tests.values())
        return [f"session: wall {wall:.1f}s, machine busy CPU {cpu:.1f}s, "
                f"wall/CPU {wall / max(cpu, 1e-9):.2f}",
                f"the {top} tests with the most wall time not matched by CPU (wall - CPU):",
                "  wait s   wall s    CPU s  test",
                *_most_waiting(self.tests, top),
                "the 5 modules with the most wall time not matched by CPU:",
                *_most_waiting(modules, 5),
                f"waiting summed over tests (where wall > CPU): {total_wait:.1f}s"]


def _most_waiting(times: dict[str, tuple[float, float]], n: int) -> list[str]:
    """The n entries of {name: (wall s, CPU s)} with the largest wall - CPU, one table row each."""
    ranked = sorted(times.items(), key=lambda kv: kv[1][1] - kv[1][0])[:n]
    return [f"{w - c:8.1f} {w:8.1f} {c:8.1f}  {name}" for name, (w, c) in ranked]
