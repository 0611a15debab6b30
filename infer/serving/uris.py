"""Which video URIs the serving endpoint may read, and reading them safely.

A client names a video by URI; the server reads it only when it lies under one
of the configured roots (`serve.allowed_roots`: local directories and
`s3://bucket/prefix`) or on an allow-listed http(s) host
(`serve.allowed_http_hosts`). Pure python, no ray; used by infer/serving/service.py.

    policy = UriPolicy(["/data/videos", "s3://media/clips"], ["videos.example.org"])
    source = policy.resolve("/data/videos/a.mp4")      # Source(kind="local", ...) or UriError
    with materialize(source, max_bytes, timeout_s, tmp_dir) as path: ...

Rules (every rejection is a `UriError` with an HTTP status and a message that
says what was wrong):
- local paths must be absolute (or `file:///abs`, `file://localhost/abs`);
  `..` components are refused outright; the real path (symlinks resolved) must
  lie under a root's real path, so a symlink inside a root that points outside
  is refused; after opening, the opened descriptor's path is checked again, and
  only regular files are accepted (no directories, FIFOs or devices).
- `s3://bucket/key`: the bucket must equal a root's bucket and the key must lie
  under its prefix on a `/` boundary; `.`/`..`/empty key components, `?` and `#`
  are refused.
- `http(s)://host[:port]/path`: the host (and port, if the entry names one; else
  the scheme's default port) must be listed; no user-info; redirects are not
  followed.
- every other scheme (ftp, gs, data, ...) is refused. Containment is decided
  before existence, so a path outside the roots gives 403 whether or not it exists.
Sizes are checked before reading (stat / object size / Content-Length) and
again while copying (a byte cap), so a lying server cannot overrun the limit.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Literal
from urllib.parse import unquote, urlsplit

from infer.serving.bodies import spool_prefix
from infer.serving.errors import RequestError

MAX_URI_CHARS = 4096
CHUNK_BYTES = 1024 * 1024
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
_DEFAULT_PORTS = {"http": 80, "https": 443}


class UriError(RequestError):
    """A URI that the server will not read; `status` is the HTTP status to answer with."""


@dataclass(frozen=True)
class Source:
    """A video location that passed the policy.

    kind=local: `location` is the real path, `size` its stat size.
    kind=s3: `location` is `s3://bucket/key` (size unknown until fetched).
    kind=http: `location` is the URL (size unknown until fetched).
    """

    kind: Literal["local", "s3", "http"]
    location: str
    name: str  # the file name (last path component), for the video id
    size: int | None = None


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


class UriPolicy:
    """The allow-list: local roots, S3 prefixes and http hosts; `resolve` applies it."""

    def __init__(self, allowed_roots: list[str], allowed_http_hosts: list[str] | None = None,
                 allowed_extensions: list[str] | None = None):
        self.local_roots: list[str] = []
        self.s3_roots: list[tuple[str, str]] = []  # (bucket, prefix without slashes at the ends)
        for root in allowed_roots:
            if root.startswith("s3://"):
                bucket, _, prefix = root[len("s3://"):].partition("/")
                if not _BUCKET.match(bucket):
                    raise ValueError(f"serve.allowed_roots: bad S3 bucket in {root!r}")
                self.s3_roots.append((bucket, prefix.strip("/")))
            else:
                path = root[len("file://"):] if root.startswith("file://") else root
                if not os.path.isabs(path):
                    raise ValueError(f"serve.allowed_roots: local roots must be absolute paths, got {root!r}")
                self.local_roots.append(os.path.realpath(path))
        self.http_hosts = {h.strip().lower() for h in (allowed_http_hosts or []) if h.strip()}
        self.extensions = {e.lower() for e in (allowed_extensions or [])}

    # ------------------------------------------------------------------ resolve

    def resolve(self, uri: object) -> Source:
        """Check `uri` against the allow-list; local files are also stat-checked (exists, regular)."""
        if not isinstance(uri, str) or not uri.strip():
            raise UriError(400, "bad_uri", "video must be a non-empty string URI")
        if len(uri) > MAX_URI_CHARS:
            raise UriError(400, "bad_uri", f"video URI is {len(uri)} characters long, the limit is {MAX_URI_CHARS}")
        if any(ord(c) < 32 or ord(c) == 127 for c in uri):
            raise UriError(400, "bad_uri", "video URI contains control characters")
        if "\\" in uri:
            raise UriError(400, "bad_uri", "video URI contains a backslash")
        scheme = uri.split("://", 1)[0].lower() if "://" in uri else ""
        if scheme == "":
            if ":" in uri.split("/", 1)[0]:
                raise UriError(400, "unsupported_scheme", f"unsupported URI scheme in {uri!r}")
            return self._local(uri, uri)
        if scheme == "file":
            return self._local(self._file_uri_path(uri), uri)
        if scheme == "s3":
            return self._s3(uri)
        if scheme in ("http", "https"):
            return self._http(uri, scheme)
        raise UriError(400, "unsupported_scheme",
                       f"unsupported URI scheme {scheme!r}: use an absolute path, file://, s3:// or an allowed http(s) host")

    def _check_extension(self, name: str, uri: str) -> None:
        suffix = PurePosixPath(name).suffix.lower()
        if self.extensions and suffix not in self.extensions:
            raise UriError(415, "not_a_video", f"{uri!r} does not have a video file extension "
                           f"(allowed: {', '.join(sorted(self.extensions))})")

    @staticmethod
    def _file_uri_path(uri: str) -> str:
        parts = urlsplit(uri)
        if parts.netloc not in ("", "localhost"):
            raise UriError(400, "bad_uri", f"file:// URIs must name a local path (file:///path), got host {parts.netloc!r}")
        if parts.query or parts.fragment:
            raise UriError(400, "bad_uri", "file:// URIs may not carry a query or fragment")
        path = unquote(parts.path)
        if "\x00" in path:
            raise UriError(400, "bad_uri", "video URI contains a NUL byte")
        return path

    def _local(self, path: str, uri: str) -> Source:
        if not self.local_roots:
            raise UriError(403, "outside_roots", "this server reads no local paths (no local allowed_roots configured)")
        if not os.path.isabs(path):
            raise UriError(400, "bad_uri", f"local paths must be absolute, got {uri!r}")
        if ".." in path.split("/"):
            raise UriError(403, "path_traversal", f"'..' components are not allowed in {uri!r}")
        real = os.path.realpath(path)
        root = next((r for r in self.local_roots if _within(real, r)), None)
        if root is None:
            raise UriError(403, "outside_roots", f"{uri!r} is not under an allowed root (symlinks are resolved first)")
        self._check_extension(real, uri)
        try:
            fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise UriError(404, "not_found", f"no such file: {uri!r}") from None
        except PermissionError:
            raise UriError(403, "not_readable", f"the server may not read {uri!r}") from None
        except OSError as e:  # ELOOP (raced symlink), ENOTDIR, ...
            raise UriError(400, "bad_path", f"cannot open {uri!r}: {e.strerror}") from None
        try:
            st = os.fstat(fd)
            opened = _fd_path(fd)
            if opened is not None and not _within(opened, root):
                raise UriError(403, "outside_roots", f"{uri!r} is not under an allowed root")
            if not stat.S_ISREG(st.st_mode):
                what = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
                raise UriError(400, "not_a_file", f"{uri!r} is {what}")
        finally:
            os.close(fd)
        return Source("local", real, os.path.basename(real), int(st.st_size))

    def _s3(self, uri: str) -> Source:
        rest = uri[len("s3://"):]
        if "?" in rest or "#" in rest:
            raise UriError(400, "bad_uri", f"s3 URIs may not carry '?' or '#': {uri!r}")
        bucket, _, key = rest.partition("/")
        if not _BUCKET.match(bucket):
            raise UriError(400, "bad_uri", f"bad S3 bucket name {bucket!r}")
        parts = key.split("/")
        if not key or any(p in ("", ".", "..") for p in parts):
            raise UriError(403 if ".." in parts else 400, "path_traversal" if ".." in parts else "bad_uri",
                           f"S3 keys must be non-empty with no empty, '.' or '..' components: {uri!r}")
        for rb, prefix in self.s3_roots:
            if rb == bucket and (not prefix or key.startswith(prefix + "/")):
                self._check_extension(key, uri)
                return Source("s3", f"s3://{bucket}/{key}", parts[-1])
        raise UriError(403, "outside_roots", f"{uri!r} is not under an allowed S3 prefix")

    def _http(self, uri: str, scheme: str) -> Source:
        try:
            parts = urlsplit(uri)
            port = parts.port or _DEFAULT_PORTS[scheme]
        except ValueError as e:
            raise UriError(400, "bad_uri", f"malformed URL {uri!r}: {e}") from None
        if "@" in parts.netloc:
            raise UriError(400, "bad_uri", "URLs with user-info (user@host) are not accepted")
        host = (parts.hostname or "").lower()
        if not host:
            raise UriError(400, "bad_uri", f"URL without a host: {uri!r}")
        allowed = f"{host}:{port}" in self.http_hosts or (port == _DEFAULT_PORTS[scheme] and host in self.http_hosts)
        if not allowed:
            raise UriError(403, "host_not_allowed", f"http(s) host {host}:{port} is not in serve.allowed_http_hosts")
        name = unquote(parts.path).rsplit("/", 1)[-1]
        if ".." in unquote(parts.path).split("/"):
            raise UriError(403, "path_traversal", f"'..' components are not allowed in {uri!r}")
        self._check_extension(name, uri)
        return Source("http", uri, name)


def _fd_path(fd: int) -> str | None:
    """The kernel's path of an open descriptor (Linux /proc), None where unavailable."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


