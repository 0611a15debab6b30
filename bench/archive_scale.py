"""Archive scale: N videos through preprocess and offline captioning on the simulated multi-node cluster,
exactly once through a lost node in each stage and a driver killed half-way through captioning.

    python -m bench.archive_scale                          # N = 10,000 -> bench/results/archive_scale.json
    python -m bench.archive_scale --n 1000 --out bench/results/archive_scale_n1000.json
    python -m bench.archive_scale --n 200 --small-n 0 --work /tmp/arch   # the CI test's run

What it does, once at N/10 (`--small-n`, 0 = skip) and once at N, on one cluster (bench/sim_cluster.py:
a head with the driver, 2 CPU nodes, 1 "GPU" node) and one S3 server (bench/s3server.py):
1. the corpus (bench/archive_corpus.py): N synthetic mp4s with audio (copies of `--distinct` rendered
   files under distinct names) and LongVALE annotations on local disk, uploaded to the S3 server; a few
   broken on purpose (`--bad`). Both stages read the videos (and preprocess its annotations) from s3://
   (`--source local` reads the local copy instead); outputs go to local disk under `--work`.
2. preprocess (preprocess/job.py) in a driver process of its own; the first video a featurizer starts
   is held (bench/inflight.py, the jobs' `wrap_stage` hook) and its CPU node removed while it holds
   it, then a fresh CPU node added (as an autoscaler would).
3. offline captioning (infer/offline/job.py), the same CPU-node loss in its featurize stage; when about
   half the videos are committed the driver process is killed (SIGKILL) and the same command is run again.
It samples the driver process's RSS and the cluster's object store use, and counts from the outputs and
the markers: rows per video (`lost`, `duplicated`), what the second captioning run did again
(`rerun_redone`), throughput per tenth, wall time per stage and error rows by reason.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import archive_measure as am  # noqa: E402
from bench import sim_cluster as sc  # before ray: the 127.0.0.1 variables
from bench.archive_corpus import ArchiveCorpus, build_corpus, subset, upload  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "bench/results/archive_scale.json"
CONFIG = ROOT / "cluster/configs/default.yaml"
OVERRIDES = [*sc.SIM_OVERRIDES, "features.min_frames=8", "features.max_frames=16", "cluster.preprocess_actors=2",
             "cluster.caption_actors=1", "cluster.caption_gpus_per_actor=1", "cluster.caption_cpus_per_actor=1",
             "infer.max_events=3", "infer.max_branch_tokens=6"]
BUCKET = "archive"


def model_dir() -> str:
    """The tiny random-init model, spelled as this checkout's loader spells it."""
    import infer.loading

    return getattr(infer.loading, "RANDOM_MODEL", "")


# ----------------------------------------------------------------------------- the driver process


def drive(spec_path: str) -> int:
    """One stage's driver (a process of its own, so it can be killed): the spec's job on the cluster."""
    import ray

    from bench.inflight import InFlight
    from pipeline.config import load_config

    spec = json.loads(Path(spec_path).read_text())
    ray.init(address=spec["address"], log_to_driver=False, configure_logging=False)
    cfg = load_config(CONFIG, spec["overrides"])
    watch = InFlight(spec["markers"], hold=spec["hold"], hold_s=spec["hold_s"])
    if spec["stage"] == "preprocess":
        from preprocess.job import run_preprocess

        summary = run_preprocess(cfg, {s: (p, "longvale") for s, p in spec["annotations"].items()}, spec["videos"],
                                 spec["out"], chunk_videos=spec["chunk_videos"], wrap_stage=watch)
    else:
        from infer.offline.job import run_caption

        summary = run_caption(cfg, spec["videos"], spec["model"], spec["out"], chunk_videos=spec["chunk_videos"],
                              wrap_stage=watch)
    Path(spec["summary"]).write_text(json.dumps(summary, default=str))
    return 0


# ----------------------------------------------------------------------------- the orchestrator


class Sampler:
    """Peak RSS of one process and peak object-store use of the cluster, sampled on `poll()`."""

    def __init__(self, address: str):
        self.address, self.rss_peak, self.store_peak, self._state, self._last = address, 0, 0, None, 0.0

    def poll(self, pid: int) -> None:
        import psutil

        try:
            self.rss_peak = max(self.rss_peak, psutil.Process(pid).memory_info().rss)
        except psutil.Error:
            pass
        if time.monotonic() - self._last < 2.0:
            return
        self._last = time.monotonic()
        try:
            from ray._private.internal_api import get_memory_info_reply, get_state_from_address

            self._state = self._state or get_state_from_address(self.address)
            used = get_memory_info_reply(self._state, timeout_seconds=10).store_stats.object_store_bytes_used
            self.store_peak = max(self.store_peak, int(used))
        except Exception:  # a node going away mid-call: the next sample
            self._state = None


