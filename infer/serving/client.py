"""A small Python client for the captioning endpoint, and a command line around it.

    from infer.serving.client import CaptionClient
    client = CaptionClient("http://127.0.0.1:8000")
    result = client.caption(uri="/data/videos/a.mp4", options={"max_events": 5})
    result = client.caption(path="local/clip.mp4")          # uploads the file (multipart)

    python -m infer.serving.client /data/videos/a.mp4 [--url http://127.0.0.1:8000]
    python -m infer.serving.client local/clip.mp4 --upload [--option max_events=5] [--json]

The command prints the events as a table (start, end, caption) and the timings.
A refused request raises `CaptionError` (status, code, message, request id); the
command prints it and exits with 2 (4xx) or 1 (anything else).

Retries (`CaptionClient(retries=N)`, `--retries N`): a request is sent again when the
answer is 503 (Ray Serve back-pressure: over `serve.max_queued_requests`), a 5xx that
does not carry the service's error body, or no answer on a closed connection: what Ray
Serve gives a request that was in flight on a replica that died (its node was lost;
tests/test_cluster_sim.py). Timeouts are not retried. A
caption request has no side effects, so sending it again is safe. The service's own 5xx
(a bug, with its request id) is not retried.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
import time
from typing import Any

import requests


class CaptionError(RuntimeError):
    """The server refused or failed a request."""

    def __init__(self, status: int, code: str, message: str, request_id: str = ""):
        super().__init__(f"HTTP {status} {code}: {message}" + (f" (request {request_id})" if request_id else ""))
        self.status = status
        self.code = code
        self.message = message
        self.request_id = request_id


def should_retry(status: int, body: Any) -> bool:
    """503 (back-pressure), or a 5xx from Ray Serve itself (a replica lost with the request in
    flight), not one the service answered (see the module docstring)."""
    err = body.get("error") if isinstance(body, dict) else None
    service_error = isinstance(err, dict) and "code" in err and "request_id" in err  # {"error": {"code", "message", "request_id"}}
    return status == 503 or (status >= 500 and not service_error)


def _json_or_none(r: requests.Response) -> Any:
    try:
        return r.json()
    except ValueError:
        return None


class CaptionClient:
    """Talks to POST /v1/captions, GET /healthz and GET /v1/model; caption() retries up to `retries`
    times, `retry_pause_s` apart, on the answers `should_retry` names."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", timeout: float = 600.0, session: requests.Session | None = None,
                 retries: int = 0, retry_pause_s: float = 0.5):
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.session = session or requests.Session()
        self.retries = retries
        self.retry_pause_s = retry_pause_s

    def _check(self, r: requests.Response) -> dict[str, Any]:
        body = _json_or_none(r)
        if r.status_code != 200:
            err = (body or {}).get("error", {}) if isinstance(body, dict) else {}
            raise CaptionError(r.status_code, err.get("code", "http_error"), err.get("message", r.text[:300]),
                               err.get("request_id", r.headers.get("X-Request-ID", "")))
        if not isinstance(body, dict):
            raise CaptionError(r.status_code, "bad_response", f"expected a JSON object, got {r.text[:200]!r}")
        return body

    def caption(self, uri: str | None = None, path: str | os.PathLike | None = None,
                options: dict[str, Any] | None = None) -> dict[str, Any]:
        """Caption a server-side URI (`uri=`) or upload a local file (`path=`)."""
        if (uri is None) == (path is None):
            raise ValueError("give exactly one of uri= or path=")
        for attempt in range(self.retries + 1):
            try:
                r = self._post_caption(uri, path, options)
            except requests.ConnectionError:  # closed without an answer (or refused): send again
                if attempt == self.retries:
                    raise
            else:
                if attempt == self.retries or not should_retry(r.status_code, _json_or_none(r)):
                    return self._check(r)
            time.sleep(self.retry_pause_s)
        raise AssertionError("unreachable")

    def _post_caption(self, uri: str | None, path: str | os.PathLike | None,
                      options: dict[str, Any] | None) -> requests.Response:
        url = f"{self.base_url}/v1/captions"
        if uri is not None:
            payload: dict[str, Any] = {"video": uri}
            if options:
                payload["options"] = options
            return self.session.post(url, json=payload, timeout=self.timeout)
        with open(path, "rb") as fh:
            files: dict[str, Any] = {"file": (os.path.basename(os.fspath(path)), fh, "application/octet-stream")}
            if options:
                files["options"] = (None, json.dumps(options), "application/json")
            return self.session.post(url, files=files, timeout=self.timeout)

    def health(self) -> dict[str, Any]:
        return self._check(self.session.get(f"{self.base_url}/healthz", timeout=self.timeout))

    def model(self) -> dict[str, Any]:
        return self._check(self.session.get(f"{self.base_url}/v1/model", timeout=self.timeout))


def format_result(result: dict[str, Any], width: int = 100) -> str:
    """Events as a table (start, end, caption) followed by the timings."""
    lines = [f"video {result['video_id']}  duration {result['duration']:.2f} s  model {result.get('model', '?')}",
             f"{'start':>8}  {'end':>8}  caption", f"{'-' * 8}  {'-' * 8}  {'-' * max(7, width - 20)}"]
    for e in result["events"]:
        wrapped = textwrap.wrap(e["caption"], max(20, width - 20)) or [""]
        lines.append(f"{e['start']:8.2f}  {e['end']:8.2f}  {wrapped[0]}")
        lines.extend(f"{'':8}  {'':8}  {more}" for more in wrapped[1:])
    if not result["events"]:
        lines.append("(no events)")
    timings = result.get("timings", {})
    if timings:
        lines.append("timings: " + "  ".join(f"{k}={v:.3f}s" if k.endswith("_s") else f"{k}={v:.3f}" for k, v in timings.items()))
    return "\n".join(lines)


def _parse_option(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"--option {text!r} is not key=value")
    key, raw = text.split("=", 1)
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw
    return key.strip(), value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m infer.serving.client", description=__doc__.split("\n\n")[0])
    ap.add_argument("video", help="a URI under the server's allowed roots, or a local file with --upload")
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="the endpoint's base URL")
    ap.add_argument("--upload", action="store_true", help="upload the local file instead of sending its URI")
    ap.add_argument("--option", action="append", default=[], type=_parse_option, metavar="KEY=VALUE",
                    help="a decoding option (max_events, max_branch_tokens, temperature, top_p, seed); repeatable")
    ap.add_argument("--json", action="store_true", help="print the raw JSON response")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--retries", type=int, default=0, help="send again on 503 / a lost replica, this many times")
    args = ap.parse_args(argv)
    client = CaptionClient(args.url, timeout=args.timeout, retries=args.retries)
    options = dict(args.option) or None
    try:
        result = client.caption(path=args.video, options=options) if args.upload else client.caption(uri=args.video, options=options)
    except CaptionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2 if 400 <= e.status < 500 else 1
    except (requests.RequestException, OSError) as e:
        print(f"error: {e.__class__.__name__}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2) if args.json else format_result(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