# ---------------------------------------------------------------------- reading


def _too_large(what: str, size: int, max_bytes: int) -> UriError:
    return UriError(413, "too_large", f"{what} is {size} bytes, over the limit of {max_bytes} bytes (serve.max_upload_bytes)")


def _copy_capped(read, out, max_bytes: int, what: str) -> int:
    written = 0
    while chunk := read(CHUNK_BYTES):
        written += len(chunk)
        if written > max_bytes:
            raise UriError(413, "too_large", f"{what} passed the limit of {max_bytes} bytes (serve.max_upload_bytes)")
        out.write(chunk)
    return written


@contextlib.contextmanager
def materialize(source: Source, max_bytes: int, timeout_s: float, tmp_dir: str | None = None) -> Iterator[str]:
    """A local path holding the video: the real path itself, or a capped temp copy (removed on exit).

    Raises UriError: 404 (object gone), 413 (over `max_bytes`, checked before and
    while copying), 400 (remote fetch failed).
    """
    if source.kind == "local":
        size = os.path.getsize(source.location)
        if size > max_bytes:
            raise _too_large(source.name, size, max_bytes)
        yield source.location
        return
    suffix = PurePosixPath(source.name).suffix.lower()[:10]
    fd, tmp = tempfile.mkstemp(prefix=spool_prefix("fetch"), suffix=suffix, dir=tmp_dir or None)
    try:
        with os.fdopen(fd, "wb") as out:
            if source.kind == "s3":
                _fetch_s3(source, out, max_bytes, timeout_s)
            else:
                _fetch_http(source, out, max_bytes, timeout_s)
        yield tmp
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


