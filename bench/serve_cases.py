"""Shared material for the serving tests: a video tree with hostile files, raw HTTP, bad requests.

    files = make_video_tree(tmp_dir, good_video)     # VideoTree: paths of good and hostile files
    cfg = serve_test_config(files)                   # a Config whose serve limits these files cross
    status, body, headers = send(base_url, "POST", "/v1/captions", body, headers)
    for case in bad_requests(files): case.name, case.expected, case.send(base_url)

Requests go out through http.client so that headers can lie (Content-Length larger
than the body, chunked bodies, no Content-Type): requests/httpx would fix them.
The same cases run against the plain FastAPI app (tests/test_serve_service.py)
and through Ray Serve (tests/test_serve_integration.py).
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from bench.mp4 import moving_square, tone, write_mp4
from pipeline.config import Config

MAX_UPLOAD = 3 * 1024 * 1024
MAX_DURATION = 20.0
MAX_PIXELS = 160 * 160


@dataclass
class VideoTree:
    root: Path  # the allowed root
    outside: Path
    good: Path  # a real synthetic video inside the root
    files: dict[str, Path]


def make_video_tree(base: Path, good_video: Path) -> VideoTree:
    """root/ with the good video and hostile files; outside/ and root-evil/ beside it."""
    root, outside, evil = base / "videos", base / "outside", base / "videos-evil"
    for d in (root, outside, evil):
        d.mkdir(parents=True, exist_ok=True)
    good = root / "good.mp4"
    shutil.copyfile(good_video, good)
    data = good.read_bytes()
    f = {
        "text": root / "text.mp4",
        "empty": root / "empty.mp4",
        "truncated": root / "truncated.mp4",
        "audio_only": root / "audio_only.mp4",
        "long": root / "long.mp4",
        "wide": root / "wide.mp4",
        "big": root / "big.mp4",
        "notes": root / "notes.txt",
        "folder": root / "folder.mp4",
        "fifo": root / "pipe.mp4",
        "link_out": root / "link_out.mp4",
        "linkdir": root / "linkdir",
        "secret": outside / "secret.mp4",
        "evil": evil / "x.mp4",
    }
    f["text"].write_text("this is not a video\n" * 20)
    f["empty"].write_bytes(b"")
    f["truncated"].write_bytes(data[: len(data) // 2])
    write_mp4(f["audio_only"], None, audio=tone(440, 1.0, 16000), sample_rate=16000, layout="mono")
    write_mp4(f["long"], moving_square(int(MAX_DURATION * 2 + 10), 16, 16, 0, 0), fps=2)  # 25 s at 2 fps
    write_mp4(f["wide"], np.zeros((4, 192, 192, 3), np.uint8), fps=4)
    with open(f["big"], "wb") as fh:  # sparse: over the limit without using the disk
        fh.truncate(MAX_UPLOAD + 1)
    f["notes"].write_text("notes")
    f["folder"].mkdir(exist_ok=True)
    if not f["fifo"].exists():
        os.mkfifo(f["fifo"])
    shutil.copyfile(good_video, f["secret"])
    shutil.copyfile(good_video, f["evil"])
    if not f["link_out"].is_symlink():
        f["link_out"].symlink_to(f["secret"])
        f["linkdir"].symlink_to(outside, target_is_directory=True)
    return VideoTree(root, outside, good, f)


def serve_test_config(tree: VideoTree, **serve_overrides: Any) -> Config:
    cfg = Config()
    cfg.serve.allowed_roots = [str(tree.root), "s3://media/clips"]
    cfg.serve.allowed_http_hosts = ["videos.example.org"]
    cfg.serve.max_upload_bytes = MAX_UPLOAD
    cfg.serve.max_duration_s = MAX_DURATION
    cfg.serve.max_frame_pixels = MAX_PIXELS
    cfg.serve.decode_timeout_s = 60.0
    cfg.serve.max_json_bytes = 16 * 1024
    for k, v in serve_overrides.items():
        setattr(cfg.serve, k, v)
    cfg.infer.max_events = 8
    cfg.infer.max_branch_tokens = 12
    cfg.features.device = "cpu"
    cfg.infer.device = "cpu"
    return cfg


# ------------------------------------------------------------------------ raw HTTP


def send(base_url: str, method: str, path: str, body: bytes | Iterable[bytes] | None = None,
         headers: dict[str, str] | None = None, timeout: float = 120.0) -> tuple[int, Any, dict[str, str]]:
    """One request over http.client; headers are sent exactly as given (no Content-Length fix-ups)."""
    u = urlsplit(base_url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        headers = dict(headers or {})
        chunked = body is not None and not isinstance(body, (bytes, bytearray))
        if chunked:
            headers.setdefault("Transfer-Encoding", "chunked")
        elif body is not None and not any(k.lower() == "content-length" for k in headers):
            headers["Content-Length"] = str(len(body))
        for k, v in headers.items():
            conn.putheader(k, v)
        conn.endheaders()
        try:
            if chunked:
                for piece in body:
                    conn.send(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
                conn.send(b"0\r\n\r\n")
            elif body:
                conn.send(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered early and closed; read its answer below
        r = conn.getresponse()
        raw = r.read()
        try:
            parsed = json.loads(raw) if raw else None
        except ValueError:
            parsed = raw.decode("utf-8", "replace")
        return r.status, parsed, {k.lower(): v for k, v in r.getheaders()}
    finally:
        conn.close()


def post_json(base_url: str, obj: Any, **kw) -> tuple[int, Any, dict[str, str]]:
    return send(base_url, "POST", "/v1/captions", json.dumps(obj).encode(), {"Content-Type": "application/json"}, **kw)


BOUNDARY = "padcapTestBoundary7MA4YWxk"


def multipart(parts: list[tuple[str, str | None, str | None, bytes]], boundary: str = BOUNDARY, close: bool = True) -> bytes:
    """parts: (field name, file name or None, content type or None, data) -> a multipart body."""
    out = bytearray()
    for name, filename, ctype, data in parts:
        out += f"--{boundary}\r\n".encode()
        disp = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename is not None else "")
        out += f"Content-Disposition: {disp}\r\n".encode()
        if ctype:
            out += f"Content-Type: {ctype}\r\n".encode()
        out += b"\r\n" + data + b"\r\n"
    if close:
        out += f"--{boundary}--\r\n".encode()
    return bytes(out)


def post_upload(base_url: str, parts, boundary: str = BOUNDARY, close: bool = True, headers: dict | None = None, **kw):
    h = {"Content-Type": f"multipart/form-data; boundary={boundary}"}
    h.update(headers or {})
    return send(base_url, "POST", "/v1/captions", multipart(parts, boundary, close), h, **kw)


def wait_healthy(base_url: str, timeout: float = 60.0) -> None:
    end = time.time() + timeout
    while True:
        try:
            status, _, _ = send(base_url, "GET", "/healthz", timeout=5)
            if status == 200:
                return
        except OSError:
            pass
        if time.time() > end:
            raise TimeoutError(f"{base_url} not healthy after {timeout} s")
        time.sleep(0.2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------ bad requests


@dataclass
class BadRequest:
    name: str
    expected: int  # the exact 4xx the server must answer
    send: Callable[[str], tuple[int, Any, dict[str, str]]]
    by_http_layer: bool = False  # refused by the HTTP server itself (plain text, not our JSON error)


def bad_requests(tree: VideoTree) -> list[BadRequest]:
    """Bad or hostile requests, each with the exact 4xx it must get."""
    r, f, good = tree.root, tree.files, tree.good
    video = good.read_bytes()

    def uri(u: str, expected: int, name: str, **options) -> BadRequest:
        body = {"video": u, **({"options": options} if options else {})}
        return BadRequest(name, expected, lambda base: post_json(base, body))

    def raw(name: str, expected: int, body: bytes | Iterable[bytes] | None, headers: dict, method: str = "POST",
            path: str = "/v1/captions", by_http_layer: bool = False):
        return BadRequest(name, expected, lambda base: send(base, method, path, body() if callable(body) else body, headers),
                          by_http_layer)

    def endless_upload() -> Iterable[bytes]:
        yield multipart([("file", "big.mp4", "video/mp4", b"")], close=False)[:-2]  # headers, then the data never ends
        for _ in range(MAX_UPLOAD // 65536 + 4):
            yield b"\0" * 65536

    def upload(name: str, expected: int, parts, **kw) -> BadRequest:
        return BadRequest(name, expected, lambda base: post_upload(base, parts, **kw))

    js = {"Content-Type": "application/json"}
    mp = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}
    return [
        # --- where the video is
        uri(f"{r}/../outside/secret.mp4", 403, "dotdot traversal"),
        uri(f"file://{r}/%2e%2e/outside/secret.mp4", 403, "percent-encoded traversal"),
        uri(str(f["link_out"]), 403, "symlink escape"),
        uri(f"{f['linkdir']}/secret.mp4", 403, "symlinked dir escape"),
        uri(str(f["secret"]), 403, "absolute path outside"),
        uri(f"file://{f['secret']}", 403, "file uri outside"),
        uri(str(f["evil"]), 403, "sibling dir sharing the root prefix"),
        uri("/etc/passwd", 403, "system file"),
        uri(f"{r}/missing.mp4", 404, "missing file"),
        uri(str(f["folder"]), 400, "directory"),
        uri(str(f["fifo"]), 400, "fifo"),
        uri("videos/good.mp4", 400, "relative path"),
        uri("http://169.254.169.254/latest/meta-data.mp4", 403, "http to a non-allowed host"),
        uri("s3://media/secret/a.mp4", 403, "s3 outside the prefix"),
        uri("s3://media/clips/../secret/a.mp4", 403, "s3 traversal"),
        uri("ftp://videos.example.org/a.mp4", 400, "unsupported scheme"),
        uri(str(f["notes"]), 415, "non-video extension"),
        # --- what the file is
        uri(str(f["text"]), 422, "text file as .mp4"),
        uri(str(f["empty"]), 400, "zero-byte file"),
        uri(str(f["truncated"]), 422, "truncated mp4"),
        uri(str(f["audio_only"]), 422, "audio-only mp4"),
        uri(str(f["long"]), 422, "over max_duration_s"),
        uri(str(f["wide"]), 422, "over max_frame_pixels"),
        uri(str(f["big"]), 413, "over max_upload_bytes by stat"),
        # --- the JSON request
        raw("malformed JSON", 400, b'{"video": "/x.mp4",', js),
        raw("empty JSON body", 400, b"", js),
        raw("deeply nested JSON", 400, b"[" * 5000 + b"]" * 5000, js),
        raw("JSON array body", 422, b'["/x.mp4"]', js),
        raw("JSON body over max_json_bytes", 413, b'{"video": "' + b"a" * 20000 + b'"}', js),
        raw("declared JSON length over the cap", 413, b"{}", {**js, "Content-Length": str(10**9)}),
        raw("not UTF-8 JSON", 400, b'{"video": "\xff\xfe"}', js),
        uri(f"{good}", 422, "unknown option", colour="red"),
        uri(f"{good}", 422, "negative max_events", max_events=-1),
        uri(f"{good}", 422, "max_events over the server cap", max_events=10_000),
        uri(f"{good}", 422, "max_events as a string", max_events="3"),
        uri(f"{good}", 422, "max_events as a bool", max_events=True),
        uri(f"{good}", 422, "top_p zero", top_p=0.0),
        uri(f"{good}", 422, "temperature negative", temperature=-1.0),
        BadRequest("video as a number", 422, lambda base: post_json(base, {"video": 123})),
        BadRequest("missing video", 422, lambda base: post_json(base, {"options": {}})),
        BadRequest("unknown top-level field", 422, lambda base: post_json(base, {"video": str(good), "priority": 1})),
        BadRequest("options not an object", 422, lambda base: post_json(base, {"video": str(good), "options": [1]})),
        raw("NaN temperature", 422, ('{"video": "%s", "options": {"temperature": NaN}}' % good).encode(), js),
        # --- content types
        raw("text/plain body", 415, b"hello", {"Content-Type": "text/plain"}),
        raw("no Content-Type", 415, b'{"video": "/x.mp4"}', {}),
        raw("video/mp4 raw body", 415, video[:1000], {"Content-Type": "video/mp4"}),
        raw("bad Content-Length header", 400, b"{}", {**js, "Content-Length": "12abc"}, by_http_layer=True),
        # --- uploads
        raw("huge declared upload", 413, b"--x", {**mp, "Content-Length": str(50 * 2**30)}),
        raw("chunked upload over the cap", 413, endless_upload, mp),
        upload("truncated upload", 400, [("file", "a.mp4", "video/mp4", video[: len(video) // 3])], close=False),
        upload("text file uploaded as .mp4", 422, [("file", "a.mp4", "video/mp4", b"plain text, not a video\n" * 50)]),
        upload("zero-byte upload", 400, [("file", "a.mp4", "video/mp4", b"")]),
        upload("upload of a cut mp4", 422, [("file", "cut.mp4", None, video[: len(video) // 2])]),
        upload("upload with an unknown field", 400, [("file", "a.mp4", None, video), ("priority", None, None, b"1")]),
        upload("upload without a file", 400, [("options", None, None, b"{}")]),
        upload("upload with two files", 400, [("file", "a.mp4", None, video), ("file", "b.mp4", None, video)]),
        upload("upload part typed text/plain", 415, [("file", "a.mp4", "text/plain", video)]),
        upload("upload named .exe", 415, [("file", "run.exe", None, video)]),
        upload("upload options malformed JSON", 400, [("file", "a.mp4", None, video), ("options", None, None, b"{max_events: 2")]),
        upload("upload options unknown key", 422, [("file", "a.mp4", None, video), ("options", None, None, b'{"beam": 4}')]),
        raw("multipart without boundary", 400, b"--x\r\n", {"Content-Type": "multipart/form-data"}),
        raw("multipart garbage", 400, b"this is not multipart at all", mp),
        # --- routes
        raw("GET on the captions route", 405, None, {}, method="GET"),
        raw("unknown route", 404, None, {}, method="GET", path="/v1/../../etc/passwd"),
    ]


def hanging_reader(cfg: Config):
    """A decode-worker reader (infer/serving/media_pool.py) that never returns for files named
    hang*: a decode stuck in C code, as a hostile file can make one. Other files get the
    real reader. Module-level, so the spawned workers can unpickle it."""
    from preprocess.featurize import MediaReader

    real = MediaReader(cfg)

    def read(path: str, annotation):
        if Path(path).name.startswith("hang"):
            threading.Event().wait()  # a decode that never returns: the pool must kill its worker
        return real(path, annotation)

    return read


def module_counting_reader(cfg: Config):
    """A decode-worker reader that sends back, with each result, how many model parameters the
    torch modules of its worker process hold (a worker that had built an encoder would hold its
    tower's). The real reader otherwise. Module-level, so the spawned workers can unpickle it."""
    import gc

    import torch

    from preprocess.featurize import MediaReader

    real = MediaReader(cfg)

    def read(path: str, annotation):
        media = real(path, annotation)
        modules = [o for o in gc.get_objects() if isinstance(o, torch.nn.Module)]
        return media, sum(p.numel() for m in modules for p in m.parameters(recurse=False))

    return read


def events_of(result) -> list[tuple[float, float, str]]:
    """(start, end, caption) of a response body or a VideoResult."""
    if isinstance(result, dict):
        return [(e["start"], e["end"], e["caption"]) for e in result["events"]]
    return [(float(e.start), float(e.end), str(e.caption)) for e in result.events]


def well_formed_body(body: dict, duration_hint: float | None = None) -> None:
    """Assert a caption response has every field, in range."""
    assert set(body) == {"video_id", "duration", "events", "timings", "model", "segments_kept", "segments_total"}
    assert body["duration"] > 0 and 0 < body["segments_kept"] <= body["segments_total"]
    for e in body["events"]:
        assert set(e) == {"start", "end", "caption", "capped"} and isinstance(e["capped"], bool)
        assert 0.0 <= e["start"] <= e["end"] <= body["duration"] + 1e-6
        assert isinstance(e["caption"], str)
    assert {"probe_s", "features_s", "decode_s", "total_s"} <= set(body["timings"])
    if duration_hint is not None:
        assert abs(body["duration"] - duration_hint) < 0.5
