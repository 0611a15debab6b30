"""Closed-loop load test of the Ray Serve captioning endpoint on 127.0.0.1.

    flock /tmp/padcap-ray.lock .venv/bin/python -m bench.serve [--seconds 20] [--concurrency 1 4 16]
        [--config cluster/configs/default.yaml] [--model D] [--set k=v ...] [--upload] [--out runs/bench/serve.json]

Starts a local Ray + Serve app (infer.serving.deployment:app_builder; the default model is the tiny
random-init model), generates a synthetic video, then for each concurrency level
runs that many clients in a closed loop (each sends its next request when the
last one answers) for --seconds. Per level it reports requests/s, p50/p99
latency of the answered requests, and the counts of refused (503 back-pressure),
failed (any other status) and lost (no answer: connection error or timeout)
requests; below the queue limit (max_ongoing * replicas + max_queued) refused,
failed and lost must all be 0. Prints JSON (and writes it, plus a PNG, to --out).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import requests

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_level(url: str, video: str, concurrency: int, seconds: float, upload: bool, timeout: float) -> dict:
    """`concurrency` closed-loop clients for `seconds`; latencies of 200s, counts of the rest."""
    deadline = time.perf_counter() + seconds
    lock = threading.Lock()
    latencies: list[float] = []
    counts = {"ok": 0, "refused_503": 0, "failed": 0, "lost": 0}
    data = Path(video).read_bytes() if upload else b""

    def client() -> None:
        session = requests.Session()
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            try:
                if upload:
                    r = session.post(f"{url}/v1/captions", files={"file": ("v.mp4", data, "video/mp4")}, timeout=timeout)
                else:
                    r = session.post(f"{url}/v1/captions", json={"video": video}, timeout=timeout)
                status = r.status_code
            except requests.RequestException:
                status = None
            dt = time.perf_counter() - t0
            with lock:
                if status == 200:
                    counts["ok"] += 1
                    latencies.append(dt)
                elif status == 503:
                    counts["refused_503"] += 1
                elif status is None:
                    counts["lost"] += 1
                else:
                    counts["failed"] += 1

    t_start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t_start
    lat = np.asarray(latencies) if latencies else np.asarray([float("nan")])
    return {
        "concurrency": concurrency,
        "seconds": round(elapsed, 3),
        "requests": sum(counts.values()),
        **counts,
        "requests_per_s": round(counts["ok"] / elapsed, 3),
        "p50_latency_s": round(float(np.percentile(lat, 50)), 4),
        "p99_latency_s": round(float(np.percentile(lat, 99)), 4),
        "mean_latency_s": round(float(lat.mean()), 4),
    }


def _plot(levels: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = [lv["concurrency"] for lv in levels]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    a.plot(c, [lv["requests_per_s"] for lv in levels], "o-")
    a.set(xscale="log", xlabel="concurrent clients", ylabel="requests / s", title="throughput")
    b.plot(c, [lv["p50_latency_s"] for lv in levels], "o-", label="p50")
    b.plot(c, [lv["p99_latency_s"] for lv in levels], "s--", label="p99")
    b.set(xscale="log", xlabel="concurrent clients", ylabel="seconds", title="latency")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--config", default=str(ROOT / "cluster/configs/default.yaml"))
    ap.add_argument("--model", "--model-dir", dest="model_dir", default="random:tiny",
                    help="a trained model dir or a release checkpoint dir (default: a random tiny model)")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--upload", action="store_true", help="upload the video instead of naming it by URI")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--num-cpus", type=int, default=2)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)

    import ray
    from ray import serve

    from infer.serving.deployment import app_builder
    from pipeline.config import SyntheticConfig, load_config
    from preprocess.synthetic import generate_corpus

    work = Path(tempfile.mkdtemp(prefix="padcap-bench-serve-"))
    info = generate_corpus(work / "corpus", SyntheticConfig(num_videos=1, min_duration=20.0, max_duration=20.0, seed=7, num_workers=1),
                           progress=False)
    video = next(iter(info.videos.values()))
    overrides = [f"serve.allowed_roots=[{work}]", *args.overrides]
    cfg = load_config(args.config, overrides)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, configure_logging=False, log_to_driver=False)
    port = _free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(app_builder({"config": args.config, "model_dir": args.model_dir, "overrides": overrides}), name="bench", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        for _ in range(3):  # warm-up: encoders, engine caches, first-call costs
            r = requests.post(f"{url}/v1/captions", json={"video": video}, timeout=args.timeout)
            r.raise_for_status()
        sample = r.json()
        levels = []
        for c in args.concurrency:
            lv = run_level(url, video, c, args.seconds, args.upload, args.timeout)
            print(json.dumps(lv), file=sys.stderr)
            levels.append(lv)
    finally:
        serve.shutdown()
        ray.shutdown()
    sc = cfg.serve
    queue_limit = sc.max_ongoing_requests * sc.max_replicas + sc.max_queued_requests
    base = levels[0]["requests_per_s"] or float("nan")
    report = {
        "bench": "serve",
        "mode": "upload" if args.upload else "uri",
        "model": sample["model"],
        "video_duration_s": sample["duration"],
        "events_per_video": len(sample["events"]),
        "server_timings_s": sample["timings"],
        "serve": {"min_replicas": sc.min_replicas, "max_replicas": sc.max_replicas, "max_ongoing_requests": sc.max_ongoing_requests,
                  "max_queued_requests": sc.max_queued_requests, "target_ongoing_requests": sc.target_ongoing_requests},
        "queue_limit": queue_limit,
        "levels": levels,
        "throughput_ratio_vs_c1": {str(lv["concurrency"]): round(lv["requests_per_s"] / base, 3) for lv in levels},
        "no_loss_below_queue_limit": all(lv["refused_503"] + lv["failed"] + lv["lost"] == 0
                                         for lv in levels if lv["concurrency"] <= queue_limit),
    }
    print(json.dumps(report, indent=2))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2))
        _plot(levels, out.with_suffix(".png"))
    return 0 if report["no_loss_below_queue_limit"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
