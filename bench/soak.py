"""A long mixed soak of the Ray Serve captioning endpoint on 127.0.0.1 (the tiny random-init model).

    flock /tmp/ray.lock .venv/bin/python -m bench.soak [--duration-s 1800] [--sample-s 60]
        [--kill-replica-at S] [--out bench/results/soak.json]        # + soak.png beside it

Starts a local Ray + Serve app exactly as the serving integration tests do
(`infer.serving.deployment:app_builder` on a preset from bench/serve_cases.py
`serve_test_config`, the random tiny model asked for by name; uploads spooled to a directory of the run's own), then runs
the mixed traffic of bench/soak_traffic.py (Locust as a library, in its own process) for
`--duration-s`: good requests by URI and by upload, the serving tests' hostile requests, client
disconnects mid-upload and mid-decode, requests cancelled by the client's timeout, oversized
bodies, bursts above the queue limit. Every `--sample-s` (a minute by default) it records, per
replica process: RSS, open file descriptors, live decode workers (its child processes); the temp
files under the upload spool; the KV pages in use and the requests in flight (each replica's
/healthz); decode workers left running by a replica that is gone. When the traffic stops it waits
for the replicas to be idle and samples once more.

`--kill-replica-at S` (two replicas): at S seconds one replica process is killed (SIGKILL);
requests in flight on it must get an error the client can retry (infer/serving/client.py
`should_retry`), the others none; Serve must start a replacement and the later minutes must
look like the earlier ones.

The API has no client-requested timeout, so a 504 is never expected: a client that stops
waiting closes its connection, which cancels its request on the replica (counted as `aborted`).
The report (bench/soak_report.py) is written as JSON to `--out`; exit status 0 when every target
holds (`targets`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

for _k, _v in {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}.items():
    os.environ.setdefault(_k, _v)  # a local instance on 127.0.0.1, as tests/conftest.py starts one

from bench.serve_cases import free_port, make_video_tree, send, serve_test_config, wait_healthy  # noqa: E402
from bench.soak_report import plot, summarize  # noqa: E402

APP = "soak"
MAX_ONGOING, MAX_QUEUED = 2, 2  # small limits: the bursts cross them
GROWTH_LIMIT = 0.05


def replica_procs() -> list:
    """This soak's replica processes: Ray titles them ray::ServeReplica:<app>:<deployment>; only
    this process's descendants (its Ray instance's workers), not another run's on the same machine."""
    import psutil

    out = []
    for p in psutil.Process(os.getpid()).children(recursive=True):
        try:
            if f"ServeReplica:{APP}:" in " ".join(p.cmdline()):
                out.append(p)
        except psutil.Error:
            continue
    return out


def _decode_workers(proc) -> list:
    import psutil

    try:
        return [c for c in proc.children(recursive=True) if "spawn_main" in " ".join(c.cmdline()) and
                "resource_tracker" not in " ".join(c.cmdline())]
    except psutil.Error:
        return []