def run_driver(sim, spec: dict[str, Any], work: Path, name: str, kill_node: bool,
               kill_at: int | None = None, committed=lambda: 0) -> dict[str, Any]:
    """Run one driver process to its end (or kill it once `committed()` reaches `kill_at`), removing the
    node of the held video when `kill_node`. -> what happened."""
    spec_path = work / f"{name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    log = open(work / f"{name}.log", "wb")
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "bench.archive_scale", "--drive", str(spec_path)], cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT)
    sampler = Sampler(sim.cluster.address)
    out: dict[str, Any] = {"node_removed": None, "killed": False}
    while proc.poll() is None:
        sampler.poll(proc.pid)
        if kill_node and out["node_removed"] is None:
            held = am.inflight.held(spec["markers"], spec["hold"])
            if held and held["node_id"] and sim.kind_by_id.get(held["node_id"]) == "cpu":
                out["committed_at_node_loss"] = committed()
                sim.remove(sim.node(held["node_id"]))
                out["node_removed"] = held["node_id"]
                out["held_video"] = held["video_id"]
                sim.add("cpu")  # the replacement an autoscaler would start
        if kill_at is not None and committed() >= kill_at:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            out.update(killed=True, committed_at_kill=committed())
            break
        time.sleep(0.5)
    log.close()
    out.update(rc=proc.returncode, wall_s=round(time.monotonic() - t0, 1), driver_peak_rss_mb=round(sampler.rss_peak / 2**20, 1),
               object_store_peak_mb=round(sampler.store_peak / 2**20, 1))
    if not out["killed"]:
        if proc.returncode != 0:
            raise RuntimeError(f"{name} driver failed (rc {proc.returncode}); see {work / f'{name}.log'}")
        out["summary"] = json.loads(Path(spec["summary"]).read_text())
    return out


def lost_in_flight(markers: str, stage: str, removed: str | None, rerun: str | None = None) -> dict[str, Any]:
    """The node-loss proof, as the node-loss tests make it: the held video was started on the removed
    node and never finished there, and another process finished it: the same run's retry, or (when
    the driver was killed before the cluster noticed the node was gone) the rerun's, whose markers
    are under `rerun`."""
    m = am.inflight.held(markers, stage)
    found = {"retry": am.inflight.markers(markers, stage), "rerun": am.inflight.markers(rerun, stage) if rerun else []}
    redone = [(by, r) for by, rows in found.items() for r in rows
              if m and r["video_id"] == m["video_id"] and r["pid"] != m["pid"] and r["done"]]
    proved = bool(m and removed and m["node_id"] == removed and not m["done"] and redone
                  and redone[0][1]["node_id"] != removed)
    return {"proved": proved, "video": m and m["video_id"], "redone_on": [r["node_id"] for _, r in redone],
            "redone_by": redone[0][0] if redone else None}


def preprocess_stage(sim, corpus: ArchiveCorpus, source: str, work: Path, chunk: int, hold_s: float) -> dict[str, Any]:
    from pipeline.schema import decode
    from preprocess import manifest as mf

    out, markers = work / "shards", str(work / "markers")
    annotations = ({s: corpus.remote[f"longvale_{s}"] for s in corpus.longvale} if source == "s3" else corpus.longvale)
    spec = {"stage": "preprocess", "address": sim.cluster.address, "overrides": OVERRIDES, "annotations": annotations,
            "videos": corpus.remote["videos"] if source == "s3" else corpus.video_dir, "out": str(out),
            "chunk_videos": chunk, "markers": markers, "hold": "preprocess", "hold_s": hold_s,
            "summary": str(work / "preprocess.summary.json")}
    run = run_driver(sim, spec, work, "preprocess", kill_node=True,
                     committed=lambda: len(list((out / "manifest").glob("*-0*.parquet"))) if out.exists() else 0)
    rows = mf.read_table(mf.manifest_path(str(out)))
    in_shards = [decode(f).video_id for shard in mf.ok_shards(rows) for f in mf.iter_shard(shard)]
    once = am.exactly_once(corpus.videos, [r["video_id"] for r in rows])
    shards = am.exactly_once([r["video_id"] for r in rows if r["status"] == "ok"], in_shards)
    return {"rows": once["rows"], "ok": sum(r["status"] == "ok" for r in rows), "lost": once["lost"],
            "duplicated": once["duplicated"] + shards["duplicated"], "lost_from_shards": shards["lost"],
            "wall_s": run["wall_s"], "driver_peak_rss_mb": run["driver_peak_rss_mb"],
            "object_store_peak_mb": run["object_store_peak_mb"], "node_loss": lost_in_flight(markers, "preprocess", run["node_removed"]),
            "videos_per_min": am.tenths(am.done_times(markers, "preprocess").values()),
            "error_rows": am.error_reasons(rows)}


