"""Shared pytest set-up: GPU tests skipped without CUDA, local Ray instances, the CPU clock.

The repository root is on sys.path through pytest's `pythonpath` setting (pyproject.toml), for the
`tests.*` helpers; the product is importable as installed (pip install -e .) or from the checkout."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.cpu_clock import CpuClock

ROOT = Path(__file__).resolve().parents[1]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Local Ray instances bind to 127.0.0.1 only (see docs/design/environment.md).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# infer/loading.py caches model fingerprints per machine: the suite's go to a directory of its own
if "PADCAP_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["PADCAP_CACHE_DIR"] = tempfile.mkdtemp(prefix="padcap-test-cache-")
    atexit.register(shutil.rmtree, os.environ["PADCAP_CACHE_DIR"], ignore_errors=True)


_CLOCK = CpuClock()


def pytest_configure(config):
    _CLOCK.start = _CLOCK.now()
    # Tiny test models run ~20x faster on one thread than fighting over 2 shared cores.
    try:
        import torch

        torch.set_num_threads(1)
    except Exception:
        pass


# `make test XDIST="-n 2"` runs the suite on pytest-xdist workers. Every module with a test that starts
# Ray, Ray Serve or the S3 server is one unit of work (RAY_MODULES, the scheduler below), so one
# worker runs them all, one after another (one Ray cluster at a time, as on a shared box), while
# the other worker runs the rest: the Ray tests' waiting (start-up, deployments, node loss)
# overlaps with CPU-bound unit tests. (xdist's own --dist loadgroup no longer groups under pytest
# 9.2: pytest-dev/pytest-xdist#1386.) A test that needs Ray outside these modules is a collection
# error, and under xdist one that starts Ray anyway fails naming why.
RAY_GROUP = "ray"
RAY_MODULES = frozenset({
    "test_annotations.py", "test_archive_scale.py", "test_batch_caption.py", "test_cluster_files.py", "test_cluster_sim.py",
    "test_job_submit.py", "test_preprocess_job.py", "test_release_encoders.py", "test_release_pipeline.py",
    "test_serve_integration.py", "test_serve_service.py", "test_serve_uris.py", "test_soak.py", "test_storage.py",
    "test_train_order.py", "test_train_ray.py", "test_docs.py",
})
_RAY_FIXTURES = {"ray_local", "own_ray_cluster", "s3_server"}


def _needs_ray(item) -> bool:
    return "integration" in item.keywords or bool(_RAY_FIXTURES & set(getattr(item, "fixturenames", ())))


def _in_ray_modules(nodeid: str) -> bool:
    return nodeid.split("::", 1)[0].rsplit("/", 1)[-1] in RAY_MODULES


def pytest_itemcollected(item):
    if _needs_ray(item) and not _in_ray_modules(item.nodeid):
        raise pytest.UsageError(f"{item.nodeid} needs Ray or S3 but its module is not in tests/conftest.py "
                                "RAY_MODULES (the modules one xdist worker runs one after another)")


def pytest_xdist_make_scheduler(config, log):
    """Under xdist: load scheduling, with RAY_MODULES as one unit of work (see above)."""
    from xdist.scheduler import LoadScopeScheduling

    class RayAsOneUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return RAY_GROUP if _in_ray_modules(nodeid) else nodeid

    return RayAsOneUnit(config, log)


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


@pytest.fixture(autouse=True)
def _ray_only_in_its_group(request, monkeypatch):
    """Under xdist, a test outside RAY_MODULES that starts Ray fails, naming why (two workers would
    otherwise run two clusters at once): its module belongs in RAY_MODULES."""
    if not os.environ.get("PYTEST_XDIST_WORKER") or _in_ray_modules(request.node.nodeid):
        return
    import ray

    def refuse(*args, **kwargs):
        raise RuntimeError(f"{request.node.nodeid} starts Ray but its module is not in tests/conftest.py "
                           "RAY_MODULES (the modules one xdist worker runs one after another)")

    monkeypatch.setattr(ray, "init", refuse)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3 server (SeaweedFS) on 127.0.0.1 for the session, bucket `test`.

    The AWS_* variables are set in this process (s3fs/boto3 read them) and
    passed on to Ray workers through the environment they inherit.
    """
    from bench.s3server import SeaweedS3

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


