"""The soak's mixed traffic, on Locust used as a library: its own process (Locust patches the
standard library for gevent, which Ray must not share), started by bench/soak.py.

    python -m bench.soak_traffic --url http://127.0.0.1:PORT --tree tree.json --duration-s 1800 --out records.jsonl

Users (each a Locust `User`, fixed counts):
- GoodUser (`--good-users`): good requests, by URI (JSON) and by upload (multipart), through
  Locust's HttpSession; a 503 is back-pressure, not a failure.
- HostileUser: the hostile and malformed requests of the serving tests
  (bench/serve_cases.py `bad_requests`), round robin, each with the 4xx it must get.
- AbuseUser: clients that leave: a disconnect mid-upload (half the body sent, then the socket
  closed), a disconnect mid-decode (the whole request sent, the socket closed before the
  answer), a request cancelled by the client's own timeout; and oversized bodies (an honest
  Content-Length over the cap, a chunked body that never stops).
- BurstUser: every `--burst-every-s`, `--burst-size` good requests at once (more than the
  queue limit: the ones over it must get 503 at once).

Every request is one JSON line in `--out` (flushed as it ends, so a killed run keeps what it
did): t0, t1 (epoch seconds), kind, name, status (None: no answer), expected (the status a
hostile request must get), intended_abort (the client left on purpose), service_error (the
body is the service's own error JSON), error (the client's exception, if any).
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import socket
import sys
import time
from pathlib import Path
from typing import Any

import gevent  # locust's own dependency
from locust import HttpUser, User, between, constant, task
from locust.env import Environment

from bench.serve_cases import BOUNDARY, MAX_UPLOAD, VideoTree, bad_requests, multipart, post_json, send

GOOD_TIMEOUT_S = 300.0  # a good request without an answer in this long is `unanswered`


class Recorder:
    """Appends one JSON line per request to the records file."""

    def __init__(self, path: Path):
        self.fh = open(path, "a", buffering=1)

    def add(self, t0: float, kind: str, name: str, status: int | None, *, expected: int | None = None,
            intended_abort: bool = False, body: Any = None, error: str = "") -> None:
        err = body.get("error") if isinstance(body, dict) else None
        self.fh.write(json.dumps({"t0": round(t0, 4), "t1": round(time.time(), 4), "kind": kind, "name": name,
                                  "status": status, "expected": expected, "intended_abort": intended_abort,
                                  "service_error": isinstance(err, dict) and "request_id" in err,
                                  "error": error[:200], "body": body[:200] if isinstance(body, str) else None}) + "\n")


class Shared:
    """What every user reads: the URL, the video tree, its bytes, the recorder, the knobs."""

    url = ""
    tree: VideoTree | None = None
    video = b""
    rec: Recorder | None = None
    burst_size = 8
    good_latencies: list[float] = []  # recent good-request latencies: sets when a "mid-decode" disconnect happens


def _fire(user: User, kind: str, t0: float, status: int | None, exc: Exception | None = None) -> None:
    """Tell Locust's statistics about a request made outside its HttpSession."""
    user.environment.events.request.fire(request_type="POST", name=kind, response_time=(time.time() - t0) * 1000,
                                         response_length=0, response=None, context={"status": status}, exception=exc)


def _json_or_none(r) -> Any:
    try:
        return r.json()
    except Exception:  # noqa: BLE001 - any body that is not JSON
        return None


class GoodUser(HttpUser):
    fixed_count = 2
    wait_time = between(0.2, 1.0)

    def _good(self, kind: str, **kw) -> None:
        t0 = time.time()
        try:
            with self.client.post("/v1/captions", name=kind, timeout=GOOD_TIMEOUT_S, catch_response=True, **kw) as r:
                status = r.status_code or None
                if status in (200, 503):
                    r.success()
                body = (_json_or_none(r) or r.text[:200]) if status else None
                error = "" if status else repr(r.error)
        except Exception as e:  # noqa: BLE001 - recorded as no answer
            status, body, error = None, None, repr(e)
        if status == 200:
            Shared.good_latencies = (Shared.good_latencies + [time.time() - t0])[-50:]
        Shared.rec.add(t0, kind, kind, status, body=body, error=error)

    @task(1)
    def by_uri(self) -> None:
        self._good("good_uri", json={"video": str(Shared.tree.good)})

    @task(1)
    def by_upload(self) -> None:
        self._good("good_upload", files={"file": ("good.mp4", Shared.video, "video/mp4")})


class HostileUser(User):
    fixed_count = 1
    wait_time = between(0.1, 0.5)

    def on_start(self) -> None:
        self.cases = bad_requests(Shared.tree)
        self.i = 0

    @task
    def hostile(self) -> None:
        case = self.cases[self.i % len(self.cases)]
        self.i += 1
        t0 = time.time()
        try:
            status, body, _ = case.send(Shared.url)
        except Exception as e:  # noqa: BLE001
            Shared.rec.add(t0, "hostile", case.name, None, expected=case.expected, error=repr(e))
            _fire(self, "hostile", t0, None, e)
            return
        Shared.rec.add(t0, "hostile", case.name, status, expected=case.expected, body=body)
        _fire(self, "hostile", t0, status)


def _connect() -> socket.socket:
    host, port = Shared.url.split("//", 1)[1].rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=30)


