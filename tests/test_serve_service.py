"""CaptionService called directly, and its FastAPI app over real HTTP on 127.0.0.1 (uvicorn, no Ray).

The engine is the real CaptionEngine around the tiny PadCaptioner (random init,
seeded) and the features come from the real featurizer on real synthetic mp4s.
The hostile-request list (bench/serve_cases.py) runs here against the
plain app; tests/test_serve_integration.py runs it again through Ray Serve.
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest

from bench.serve_cases import (
    BOUNDARY,
    bad_requests,
    events_of,
    free_port,
    make_video_tree,
    post_json,
    post_upload,
    send,
    serve_test_config,
    wait_healthy,
    well_formed_body,
)
from bench.serve_engine import direct_caption, synthetic_videos, tiny_engine
from infer.serving.errors import RequestError
from infer.serving.service import CaptionService
from tests.support.waiting import until, until_sync


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    base = tmp_path_factory.mktemp("serve")
    videos = synthetic_videos(base / "corpus")
    return make_video_tree(base, videos[0])


@pytest.fixture(scope="module")
def parts(tree):
    cfg = serve_test_config(tree)
    factory, card, cfg = tiny_engine(cfg)
    return factory, card, cfg


@pytest.fixture(scope="module")
def service(parts):
    factory, card, cfg = parts
    svc = CaptionService(cfg, factory, card)
    yield svc
    svc.close()


def run(coro):
    return asyncio.run(coro)


# ------------------------------------------------------------------------ the service, directly


def test_uri_matches_engine_called_directly(service, parts, tree):
    factory, _, cfg = parts
    body = run(service.caption_uri(str(tree.good)))
    well_formed_body(body)
    assert body["video_id"] == "good"
    direct = direct_caption(factory, cfg, tree.good, "good")
    assert events_of(body) == events_of(direct)
    assert body["duration"] == pytest.approx(direct.duration)


def test_upload_path_gives_the_sameevents_of(service, tree):
    by_uri = run(service.caption_uri(str(tree.good)))
    by_file = run(service.caption_file(str(tree.good), "clip.mp4"))
    assert by_file["video_id"] == "clip"
    assert events_of(by_file) == events_of(by_uri)


def test_options_reach_the_engine(service, parts, tree):
    factory, _, cfg = parts
    body = run(service.caption_uri(str(tree.good), {"max_events": 1, "max_branch_tokens": 3}))
    assert len(body["events"]) <= 1
    direct = direct_caption(factory, cfg, tree.good, "good", max_events=1, max_branch_tokens=3)
    assert events_of(body) == events_of(direct)


def test_concurrent_requests_share_decode_steps(service, parts, tree):
    """Requests in flight together are decoded in the same steps (rows of several videos per
    step), whatever their decoding options; a request that arrives mid-decode joins the
    running batch; every one gets the captions it would get alone."""
    factory, card, cfg = parts
    spans_per_step: list[int] = []
    engines = []
    all_three, second_step, late_queued = threading.Event(), threading.Event(), threading.Event()

    def recording_factory(infer_cfg):
        eng = factory(infer_cfg)
        forward = eng.runner.forward

        def counting(batch):
            spans_per_step.append(len(eng.stats["step_log"]))
            batcher = svc._batcher
            # the first three start together (each one's media decodes on its own, so one may come late)
            if not all_three.wait(0) and not until_sync(lambda: len(batcher._pending) + batcher.in_flight >= 3):
                raise TimeoutError("the first three requests never reached the engine")
            all_three.set()
            if batcher.in_flight == 3 and not second_step.is_set():  # all three running: wait for the late one
                second_step.set()
                late_queued.wait(60)
            return forward(batch)

        eng.runner.forward = counting
        engines.append(eng)
        return eng

    service.decoders.warm(4, wait=True)  # the requests' decodes end together, as on a started replica
    svc = CaptionService(cfg, recording_factory, card, featurizer=service._featurize)
    names = ["a.mp4", "b.mp4", "c.mp4"]
    try:
        async def scenario():
            first = [asyncio.ensure_future(svc.caption_file(str(tree.good), n, {"max_events": 2} if n == "b.mp4" else None))
                     for n in names]
            await until(second_step.is_set, "a decode step with the first three in the engine")
            late = asyncio.ensure_future(svc.caption_file(str(tree.good), "late.mp4"))
            await until(lambda: any(p.sample.video_id == "late" for p in svc._batcher._pending),
                        "the late request queued for the engine")
            late_queued.set()
            return await asyncio.gather(*first, late)

        bodies = run(scenario())
    finally:
        svc.close()
    alone = events_of(direct_caption(factory, cfg, tree.good, "good"))
    alone_b = events_of(direct_caption(factory, cfg, tree.good, "good", max_events=2))
    assert [b["video_id"] for b in bodies] == ["a", "b", "c", "late"]
    assert [events_of(b) for b in bodies] == [alone, alone_b, alone, alone]  # b's own options, in the same batch
    assert len(engines) == 1 and max(r.videos for r in engines[0].stats["step_log"]) >= 2  # videos share steps
    assert svc._batcher.max_in_flight == min(4, svc._batcher.max_batch)  # the late one joined the running batch


@pytest.mark.parametrize("options,fragment", [
    ({"max_events": 0}, "options.max_events"),
    ({"max_events": 9}, "over this server's limit of 8"),
    ({"max_branch_tokens": 13}, "infer.max_branch_tokens"),
    ({"top_p": 1.5}, "options.top_p"),
    ({"seed": -1}, "options.seed"),
    ({"temperature": "hot"}, "options.temperature"),
    ({"beam_size": 4}, "options.beam_size: unknown field"),
    ([1, 2], "options must be a JSON object"),
])
def test_bad_options_name_the_option(service, options, fragment):
    with pytest.raises(RequestError) as info:
        service.check_options(options)
    assert info.value.status == 422 and fragment in info.value.message


def test_refusals_come_before_any_decoding(service, tree):
    calls = []
    svc = CaptionService(service.cfg, service._engine_factory, service.card, featurizer=lambda p, a: calls.append(p))
    try:
        for uri, status in [(str(tree.files["link_out"]), 403), (str(tree.files["long"]), 422), (str(tree.files["big"]), 413),
                            (str(tree.files["wide"]), 422), (str(tree.files["text"]), 422)]:
            with pytest.raises(RequestError) as info:
                run(svc.caption_uri(uri))
            assert info.value.status == status, (uri, info.value.message)
        assert calls == []  # every one was refused by the policy or the header probe
    finally:
        svc.close()


def test_decoder_failures_are_422_with_the_clients_name(service, tree):
    def boom(path, annotation):
        raise RuntimeError(f"decoder exploded on {path}")

    svc = CaptionService(service.cfg, service._engine_factory, service.card, featurizer=boom)
    try:
        with pytest.raises(RequestError) as info:
            run(svc.caption_file(str(tree.good), "mine.mp4"))
        assert info.value.status == 422
        assert "mine.mp4" in info.value.message and str(tree.good) not in info.value.message
    finally:
        svc.close()


def test_model_info_and_health(service):
    info = service.model_info()
    assert info["model"] and len(info["config_hash"]) == 12
    assert info["decoding"]["max_events"] == 8
    assert set(info["options"]) == {"max_events", "max_branch_tokens", "temperature", "top_p", "seed"}
    assert service.health()["status"] == "ok"


def test_health_reports_what_the_replica_holds_and_idle_holds_none(service, tree):
    """/healthz's resources (what the soak, bench/soak.py, watches): after requests, and one refused
    mid-way, nothing is in flight and no KV page is allocated or promised; the decode workers live."""
    import os

    run(service.caption_uri(str(tree.good)))
    with pytest.raises(RequestError):
        run(service.caption_uri(str(tree.files["truncated"])))
    res = service.health()["resources"]
    assert res["pid"] == os.getpid()
    assert res["in_flight"] == 0 and res["kv_pages_in_use"] == 0
    assert res["decode_workers"] == len(service.decoders.pids()) >= 1


# ------------------------------------------------------------------------ the FastAPI app over HTTP


@pytest.fixture(scope="module")
def base_url(service):
    import uvicorn

    from infer.serving.api import build_app

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(lambda: service), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, 30)
    yield url
    server.should_exit = True
    thread.join(10)


def test_http_uri_and_upload(base_url, tree, service):
    status, body, headers = post_json(base_url, {"video": str(tree.good), "options": {"max_events": 4}})
    assert status == 200, body
    well_formed_body(body)
    assert headers.get("x-request-id")
    status2, body2, _ = post_upload(base_url, [("file", "good.mp4", "video/mp4", tree.good.read_bytes()),
                                              ("options", None, "application/json", b'{"max_events": 4}')])
    assert status2 == 200, body2
    assert events_of(body2) == events_of(body) and body2["video_id"] == "good"


def test_upload_file_name_is_only_a_label(base_url, tree, tmp_path):
    status, body, _ = post_upload(base_url, [("file", "../../../../tmp/evil name.mp4", None, tree.good.read_bytes())])
    assert status == 200, body
    assert body["video_id"] == "evil_name"
    assert not Path("/tmp/evil name.mp4").exists()


BAD = None


def _bad(tree):
    global BAD
    if BAD is None:
        BAD = {c.name: c for c in bad_requests(tree)}
    return BAD


def test_at_least_twenty_kinds_of_bad_requests(tree):
    assert len(_bad(tree)) >= 20


def test_bad_requests_get_the_right_4xx(base_url, tree):
    wrong = []
    for case in _bad(tree).values():
        status, body, headers = case.send(base_url)
        ok = status == case.expected and (case.by_http_layer or (
            isinstance(body, dict) and body["error"]["message"] and headers.get("x-request-id")))
        if not ok:
            wrong.append((case.name, case.expected, status, body))
    assert not wrong, "\n".join(map(str, wrong))
    status, body, _ = post_json(base_url, {"video": str(tree.good)})  # still serving
    assert status == 200, body


def test_json_number_with_too_many_digits_is_a_400_not_a_500(base_url, tree):
    """json.loads raises a plain ValueError past Python's int digit limit; that is the client's JSON."""
    huge = b"9" * 5000  # well under max_json_bytes, over sys.get_int_max_str_digits() (4300)
    body = b'{"video": "%s", "options": {"seed": %s}}' % (str(tree.good).encode(), huge)
    status, reply, headers = send(base_url, "POST", "/v1/captions", body, {"Content-Type": "application/json"})
    assert status == 400 and reply["error"]["code"] == "malformed_json", reply
    assert "digits" in reply["error"]["message"] and headers.get("x-request-id")
    status, reply, _ = post_upload(base_url, [("file", "a.mp4", None, tree.good.read_bytes()),
                                              ("options", None, None, b'{"seed": %s}' % huge)])
    assert status == 400 and reply["error"]["code"] == "malformed_json", reply
    assert "the 'options' field" in reply["error"]["message"]


def test_client_disconnect_mid_upload_is_survived(base_url, tree):
    import socket
    from urllib.parse import urlsplit

    u = urlsplit(base_url)
    with socket.create_connection((u.hostname, u.port), timeout=10) as s:
        s.sendall((f"POST /v1/captions HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary={BOUNDARY}\r\n"
                   f"Content-Length: 100000\r\n\r\n--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; "
                   f"filename=\"a.mp4\"\r\n\r\n").encode() + tree.good.read_bytes()[:5000])
        s.shutdown(socket.SHUT_WR)
        reply = s.recv(65536)
    assert not reply.startswith(b"HTTP/1.1 5")
    status, body, _ = post_json(base_url, {"video": str(tree.good)})
    assert status == 200, body


def test_openapi_and_info_routes(base_url):
    status, spec, _ = send(base_url, "GET", "/openapi.json")
    assert status == 200
    post = spec["paths"]["/v1/captions"]["post"]
    assert set(post["requestBody"]["content"]) == {"application/json", "multipart/form-data"}
    assert "CaptionRequest" in spec["components"]["schemas"] and "CaptionOptions" in spec["components"]["schemas"]
    assert {"/healthz", "/v1/model"} <= set(spec["paths"])
    assert send(base_url, "GET", "/healthz")[0] == 200
    status, info, _ = send(base_url, "GET", "/v1/model")
    assert status == 200 and info["config_hash"]


def test_python_client_and_cli(base_url, tree, capsys):
    from infer.serving.client import CaptionClient, CaptionError, main

    client = CaptionClient(base_url)
    by_uri = client.caption(uri=str(tree.good), options={"max_events": 2})
    by_path = client.caption(path=tree.good, options={"max_events": 2})
    assert events_of(by_uri) == events_of(by_path) and len(by_uri["events"]) <= 2
    with pytest.raises(CaptionError) as info:
        client.caption(uri=str(tree.files["link_out"]))
    assert info.value.status == 403 and info.value.request_id
    assert client.model()["model"] == client.health()["model"]
    assert main([str(tree.good), "--url", base_url]) == 0
    out = capsys.readouterr().out
    assert "start" in out and "caption" in out and "timings:" in out
    for e in by_uri["events"][:1]:
        assert f"{e['start']:8.2f}" in out
    assert main([str(tree.good), "--url", base_url, "--upload", "--option", "max_events=1", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["events"]) <= 1
    assert main([str(tree.files["secret"]), "--url", base_url]) == 2
    assert "403" in capsys.readouterr().err


def test_serve_cli_starts_ray_as_the_cluster_section_says(monkeypatch):
    """`python -m infer.serving.deployment --set cluster.num_cpus=1` must size the local Ray instance, not drop the value."""
    import ray
    from ray import serve

    from infer.serving import deployment as serve_module

    calls, started = [], []
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.setattr(serve, "start", lambda **kw: started.append(kw))
    monkeypatch.setattr(serve, "run", lambda app, **kw: started.append(kw))
    assert serve_module.main(["--set", "cluster.num_cpus=1", "--set", "serve.port=8123", "--random-model"]) == 0
    assert len(calls) == 1 and calls[0].get("num_cpus") == 1 and calls[0].get("_node_ip_address") == "127.0.0.1"
    assert started[0]["http_options"] == {"host": "127.0.0.1", "port": 8123}
