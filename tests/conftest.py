"""Shared pytest set-up: repo root on sys.path, GPU tests skipped without CUDA."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Local Ray instances bind to 127.0.0.1 only (see shared/ENVIRONMENT.md).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def pytest_configure(config):
    # Tiny test models run ~20x faster on one thread than fighting over 2 shared cores.
    try:
        import torch

        torch.set_num_threads(1)
    except Exception:
        pass


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # torch missing: nothing GPU-side can run
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3 server (SeaweedFS) on 127.0.0.1 for the session, bucket `test`.

    The AWS_* variables are set in this process (s3fs/boto3 read them) and
    passed on to Ray workers through the environment they inherit.
    """
    from tests.support.s3server import SeaweedS3

    server = SeaweedS3(tmp_path_factory.mktemp("s3"), buckets=["test"]).start()
    old = {k: os.environ.get(k) for k in server.env}
    os.environ.update(server.env)
    yield server
    server.stop()
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def ray_local():
    """A local 2-CPU Ray instance on 127.0.0.1 for one test module, shut down after it."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    yield ray
    ray.shutdown()