def _upload_request(body: bytes) -> bytes:
    head = (f"POST /v1/captions HTTP/1.1\r\nHost: soak\r\nContent-Type: multipart/form-data; boundary={BOUNDARY}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


class AbuseUser(User):
    fixed_count = 1
    wait_time = between(0.5, 2.0)

    @task(2)
    def disconnect_mid_upload(self) -> None:
        t0 = time.time()
        raw = _upload_request(multipart([("file", "leave.mp4", "video/mp4", Shared.video)]))
        with _connect() as s:
            s.sendall(raw[: len(raw) // 2])
            gevent.sleep(0.2)
        Shared.rec.add(t0, "abort_upload", "disconnect mid-upload", None, intended_abort=True)
        _fire(self, "abort_upload", t0, None)

    @task(2)
    def disconnect_mid_decode(self) -> None:
        lat = sorted(Shared.good_latencies) or [1.0]
        wait = lat[len(lat) // 2] * random.uniform(0.2, 0.8)
        t0 = time.time()
        with _connect() as s:
            s.sendall(_upload_request(multipart([("file", "leave.mp4", "video/mp4", Shared.video)])))
            gevent.sleep(wait)
        Shared.rec.add(t0, "abort_decode", "disconnect mid-decode", None, intended_abort=True)
        _fire(self, "abort_decode", t0, None)

    @task(2)
    def cancelled_by_client_timeout(self) -> None:
        lat = sorted(Shared.good_latencies) or [1.0]
        timeout = max(0.05, lat[len(lat) // 2] * random.uniform(0.2, 0.8))
        t0 = time.time()
        try:
            status, body, _ = post_json(Shared.url, {"video": str(Shared.tree.good)}, timeout=timeout)
        except (TimeoutError, OSError) as e:
            Shared.rec.add(t0, "client_timeout", "cancelled by the client's timeout", None, intended_abort=True, error=repr(e))
            _fire(self, "client_timeout", t0, None)
            return
        Shared.rec.add(t0, "client_timeout", "answered before the client's timeout", status, body=body)
        _fire(self, "client_timeout", t0, status)

    @task(1)
    def oversized_declared(self) -> None:
        data = multipart([("file", "big.mp4", "video/mp4", b"\0" * (MAX_UPLOAD + 1024))])
        self._expect_413("oversized body, honest Content-Length", data)

    @task(1)
    def oversized_chunked(self) -> None:
        def endless():
            yield multipart([("file", "big.mp4", "video/mp4", b"")], close=False)[:-2]
            for _ in range(MAX_UPLOAD // 65536 + 8):
                yield b"\0" * 65536

        self._expect_413("oversized body, chunked", endless())

    def _expect_413(self, name: str, body) -> None:
        t0 = time.time()
        headers = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}
        try:
            status, answer, _ = send(Shared.url, "POST", "/v1/captions", body, headers)
        except (OSError, http.client.HTTPException) as e:
            Shared.rec.add(t0, "oversized", name, None, expected=413, error=repr(e))
            _fire(self, "oversized", t0, None, e)
            return
        Shared.rec.add(t0, "oversized", name, status, expected=413, body=answer)
        _fire(self, "oversized", t0, status)


class BurstUser(User):
    fixed_count = 1
    wait_time = constant(30.0)

    @task
    def burst(self) -> None:
        def one() -> None:
            t0 = time.time()
            try:
                status, body, _ = post_json(Shared.url, {"video": str(Shared.tree.good)}, timeout=GOOD_TIMEOUT_S)
            except (OSError, http.client.HTTPException) as e:
                Shared.rec.add(t0, "burst", "burst over the queue limit", None, error=repr(e))
                _fire(self, "burst", t0, None, e)
                return
            Shared.rec.add(t0, "burst", "burst over the queue limit", status, body=body)
            _fire(self, "burst", t0, status)

        gevent.joinall([gevent.spawn(one) for _ in range(Shared.burst_size)])


def load_tree(path: Path) -> VideoTree:
    d = json.loads(path.read_text())
    return VideoTree(Path(d["root"]), Path(d["outside"]), Path(d["good"]), {k: Path(v) for k, v in d["files"].items()})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--tree", required=True, help="JSON: the video tree's paths (bench/soak.py writes it)")
    ap.add_argument("--duration-s", type=float, required=True)
    ap.add_argument("--out", required=True, help="records, one JSON line per request")
    ap.add_argument("--good-users", type=int, default=2)
    ap.add_argument("--burst-every-s", type=float, default=30.0)
    ap.add_argument("--burst-size", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    random.seed(args.seed)
    Shared.url, Shared.tree = args.url.rstrip("/"), load_tree(Path(args.tree))
    Shared.video, Shared.rec, Shared.burst_size = Shared.tree.good.read_bytes(), Recorder(Path(args.out)), args.burst_size
    GoodUser.fixed_count = args.good_users
    BurstUser.wait_time = constant(args.burst_every_s)
    users = [GoodUser, HostileUser, AbuseUser, BurstUser]
    env = Environment(user_classes=users, host=Shared.url, stop_timeout=GOOD_TIMEOUT_S)
    runner = env.create_local_runner()
    total = sum(u.fixed_count for u in users)
    runner.start(total, spawn_rate=total)
    gevent.spawn_later(args.duration_s, runner.quit)  # quit: users finish the request they are in (stop_timeout)
    runner.greenlet.join()
    stats = env.stats.total
    print(json.dumps({"locust_requests": stats.num_requests, "locust_failures": stats.num_failures}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
