"""Reading request bodies with hard byte caps: capped JSON and streamed multipart uploads.

Used by infer/serving/api.py; framework-free (takes an async iterator of body chunks, e.g.
Starlette's `request.stream()`), so unit tests feed it bytes directly.

    obj = await read_json(chunks, declared_length, max_bytes)                 # any JSON value
    form = await receive_upload(chunks, content_type, declared_length, limits)  # UploadedForm
    ... form.path (temp file holding the video), form.filename, form.options_text
    form.cleanup()

A declared Content-Length over the cap is refused before one byte is read; the
actual bytes are counted as they arrive (chunked bodies, lying clients). The
upload's `file` part streams straight into a temp file; nothing holds it in RAM.
Every problem is a `RequestError` (400 malformed, 413 too large, 415 wrong type).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from infer.serving.errors import RequestError

FORM_FIELDS = ("file", "options")
MULTIPART_OVERHEAD = 64 * 1024  # boundaries and part headers on top of the file and the options field
# Per-part content types accepted for the `file` part (absent is fine too).
VIDEO_PART_TYPES = ("video/", "application/octet-stream", "application/mp4", "application/x-matroska")


def declared_length(header: str | None) -> int | None:
    """Content-Length as an int; None when absent; RequestError when malformed."""
    if header is None:
        return None
    text = header.strip()
    if not text.isdigit():
        raise RequestError(400, "bad_content_length", f"Content-Length {header[:40]!r} is not a non-negative integer")
    return int(text)


def parse_json(data: bytes, what: str = "request body") -> Any:
    """bytes -> JSON value; 400 naming the position of a syntax error."""
    if not data.strip():
        raise RequestError(400, "malformed_json", f"{what} is empty; expected a JSON object")
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise RequestError(400, "malformed_json", f"{what} is not UTF-8 (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise RequestError(400, "malformed_json", f"{what} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise RequestError(400, "malformed_json", f"{what} is nested too deeply") from None
    except ValueError as e:  # an integer past Python's int_max_str_digits: the client's number, not a server bug
        raise RequestError(400, "malformed_json", f"{what} holds a number that cannot be read: {str(e).split(';')[0]}") from None


async def read_json(chunks: AsyncIterator[bytes], declared: int | None, max_bytes: int) -> Any:
    """The whole body as JSON, refusing more than `max_bytes` (declared or actual)."""
    if declared is not None and declared > max_bytes:
        raise RequestError(413, "too_large", f"the JSON body declares {declared} bytes, the limit is {max_bytes}")
    parts, total = [], 0
    async for chunk in chunks:
        total += len(chunk)
        if total > max_bytes:
            raise RequestError(413, "too_large", f"the JSON body is over the limit of {max_bytes} bytes")
        parts.append(chunk)
    return parse_json(b"".join(parts))


def spool_prefix(kind: str) -> str:
    """Temp file name prefix for an upload or a download: it names the owning process, so that a
    replica that was killed (no clean-up of its own) can have its files removed by the next one."""
    return f"padcap-{kind}-{os.getpid()}-"


_SPOOLED = re.compile(r"^padcap-(?:upload|fetch)-(\d+)-")


def remove_orphaned_spool(tmp_dir: str | None) -> int:
    """Remove the temp files in `tmp_dir` (None: the system temp dir) that a process no longer alive
    left there (a killed replica's uploads and downloads); returns how many. A process id reused
    since keeps its files (they stay until that process is gone and this runs again)."""
    folder = tmp_dir or tempfile.gettempdir()
    removed = 0
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(folder):
            m = _SPOOLED.match(name)
            if m is None or _alive(int(m.group(1))):
                continue
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(folder, name))
                removed += 1
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


@dataclass
class UploadLimits:
    max_file_bytes: int
    max_field_bytes: int
    tmp_dir: str | None = None
    allowed_extensions: tuple[str, ...] = ()

    @property
    def max_body_bytes(self) -> int:
        return self.max_file_bytes + self.max_field_bytes + MULTIPART_OVERHEAD


@dataclass
class UploadedForm:
    """The parsed upload: `path` is a temp file (deleted by `cleanup`)."""

    path: str
    filename: str
    options_text: str | None

    def cleanup(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.path)


def _disposition(value: bytes) -> tuple[str | None, str | None]:
    """Content-Disposition of a part -> (field name, file name)."""
    from python_multipart.multipart import parse_options_header

    kind, params = parse_options_header(value)
    if kind.lower() != b"form-data":
        raise RequestError(400, "bad_multipart", "each multipart part needs 'Content-Disposition: form-data'")
    name = params.get(b"name")
    filename = params.get(b"filename")
    return (name.decode("utf-8", "replace") if name is not None else None,
            filename.decode("utf-8", "replace") if filename is not None else None)


class _FormReceiver:
    """python-multipart callbacks -> the `file` part in a temp file, the `options` part in memory."""

    def __init__(self, limits: UploadLimits):
        self.limits = limits
        self.seen: set[str] = set()
        self.header_field = bytearray()
        self.header_value = bytearray()
        self.headers: dict[bytes, bytes] = {}
        self.current: str | None = None
        self.file = None
        self.path: str | None = None
        self.filename = ""
        self.file_bytes = 0
        self.options = bytearray()
        self.ended = False
        self.error: RequestError | None = None

    def callbacks(self) -> dict:
        return {
            "on_part_begin": self._part_begin,
            "on_header_field": lambda d, s, e: self.header_field.extend(d[s:e]),
            "on_header_value": lambda d, s, e: self.header_value.extend(d[s:e]),
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished,
            "on_part_data": self._part_data,
            "on_part_end": self._part_end,
            "on_end": self._end,
        }

    # python-multipart swallows nothing: an exception here propagates out of write().
    def _part_begin(self) -> None:
        self.headers = {}
        self.current = None

    def _header_end(self) -> None:
        self.headers[bytes(self.header_field).lower()] = bytes(self.header_value)
        self.header_field.clear()
        self.header_value.clear()

    def _headers_finished(self) -> None:
        name, filename = _disposition(self.headers.get(b"content-disposition", b""))
        if name not in FORM_FIELDS:
            raise RequestError(400, "unknown_field", f"unknown form field {name!r}; expected 'file' (the video) and optionally 'options' (JSON)")
        if name in self.seen:
            raise RequestError(400, "duplicate_field", f"form field {name!r} appears more than once")
        self.seen.add(name)
        self.current = name
        if name == "file":
            ctype = self.headers.get(b"content-type", b"").decode("latin-1").strip().lower()
            if ctype and not ctype.startswith(VIDEO_PART_TYPES):
                raise RequestError(415, "not_a_video", f"the 'file' part has content type {ctype!r}; expected video/* or application/octet-stream")
            self.filename = os.path.basename((filename or "").replace("\\", "/"))[:255]
            suffix = PurePosixPath(self.filename).suffix.lower()
            if self.limits.allowed_extensions and suffix and suffix not in self.limits.allowed_extensions:
                raise RequestError(415, "not_a_video", f"uploaded file name {self.filename!r} does not have a video extension "
                                   f"(allowed: {', '.join(self.limits.allowed_extensions)})")
            fd, self.path = tempfile.mkstemp(prefix=spool_prefix("upload"), suffix=suffix or ".bin", dir=self.limits.tmp_dir or None)
            self.file = os.fdopen(fd, "wb")

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        n = end - start
        if self.current == "file":
            self.file_bytes += n
            if self.file_bytes > self.limits.max_file_bytes:
                raise RequestError(413, "too_large", f"the uploaded file is over the limit of {self.limits.max_file_bytes} bytes (serve.max_upload_bytes)")
            self.file.write(data[start:end])
        elif self.current == "options":
            self.options.extend(data[start:end])
            if len(self.options) > self.limits.max_field_bytes:
                raise RequestError(413, "too_large", f"the 'options' field is over {self.limits.max_field_bytes} bytes")

    def _part_end(self) -> None:
        if self.current == "file" and self.file is not None:
            self.file.close()
        self.current = None

    def _end(self) -> None:
        self.ended = True

    def discard(self) -> None:
        if self.file is not None and not self.file.closed:
            self.file.close()
        if self.path:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)


def _boundary(content_type: str) -> bytes:
    from python_multipart.multipart import parse_options_header

    _, params = parse_options_header(content_type)
    boundary = params.get(b"boundary")
    if not boundary:
        raise RequestError(400, "bad_multipart", "multipart/form-data without a boundary parameter")
    if len(boundary) > 70:
        raise RequestError(400, "bad_multipart", "multipart boundary is longer than 70 characters")
    return boundary


async def receive_upload(chunks: AsyncIterator[bytes], content_type: str, declared: int | None,
                         limits: UploadLimits) -> UploadedForm:
    """Stream a multipart/form-data body (`file` + optional `options`) into a temp file."""
    from python_multipart.exceptions import MultipartParseError
    from python_multipart.multipart import MultipartParser

    if declared is not None and declared > limits.max_body_bytes:
        raise RequestError(413, "too_large", f"the upload declares {declared} bytes, over the limit of "
                           f"{limits.max_file_bytes} bytes for the file (serve.max_upload_bytes)")
    receiver = _FormReceiver(limits)
    parser = MultipartParser(_boundary(content_type), receiver.callbacks())
    total = 0
    try:
        async for chunk in chunks:
            total += len(chunk)
            if total > limits.max_body_bytes:
                raise RequestError(413, "too_large", f"the upload is over the limit of {limits.max_file_bytes} bytes (serve.max_upload_bytes)")
            try:
                parser.write(chunk)
            except MultipartParseError as e:
                raise RequestError(400, "bad_multipart", f"malformed multipart body: {e}") from None
        parser.finalize()
        if not receiver.ended:
            raise RequestError(400, "truncated_upload", f"the multipart body ended after {total} bytes without its closing boundary (truncated upload)")
        if "file" not in receiver.seen:
            raise RequestError(400, "missing_file", "multipart upload without a 'file' field")
        if receiver.file_bytes == 0:
            raise RequestError(400, "empty_file", "the uploaded file is empty (0 bytes)")
        options = None
        if "options" in receiver.seen:
            try:
                options = bytes(receiver.options).decode("utf-8")
            except UnicodeDecodeError:
                raise RequestError(400, "malformed_json", "the 'options' field is not UTF-8") from None
    except BaseException:
        receiver.discard()
        raise
    return UploadedForm(receiver.path, receiver.filename, options)
