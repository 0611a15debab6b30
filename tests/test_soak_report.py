"""bench/soak_report.py's arithmetic on hand-made records and samples (no server)."""

from __future__ import annotations

from bench.soak_report import per_period


def sample(t: float) -> dict:
    return {"t": t, "phase": "load", "replicas": [{"rss_mb": 100.0, "fds": 10, "decode_workers": 2}],
            "temp_files": 0, "kv_pages_in_use": {}, "orphan_workers": 0}


def good(t1: float) -> dict:
    return {"t0": t1 - 0.1, "t1": t1, "kind": "good_uri", "status": 200}


def test_an_end_of_load_sample_soon_after_a_periodic_one_extends_the_last_period():
    records = [good(t + 0.5) for t in range(31)]  # one good answer each second, the last at 30.5 s
    periods = per_period(records, [sample(10.0), sample(20.0), sample(30.0), sample(31.0)], 0.0, None)
    assert [p["t_s"] for p in periods] == [10.0, 20.0, 31.0]  # not a 1-second period of its own
    assert [p["good_ok"] for p in periods] == [10, 10, 11]
    assert sum(p["good_ok"] for p in periods) == len(records)  # nothing dropped


def test_a_full_last_period_stays_its_own():
    records = [good(t + 0.5) for t in range(28)]
    periods = per_period(records, [sample(10.0), sample(20.0), sample(28.0)], 0.0, None)
    assert [p["t_s"] for p in periods] == [10.0, 20.0, 28.0] and [p["good_ok"] for p in periods] == [10, 10, 8]
