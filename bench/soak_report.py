"""The soak's numbers from its raw material: request records + server samples -> the report and a plot.

    report = summarize(records, samples, meta)    # the dict bench/soak.py writes as soak.json
    plot(report, "bench/results/soak.png")

records: one dict per request (bench/soak_traffic.py: t0, t1, kind, name, status, expected,
intended_abort, service_error). samples: one dict per sampling period (bench/soak.py: t,
replicas [{pid, rss_mb, fds, decode_workers}], temp_files, kv_pages_in_use, orphan_workers).
meta: t_start, t_end, kill_t (epoch s, or None), sample_s, kill_at_s, ... Pure python + numpy (matplotlib for the plot).

Classes of answers:
- server_errors: 500-599 other than 503 (back-pressure), except the retryable losses below;
- replica_lost: in the kill variant, requests in flight when the replica was killed that got the
  retryable error Ray Serve gives them (a 5xx without the service's error body, or a connection
  closed without an answer), counted apart and only within `LOST_WINDOW_S` of the kill;
- unanswered: requests without an answer that the client did not leave on purpose;
- hostile_wrong: hostile requests whose status is neither the 4xx they must get nor 503.

Growth of RSS and open file descriptors: per replica process, the median of the last third of
the window over the median of its first third, minus 1 (medians: one sample taken while a
request holds its decoded frames is not a trend); the window is the last 20 minutes, or the last
2/3 of a run shorter than 30 minutes (said in `growth_window`). The worst replica is reported.
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np

GOOD_KINDS = ("good_uri", "good_upload")
LOST_WINDOW_S = 30.0  # a kill's in-flight requests end within this


def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 4) if values else None


def _status_key(status: int | None) -> str:
    return "no_answer" if status is None else str(status)


def classify(rec: dict[str, Any], kill_t: float | None) -> str:
    """One of: ok, backpressure, refused, server_error, replica_lost, unanswered, aborted."""
    s = rec["status"]
    near_kill = kill_t is not None and rec["t0"] <= kill_t + 1.0 and rec["t1"] >= kill_t - 1.0 and rec["t1"] <= kill_t + LOST_WINDOW_S
    if s is None:
        if rec.get("intended_abort"):
            return "aborted"
        return "replica_lost" if near_kill else "unanswered"
    if s == 503:
        return "backpressure"
    if 500 <= s <= 599:
        return "replica_lost" if near_kill and not rec.get("service_error") else "server_error"
    return "ok" if s == 200 else "refused"


def growth(samples: list[dict[str, Any]], key: str, t_from: float) -> dict[str, float]:
    """Per replica pid: median(last third) / median(first third) - 1 of `key` over the samples at
    t >= t_from, from a replica's second sample after it first answered /healthz (a replacement
    replica's boot and first requests are its warm-up, not a trend)."""
    series: dict[int, list[float]] = collections.defaultdict(list)
    answered: dict[int, int] = collections.Counter()
    for s in samples:
        for r in s["replicas"]:
            if answered[r["pid"]] or str(r["pid"]) in s["kv_pages_in_use"]:
                answered[r["pid"]] += 1
            if s["t"] >= t_from and answered[r["pid"]] >= 2:
                series[r["pid"]].append(float(r[key]))
    out = {}
    for pid, vals in series.items():
        if len(vals) < 3:
            continue
        third = max(1, len(vals) // 3)
        first, last = float(np.median(vals[:third])), float(np.median(vals[-third:]))
        out[str(pid)] = round(last / first - 1.0, 4) if first > 0 else 0.0
    return out


def per_period(records: list[dict[str, Any]], samples: list[dict[str, Any]], t_start: float,
               kill_t: float | None) -> list[dict[str, Any]]:
    """For each sampling period: good-request latency, counts by status and by class, and the
    server sample taken at its end."""
    ends = [s for s in samples if s.get("phase") == "load"]
    if len(ends) >= 3 and ends[-1]["t"] - ends[-2]["t"] < (ends[-2]["t"] - ends[-3]["t"]) / 2:
        del ends[-2]  # the end-of-load sample came soon after a periodic one: one last, longer period
    rows, prev = [], t_start
    for s in ends:
        inside = [r for r in records if prev <= r["t1"] < s["t"]]
        good = [r["t1"] - r["t0"] for r in inside if r["kind"] in GOOD_KINDS and r["status"] == 200]
        rows.append({
            "t_s": round(s["t"] - t_start, 1),
            "good_p50_s": _pct(good, 50), "good_p99_s": _pct(good, 99), "good_ok": len(good),
            "status_counts": dict(collections.Counter(_status_key(r["status"]) for r in inside)),
            "classes": dict(collections.Counter(classify(r, kill_t) for r in inside)),
            "replicas": s["replicas"], "rss_mb_total": round(sum(r["rss_mb"] for r in s["replicas"]), 1),
            "fds_total": sum(r["fds"] for r in s["replicas"]), "temp_files": s["temp_files"],
            "kv_pages_in_use": s["kv_pages_in_use"], "decode_workers": sum(r["decode_workers"] for r in s["replicas"]),
            "orphan_workers": s["orphan_workers"], "load_avg_1min": s.get("load_avg_1min"),
        })
        prev = s["t"]
    return rows


def summarize(records: list[dict[str, Any]], samples: list[dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    t_start, t_end = meta["t_start"], meta["t_end"]
    duration = t_end - t_start
    kill_t = meta.get("kill_t")  # epoch seconds of the kill, or None
    classes = collections.Counter(classify(r, kill_t) for r in records)
    window = 1200.0 if duration >= 1800 else duration * 2 / 3
    t_from = t_end - window
    load = [s for s in samples if s.get("phase") == "load"]
    rss, fds = growth(load, "rss_mb", t_from), growth(load, "fds", t_from)
    idle = next((s for s in reversed(samples) if s.get("phase") == "idle"), None)
    good = [r["t1"] - r["t0"] for r in records if r["kind"] in GOOD_KINDS and r["status"] == 200]
    hostile_wrong = [{"name": r["name"], "expected": r["expected"], "status": r["status"]} for r in records
                     if r["expected"] is not None and r["status"] not in (r["expected"], 503)
                     and classify(r, kill_t) != "replica_lost"]
    at_kill = collections.Counter(f"{_status_key(r['status'])}:{classify(r, kill_t)}" for r in records
                                  if kill_t is not None and r["t0"] < kill_t < r["t1"])
    by_kind = collections.defaultdict(collections.Counter)
    for r in records:
        by_kind[r["kind"]][_status_key(r["status"])] += 1
    report = {
        "duration_s": round(duration, 1),
        "requests": len(records),
        "status_counts": dict(sorted(collections.Counter(_status_key(r["status"]) for r in records).items())),
        "status_counts_by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
        "classes": dict(classes),
        "server_errors": classes["server_error"],
        "unanswered": classes["unanswered"],
        "replica_lost": classes["replica_lost"],
        "in_flight_at_kill": dict(at_kill),  # status:class of the requests open when the replica was killed
        "hostile_wrong": len(hostile_wrong), "hostile_wrong_examples": hostile_wrong[:10],
        "good_ok": len(good), "good_p50_s": _pct(good, 50), "good_p99_s": _pct(good, 99),
        "rss_growth_last_20min": max(rss.values()) if rss else None,
        "fd_growth_last_20min": max(fds.values()) if fds else None,
        "rss_growth_by_replica": rss, "fd_growth_by_replica": fds,
        "growth_window": {"seconds": round(window, 1), "rule": "last 20 min" if duration >= 1800 else
                          "run shorter than 30 min: the last 2/3 of the run",
                          "measure": "per replica, median of the window's last third / median of its first third - 1; worst replica"},
        "temp_files_left": idle["temp_files"] if idle else None,
        "kv_pages_left_idle": sum(idle["kv_pages_in_use"].values()) if idle else None,
        "in_flight_left_idle": sum(idle["in_flight"].values()) if idle else None,
        "decode_workers_idle": sum(r["decode_workers"] for r in idle["replicas"]) if idle else None,
        "orphan_workers_left": idle["orphan_workers"] if idle else None,
        "per_minute": per_period(records, samples, t_start, kill_t),
        **{k: v for k, v in meta.items() if k not in ("t_start", "t_end", "kill_t")},
    }
    return report


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["per_minute"]
    t = [r["t_s"] / 60 for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    a.plot(t, [r["good_p50_s"] for r in rows], "o-", label="p50")
    a.plot(t, [r["good_p99_s"] for r in rows], "s--", label="p99")
    a.set(xlabel="minutes", ylabel="seconds", title="good-request latency")
    a.legend()
    pids = sorted({rep["pid"] for r in rows for rep in r["replicas"]})
    for pid in pids:
        pts = [(r["t_s"] / 60, rep["rss_mb"]) for r in rows for rep in r["replicas"] if rep["pid"] == pid]
        b.plot(*zip(*pts), "o-", label=f"replica {pid}")
    b.set(xlabel="minutes", ylabel="MB", title="replica RSS")
    b.legend(fontsize=7)
    if report.get("kill_at_s") is not None:
        for ax in (a, b):
            ax.axvline(report["kill_at_s"] / 60, color="red", lw=0.8, ls=":")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