def _fetch_s3(source: Source, out, max_bytes: int, timeout_s: float) -> None:
    import fsspec

    from pipeline.storage import storage_options

    options = dict(storage_options(source.location))
    options.setdefault("config_kwargs", {"connect_timeout": timeout_s, "read_timeout": timeout_s, "retries": {"max_attempts": 2}})
    try:
        fs, key = fsspec.core.url_to_fs(source.location, **options)
        info = fs.info(key)
    except FileNotFoundError:
        raise UriError(404, "not_found", f"no such S3 object: {source.location}") from None
    except PermissionError:
        raise UriError(403, "not_readable", f"the server may not read {source.location}") from None
    if info.get("type") != "file":
        raise UriError(400, "not_a_file", f"{source.location} is not an object")
    size = int(info.get("size") or 0)
    if size > max_bytes:
        raise _too_large(source.location, size, max_bytes)
    with fs.open(key, "rb", block_size=CHUNK_BYTES) as src:
        _copy_capped(src.read, out, max_bytes, source.location)


def _fetch_http(source: Source, out, max_bytes: int, timeout_s: float) -> None:
    import requests

    try:
        with requests.get(source.location, stream=True, allow_redirects=False, timeout=(min(10.0, timeout_s), timeout_s)) as r:
            if 300 <= r.status_code < 400:
                raise UriError(400, "redirect", f"{source.location} answered with a redirect (HTTP {r.status_code}); redirects are not followed")
            if r.status_code == 404:
                raise UriError(404, "not_found", f"{source.location} answered 404")
            if r.status_code != 200:
                raise UriError(400, "fetch_failed", f"{source.location} answered HTTP {r.status_code}")
            declared = r.headers.get("Content-Length")
            if declared and declared.isdigit() and int(declared) > max_bytes:
                raise _too_large(source.location, int(declared), max_bytes)
            _copy_capped(lambda n: r.raw.read(n, decode_content=True), out, max_bytes, source.location)
    except requests.RequestException as e:
        raise UriError(400, "fetch_failed", f"could not fetch {source.location}: {e.__class__.__name__}") from None
