"""Paths that may be local or remote (`s3://`), through fsspec.

Every stage writes under one run directory that may live on S3; this module is
the only place that knows how to join, test, read and write such paths.
S3 credentials and endpoints come from the standard AWS environment variables
(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL for S3-compatible
servers such as MinIO or SeaweedFS).
"""

from __future__ import annotations

import json
import os
from typing import Any

import fsspec


def is_remote(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def _strip_file(path: str) -> str:
    return path[len("file://"):] if path.startswith("file://") else path


def storage_options(path: str) -> dict[str, Any]:
    """fsspec options for `path`: an explicit S3 endpoint from AWS_ENDPOINT_URL(_S3)."""
    if path.startswith("s3://"):
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            return {"client_kwargs": {"endpoint_url": endpoint}}
    return {}


def filesystem(path: str, carry_credentials: bool = False) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, path inside it) for a local path or URI.

    carry_credentials: an s3:// filesystem holds this process's AWS_ACCESS_KEY_ID /
    AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN as explicit options, so a pickled copy works in a
    process whose environment lacks them (Ray Train's controller inherits the raylet's environment,
    not the driver's). Without them in the environment it changes nothing (instance roles, profiles:
    the remote side's own credential chain)."""
    path = _strip_file(path)
    if is_remote(path):
        opts = storage_options(path)
        if carry_credentials and path.startswith("s3://"):
            named = {"key": "AWS_ACCESS_KEY_ID", "secret": "AWS_SECRET_ACCESS_KEY", "token": "AWS_SESSION_TOKEN"}
            opts.update({k: os.environ[v] for k, v in named.items() if os.environ.get(v)})
        return fsspec.core.url_to_fs(path, **opts)
    return fsspec.filesystem("file"), os.path.abspath(path)


def join(base: str, *parts: str) -> str:
    out = base.rstrip("/")
    for p in parts:
        out = f"{out}/{p.strip('/')}"
    return out


def exists(path: str) -> bool:
    fs, inner = filesystem(path)
    return fs.exists(inner)


def makedirs(path: str) -> None:
    fs, inner = filesystem(path)
    if not is_remote(path):
        fs.makedirs(inner, exist_ok=True)


def read_bytes(path: str) -> bytes:
    fs, inner = filesystem(path)
    with fs.open(inner, "rb") as f:
        return f.read()


def write_bytes(path: str, data: bytes) -> None:
    """Write atomically where the filesystem allows it (local: tmp file + rename)."""
    fs, inner = filesystem(path)
    if is_remote(path):
        with fs.open(inner, "wb") as f:
            f.write(data)
        return
    os.makedirs(os.path.dirname(inner), exist_ok=True)
    tmp = f"{inner}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, inner)


def read_json(path: str) -> Any:
    return json.loads(read_bytes(path).decode("utf-8"))


def write_json(path: str, obj: Any) -> None:
    write_bytes(path, json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False).encode("utf-8"))


def remove(path: str, recursive: bool = False) -> None:
    """Delete a file (or, recursive, a directory tree) if it exists; no error when it does not."""
    fs, inner = filesystem(path)
    if fs.exists(inner):
        fs.rm(inner, recursive=recursive)


def upload_dir(local_dir: str, remote: str) -> None:
    """Copy a local directory tree to `remote` (no-op when `remote` is that directory)."""
    fs, inner = filesystem(remote)  # local: the file system and the absolute path
    if not is_remote(remote):
        if os.path.abspath(local_dir) != inner:
            fs.copy(local_dir.rstrip("/") + "/", inner, recursive=True)
        return
    fs.put(local_dir.rstrip("/") + "/", inner, recursive=True)


def list_files(path: str, suffixes: tuple[str, ...] = ()) -> list[str]:
    """Files under a local dir or remote prefix (recursive), as full paths/URIs, sorted."""
    fs, inner = filesystem(path)
    if not fs.exists(inner):
        return []
    found = fs.find(inner)
    proto = path.split("://", 1)[0] + "://" if is_remote(path) else ""
    out = [proto + f if proto and not f.startswith(proto) else f for f in found]
    if suffixes:
        out = [f for f in out if f.lower().endswith(tuple(s.lower() for s in suffixes))]
    return sorted(out)


FORWARDED_ENV_PREFIXES = ("AWS_",)


def forwarded_env() -> dict[str, str]:
    """The storage variables of this process (AWS_*), to hand to Ray workers' runtime_env
    so that workers reach the same buckets as the driver."""
    return {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)}
