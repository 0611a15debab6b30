"""How the config becomes Ray resource requests (pipeline/cluster.py), and the client's retry rule.

Unit tests: no Ray. tests/test_cluster_sim.py checks the same rules on a simulated cluster.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pipeline.cluster import CPU_NODE_SHARE, featurize_gpus, placement, train_resources
from pipeline.config import ClusterConfig, load_config


def test_gpu_work_asks_for_ray_gpus_by_default_and_cpu_work_for_cpus_only():
    cc = ClusterConfig()
    assert placement(cc, 4, 1) == {"num_cpus": 4, "num_gpus": 1}
    assert placement(cc, 2) == {"num_cpus": 2}
    assert train_resources(cc, 8, 1, use_gpu=True) == (True, {"CPU": 8, "GPU": 1}, None)
    assert train_resources(cc, 8, 1, use_gpu=False) == (False, {"CPU": 8}, None)


def test_a_custom_gpu_resource_and_an_accelerator_type():
    cc = ClusterConfig(gpu_resource="sim_gpu", cpu_node_resource="cpu_node")
    assert placement(cc, 1, 0.5) == {"num_cpus": 1, "resources": {"sim_gpu": 0.5}}
    assert placement(cc, 1) == {"num_cpus": 1, "resources": {"cpu_node": CPU_NODE_SHARE}}
    # a custom GPU resource assigns no CUDA device: Ray Train's use_gpu stays off
    assert train_resources(cc, 2, 1, use_gpu=True) == (False, {"CPU": 2, "sim_gpu": 1}, None)
    assert train_resources(cc, 2, 1, use_gpu=False) == (False, {"CPU": 2, "cpu_node": CPU_NODE_SHARE}, None)
    h100 = ClusterConfig(accelerator_type="H100")
    assert placement(h100, 4, 1) == {"num_cpus": 4, "num_gpus": 1, "accelerator_type": "H100"}
    assert placement(h100, 4) == {"num_cpus": 4}  # CPU work is not tied to the GPU type
    assert train_resources(h100, 8, 1, use_gpu=True) == (True, {"CPU": 8, "GPU": 1}, "H100")


def test_featurize_actors_ask_for_gpus_where_they_encode_on_cuda(tmp_path, capsys):
    """Preprocessing's and offline captioning's featurize actors take cluster.preprocess_gpus_per_actor GPUs
    with features.device=cuda, none on the CPU or when they only prepare media (the release encoders
    online); cuda with 0 GPUs per actor is refused by the job before Ray starts, in one line."""
    from infer.offline.job import featurizers_encode, main

    cuda = load_config(None, ["features.device=cuda", "cluster.preprocess_gpus_per_actor=0.25"])
    assert placement(cuda.cluster, 1, featurize_gpus(cuda, featurizers_encode(cuda))) == {"num_cpus": 1, "num_gpus": 0.25}
    assert featurize_gpus(load_config(None, ["features.device=cpu"])) == 0.0
    online = load_config(None, ["features.device=cuda", "features.visual_encoder=release", "features.audio_encoder=release",
                                "features.release_features=online"])
    assert not featurizers_encode(online) and featurize_gpus(online, featurizers_encode(online)) == 0.0
    assert featurizers_encode(load_config(None, ["features.visual_encoder=release", "features.audio_encoder=release"]))
    code = main(["--videos", str(tmp_path), "--random-model", "--out", str(tmp_path / "out"),
                 "--set", "features.device=cuda", "--set", "cluster.preprocess_gpus_per_actor=0"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "cluster.preprocess_gpus_per_actor > 0" in err, err
    assert not (tmp_path / "out").exists()


def test_serve_replicas_and_the_presets_follow_the_rule():
    from infer.serving.deployment import deployment_options

    cfg = load_config(None, ["cluster.gpu_resource=sim_gpu", "serve.num_gpus_per_replica=1",
                             "serve.look_back_period_s=2", "serve.metrics_interval_s=0.5"])
    opts = deployment_options(cfg.serve, cfg.cluster)
    assert opts["ray_actor_options"] == {"num_cpus": 1.0, "resources": {"sim_gpu": 1.0}}
    assert opts["autoscaling_config"]["look_back_period_s"] == 2 and opts["autoscaling_config"]["metrics_interval_s"] == 0.5
    gpu1 = load_config("cluster/configs/gpu-1.yaml")
    assert deployment_options(gpu1.serve, gpu1.cluster)["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 1.0}


def test_should_retry_503_and_ray_serves_own_5xx_not_the_services():
    from infer.serving.client import should_retry

    ours = {"error": {"code": "internal", "message": "bug", "request_id": "abc"}}
    assert should_retry(503, ours) and should_retry(503, None)
    assert should_retry(500, None) and should_retry(500, {"detail": "x"}) and should_retry(502, None)
    assert not should_retry(500, ours) and not should_retry(422, None) and not should_retry(200, {})


@pytest.fixture
def flaky_server():
    """A real HTTP server on 127.0.0.1 that answers the given (status, body) in turn."""
    answers: list[tuple[int, bytes]] = []
    seen: list[int] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            status, body = answers[len(seen)]
            seen.append(status)
            if status == 0:  # as a proxy whose replica died: close without an answer
                self.close_connection = True
                return
            self.send_response(status)
            self.send_header("Content-Type", "application/json" if body.startswith(b"{") else "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", answers, seen
    server.shutdown()
    server.server_close()


def test_client_retries_back_pressure_and_a_lost_replica(flaky_server):
    from infer.serving.client import CaptionClient, CaptionError

    url, answers, seen = flaky_server
    ok = {"video_id": "v", "duration": 1.0, "events": [], "timings": {}}
    ours = json.dumps({"error": {"code": "internal", "message": "bug", "request_id": "r1"}}).encode()
    answers += [(503, b"overloaded"), (500, b"Internal Server Error"), (200, json.dumps(ok).encode()), (500, ours)]
    client = CaptionClient(url, retries=3, retry_pause_s=0.01)
    assert client.caption(uri="/v.mp4") == ok and seen == [503, 500, 200]
    with pytest.raises(CaptionError) as info:  # the service's own 500 is not sent again
        client.caption(uri="/v.mp4")
    assert info.value.status == 500 and info.value.request_id == "r1" and seen == [503, 500, 200, 500]
    answers += [(503, b"x"), (503, b"x")]
    with pytest.raises(CaptionError) as info:  # retries=1: two tries, then the 503 is raised
        CaptionClient(url, retries=1, retry_pause_s=0.01).caption(uri="/v.mp4")
    assert info.value.status == 503 and seen[4:] == [503, 503]


def test_client_retries_a_dropped_connection(flaky_server):
    from infer.serving.client import CaptionClient

    url, answers, seen = flaky_server
    ok = {"video_id": "v", "duration": 1.0, "events": [], "timings": {}}
    answers += [(0, b""), (200, json.dumps(ok).encode())]  # status 0: close the connection, no answer
    assert CaptionClient(url, retries=2, retry_pause_s=0.01).caption(uri="/v.mp4") == ok and seen == [0, 200]


def test_init_ray_starts_a_private_instance_or_joins_the_named_cluster(monkeypatch):
    """No address: a new local instance (address "local"), never the last `ray start` cluster that ray.init
    with no address would attach to (a killed one leaves its address file behind, and then ray.init refuses
    the CPU count); an address (config or RAY_ADDRESS): that cluster, with no resources of its own."""
    import os

    import ray

    from pipeline.cluster import init_ray

    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"})
    init_ray(load_config(None, ["cluster.num_cpus=2"]))
    init_ray(load_config(None, ["cluster.address=10.0.0.1:6379"]))
    os.environ["RAY_ADDRESS"] = "10.0.0.2:6379"
    init_ray(load_config(None))
    assert calls[0]["address"] == "local" and calls[0]["num_cpus"] == 2 and calls[0]["_node_ip_address"] == "127.0.0.1"
    assert calls[1] == {"address": "10.0.0.1:6379", "log_to_driver": True}
    assert calls[2] == {"address": "10.0.0.2:6379", "log_to_driver": True}
