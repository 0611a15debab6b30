"""pipeline/faults.py: the in-flight markers and the hold the node-loss tests rely on."""

from __future__ import annotations

import threading

import pytest

from pipeline import faults


def test_off_without_the_directory(tmp_path, monkeypatch):
    monkeypatch.delenv(faults.DIR_ENV, raising=False)
    monkeypatch.setenv(faults.STAGE_ENV, "caption")
    with faults.in_flight("caption", ["v"]):
        pass
    assert faults.forwarded_env() == {faults.STAGE_ENV: "caption"}
    assert list(tmp_path.iterdir()) == []


def test_markers_say_who_started_and_finished_and_only_the_first_call_holds(tmp_path, monkeypatch):
    monkeypatch.setenv(faults.DIR_ENV, str(tmp_path))
    monkeypatch.setenv(faults.STAGE_ENV, "caption")
    monkeypatch.setenv(faults.HOLD_ENV, "60")
    assert faults.forwarded_env() == {faults.DIR_ENV: str(tmp_path), faults.STAGE_ENV: "caption",
                                      faults.HOLD_ENV: "60"}
    release = threading.Event()
    monkeypatch.setattr(faults.time, "sleep", lambda s: release.wait(s))  # the hold, ended by the test
    entered = []  # the holder's context, entered and never exited (a process killed while in it)
    holder = threading.Thread(target=lambda: entered.append(faults.in_flight("caption", ["a/1", "b"])) or
                              entered[0].__enter__())
    holder.start()
    held = faults.held(tmp_path, "caption")
    for _ in range(200):  # the holder thread writes its markers before it waits
        if held:
            break
        release.wait(0.01)
        held = faults.held(tmp_path, "caption")
    assert held and held["video_id"] in ("a/1", "b") and not held["done"]
    with faults.in_flight("caption", ["c"]):  # a later call (a retry elsewhere) does not hold
        pass
    with faults.in_flight("preprocess", ["a/1"]):  # nor does another stage
        pass
    release.set()
    holder.join()
    found = {(m["video_id"], m["held"], m["done"]) for m in faults.markers(tmp_path, "caption")}
    # the holder's videos are started, not done (its context never exited); c started and done
    assert found == {("a/1", True, False), ("b", True, False), ("c", False, True)}
    assert [(m["video_id"], m["done"]) for m in faults.markers(tmp_path, "preprocess")] == [("a/1", True)]


def test_an_exception_ends_the_work_too(tmp_path, monkeypatch):
    monkeypatch.setenv(faults.DIR_ENV, str(tmp_path))
    monkeypatch.delenv(faults.STAGE_ENV, raising=False)
    with pytest.raises(ValueError):
        with faults.in_flight("preprocess", ["v"]):
            raise ValueError("bad media")
    assert [(m["video_id"], m["done"], m["held"]) for m in faults.markers(tmp_path, "preprocess")] == [("v", True, False)]
