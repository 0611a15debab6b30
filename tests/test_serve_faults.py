"""What a replica does when something goes wrong: a decode that hangs or times out, an engine that
raises, a device fault, a replica killed mid-upload. CaptionService called directly and its FastAPI app
over real HTTP on 127.0.0.1 (uvicorn, no Ray), with the engine and videos of tests/test_serve_service.py.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from bench.serve_cases import events_of, free_port, post_json, wait_healthy
from bench.serve_engine import StandInEngine
from infer.serving.errors import RequestError
from infer.serving.service import CaptionService
from tests.support.waiting import until
from tests.test_serve_service import parts, run, service, tree  # noqa: F401 - the module's fixtures


def test_decode_timeout_is_a_422_and_frees_the_loop(service, tree):
    import dataclasses

    cfg = dataclasses.replace(service.cfg, serve=dataclasses.replace(service.cfg.serve, decode_timeout_s=0.5))
    release, started = threading.Event(), threading.Event()

    def slow(path, annotation):
        started.set()
        release.wait(10)
        raise RuntimeError("released")

    svc = CaptionService(cfg, service._engine_factory, service.card, featurizer=slow)
    try:
        async def scenario():
            t0 = time.perf_counter()
            task = asyncio.ensure_future(svc.caption_uri(str(tree.good)))
            await until(started.is_set, "the decode to start")
            free = not task.done() and not release.is_set()  # the loop runs while the decode thread blocks
            with pytest.raises(RequestError) as info:
                await task
            return free, info.value, time.perf_counter() - t0

        free, err, elapsed = run(scenario())
        assert free and err.status == 422 and err.code == "decode_timeout" and elapsed < 5  # 10 s without the timeout
    finally:
        release.set()
        svc.close()


def test_stuck_decodes_are_killed_and_the_replica_keeps_serving(parts, tree, tmp_path):
    # serve.decode_timeout_s must free what the stuck decode held: with 2 decode workers,
    # 4 files whose decode never returns, then a good file that must be served as usual.
    import dataclasses
    import os
    import shutil

    from bench.serve_cases import hanging_reader

    factory, card, cfg = parts
    cfg = dataclasses.replace(cfg, serve=dataclasses.replace(cfg.serve, decode_timeout_s=3.0, decode_workers=2))
    hang = tmp_path / "hang.mp4"
    shutil.copy(tree.good, hang)
    svc = CaptionService(cfg, factory, card, reader_factory=hanging_reader)
    try:
        async def good():
            t0 = time.perf_counter()
            body = await svc.caption_file(str(tree.good), "good.mp4")
            return body, time.perf_counter() - t0

        async def stuck():
            return await asyncio.gather(*(svc.caption_file(str(hang), f"hang{i}.mp4") for i in range(4)),
                                        return_exceptions=True)

        first, _ = run(good())  # starts a worker
        _, usual = run(good())
        errors = run(stuck())
        assert all(isinstance(e, RequestError) and e.status == 422 and e.code == "decode_timeout" for e in errors)
        killed = list(svc.decoders.killed)
        assert len(killed) >= 2 and svc.counters["decode_workers_killed"] >= 2
        after, took = run(good())
        assert events_of(after) == events_of(first)
        assert took < usual + 30  # generous: at most the boot of a replacement worker on a busy box
        for pid in killed:  # the stuck decoders are gone, not left running
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        assert 1 <= len(svc.decoders.pids()) <= 2
    finally:
        svc.close()


def test_a_warm_service_is_ready_when_built(parts):
    """warm=True (a Serve replica, which takes requests once its constructor returns): the decode
    workers have booted and the engine is built before the constructor returns. The soak's
    replacement replica (bench/soak.py --kill-replica-at) made its first request wait 15 s for
    its workers' boot (p99 0.7 s before the kill) when the constructor returned at once."""
    factory, card, cfg = parts
    svc = CaptionService(cfg, factory, card, warm=True)
    try:
        assert svc._engine is not None
        assert svc.health()["engine"] == {"builds": 1, "built_at_start": True, "fault": None}
        svc.check_health()  # Serve's health check passes
        assert svc.decoders.count() == svc.decoders.size == len(svc.decoders.pids())
        assert all(w.ready for w in svc.decoders._idle)
    finally:
        svc.close()


