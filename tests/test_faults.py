"""bench/inflight.py: the in-flight markers and the hold the node-loss tests rely on, and the
stage wrapper that puts them around a job's stage through the jobs' `wrap_stage` hook."""

from __future__ import annotations

import pickle
import threading

import cloudpickle
import pytest

from bench import inflight


def test_markers_say_who_started_and_finished_and_only_the_first_call_holds(tmp_path, monkeypatch):
    release = threading.Event()
    monkeypatch.setattr(inflight.time, "sleep", lambda s: release.wait(s))  # the hold, ended by the test
    entered = []  # the holder's context, entered and never exited (a process killed while in it)
    holder = threading.Thread(target=lambda: entered.append(
        inflight.in_flight(tmp_path, "caption", ["a/1", "b"], hold="caption", hold_s=60)) or entered[0].__enter__())
    holder.start()
    held = inflight.held(tmp_path, "caption")
    for _ in range(200):  # the holder thread writes its markers before it waits
        if held:
            break
        release.wait(0.01)
        held = inflight.held(tmp_path, "caption")
    assert held and held["video_id"] in ("a/1", "b") and not held["done"]
    with inflight.in_flight(tmp_path, "caption", ["c"], hold="caption"):  # a later call (a retry elsewhere) does not hold
        pass
    with inflight.in_flight(tmp_path, "preprocess", ["a/1"], hold="caption"):  # nor does another stage
        pass
    release.set()
    holder.join()
    found = {(m["video_id"], m["held"], m["done"]) for m in inflight.markers(tmp_path, "caption")}
    # the holder's videos are started, not done (its context never exited); c started and done
    assert found == {("a/1", True, False), ("b", True, False), ("c", False, True)}
    assert [(m["video_id"], m["done"]) for m in inflight.markers(tmp_path, "preprocess")] == [("a/1", True)]


def test_an_exception_ends_the_work_too(tmp_path):
    with pytest.raises(ValueError):
        with inflight.in_flight(tmp_path, "preprocess", ["v"]):
            raise ValueError("bad media")
    assert [(m["video_id"], m["done"], m["held"]) for m in inflight.markers(tmp_path, "preprocess")] == [("v", True, False)]


class Featurize:
    """A stand-in of preprocess/job.py FeaturizeVideos: `__call__` runs `featurize` per video."""

    def __init__(self, tag: str):
        self.tag = tag

    def featurize(self, video, chunk):
        if video["video_id"] == "bad":
            raise ValueError("bad media")
        return f"{self.tag}:{chunk}:{video['video_id']}"

    def __call__(self, batch):
        return [self.featurize(v, "c0") for v in batch["videos"]]


class Caption:
    """A stand-in of the offline job's stages: one call per batch of `video_id`s."""

    def __call__(self, batch):
        return {"video_id": list(batch["video_id"])}


def test_the_wrapper_marks_each_stage_as_the_jobs_hook_hands_it(tmp_path):
    watch = inflight.InFlight(str(tmp_path))
    wrapped = watch("preprocess", Featurize)
    assert issubclass(wrapped, Featurize) and wrapped.__name__ == "Featurize"  # actors keep their names
    # pickled with its settings, as Ray Data ships it to the workers
    wrapped = pickle.loads(cloudpickle.dumps(wrapped))
    assert wrapped("t")({"videos": [{"video_id": "a"}, {"video_id": "b"}]}) == ["t:c0:a", "t:c0:b"]
    with pytest.raises(ValueError):
        wrapped("t").featurize({"video_id": "bad"}, "c1")
    caption = watch("caption", Caption)
    assert caption()({"video_id": ["x", "y"]}) == {"video_id": ["x", "y"]}
    assert sorted((m["video_id"], m["done"], m["held"]) for m in inflight.markers(tmp_path, "preprocess")) == [
        ("a", True, False), ("b", True, False), ("bad", True, False)]
    assert sorted(m["video_id"] for m in inflight.markers(tmp_path, "caption")) == ["x", "y"]


def test_the_held_stage_holds_its_first_call_once(tmp_path, monkeypatch):
    slept = []
    monkeypatch.setattr(inflight.time, "sleep", slept.append)
    wrapped = inflight.InFlight(str(tmp_path), hold="caption", hold_s=7.0)("caption", Caption)
    wrapped()({"video_id": ["x"]})
    wrapped()({"video_id": ["y"]})
    assert slept == [7.0]
    assert inflight.held(tmp_path, "caption")["video_id"] == "x"
