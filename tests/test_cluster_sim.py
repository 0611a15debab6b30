"""Scale-out on a simulated multi-node cluster (bench/sim_cluster.py): placement by resources
from the config, Serve autoscaling under load, and node loss without lost or duplicated work.

    flock /work/helpers/ray.lock .venv/bin/python -m pytest tests/test_cluster_sim.py -q

One `ray.cluster_utils.Cluster` for the module: a head (0 CPUs, the driver), two CPU nodes
(`cpu_node` resource) and one "GPU" node (`sim_gpu` instead of GPUs), every raylet on
127.0.0.1. The config maps GPU work to `sim_gpu` and CPU work to `cpu_node`
(`cluster.gpu_resource`, `cluster.cpu_node_resource`). Where actors ran is read from Ray's
state API. Node loss is `Cluster.remove_node` (every process of that raylet killed, no
graceful shutdown) in the middle of the work; each test then adds a fresh node of the same
kind, as an autoscaler would, so the next test sees the full cluster (the GPU caption test
adds a second "GPU" node first and keeps the survivor). Preprocess and captioning (its CPU
featurizers and its GPU caption actor) lose their node while it holds a video: the jobs' stages
are wrapped through their `wrap_stage` hook (bench/inflight.py), which marks every video a
process starts and ends and holds the first one of the stage, whose node is then removed; the markers prove it was in
flight there (never ended) and say who redid it. Training loses a node in the middle of an epoch
and the steps' logged video ids show each video once per epoch. Inputs are tiny (a few 8-9 s
synthetic videos, the tiny random-init model, a few training steps).
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from bench import (
    autoscale,  # noqa: E402
    inflight,  # noqa: E402
)
from bench import sim_cluster as sc  # before ray: the 127.0.0.1 variables
from infer.loading import RANDOM_MODEL  # noqa: E402
from pipeline import storage  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.schema import decode  # noqa: E402
from preprocess import manifest as mf  # noqa: E402
from preprocess.synthetic import generate_corpus  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[1]
MANIFEST_KEYS = ("video_id", "split", "status", "error", "key", "num_segments", "num_events", "duration", "feature_hash")


def sim_cfg(*extra):
    return load_config(ROOT / "cluster/configs/default.yaml", [
        *sc.SIM_OVERRIDES,
        "data.synthetic.num_videos=6", "data.synthetic.min_duration=8", "data.synthetic.max_duration=9",
        "data.synthetic.max_events=2", "data.synthetic.num_workers=1", "features.min_frames=8", "features.max_frames=16",
        "cluster.preprocess_actors=2", "cluster.caption_actors=1", "cluster.caption_gpus_per_actor=1",
        "cluster.caption_cpus_per_actor=1", "infer.max_events=3", "infer.max_branch_tokens=6", "infer.videos_per_call=2",
        "train.num_workers=2", "train.batch_size=1", "train.log_every=1", "train.val_samples=1", "train.eval_samples=1",
        "train.warmup_steps=1", "train.torch_threads=1", "train.backend=ddp", *extra])


@pytest.fixture(scope="module")
def sim(own_ray_cluster):  # the shared local instance is stopped first: one cluster at a time
    cluster = sc.SimCluster.start()
    yield cluster
    cluster.shutdown()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("sim-corpus")
    return generate_corpus(str(root / "synth"), sim_cfg().data.synthetic, progress=False)


class NodeKiller(threading.Thread):
    """Removes the node of the first alive actor named `actor` (on a node of `kind`), or the node
    `target()` names, once `ready()` holds; records which node and what `probe()` said just before.
    `finish` adds the replacement an autoscaler would start (nodes are added from the main thread
    only), unless `replace=False` (the test had one more node of that kind to start with)."""

    def __init__(self, sim, actor: str, kind: str, ready=lambda: True, probe=lambda: None, timeout: float = 180.0,
                 target=None, replace: bool = True):
        super().__init__(daemon=True)
        self.sim, self.actor, self.kind, self.ready, self.probe, self.timeout = sim, actor, kind, ready, probe, timeout
        self.target, self.replace = target or self.actor_node, replace
        self.removed_id: str | None = None
        self.probed = None
        self.error: BaseException | None = None

    def actor_node(self):
        for node_id in sc.actor_nodes(self.actor, alive_only=True):
            if self.sim.kind_by_id.get(node_id) == self.kind:
                return node_id
        return None

    def run(self) -> None:
        try:
            node_id = sc.wait_for(lambda: self.ready() and self.target(), sc.scaled(self.timeout),
                                  f"an alive {self.actor} on a {self.kind} node")
            assert self.sim.kind_by_id.get(node_id) == self.kind, (node_id, self.sim.kind_by_id.get(node_id))
            self.probed = self.probe()
            self.sim.remove(self.sim.node(node_id))
            self.removed_id = node_id
        except BaseException as e:  # reported by the test thread
            self.error = e

    def finish(self) -> str:
        self.join(timeout=sc.scaled(self.timeout))
        if self.error:
            raise self.error
        assert self.removed_id, "no node was removed"
        if self.replace:
            self.sim.add(self.kind)
        return self.removed_id


def hold_one_video(tmp_path, stage: str) -> tuple[Path, inflight.InFlight]:
    """The in-flight markers on for this test (the job's `wrap_stage`): every video of every stage marked
    in flight, and the first one `stage` starts held (its node is lost during the hold, which a missed
    kill only lengthens). -> (the marker directory, the hook to pass to the job)."""
    root = tmp_path / "inflight"
    return root, inflight.InFlight(str(root), hold=stage, hold_s=sc.scaled(150.0))


def held_node(root: Path, stage: str):
    """The node of the video `stage` holds (a function for NodeKiller's `target`)."""
    return lambda: (inflight.held(root, stage) or {}).get("node_id")


def check_lost_in_flight(root: Path, stage: str, removed: str) -> dict:
    """What the markers prove: the held video was in flight on the removed node when it went (that
    process never ended its work on it), and another process on another node did it after. -> the
    marker of that other process."""
    m = inflight.held(root, stage)
    assert m and m["node_id"] == removed, (m, removed)
    assert not m["done"], f"{m['video_id']} was finished on the removed node before it went"
    redone = [r for r in inflight.markers(root, stage) if r["video_id"] == m["video_id"] and r["pid"] != m["pid"]]
    assert [r["done"] for r in redone] == [True] and redone[0]["node_id"] != removed, redone
    return redone[0]


# ----------------------------------------------------------------------------- preprocess


def run_preprocess_job(cfg, info, out, **hook):
    from preprocess.job import run_preprocess

    return run_preprocess(cfg, {s: (p, "longvale") for s, p in info.longvale.items()}, info.video_dir, out, **hook)


def shard_samples(out):
    rows = mf.read_table(mf.manifest_path(out))
    samples = {}
    for shard in mf.ok_shards(rows):
        for fields in mf.iter_shard(shard):
            s = decode(fields)
            assert s.video_id not in samples, f"{s.video_id} written twice"
            samples[s.video_id] = s
    return rows, samples


@pytest.fixture(scope="module")
def baseline_shards(sim, corpus, tmp_path_factory):
    """The uninterrupted preprocess run on the cluster: what a run that loses a node must equal."""
    out = str(tmp_path_factory.mktemp("shards-baseline"))
    summary = run_preprocess_job(sim_cfg(), corpus, out)
    assert summary["ok"] == 6 and summary["failed"] == 0
    return out


def test_preprocess_actors_run_only_on_cpu_nodes(sim, baseline_shards):
    nodes = sc.actor_nodes("FeaturizeVideos")
    assert nodes, "no FeaturizeVideos actor in the state API"
    assert sim.kinds_of(nodes) == {"cpu"}


def test_preprocess_survives_losing_a_cpu_node_with_a_video_in_flight(sim, corpus, baseline_shards, tmp_path):
    out = str(tmp_path / "shards")
    root, watch = hold_one_video(tmp_path, "preprocess")
    killer = NodeKiller(sim, "FeaturizeVideos", "cpu", target=held_node(root, "preprocess"),
                        probe=lambda: mf.committed_parts(out))
    killer.start()
    summary = run_preprocess_job(sim_cfg(), corpus, out, wrap_stage=watch)
    removed = killer.finish()
    assert killer.probed == {}, "the node was removed after the job had committed its work"
    assert sim.kind_by_id[check_lost_in_flight(root, "preprocess", removed)["node_id"]] == "cpu"
    assert summary["ok"] == 6 and summary["failed"] == 0
    rows_a, samples_a = shard_samples(baseline_shards)
    rows_b, samples_b = shard_samples(out)
    pick = lambda rows: sorted(tuple(r[k] for k in MANIFEST_KEYS) for r in rows)  # noqa: E731
    assert pick(rows_b) == pick(rows_a)  # the same manifest rows, one per video
    assert sorted(samples_b) == sorted(samples_a)  # every video exactly once in the shards
    for vid, a in samples_a.items():
        b = samples_b[vid]
        assert np.array_equal(a.visual, b.visual) and np.array_equal(a.audio, b.audio) and a.events == b.events


# ----------------------------------------------------------------------------- offline captioning


def caption_rows(out):
    from infer.offline.results import read_results

    rows = read_results(out)
    ids = [r["video_id"] for r in rows]
    assert len(ids) == len(set(ids))
    return {r["video_id"]: (r["status"], [(e["start"], e["end"], e["caption"]) for e in r["events"]]) for r in rows}


@pytest.fixture(scope="module")
def baseline_captions(sim, corpus, tmp_path_factory):
    from infer.offline.job import run_caption

    out = str(tmp_path_factory.mktemp("captions-baseline"))
    summary = run_caption(sim_cfg(), corpus.video_dir, RANDOM_MODEL, out)
    assert summary["captioned"] == 6 and summary["failed"] == 0
    return out


def test_caption_actors_on_the_gpu_node_featurizers_on_cpu_nodes(sim, baseline_captions):
    assert sim.kinds_of(sc.actor_nodes("CaptionVideos")) == {"gpu"}
    assert sim.kinds_of(sc.actor_nodes("FeaturizeForCaption")) == {"cpu"}


def encode_on_cpu(marks: Path):
    """A `wrap_stage` hook: offline captioning's featurize actors record the node they run on, and they and
    the caption actor build their encoders on the CPU (the simulated GPU node has no CUDA device:
    features.device=cuda only decides where they are placed)."""
    def on_cpu(cfg_json: str) -> str:
        from pipeline.config import Config

        cfg = Config.from_json(cfg_json)
        cfg.features.device = "cpu"
        return cfg.to_json(indent=None)

    def hook(stage: str, cls: type) -> type:
        if stage == "caption":
            def caption_init(self, cfg_json: str, *args, **kwargs):
                cls.__init__(self, on_cpu(cfg_json), *args, **kwargs)

            return type(cls.__name__, (cls,), {"__init__": caption_init})

        def featurize_init(self, cfg_json: str):
            import os

            import ray

            cls.__init__(self, on_cpu(cfg_json))
            (marks / f"{os.getpid()}.json").write_text(json.dumps({"node_id": ray.get_runtime_context().get_node_id()}))

        # another name: test_caption_actors_on_the_gpu_node_featurizers_on_cpu_nodes finds its actors by name
        return type("GpuPlacedFeaturizer", (cls,), {"__init__": featurize_init})
    return hook


def test_featurize_actors_take_a_gpu_when_their_encoders_run_on_cuda(sim, corpus, baseline_captions, tmp_path):
    """features.device=cuda: offline captioning's featurize actors ask for `cluster.preprocess_gpus_per_actor`
    of the GPU resource, so they run on the GPU node, beside the caption actor (half a GPU and half a CPU
    each, so two fit there with it); the captions equal the CPU placement's."""
    from infer.offline.job import run_caption

    marks = tmp_path / "featurize-nodes"
    marks.mkdir()
    cfg = sim_cfg("features.device=cuda", "cluster.preprocess_gpus_per_actor=0.5", "cluster.preprocess_cpus_per_actor=0.5")
    summary = run_caption(cfg, corpus.video_dir, RANDOM_MODEL, str(tmp_path / "captions"), wrap_stage=encode_on_cpu(marks))
    assert summary["captioned"] == 6 and summary["failed"] == 0
    nodes = [json.loads(m.read_text())["node_id"] for m in marks.iterdir()]
    assert nodes and sim.kinds_of(nodes) == {"gpu"}
    assert caption_rows(str(tmp_path / "captions")) == caption_rows(baseline_captions)


def test_offline_captioning_survives_losing_a_cpu_node_with_a_video_in_flight(sim, corpus, baseline_captions,
                                                                              tmp_path):
    from infer.offline.job import run_caption

    out = str(tmp_path / "captions")
    parts = Path(out) / "parts"
    root, watch = hold_one_video(tmp_path, "caption-featurize")
    killer = NodeKiller(sim, "FeaturizeForCaption", "cpu", target=held_node(root, "caption-featurize"),
                        probe=lambda: sorted(parts.glob("*.parquet")))
    killer.start()
    summary = run_caption(sim_cfg(), corpus.video_dir, RANDOM_MODEL, out, wrap_stage=watch)
    removed = killer.finish()
    assert killer.probed == [], "the node was removed after the run had committed its captions"
    assert sim.kind_by_id[check_lost_in_flight(root, "caption-featurize", removed)["node_id"]] == "cpu"
    assert summary["captioned"] == 6 and summary["failed"] == 0 and summary["this_run_ok"] == 6
    assert caption_rows(out) == caption_rows(baseline_captions)  # each video once, the same captions


def test_offline_captioning_survives_losing_the_gpu_node_with_videos_in_flight(sim, corpus, baseline_captions,
                                                                              tmp_path):
    """Two "GPU" nodes; the caption actor's node goes while it holds a call's videos, the actor is
    started again on the other one, and the run ends with every video exactly once, captioned as in
    the uninterrupted run. The cluster is left with one "GPU" node, as before."""
    from infer.offline.job import run_caption

    out = str(tmp_path / "captions")
    parts = Path(out) / "parts"
    root, watch = hold_one_video(tmp_path, "caption")
    sim.add("gpu")  # the one that takes over
    killer = NodeKiller(sim, "CaptionVideos", "gpu", target=held_node(root, "caption"), replace=False,
                        probe=lambda: sorted(parts.glob("*.parquet")))
    killer.start()
    try:
        summary = run_caption(sim_cfg(), corpus.video_dir, RANDOM_MODEL, out, wrap_stage=watch)
        removed = killer.finish()
    finally:
        for node in sim.nodes["gpu"][1:]:  # back to one "GPU" node, whatever happened
            sim.remove(node)
    assert killer.probed == [], "the node was removed after the run had committed its captions"
    redone = check_lost_in_flight(root, "caption", removed)
    assert sim.kind_by_id[redone["node_id"]] == "gpu" and redone["node_id"] in {n.node_id for n in sim.nodes["gpu"]}
    assert summary["captioned"] == 6 and summary["failed"] == 0 and summary["this_run_ok"] == 6
    assert caption_rows(out) == caption_rows(baseline_captions)  # each video once, the same captions
    rows = pq.read_table(next(parts.glob("*.parquet"))).to_pylist()  # the commit itself, before consolidation
    assert sorted(r["video_id"] for r in rows) == sorted(corpus.videos)


# ----------------------------------------------------------------------------- training


def registered_checkpoint(out: Path) -> str | None:
    """The latest checkpoint the Ray Train controller has registered (its checkpoint manager's
    snapshot, written once it took the report), or None."""
    for snap in out.glob("ray/*/checkpoint_manager_snapshot.json"):
        latest = json.loads(snap.read_text()).get("latest_checkpoint_result") or {}
        found = re.findall(r"checkpoint_\d{7}", json.dumps(latest))
        if found:
            return found[-1]
    return None


def train_ids(shards: str) -> list[str]:
    return sorted(r["video_id"] for r in mf.read_table(mf.manifest_path(shards)) if r["split"] == "train")


def test_training_resumes_mid_epoch_after_losing_a_worker_node_and_sees_each_sample_once_per_epoch(
        sim, baseline_shards, tmp_path):
    """4 training videos, 2 workers of one video per step: 2 steps an epoch. The node goes in the
    middle of epoch 1 (paused after step 3, once checkpoint 3 is registered); the restart resumes
    from checkpoint 3 and the steps' logged video ids give every epoch each video exactly once."""
    from tests.support.train_faults import PauseAt
    from train.trainer import run_train

    marker = tmp_path / "paused.txt"
    out = tmp_path / "train"
    killer = NodeKiller(sim, "RayTrainWorker", "cpu",
                        ready=lambda: marker.exists() and registered_checkpoint(out) == "checkpoint_0000003",
                        probe=lambda: sorted(p.name for p in out.glob("ray/*/checkpoint_0*")))
    killer.start()
    cfg = sim_cfg("train.max_steps=6", "train.checkpoint_every=3", "train.val_every=0", "train.max_failures=2",
                  "train.keep_checkpoints=3")
    summary = run_train(cfg, baseline_shards, str(out), on_step=PauseAt(step=3, marker=str(marker), seconds=sc.scaled(90.0)))
    removed = killer.finish()
    assert killer.probed[-1] == "checkpoint_0000003"  # the latest checkpoint when the node went
    details = storage.read_json(summary["details"])
    assert summary["steps"] == 6 and details["resumes"] == 1
    hist = storage.read_json(str(out / "history.json"))
    assert [h["step"] for h in hist] == [1, 2, 3, 4, 5, 6]
    assert [h["resumes"] for h in hist] == [0, 0, 0, 1, 1, 1]  # steps 4-6 after the restart from checkpoint 3
    assert [h["epoch"] for h in hist] == [0, 0, 1, 1, 2, 2]  # the restart came in the middle of epoch 1
    videos = train_ids(baseline_shards)
    assert len(videos) == 4
    for epoch in (0, 1, 2):
        steps = [h for h in hist if h["epoch"] == epoch]
        assert all([len(ids) for ids in h["samples"]] == [1, 1] for h in steps), steps  # one per worker per step
        seen = sorted(v for h in steps for ids in h["samples"] for v in ids)
        assert seen == videos, (epoch, [h["samples"] for h in steps])  # none skipped, none repeated
    workers = sc.actors("RayTrainWorker")
    assert sim.kinds_of(a.node_id for a in workers) == {"cpu"}
    assert any(a.node_id == removed for a in workers) and any(a.node_id != removed for a in workers)


def test_training_workers_run_on_the_gpu_node_when_the_gpu_resource_asks_for_it(sim, baseline_shards, tmp_path):
    """train.use_gpu with cluster.gpu_resource=sim_gpu: the workers take `sim_gpu` (so only the
    "GPU" node can hold them; Ray assigns no CUDA device, the loop runs on its CPUs)."""
    from train.trainer import build_trainer

    before = {a.actor_id for a in sc.actors("RayTrainWorker")}
    cfg = sim_cfg("train.use_gpu=true", "train.gpus_per_worker=1", "train.max_steps=1", "train.val_every=0",
                  "train.checkpoint_every=0")
    result = build_trainer(cfg, baseline_shards, str(tmp_path / "train")).fit()
    assert result.error is None and result.metrics["step"] == 1
    workers = [a for a in sc.actors("RayTrainWorker") if a.actor_id not in before]
    # only the "GPU" node has sim_gpu (and it lacks cpu_node, which CPU-only workers would ask for)
    assert len(workers) == 2 and sim.kinds_of(a.node_id for a in workers) == {"gpu"}


# ----------------------------------------------------------------------------- serving


@pytest.fixture
def serve_app(sim, corpus):
    """Deploys an endpoint config on the cluster; shuts Serve down after the test."""
    from ray import serve

    def deploy(*overrides):
        cfg = autoscale.autoscale_config(str(Path(corpus.video_dir).parent), list(overrides))
        url, deployment = autoscale.deploy(cfg)
        video = sorted(corpus.videos.values())[0]
        assert autoscale.post(url, video, 120) == 200  # warm-up
        return cfg, url, deployment, video

    yield deploy
    serve.shutdown()


def test_serve_autoscales_up_and_down_and_refuses_over_the_queue(sim, serve_app):
    """The load lasts until the controller has scaled to max_replicas and the new replica has run for
    a few seconds (bounded by a deadline scaled to the box), the cool-down until it is back at
    min_replicas: what is checked is what the controller decided and that it waited at least its
    configured delays, never that a slow box kept up with a fixed window."""
    cfg, url, deployment, video = serve_app()
    s = cfg.serve
    report = autoscale.run_phases(url, video, "padcap", deployment, autoscale.serve_numbers(cfg), clients=4,
                                  load_s=sc.scaled(120.0), hold_max_s=3.0, burst_n=16,
                                  cooldown_max_s=sc.scaled(90.0))
    print("[autoscale]", {k: v for k, v in report.items() if k not in ("timeline", "requests")})
    assert sim.kinds_of(sc.actor_nodes("ServeReplica")) == {"gpu"}
    assert report["replicas_at_load_start"] == s.min_replicas and report["peak_replicas"] == s.max_replicas, report
    decided, down = report["upscale_decided_after_load_start_s"], report["back_to_min_after_load_end_s"]
    # the controller scaled only after the load had lasted upscale_delay_s, and back down only
    # after downscale_delay_s without it (a slow box can only make both later)
    assert decided is not None and decided >= s.upscale_delay_s * 0.9, report
    assert report["max_replicas_after_load_start_s"] is not None
    assert down is not None and down >= s.downscale_delay_s * 0.9, report
    load, burst = report["load"], report["burst"]
    assert load["requests"] > 0 and load["completed_200"] == load["requests"]  # every accepted request completed
    assert load["failed"] == load["lost"] == 0
    assert burst["refused_503"] >= 1 and burst["other"] == 0 and burst["completed_200"] >= 1
    assert burst["max_503_latency_s"] < burst["min_200_latency_s"]  # refused at once, not after queueing


def test_serve_keeps_every_accepted_request_when_a_gpu_node_is_lost(sim, serve_app):
    sim.add("gpu")  # two "GPU" nodes, one replica each (a replica takes a node's 2 sim_gpu)
    try:
        cfg, url, deployment, video = serve_app("serve.min_replicas=2", "serve.max_replicas=2",
                                                "serve.num_gpus_per_replica=2", "serve.max_queued_requests=8")
        replica_nodes = sc.wait_for(lambda: (lambda n: n if len(n) == 2 else None)(
            set(sc.actor_nodes("ServeReplica", alive_only=True))), 60, "two replicas")
        assert sim.kinds_of(replica_nodes) == {"gpu"}
        t0 = time.monotonic()
        results: list = []  # answered requests, appended as they come
        done = threading.Event()
        loader = threading.Thread(target=autoscale.closed_loop, args=(url, video, 4, sc.scaled(240.0), t0, 120.0),
                                  kwargs={"until": done.is_set, "out": results})
        loader.start()

        def answered_since(t: float, n: int) -> bool:
            return sum(r.t_sent > t and r.status == 200 for r in list(results)) >= n

        try:
            sc.wait_for(lambda: answered_since(0.0, 4), sc.scaled(60), "4 requests served before the loss")
            victim = sorted(replica_nodes)[0]
            sim.remove(sim.node(victim))
            t_removed = time.monotonic() - t0
            sc.wait_for(lambda: answered_since(t_removed, 2), sc.scaled(90), "the surviving replica serving")
            sim.add("gpu")  # the replacement node: the lost replica is started again there
            now = sc.wait_for(lambda: (lambda n: n if len(n) == 2 and victim not in n else None)(
                set(sc.actor_nodes("ServeReplica", alive_only=True))), sc.scaled(90), "two replicas again")
            t_back = time.monotonic() - t0
            sc.wait_for(lambda: answered_since(t_back, 4), sc.scaled(90), "4 requests served after the restart")
        finally:
            done.set()
            loader.join()
        statuses = [r.status for r in results]
        after = [r for r in results if r.t_sent > t_removed]
        assert after and all(r.status == 200 for r in after[-4:])  # serving again at the end
        assert statuses.count(None) == 0, "a request got no answer"
        # every request completed; the ones in flight on the lost replica got Ray Serve's own 500
        # or a dropped connection and were sent again (infer.serving.client), the documented client rule
        assert set(statuses) == {200}, {s: statuses.count(s) for s in set(statuses)}
        print(f"[node loss under load] {len(results)} requests, {sum(r.lost_replica_retries for r in results)} "
              f"retried after Ray Serve's 500, {sum(r.dropped_retries for r in results)} after a dropped connection, "
              f"{sum(r.attempts - 1 for r in results)} retries in all")
        assert sim.kinds_of(now) == {"gpu"}  # the lost one restarted on the new node
    finally:
        extra = sim.nodes["gpu"][1:]
        for node in extra:  # back to one "GPU" node
            sim.remove(node)
