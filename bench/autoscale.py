"""Serve autoscaling, measured on a simulated multi-node cluster (127.0.0.1 only, bounded in time).

    flock /work/helpers/ray.lock nice -n 10 .venv/bin/python -m bench.autoscale [--clients 6] [--load-s 40]
        [--out bench/results/autoscale.json]      # + autoscale.png beside it

A head, two CPU nodes and one "GPU" node (bench/sim_cluster.py); the endpoint
(`infer.serving.deployment:app_builder`, the tiny random-init model) with its replicas on the GPU node.
Phases, in order:

1. idle: `min_replicas` replicas.
2. load: `--clients` closed-loop clients (each sends its next request when the last one is
   answered; a 503 is retried after a short pause, as clients are told to) for `--load-s`.
3. cool-down: no requests until the replica count is back at `min_replicas` (bounded).
4. burst: `--burst` requests at once, more than `max_ongoing_requests * replicas +
   max_queued_requests`: the ones over the limit must get 503 at once (no retry here).

A sampler thread records the running replicas (`serve.status()`) every `--interval` s.
The report (JSON) has the timeline, per-second request rate and p50/p99 latency, the
time from the start of the load to the first upscale and to `max_replicas`, the time from
its end back to `min_replicas` (to compare with upscale_delay_s / downscale_delay_s),
and the counts: accepted, completed, refused (503), failed (other status), lost (no
answer). The PNG plots replicas next to request rate and latency.
`tests/test_cluster_sim.py` runs a small bounded version of the same phases.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import requests

from bench import sim_cluster  # (sets the 127.0.0.1 variables before ray is imported)

ROOT = Path(__file__).resolve().parents[1]

RETRY_PAUSE_S = 0.2


@dataclass
class Request:
    """One logical request: when it was sent and answered (relative to the run's start)."""

    phase: str
    t_sent: float
    t_done: float
    status: int | None  # the final status; None: no answer (connection error, timeout)
    attempts: int  # retried answers (infer.serving.client.should_retry) count as extra attempts
    lost_replica_retries: int = 0  # of those, Ray Serve's own 5xx: the replica died with the request
    dropped_retries: int = 0  # of those, connections the server closed without an answer


DROPPED = -1  # post_full's status for a connection closed without an answer


def post(url: str, video: str, timeout: float) -> int | None:
    status = post_full(url, video, timeout)[0]
    return None if status == DROPPED else status


def post_full(url: str, video: str, timeout: float) -> tuple[int | None, Any]:
    """(status, JSON body or None); status None: no answer in `timeout` (or no connection),
    DROPPED: the server closed the connection without answering."""
    try:
        r = requests.post(f"{url}/v1/captions", json={"video": video}, timeout=timeout)
    except requests.ConnectionError as e:
        dropped = "RemoteDisconnected" in repr(e) or "Connection reset" in repr(e) or "aborted" in repr(e)
        return (DROPPED if dropped else None), None
    except requests.RequestException:
        return None, None
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, None


def caption_with_retry(url: str, video: str, timeout: float, deadline: float) -> tuple[int | None, int, int, int]:
    """POST until the answer is not one `infer.serving.client.should_retry` names, nor a connection the
    server dropped (or `deadline`, monotonic, passes) -> (status, attempts, retries after Ray
    Serve's own 5xx, retries after a dropped connection)."""
    from infer.serving.client import should_retry

    attempts = lost = dropped = 0
    while True:
        attempts += 1
        status, body = post_full(url, video, timeout)
        again = status == DROPPED or (status is not None and should_retry(status, body))
        if not again or time.monotonic() > deadline:
            return (None if status == DROPPED else status), attempts, lost, dropped
        lost += status not in (503, DROPPED)
        dropped += status == DROPPED
        time.sleep(RETRY_PAUSE_S)


class ReplicaSampler(threading.Thread):
    """Samples (t, running replicas) of one deployment every `interval` s until stopped, and
    `decisions`: (t, running + starting), which moves as soon as the autoscaler decides."""

    def __init__(self, app: str, deployment: str, t0: float, interval: float = 0.5):
        super().__init__(daemon=True)
        self.app, self.deployment, self.t0, self.interval = app, deployment, t0, interval
        self.samples: list[tuple[float, int]] = []
        self.decisions: list[tuple[float, int]] = []
        self._halt = threading.Event()

    def states(self) -> dict[str, int] | None:
        from ray import serve

        try:
            dep = serve.status().applications[self.app].deployments[self.deployment]
        except Exception:  # the controller is busy or the app is (re)deploying: skip this sample
            return None
        return {str(k): int(v) for k, v in dep.replica_states.items()}

    def run(self) -> None:
        while not self._halt.is_set():
            states = self.states()
            if states is not None:
                t = round(time.monotonic() - self.t0, 2)
                self.samples.append((t, states.get("RUNNING", 0)))
                self.decisions.append((t, states.get("RUNNING", 0) + states.get("STARTING", 0)))
            self._halt.wait(self.interval)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=10)

    def last(self) -> int:
        return self.samples[-1][1] if self.samples else -1


