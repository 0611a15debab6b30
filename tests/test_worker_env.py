"""The training workers' environment (train.trainer.worker_env): thread counts and the OpenMP wait policy."""

from __future__ import annotations

import pytest

from pipeline.config import load_config
from train.trainer import worker_env


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for key in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS"):
        monkeypatch.delenv(key, raising=False)


def test_threads_within_the_workers_cpus_keep_openmps_own_wait_policy():
    env = worker_env(load_config(None))
    assert env["OMP_NUM_THREADS"] == "1"
    assert "OMP_WAIT_POLICY" not in env
    env = worker_env(load_config(None, ["train.cpus_per_worker=2", "train.torch_threads=2"]))
    assert env["OMP_NUM_THREADS"] == "2" and "OMP_WAIT_POLICY" not in env


@pytest.mark.parametrize("sets", [["train.torch_threads=2"], ["train.cpus_per_worker=0.5"]])
def test_more_threads_than_cpus_sleep_instead_of_spinning(sets):
    env = worker_env(load_config(None, sets))
    assert env["OMP_WAIT_POLICY"] == "PASSIVE"


def test_the_drivers_wait_policy_reaches_the_workers_and_wins(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert worker_env(load_config(None, ["train.torch_threads=2"]))["OMP_WAIT_POLICY"] == "ACTIVE"
    assert worker_env(load_config(None))["OMP_WAIT_POLICY"] == "ACTIVE"
