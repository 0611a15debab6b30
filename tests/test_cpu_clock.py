"""tests/cpu_clock.py: machine-wide busy CPU read from /proc/stat, and the waiting table."""

from __future__ import annotations

import sys
import time

import pytest

from tests.cpu_clock import CpuClock, busy_cpu_s

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/stat")


@linux_only
def test_busy_cpu_counts_work_done_on_the_machine():
    before = busy_cpu_s()
    own = time.process_time()
    x = 0
    while time.process_time() - own < 0.2:  # 0.2 s of this process's own CPU
        x += sum(range(10_000))
    # The machine-wide count holds at least this process's CPU (less a clock tick each end).
    assert busy_cpu_s() - before >= 0.2 - 0.05


def test_summary_orders_tests_by_wall_time_not_matched_by_cpu():
    clock = CpuClock(start=(0.0, 0.0))
    clock.tests = {"a::sleeps": (10.0, 1.0), "b::computes": (5.0, 9.0), "c::waits": (4.0, 0.5)}
    clock.now = lambda: (20.0, 10.5)  # type: ignore[method-assign]
    lines = clock.summary(top=2)
    assert lines[0] == "session: wall 20.0s, machine busy CPU 10.5s, wall/CPU 1.90"
    rows = [line.split()[-1] for line in lines[3:5]]
    assert rows == ["a::sleeps", "c::waits"]
    assert [line.split()[-1] for line in lines[6:9]] == ["a", "c", "b"]
    assert lines[-1] == "waiting summed over tests (where wall > CPU): 12.5s"


def test_nothing_is_recorded_without_a_reading():
    clock = CpuClock()
    clock.now = lambda: None  # type: ignore[method-assign]
    clock.record("x::y", None)
    assert clock.tests == {} and clock.summary() == []