def closed_loop(url: str, video: str, clients: int, seconds: float, t0: float, timeout: float,
                until: Callable[[], bool] | None = None, out: list[Request] | None = None) -> list[Request]:
    """`clients` threads, each sending its next request when the last one is answered, for `seconds`
    at most; with `until`, each stops sending once `until()` holds (checked before every request).
    Answered requests are appended to `out` (a fresh list unless given) as they come, so a caller
    on another thread can wait on them; returns that list."""
    out = [] if out is None else out
    lock = threading.Lock()
    stop_at = time.monotonic() + seconds

    def client() -> None:
        while time.monotonic() < stop_at and not (until is not None and until()):
            sent = time.monotonic()
            status, attempts, lost, dropped = caption_with_retry(url, video, timeout, deadline=sent + timeout)
            with lock:
                out.append(Request("load", sent - t0, time.monotonic() - t0, status, attempts, lost, dropped))

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def burst(url: str, video: str, n: int, t0: float, timeout: float) -> list[Request]:
    """`n` requests sent at once, no retries: those over the queue limit must be refused at once."""
    out: list[Request | None] = [None] * n
    go = threading.Barrier(n)

    def one(i: int) -> None:
        go.wait()
        sent = time.monotonic()
        status = post(url, video, timeout)
        out[i] = Request("burst", sent - t0, time.monotonic() - t0, status, 1)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [r for r in out if r is not None]