def test_a_cuda_error_fails_the_health_check_and_is_not_retried(parts, tree):
    """The engine raises a CUDA error in a step (a device-side assert; the real engine, its step made to raise):
    the request fails, no video is run again in this process (its CUDA context would be poisoned), later
    requests are refused, /healthz says engine_failed and Serve's health check fails, so Serve replaces
    the replica. Without the fault the same service answers and passes (a lazily built engine: built_at_start
    False)."""
    factory, card, cfg = parts
    steps = []

    def faulty_factory(infer_cfg):
        eng = factory(infer_cfg)
        forward = eng.runner.forward

        def step(batch):
            steps.append(batch.attn.tokens)
            if len(steps) == 2:  # mid-video: the prefill ran, then the device fails
                raise RuntimeError("CUDA error: device-side assert triggered")
            return forward(batch)

        eng.runner.forward = step
        return eng

    svc = CaptionService(cfg, faulty_factory, card)
    try:
        assert svc.health()["engine"] == {"builds": 0, "built_at_start": False, "fault": None}
        with pytest.raises(RuntimeError, match="device-side assert"):
            run(svc.caption_uri(str(tree.good)))
        assert len(steps) == 2  # not retried alone on the poisoned context
        with pytest.raises(RuntimeError, match="device-side assert"):
            run(svc.caption_uri(str(tree.good)))
        assert len(steps) == 2
        health = svc.health()
        assert health["status"] == "engine_failed" and health["engine"]["builds"] == 1
        assert health["engine"]["fault"] == "RuntimeError: CUDA error: device-side assert triggered"
        with pytest.raises(RuntimeError, match="cannot be reused: RuntimeError: CUDA error: device-side assert"):
            svc.check_health()
    finally:
        svc.close()


def test_engine_failure_is_a_500_with_a_request_id(service, tree):
    import uvicorn

    from infer.serving.api import build_app

    class Broken(StandInEngine):
        def __init__(self, cfg):
            pass

        def decode(self, samples):
            raise RuntimeError("engine bug")

    svc = CaptionService(service.cfg, Broken, service.card)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(lambda: svc), host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_healthy(f"http://127.0.0.1:{port}", 30)
        status, body, headers = post_json(f"http://127.0.0.1:{port}", {"video": str(tree.good)})
        assert status == 500 and body["error"]["code"] == "internal"
        assert body["error"]["request_id"] == headers["x-request-id"] and "engine bug" not in json.dumps(body)
    finally:
        server.should_exit = True
        thread.join(10)
        svc.close()


def test_temp_files_of_a_killed_replica_are_removed_by_the_next(parts, tmp_path):
    """A replica killed mid-upload cannot delete its spooled upload; spool files name their process,
    and a new service removes those of processes no longer alive (found by bench/soak.py
    --kill-replica-at: 1 temp file left in the spool after the kill, 0 in the plain soak)."""
    import subprocess

    from infer.serving.bodies import spool_prefix
    from pipeline.config import Config

    dead = subprocess.Popen(["true"])
    dead.wait()
    orphan = tmp_path / f"padcap-upload-{dead.pid}-abc.mp4"
    mine = tmp_path / f"{spool_prefix('upload')}def.mp4"
    other = tmp_path / "notes.txt"
    for f in (orphan, mine, other):
        f.write_bytes(b"x")
    factory, card, cfg = parts
    cfg = Config.from_json(cfg.to_json())
    cfg.serve.upload_dir = str(tmp_path)
    svc = CaptionService(cfg, factory, card, featurizer=lambda path, annotation: None)
    svc.close()
    assert not orphan.exists() and mine.exists() and other.exists()