def caption_stage(sim, corpus: ArchiveCorpus, source: str, work: Path, chunk: int, hold_s: float,
                  videos_per_call: int) -> dict[str, Any]:
    from infer.offline.results import read_parts, read_results

    out = work / "captions"
    parts = out / "parts"
    spec = {"stage": "caption", "address": sim.cluster.address, "videos_per_call": videos_per_call,
            "overrides": [*OVERRIDES, f"infer.videos_per_call={videos_per_call}"], "model": model_dir(),
            "videos": corpus.remote["videos"] if source == "s3" else corpus.video_dir, "out": str(out),
            "chunk_videos": chunk, "markers": str(work / "markers-1"), "hold": "caption-featurize", "hold_s": hold_s,
            "summary": str(work / "caption.summary.json")}
    n_parts = lambda: len(list(parts.glob("*.parquet"))) if parts.exists() else 0  # noqa: E731
    first = run_driver(sim, spec, work, "caption-1", kill_node=True, kill_at=-(-corpus.n // 2 // chunk), committed=n_parts)
    before = read_parts(str(out))
    ok_before = {r["video_id"] for r in before if r["status"] == "ok"}
    err_before = {r["video_id"] for r in before if r["status"] != "ok"}
    second = run_driver(sim, {**spec, "markers": str(work / "markers-2"), "hold": ""}, work, "caption-2", kill_node=False)
    redo = am.rerun_redone(ok_before, err_before, am.started(spec["markers"], "caption-featurize"),
                           am.started(str(work / "markers-2"), "caption-featurize"))
    committed = read_parts(str(out))
    ok_writes = am.exactly_once(corpus.videos, [r["video_id"] for r in committed if r["status"] == "ok"])
    rows = read_results(str(out))
    once = am.exactly_once(corpus.videos, [r["video_id"] for r in rows])
    done = {**am.done_times(str(work / "markers-2"), "caption"), **am.done_times(spec["markers"], "caption")}
    return {"rows": once["rows"], "ok": sum(r["status"] == "ok" for r in rows), "lost": once["lost"],
            "duplicated": once["duplicated"] + ok_writes["duplicated"], "committed_rows": len(committed),
            "partial_files_left": sorted(str(p.relative_to(out)) for p in out.rglob("*.tmp*")),
            "driver_killed": first["killed"], "rows_committed_at_kill": len(before), **redo,
            "wall_s": round(first["wall_s"] + second["wall_s"], 1), "wall_s_runs": [first["wall_s"], second["wall_s"]],
            "driver_peak_rss_mb": max(first["driver_peak_rss_mb"], second["driver_peak_rss_mb"]),
            "driver_peak_rss_mb_runs": [first["driver_peak_rss_mb"], second["driver_peak_rss_mb"]],
            "object_store_peak_mb": max(first["object_store_peak_mb"], second["object_store_peak_mb"]),
            "node_loss": lost_in_flight(spec["markers"], "caption-featurize", first["node_removed"], str(work / "markers-2")),
            "videos_per_min": am.tenths(done.values()), "error_rows": am.error_reasons(rows),
            "summary_second_run": {k: v for k, v in second["summary"].items() if k in ("captioned", "failed", "this_run_ok",
                                                                                     "this_run_failed", "duplicates_dropped")}}


def one_scale(sim, corpus: ArchiveCorpus, args, work: Path) -> dict[str, Any]:
    """Both stages at one N. -> that scale's numbers."""
    work.mkdir(parents=True, exist_ok=True)
    chunk = args.chunk_videos or max(4, min(64, corpus.n // 20))
    t0 = time.monotonic()
    pre = preprocess_stage(sim, corpus, args.source, work, chunk, args.hold_s)
    print(f"[archive] N={corpus.n} preprocess: {json.dumps(pre)}", flush=True)
    cap = caption_stage(sim, corpus, args.source, work, chunk, args.hold_s, args.videos_per_call)
    print(f"[archive] N={corpus.n} caption: {json.dumps(cap)}", flush=True)
    return {"videos": corpus.n, "chunk_videos": chunk, "preprocess": pre, "caption": cap,
            "wall_s": round(time.monotonic() - t0, 1)}


def result(big: dict[str, Any], small: dict[str, Any] | None, corpus: ArchiveCorpus, args) -> dict[str, Any]:
    """The issue's keys from the scale runs."""
    stages = ("preprocess", "caption")
    peak = lambda run, key: max(run[s][key] for s in stages) if run else None  # noqa: E731
    ratio = lambda a, b: round(a / b, 3) if a and b else None  # noqa: E731
    rss = {"n": peak(big, "driver_peak_rss_mb"), "n_over_10": peak(small, "driver_peak_rss_mb")}
    store = {"n": peak(big, "object_store_peak_mb"), "n_over_10": peak(small, "object_store_peak_mb")}
    return {
        "videos": corpus.n, "distinct_files": corpus.distinct, "broken_on_purpose": len(corpus.bad),
        "corpus_note": f"{corpus.n} videos are hard links to {corpus.distinct} rendered synthetic mp4s under distinct "
                       "names (rendering is the bottleneck); each copy has its own LongVALE record",
        "source": args.source, "manifest_rows": big["preprocess"]["rows"], "caption_rows": big["caption"]["rows"],
        "lost": big["preprocess"]["lost"] + big["caption"]["lost"],
        "duplicated": big["preprocess"]["duplicated"] + big["caption"]["duplicated"],
        "rerun_redone": big["caption"]["rerun_redone"], "in_flight_at_kill": big["caption"]["in_flight_at_kill"],
        "driver_peak_rss_mb": {**rss, "ratio": ratio(rss["n"], rss["n_over_10"])},
        "object_store_peak_mb": {**store, "ratio": ratio(store["n"], store["n_over_10"])},
        "videos_per_min": {s: big[s]["videos_per_min"] for s in stages},
        "wall_s": {s: big[s]["wall_s"] for s in stages},
        "error_rows": {s: big[s]["error_rows"] for s in stages},
        "node_loss_proved": {s: big[s]["node_loss"]["proved"] for s in stages},
        "node_loss_redone_by": {s: big[s]["node_loss"]["redone_by"] for s in stages},
        "driver_killed": big["caption"]["driver_killed"],
        "box": {"cpus": os.cpu_count(), "load_avg_1m_at_end": round(os.getloadavg()[0], 2)},
        "runs": {"n": big, "n_over_10": small},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drive", default=None, help=argparse.SUPPRESS)  # internal: one stage's driver process
    ap.add_argument("--n", type=int, default=10_000, help="videos in the archive")
    ap.add_argument("--small-n", type=int, default=None, help="the growth run's N (default N/10; 0 = none)")
    ap.add_argument("--distinct", type=int, default=200, help="distinct rendered files the N copy")
    ap.add_argument("--bad", type=int, default=None, help="videos broken on purpose (default N/500, at least 1)")
    ap.add_argument("--source", choices=("s3", "local"), default="s3")
    ap.add_argument("--chunk-videos", type=int, default=0, help="videos per commit (default N/20 in 4..64)")
    ap.add_argument("--videos-per-call", type=int, default=4)
    ap.add_argument("--hold-s", type=float, default=120.0, help="how long the held video waits for its node to go")
    ap.add_argument("--work", default=None, help="working dir (default: a temporary one, removed)")
    ap.add_argument("--out", default=str(RESULT))
    args = ap.parse_args(argv)
    if args.drive:
        return drive(args.drive)
    import tempfile

    from bench.s3server import SeaweedS3

    work = Path(args.work or tempfile.mkdtemp(prefix="archive-scale-")).resolve()
    bad = max(1, args.n // 500) if args.bad is None else args.bad
    small_n = args.n // 10 if args.small_n is None else args.small_n
    t0 = time.monotonic()
    corpus = build_corpus(work / "corpus", args.n, args.distinct, bad)
    small = subset(corpus, work / "corpus-small", small_n) if small_n else None
    print(f"[archive] corpus: {corpus.n} videos ({corpus.distinct} distinct files), {len(corpus.bad)} broken, "
          f"{time.monotonic() - t0:.0f}s", flush=True)
    with SeaweedS3(work / "s3", buckets=[BUCKET]) as s3:
        os.environ.update(s3.env)  # the drivers and every raylet's workers inherit them
        if args.source == "s3":
            t1 = time.monotonic()
            upload(corpus, f"s3://{BUCKET}/n{corpus.n}")
            if small:
                upload(small, f"s3://{BUCKET}/n{small.n}")
            print(f"[archive] uploaded to S3 in {time.monotonic() - t1:.0f}s", flush=True)
        sim = sc.SimCluster.start()
        try:
            small_run = one_scale(sim, small, args, work / f"n{small.n}") if small else None
            big_run = one_scale(sim, corpus, args, work / f"n{corpus.n}")
        finally:
            sim.shutdown()
    res = result(big_run, small_run, corpus, args)
    res["total_wall_s"] = round(time.monotonic() - t0, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k != "runs"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