def wait_replicas(sampler: ReplicaSampler, want: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sampler.last() == want:
            return True
        time.sleep(sampler.interval)
    return False


def held_at(sampler: ReplicaSampler, want: int, hold_s: float) -> bool:
    """True once the sampler's running-replica count has been `want` for the last `hold_s` seconds
    (the new replica is up and has had time to take requests)."""
    samples = list(sampler.samples)
    if not samples or samples[-1][1] != want:
        return False
    since = next((t for t, n in reversed(samples) if n != want), None)
    first_at = next(t for t, n in samples if n == want) if since is None else since
    return samples[-1][0] - first_at >= hold_s


def first_time(samples: list[tuple[float, int]], after: float, pred) -> float | None:
    return next((t for t, n in samples if t >= after and pred(n)), None)


def per_second(requests_: list[Request], t_end: float) -> list[dict[str, Any]]:
    """Per 1 s bin (by answer time): answered requests, and p50/p99 latency of the 200s in it."""
    rows = []
    for b in range(int(np.ceil(t_end))):
        done = [r for r in requests_ if b <= r.t_done < b + 1]
        lat = [r.t_done - r.t_sent for r in done if r.status == 200]
        rows.append({"t": b, "answered": len(done), "ok": len(lat),
                     "p50_s": round(float(np.percentile(lat, 50)), 3) if lat else None,
                     "p99_s": round(float(np.percentile(lat, 99)), 3) if lat else None})
    return rows


def summarize(load: list[Request], bursts: list[Request], samples: list[tuple[float, int]], phases: dict[str, float],
              serve_cfg: dict[str, Any], decisions: list[tuple[float, int]] | None = None) -> dict[str, Any]:
    """The report's numbers: scaling times against the configured delays, counts, latencies.
    `samples`: (t, running replicas); `decisions`: (t, running + starting)."""
    lo, hi = serve_cfg["min_replicas"], serve_cfg["max_replicas"]
    decided_up = first_time(decisions or [], phases["load_start"], lambda n: n > lo)
    up_first = first_time(samples, phases["load_start"], lambda n: n > lo)
    up_max = first_time(samples, phases["load_start"], lambda n: n >= hi)
    down = first_time(samples, phases["load_end"], lambda n: n <= lo)
    ok_lat = [r.t_done - r.t_sent for r in load if r.status == 200]
    burst_ok = [r.t_done - r.t_sent for r in bursts if r.status == 200]
    burst_503 = [r.t_done - r.t_sent for r in bursts if r.status == 503]

    def since(t, start):
        return None if t is None else round(t - start, 2)

    return {
        "serve": serve_cfg,
        "phases_s": {k: round(v, 2) for k, v in phases.items()},
        "replicas_at_load_start": next((n for t, n in reversed(samples) if t <= phases["load_start"]), None),
        "peak_replicas": max((n for _, n in samples), default=0),
        "upscale_decided_after_load_start_s": since(decided_up, phases["load_start"]),
        "first_upscale_after_load_start_s": since(up_first, phases["load_start"]),
        "max_replicas_after_load_start_s": since(up_max, phases["load_start"]),
        "back_to_min_after_load_end_s": since(down, phases["load_end"]),
        "load": {"requests": len(load), "completed_200": sum(r.status == 200 for r in load),
                 "failed": sum(r.status not in (200, None) for r in load), "lost": sum(r.status is None for r in load),
                 "retried_attempts": sum(r.attempts - 1 for r in load),
                 "retried_after_lost_replica": sum(r.lost_replica_retries for r in load),
                 "retried_after_dropped_connection": sum(r.dropped_retries for r in load),
                 "requests_per_s": round(len(ok_lat) / max(1e-9, phases["load_end"] - phases["load_start"]), 3),
                 "p50_latency_s": round(float(np.percentile(ok_lat, 50)), 3) if ok_lat else None,
                 "p99_latency_s": round(float(np.percentile(ok_lat, 99)), 3) if ok_lat else None},
        "burst": {"requests": len(bursts), "completed_200": len(burst_ok), "refused_503": len(burst_503),
                  "other": sum(r.status not in (200, 503) for r in bursts),
                  "max_503_latency_s": round(max(burst_503), 3) if burst_503 else None,
                  "min_200_latency_s": round(min(burst_ok), 3) if burst_ok else None},
    }


def run_phases(url: str, video: str, app: str, deployment: str, serve_cfg: dict[str, Any], clients: int, load_s: float,
               burst_n: int, idle_s: float = 2.0, cooldown_max_s: float = 60.0, interval: float = 0.5,
               timeout: float = 120.0, hold_max_s: float | None = None) -> dict[str, Any]:
    """The four phases against a running app; returns the report (numbers, timeline, requests).

    The load lasts `load_s`; with `hold_max_s` it instead lasts until the controller has scaled
    to `max_replicas` and held there for `hold_max_s` (running), with `load_s` only as the
    deadline: what a test on a box of unknown speed waits on, instead of a fixed window."""
    t0 = time.monotonic()
    sampler = ReplicaSampler(app, deployment, t0, interval)
    sampler.start()
    until = None if hold_max_s is None else (lambda: held_at(sampler, serve_cfg["max_replicas"], hold_max_s))
    try:
        time.sleep(idle_s)
        phases = {"load_start": time.monotonic() - t0}
        load = closed_loop(url, video, clients, load_s, t0, timeout, until=until)
        phases["load_end"] = time.monotonic() - t0
        wait_replicas(sampler, serve_cfg["min_replicas"], cooldown_max_s)
        phases["burst_start"] = time.monotonic() - t0
        bursts = burst(url, video, burst_n, t0, timeout)
        phases["end"] = time.monotonic() - t0
    finally:
        sampler.stop()
    report = summarize(load, bursts, sampler.samples, phases, serve_cfg, sampler.decisions)
    report["timeline"] = {"replicas": sampler.samples, "replicas_incl_starting": sampler.decisions,
                          "per_second": per_second(load + bursts, phases["end"])}
    report["requests"] = [asdict(r) for r in load + bursts]
    return report


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reps = report["timeline"]["replicas"]
    bins = report["timeline"]["per_second"]
    ph = report["phases_s"]
    fig, axes = plt.subplots(3, 1, figsize=(9, 7), sharex=True)
    wanted = report["timeline"]["replicas_incl_starting"]
    axes[0].step([t for t, _ in wanted], [n for _, n in wanted], where="post", linestyle="--", label="running + starting")
    axes[0].step([t for t, _ in reps], [n for _, n in reps], where="post", label="running")
    axes[0].legend(loc="upper right")
    axes[0].set(ylabel="running replicas", title="Serve autoscaling on a simulated cluster (1 'GPU' node)",
                ylim=(0, report["serve"]["max_replicas"] + 0.5))
    axes[1].bar([b["t"] + 0.5 for b in bins], [b["ok"] for b in bins], width=0.9, label="200")
    axes[1].bar([b["t"] + 0.5 for b in bins], [b["answered"] - b["ok"] for b in bins], width=0.9,
                bottom=[b["ok"] for b in bins], label="refused / failed")
    axes[1].set(ylabel="answered / s")
    axes[1].legend(loc="upper right")
    for key, style in (("p50_s", "o-"), ("p99_s", "s--")):
        pts = [(b["t"] + 0.5, b[key]) for b in bins if b[key] is not None]
        axes[2].plot([p[0] for p in pts], [p[1] for p in pts], style, label=key[:3], markersize=3)
    axes[2].set(ylabel="latency (s)", xlabel="seconds since start")
    axes[2].legend(loc="upper right")
    for ax in axes:
        for k in ("load_start", "load_end", "burst_start"):
            ax.axvline(ph[k], color="grey", linestyle=":", linewidth=1)
        ax.grid(alpha=0.3)
    for k, label in (("load_start", "load"), ("load_end", "load ends"), ("burst_start", "burst")):
        axes[0].text(ph[k], 0.2, " " + label, fontsize=8, color="grey")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def wait_healthy(url: str, timeout: float) -> None:
    """Poll `url`/healthz until it answers 200, or fail after `timeout` seconds."""
    end = time.time() + timeout
    while True:
        try:
            if requests.get(f"{url}/healthz", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        if time.time() > end:
            raise TimeoutError(f"{url} not healthy after {timeout} s")
        time.sleep(0.2)


def deploy(cfg, app: str = "padcap") -> tuple[str, str]:
    """Start Serve on 127.0.0.1 (a free port) and run the endpoint for `cfg` -> (url, deployment name)."""
    from ray import serve

    from infer.loading import RANDOM_MODEL
    from infer.serving.deployment import build_application

    port = sim_cluster.free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_application(cfg, RANDOM_MODEL), name=app, route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, 180)
    return url, "PadCaptioner"


def autoscale_config(video_root: str, overrides: list[str]):
    """The endpoint config of this bench: sim-cluster resource names, replicas on the 'GPU' node."""
    from pipeline.config import load_config
    return load_config(ROOT / "cluster/configs/default.yaml", [
        *sim_cluster.SIM_OVERRIDES, f"serve.allowed_roots=[{video_root}]", "serve.num_gpus_per_replica=1",
        "serve.num_cpus_per_replica=0.5", "serve.min_replicas=1", "serve.max_replicas=2",
        "serve.target_ongoing_requests=1", "serve.max_ongoing_requests=2", "serve.max_queued_requests=4",
        "serve.upscale_delay_s=2", "serve.downscale_delay_s=5", "serve.look_back_period_s=2",
        "serve.metrics_interval_s=0.5",
        "infer.max_events=4", "infer.max_branch_tokens=8", *overrides])


def serve_numbers(cfg) -> dict[str, Any]:
    sc = cfg.serve
    keys = ("min_replicas", "max_replicas", "target_ongoing_requests", "max_ongoing_requests", "max_queued_requests",
            "upscale_delay_s", "downscale_delay_s", "look_back_period_s", "metrics_interval_s", "num_gpus_per_replica")
    return {k: getattr(sc, k) for k in keys} | {"gpu_resource": cfg.cluster.gpu_resource}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--load-s", type=float, default=40.0)
    ap.add_argument("--burst", type=int, default=20)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--out", default=str(ROOT / "bench/results/autoscale.json"))
    args = ap.parse_args(argv)

    from ray import serve

    from pipeline.config import SyntheticConfig
    from preprocess.synthetic import generate_corpus

    work = Path(tempfile.mkdtemp(prefix="padcap-bench-autoscale-"))
    info = generate_corpus(work / "corpus", SyntheticConfig(num_videos=1, min_duration=10.0, max_duration=10.0, seed=7,
                                                            num_workers=1), progress=False)
    video = next(iter(info.videos.values()))
    cfg = autoscale_config(str(work), args.overrides)
    sim = sim_cluster.SimCluster.start()
    try:
        url, deployment = deploy(cfg)
        for _ in range(2):  # warm-up: encoders, engine caches
            assert post(url, video, 120) == 200
        report = run_phases(url, video, "padcap", deployment, serve_numbers(cfg), args.clients, args.load_s, args.burst)
        report["replica_node_kinds"] = sorted(sim.kinds_of(sim_cluster.actor_nodes("ServeReplica")))
        serve.shutdown()
    finally:
        sim.shutdown()
    report["bench"] = "autoscale"
    report["clients"] = args.clients
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    plot(report, out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in report.items() if k not in ("timeline", "requests")}, indent=2))
    load, b = report["load"], report["burst"]
    ok = load["failed"] == load["lost"] == 0 and b["refused_503"] > 0 and b["other"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