class Sampler:
    """Samples the replicas: psutil for what the OS sees, /healthz for what each replica holds."""

    def __init__(self, url: str, spool: Path):
        self.url, self.spool = url, spool
        self.worker_pids: set[int] = set()  # every decode worker seen: one alive without its replica is an orphan

    def health(self, pids: set[int], tries: int) -> dict[int, dict[str, Any]]:
        """Each replica's /healthz resources (Serve routes each call to some replica: ask until every pid answered)."""
        seen: dict[int, dict[str, Any]] = {}
        for _ in range(tries):
            try:
                status, body, _ = send(self.url, "GET", "/healthz", timeout=10)
            except OSError:
                continue
            if status == 200 and isinstance(body, dict) and "resources" in body:
                seen[body["resources"]["pid"]] = body["resources"]
            if pids <= set(seen):
                break
        return seen

    def sample(self, t_start: float, phase: str, health_tries: int) -> dict[str, Any]:
        import psutil

        replicas, live = [], set()
        for p in replica_procs():
            try:
                workers = _decode_workers(p)
                self.worker_pids.update(w.pid for w in workers)
                replicas.append({"pid": p.pid, "rss_mb": round(p.memory_info().rss / 2**20, 1), "fds": p.num_fds(),
                                 "decode_workers": len(workers),
                                 "workers_rss_mb": round(sum(w.memory_info().rss for w in workers) / 2**20, 1)})
                live.update(w.pid for w in workers)
            except psutil.Error:
                continue
        orphans = [pid for pid in self.worker_pids - live if psutil.pid_exists(pid) and
                   psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
        health = self.health({r["pid"] for r in replicas}, health_tries)
        return {"t": time.time(), "t_s": round(time.time() - t_start, 1), "phase": phase, "replicas": replicas,
                "load_avg_1min": round(os.getloadavg()[0], 2),  # the box's load: other work slows the soak too
                "temp_files": sum(1 for f in self.spool.rglob("*") if f.is_file()),
                "kv_pages_in_use": {str(pid): h["kv_pages_in_use"] for pid, h in health.items()},
                "in_flight": {str(pid): h["in_flight"] for pid, h in health.items()},
                "health_decode_workers": {str(pid): h["decode_workers"] for pid, h in health.items()},
                "orphan_workers": len(orphans)}


def start_endpoint(work: Path, replicas: int, num_cpus: int) -> tuple[str, Path, Path]:
    """Ray + the Serve app on 127.0.0.1 (as tests/test_serve_integration.py builds it) -> (url, tree.json, spool)."""
    import ray
    import yaml
    from ray import serve

    from bench.serve_engine import synthetic_videos
    from infer.loading import RANDOM_MODEL
    from infer.serving.deployment import app_builder

    tree = make_video_tree(work, synthetic_videos(work / "corpus")[0])
    spool = work / "spool"
    spool.mkdir(exist_ok=True)
    cfg = serve_test_config(tree, min_replicas=replicas, max_replicas=replicas, max_ongoing_requests=MAX_ONGOING,
                            max_queued_requests=MAX_QUEUED, num_cpus_per_replica=0.5, upload_dir=str(spool))
    preset = work / "soak.yaml"
    preset.write_text(yaml.safe_dump(cfg.to_dict()))
    tree_json = work / "tree.json"
    tree_json.write_text(json.dumps({"root": str(tree.root), "outside": str(tree.outside), "good": str(tree.good),
                                     "files": {k: str(v) for k, v in tree.files.items()}}))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, configure_logging=False, log_to_driver=False,
             _node_ip_address="127.0.0.1")
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(app_builder({"config": str(preset), "model_dir": RANDOM_MODEL}), name=APP, route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, 300)
    return url, tree_json, spool


