"""The Ray Serve endpoint over real HTTP on 127.0.0.1: one local Serve app for the module, on the
shared local Ray instance (tests/conftest.py `ray_local`).

Run under the Ray lock:
    flock /tmp/padcap-ray.lock .venv/bin/python -m pytest tests/test_serve_integration.py -q

The app is built by `infer.serving.deployment:app_builder` (a YAML preset + overrides, no
model_dir: the tiny random-init model) exactly as `serve run cluster/serve.yaml`
builds it. It checks: a synthetic video by URI and by upload gives well-formed
events equal to CaptionEngine called directly; every bad or hostile request of
bench/serve_cases.py gets its 4xx (never a 5xx) and the replica keeps
serving; a burst over max_queued_requests gets quick 503s while every accepted
request completes.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml

from bench.serve_cases import bad_requests, free_port, make_video_tree, post_json, post_upload, send, serve_test_config, wait_healthy
from bench.serve_engine import direct_caption, synthetic_videos, tiny_engine

pytestmark = pytest.mark.integration
MAX_ONGOING = 2
MAX_QUEUED = 2


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    base = tmp_path_factory.mktemp("serve_int")
    videos = synthetic_videos(base / "corpus")
    return make_video_tree(base, videos[0])


@pytest.fixture(scope="module")
def app_url(ray_local, tree, tmp_path_factory):
    from ray import serve

    from infer.loading import RANDOM_MODEL
    from infer.serving.deployment import app_builder

    cfg = serve_test_config(tree, min_replicas=1, max_replicas=1, max_ongoing_requests=MAX_ONGOING,
                            max_queued_requests=MAX_QUEUED, num_cpus_per_replica=0.5)
    preset = tmp_path_factory.mktemp("preset") / "serve-test.yaml"
    data = cfg.to_dict()
    data["infer"]["max_events"] = 30  # lowered again by the override below: both paths of app_builder
    preset.write_text(yaml.safe_dump(data))
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = app_builder({"config": str(preset), "model_dir": RANDOM_MODEL, "overrides": ["infer.max_events=8"]})
        serve.run(app, name="padcap", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, 120)
        yield url, cfg
    finally:
        serve.shutdown()  # the shared local instance (tests/conftest.py) stays for the next module


def _events(body: dict) -> list[tuple[float, float, str]]:
    return [(e["start"], e["end"], e["caption"]) for e in body["events"]]


def test_uri_and_upload_match_the_engine(app_url, tree):
    url, cfg = app_url
    status, by_uri, headers = post_json(url, {"video": str(tree.good)})
    assert status == 200, by_uri
    assert set(by_uri) == {"video_id", "duration", "events", "timings", "model", "segments_kept", "segments_total"}
    assert headers["x-request-id"] and 0 < by_uri["segments_kept"] == by_uri["segments_total"]
    for e in by_uri["events"]:
        assert 0 <= e["start"] <= e["end"] <= by_uri["duration"] + 1e-6 and isinstance(e["caption"], str)
        assert isinstance(e["capped"], bool)
    status, by_upload, _ = post_upload(url, [("file", "good.mp4", "video/mp4", tree.good.read_bytes())])
    assert status == 200, by_upload
    factory, _, cfg2 = tiny_engine(cfg)
    direct = direct_caption(factory, cfg2, tree.good, "good")
    expected = [(float(e.start), float(e.end), str(e.caption)) for e in direct.events]
    assert _events(by_uri) == expected
    assert _events(by_upload) == expected
    assert by_uri["duration"] == pytest.approx(direct.duration)


def test_model_routes_and_openapi(app_url):
    url, _ = app_url
    status, info, _ = send(url, "GET", "/v1/model")
    assert status == 200 and info["decoding"]["max_events"] == 8 and info["config_hash"]
    status, spec, _ = send(url, "GET", "/openapi.json")
    assert status == 200 and "/v1/captions" in spec["paths"]
    status, health, _ = send(url, "GET", "/healthz")
    # the replica built its engine in its constructor: Serve sent it requests only once it was built, and
    # the requests after it (other tests') never built another
    assert status == 200 and health["engine"] == {"builds": 1, "built_at_start": True, "fault": None}


def test_bad_requests_are_4xx_and_the_replica_keeps_serving(app_url, tree):
    url, _ = app_url
    cases = bad_requests(tree)
    assert len(cases) >= 20
    wrong = []
    for case in cases:
        status, body, headers = case.send(url)
        if status >= 500 or status != case.expected:
            wrong.append((case.name, case.expected, status, body))
    assert not wrong, "\n".join(map(str, wrong))
    status, body, _ = post_json(url, {"video": str(tree.good), "options": {"max_events": 2}})
    assert status == 200 and len(body["events"]) <= 2, body
    status, health, _ = send(url, "GET", "/healthz")
    assert status == 200 and health["requests"].get("rejected", 0) > 0


def test_burst_over_the_queue_gets_503_and_accepted_requests_complete(app_url, tree):
    url, _ = app_url
    n = 12
    video = tree.good.read_bytes()

    def one(i: int):
        t0 = time.perf_counter()
        if i % 2:
            status, body, _ = post_upload(url, [("file", f"b{i}.mp4", None, video)], timeout=300)
        else:
            status, body, _ = post_json(url, {"video": str(tree.good)}, timeout=300)
        return status, body, time.perf_counter() - t0

    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(one, range(n)))
    statuses = [s for s, _, _ in results]
    assert set(statuses) <= {200, 503}, statuses
    assert statuses.count(503) >= 1, statuses
    assert statuses.count(200) >= 1, statuses
    ok_time = max(t for s, _, t in results if s == 200)
    for status, body, elapsed in results:
        if status == 200:
            assert body["events"] is not None and body["duration"] > 0
        else:
            assert elapsed < ok_time  # refused at once, not after waiting in a queue
    status, body, _ = post_json(url, {"video": str(tree.good)})
    assert status == 200, body