# The plain local Ray instance (2 CPUs, 127.0.0.1) that every module asking for `ray_local`
# shares: started by the first of them, kept for the next, stopped by a module that needs a
# cluster of another shape (`own_ray_cluster`) and started again by the next `ray_local`, and at
# the end of the session. One cluster at a time: nothing here starts one while another runs.
# address "local": a new instance even where a `ray start` cluster (or a killed one's stale address file) is
# on the machine, which ray.init with no address would attach to (and then refuse num_cpus)
LOCAL_RAY = {"address": "local", "num_cpus": 2, "include_dashboard": False, "log_to_driver": False,
             "_node_ip_address": "127.0.0.1"}
_shared = {"id": None, "env": None}  # the shared instance's (GCS address, driver's node id), its AWS_* env
RELEASE_S = 30.0  # a module's CPUs come back to the shared instance within this, or it is restarted


def _connected(ray) -> tuple[str, str] | None:
    """Which instance this process is connected to (a restarted one has a new node id)."""
    if not ray.is_initialized():
        return None
    ctx = ray.get_runtime_context()
    return ctx.gcs_address, ctx.get_node_id()


def _storage_env() -> tuple:
    """The AWS_* variables of this process: processes Ray starts inherit them from the raylet (the
    Ray Train controller builds its S3 storage with them), so an instance started before
    `s3_server` set them lacks them."""
    from pipeline.storage import FORWARDED_ENV_PREFIXES

    return tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)))


def shared_ray():
    """The shared local instance, started if it is not running (any other connection is closed
    first), or restarted if the AWS_* variables changed since it started."""
    import ray

    if _shared["id"] is not None and _connected(ray) == _shared["id"] and _shared["env"] == _storage_env():
        return ray
    stop_ray()
    # Ray's workers, Serve's controller and replicas import the project like the driver does: from this
    # checkout, also when it is not installed (pip install -e .)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths if str(ROOT) in paths else [str(ROOT), *paths])
    ray.init(**LOCAL_RAY)
    _shared["id"], _shared["env"] = _connected(ray), _storage_env()
    return ray


def stop_ray() -> None:
    """Shut down whatever instance this process runs or is connected to (the shared one included)."""
    if "ray" not in sys.modules:
        return
    import ray

    if ray.is_initialized():
        ray.shutdown()
    _shared["id"] = None


def _cpus_back(ray, timeout: float) -> bool:
    """True once every CPU of the instance is free again (a module's actors and tasks are gone)."""
    import time

    total = ray.cluster_resources().get("CPU", 0.0)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ray.available_resources().get("CPU", 0.0) >= total:
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def ray_local():
    """The shared local 2-CPU Ray instance on 127.0.0.1 (see `shared_ray`). After the module, it is
    kept for the next one only if the module gave back every CPU; else it is shut down."""
    ray = shared_ray()
    yield ray
    if _connected(ray) != _shared["id"] or not _cpus_back(ray, RELEASE_S):
        stop_ray()


@pytest.fixture(scope="module")
def own_ray_cluster():
    """For a module that starts a cluster of its own shape: the shared instance is shut down
    first (one cluster at a time), and whatever the module left connected is shut down after."""
    stop_ray()
    yield
    stop_ray()


@pytest.fixture(scope="session", autouse=True)
def _ray_stopped_at_the_end():
    yield
    stop_ray()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    before = _CLOCK.now()
    yield
    _CLOCK.record(item.nodeid, before)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Where the suite waits (tests/cpu_clock.py). Under xdist the controller runs no test, so
    it has nothing to say (and the workers' figures would share the machine's CPU)."""
    lines = _CLOCK.summary()
    if lines:
        terminalreporter.section("wall time against CPU time")
        for line in lines:
            terminalreporter.write_line(line)