def soak(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    replicas = 2 if args.kill_replica_at is not None else args.replicas
    url, tree_json, spool = start_endpoint(work, replicas, args.num_cpus)
    tree = json.loads(tree_json.read_text())
    for _ in range(2 * replicas):  # warm-up: encoders, engine, first-call costs, on each replica
        status, body, _ = send(url, "POST", "/v1/captions", json.dumps({"video": tree["good"]}).encode(),
                               {"Content-Type": "application/json"}, timeout=300)
        if status != 200:
            raise RuntimeError(f"warm-up request failed: {status} {body}")
    sampler = Sampler(url, spool)
    records = work / "records.jsonl"
    cmd = [sys.executable, "-m", "bench.soak_traffic", "--url", url, "--tree", str(tree_json),
           "--duration-s", str(args.duration_s), "--out", str(records), "--good-users", str(args.good_users),
           "--burst-every-s", str(args.burst_every_s), "--burst-size", str(args.burst_size)]
    t_start = time.time()
    load = subprocess.Popen(cmd, env=os.environ.copy(), cwd=ROOT)
    samples, kill, next_sample = [], {}, t_start + args.sample_s
    try:
        while load.poll() is None:
            time.sleep(1.0)
            now = time.time()
            if args.kill_replica_at is not None and not kill and now - t_start >= args.kill_replica_at:
                kill = kill_busy_replica(url)
            if kill and "replica_back_s" not in kill:
                pids = {p.pid for p in replica_procs()}
                if len(pids) >= replicas and kill["killed_pid"] not in pids:
                    kill["replica_back_s"] = round(time.time() - kill["t"], 1)
            if now >= next_sample:
                samples.append(sampler.sample(t_start, "load", health_tries=8))
                next_sample += args.sample_s
    finally:
        if load.poll() is None:
            load.kill()
    t_end = time.time()
    samples.append(sampler.sample(t_start, "load", health_tries=8))
    idle = _wait_idle(sampler, t_start, args.idle_timeout_s)
    samples.append(idle)
    recs = [json.loads(line) for line in records.read_text().splitlines() if line.strip()]
    meta = {"t_start": t_start, "t_end": t_end, "kill_t": kill.get("t"), "sample_s": args.sample_s, "replicas": replicas,
            "kill_at_s": round(kill["t"] - t_start, 1) if kill else None, "killed_pid": kill.get("killed_pid"),
            "killed_while_busy": kill.get("killed_while_busy"),
            "replica_back_s": kill.get("replica_back_s"), "load_exit_code": load.returncode,
            "serve": {"max_ongoing_requests": MAX_ONGOING, "max_queued_requests": MAX_QUEUED,
                      "queue_limit": MAX_ONGOING * replicas + MAX_QUEUED, "burst_size": args.burst_size,
                      "burst_every_s": args.burst_every_s, "good_users": args.good_users},
            "load_tool": _locust_version(),
            "timeout_policy": "the API has no client-requested timeout: no 504 is expected; a client's own timeout "
                              "closes its connection and the replica cancels the request (counted as aborted)",
            "idle_sample": {k: idle[k] for k in ("t_s", "temp_files", "kv_pages_in_use", "in_flight", "orphan_workers")}}
    return summarize(recs, samples, meta)


def kill_busy_replica(url: str, within_s: float = 15.0) -> dict[str, Any]:
    """SIGKILL a replica while it has a request in flight (its /healthz says so; the first replica
    if none is seen busy within `within_s`): its in-flight requests are what the variant is about."""
    pids = [p.pid for p in replica_procs()]
    victim, busy, deadline = pids[0], False, time.time() + within_s
    while time.time() < deadline:
        try:
            status, body, _ = send(url, "GET", "/healthz", timeout=5)
        except OSError:
            continue
        res = body.get("resources", {}) if status == 200 and isinstance(body, dict) else {}
        if res.get("in_flight", 0) > 0 and res.get("pid") in pids:
            victim, busy = res["pid"], True
            break
    os.kill(victim, signal.SIGKILL)
    return {"killed_pid": victim, "t": time.time(), "killed_while_busy": busy}


def _wait_idle(sampler: Sampler, t_start: float, timeout: float) -> dict[str, Any]:
    """Sample until every replica answers with nothing in flight (or `timeout`), then once more, idle."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        s = sampler.sample(t_start, "idle", health_tries=40)
        pids = {str(r["pid"]) for r in s["replicas"]}
        if pids and pids <= set(s["in_flight"]) and not any(s["in_flight"].values()):
            break
        time.sleep(2.0)
    time.sleep(2.0)  # a cancelled request's last clean-up (its temp file) runs after its task ends
    return sampler.sample(t_start, "idle", health_tries=40)


def _locust_version() -> str:
    out = subprocess.run([sys.executable, "-c", "import locust; print(locust.__version__)"], capture_output=True,
                         text=True, env={**os.environ, "LOCUST_SKIP_MONKEY_PATCH": "1"})
    return f"locust {out.stdout.strip() or '?'}"


def targets(report: dict[str, Any]) -> dict[str, bool]:
    t = {
        "no_server_errors": report["server_errors"] == 0,
        "every_request_answered_or_cancelled": report["unanswered"] == 0,
        "hostile_requests_get_their_4xx": report["hostile_wrong"] == 0,
        "rss_flat": report["rss_growth_last_20min"] is not None and report["rss_growth_last_20min"] <= GROWTH_LIMIT,
        "fds_flat": report["fd_growth_last_20min"] is not None and report["fd_growth_last_20min"] <= GROWTH_LIMIT,
        "no_temp_files_left": report["temp_files_left"] == 0,
        "no_kv_pages_left_idle": report["kv_pages_left_idle"] == 0,
        "no_orphan_decode_workers": report["orphan_workers_left"] == 0,
    }
    if report.get("kill_at_s") is not None:
        after = [r for r in report["per_minute"] if r["t_s"] > report["kill_at_s"] + 30]
        t["replica_back"] = report.get("replica_back_s") is not None
        t["later_minutes_serve"] = bool(after) and all(r["good_ok"] > 0 for r in after)
    return t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration-s", type=float, default=1800.0)
    ap.add_argument("--sample-s", type=float, default=60.0, help="sampling period (a minute; shorter for short runs)")
    ap.add_argument("--kill-replica-at", type=float, default=None, metavar="S", help="kill one of two replicas at S s")
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--good-users", type=int, default=2)
    ap.add_argument("--burst-every-s", type=float, default=30.0)
    ap.add_argument("--burst-size", type=int, default=0, help="requests per burst; 0 = the queue limit + 4")
    ap.add_argument("--num-cpus", type=int, default=2)
    ap.add_argument("--idle-timeout-s", type=float, default=120.0)
    ap.add_argument("--work-dir", default="")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "soak.json"))
    args = ap.parse_args(argv)
    if args.burst_size <= 0:
        args.burst_size = MAX_ONGOING * (2 if args.kill_replica_at is not None else args.replicas) + MAX_QUEUED + 4
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="padcap-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        report = soak(args, work)
    finally:
        import ray
        from ray import serve

        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
    report["targets"] = targets(report)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    plot(report, str(out.with_suffix(".png")))
    summary = {k: v for k, v in report.items() if k not in ("per_minute", "status_counts_by_kind")}
    print(json.dumps(summary, indent=1))
    return 0 if all(report["targets"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
