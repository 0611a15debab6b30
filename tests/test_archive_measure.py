"""bench/archive_measure.py: the archive-scale bench's counts (pure functions, no Ray)."""

from __future__ import annotations

from bench import archive_measure as am
from bench.inflight import in_flight


def test_exactly_once_counts_lost_duplicated_and_unlisted():
    got = am.exactly_once(["a", "b", "c"], ["a", "a", "b", "z"])
    assert got == {"rows": 4, "lost": 1, "duplicated": 1, "unlisted": 1}


def test_tenths_are_measured_between_completions():
    times = [10.0 + i for i in range(100)]  # one a second from t=10: 60/min throughout
    assert am.tenths(times) == {"first_tenth": 60.0, "last_tenth": 60.0, "ratio": 1.0}
    slow_end = times[:90] + [100.0 + 2 * i for i in range(1, 11)]  # the last tenth at one per 2 s
    got = am.tenths(slow_end)
    assert got["first_tenth"] == 60.0 and got["ratio"] < 0.6
    assert am.tenths(range(19)) == {"first_tenth": None, "last_tenth": None, "ratio": None}


def test_error_reasons_elide_paths():
    rows = [{"status": "error", "error": "MediaError: zero-byte file: s3://b/x/a1.mp4"},
            {"status": "error", "error": "MediaError: zero-byte file: /tmp/v/a2.mp4"},
            {"status": "ok", "error": ""}]
    assert am.error_reasons(rows) == {"MediaError: zero-byte file: <path>": 2}


def test_rerun_redone_separates_committed_in_flight_and_retried_errors():
    got = am.rerun_redone(committed_ok={"a", "b"}, committed_error={"e"}, started_before={"a", "b", "c", "d", "e"},
                          started_after={"b", "c", "e", "f"})
    assert got == {"rerun_redone": 1, "in_flight_at_kill": 2, "redone_in_flight": 1, "retried_errors": 1}


def test_done_times_and_started_from_markers(tmp_path):
    with in_flight(tmp_path, "caption", ["v1", "v2"]):
        pass
    with in_flight(tmp_path, "caption", ["v3"], hold=""):
        pass
    assert am.started(str(tmp_path), "caption") == {"v1", "v2", "v3"}
    done = am.done_times(str(tmp_path), "caption")
    assert sorted(done) == ["v1", "v2", "v3"] and all(t > 0 for t in done.values())
