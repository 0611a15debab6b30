"""Metric inputs: references and predictions read into one validated per-video form.

References (`read_references`, format detected or given):
    longvale / activitynet  {id: {"duration", "timestamps": [[s, e], ...], "sentences": [...]}}
    chronusav               [{"id", "duration", "seg_time": [[s, e] | ["HH:MM:SS.fff", ...]],
                              "video_captions", "audio_captions"}]  -> "Visual: {v} Audio: {a}"
    youcook2                {"database": {id: {"duration", "annotations": [{"segment", "sentence"}]}}}
    shards                  a list of pipeline.schema.Sample (or their meta dicts), or a
                            directory / .tar path of WebDataset shards (only meta.json is read)
Predictions (`read_predictions`):
    ActivityNet results     {"results": {id: [{"timestamp": [s, e], "sentence"}]}}
    engine output           {id: {"events": [{"start", "end", "caption"}], ...}} or a list of
                            such records carrying "video_id" (a record with "error" and no
                            events is an unparsable output)
    text output             {id: {"text": "..."}}: a sequential model's raw text, parsed by
                            pipeline/textual.py (no valid event: unparsable)
Files may be .json or .jsonl (one record a line).

Nothing here raises on bad content: every dropped event or video is recorded as a
problem for its video (a field that should be a list and is not drops its video).
Predictions keep at most `max_predictions` (1,000) events per video in output order,
like the public evaluators. Only an unreadable file, an unrecognisable top-level shape,
references without a valid video, or predictions none of whose video ids is a
reference's raise `InputError`.
"""

from __future__ import annotations

import glob
import json
import math
import os
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

MAX_PREDICTIONS = 1000
REF_FORMATS = ("longvale", "activitynet", "chronusav", "youcook2", "shards")

# Prediction statuses: only "ok" videos have predictions to score.
OK, MISSING, EMPTY, UNPARSABLE = "ok", "missing", "empty", "unparsable"


class InputError(ValueError):
    """The input as a whole cannot be read (file, JSON, or top-level shape)."""


@dataclass
class RefVideo:
    video_id: str
    duration: float | None
    times: np.ndarray  # float64 [N, 2], seconds, annotation order
    captions: list[str]
    problems: list[str] = field(default_factory=list)


@dataclass
class PredVideo:
    video_id: str
    times: np.ndarray  # float64 [M, 2], seconds, output order, M <= max_predictions
    captions: list[str]
    status: str = OK  # ok | missing | empty | unparsable
    problems: list[str] = field(default_factory=list)
    raw_count: int = 0  # events in the output before truncation and validation

    @property
    def has_predictions(self) -> bool:
        return self.status == OK


@dataclass
class EvalInput:
    """Aligned inputs: every evaluable reference video has exactly one PredVideo."""

    refs: dict[str, RefVideo]
    preds: dict[str, PredVideo]
    problems: list[dict[str, str]]  # {"video_id", "source", "problem"}, input order
    ref_format: str = ""
    pred_format: str = ""


# ---------------------------------------------------------------- small parsers


def load_json(src: Any) -> Any:
    """A path (.json or .jsonl) -> parsed object; anything else is returned unchanged."""
    if not isinstance(src, (str, os.PathLike)):
        return src
    path = Path(src)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc}") from exc
    try:
        if path.suffix == ".jsonl":
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{path} is not valid JSON: {exc}") from exc


def _number(x: Any) -> float | None:
    """A finite real number (not bool, not a string) as float, else None."""
    if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)):
        return None
    v = float(x)
    return v if math.isfinite(v) else None


def parse_clock(x: Any) -> float | None:
    """Seconds from a number, a numeric string or "[[HH:]MM:]SS(.fff)"; None if unreadable."""
    v = _number(x)
    if v is not None:
        return v
    if not isinstance(x, str) or not x.strip():
        return None
    total = 0.0
    try:
        for part in x.strip().split(":"):
            total = total * 60.0 + float(part)
    except ValueError:
        return None
    return total if math.isfinite(total) else None


def _interval_problem(start: float | None, end: float | None, raw: Any) -> str | None:
    if start is None or end is None:
        return f"non-numeric or non-finite time {raw!r}"
    if start < 0 or end < 0:
        return f"negative time [{start}, {end}]"
    if end < start:
        return f"reversed times [{start}, {end}]"
    return None


# ---------------------------------------------------------------- references


def detect_ref_format(obj: Any) -> str:
    if isinstance(obj, (str, os.PathLike)):
        return "shards"
    if isinstance(obj, list):
        first = next((x for x in obj if x is not None), None)
        return "chronusav" if isinstance(first, dict) and "seg_time" in first else "shards"
    if isinstance(obj, dict):
        return "youcook2" if isinstance(obj.get("database"), dict) else "longvale"
    raise InputError(f"unrecognised reference object of type {type(obj).__name__}")


def _ref_video(vid: str, duration: Any, raw_times: list, raw_caps: list) -> RefVideo:
    problems: list[str] = []
    if len(raw_times) != len(raw_caps):
        problems.append(f"{len(raw_times)} timestamps but {len(raw_caps)} sentences; kept the first {min(len(raw_times), len(raw_caps))}")
    times, caps = [], []
    for i, (ts, cap) in enumerate(zip(raw_times, raw_caps)):
        if not isinstance(ts, (list, tuple)) or len(ts) != 2:
            problems.append(f"reference event {i}: timestamp {ts!r} is not [start, end]; dropped")
            continue
        start, end = parse_clock(ts[0]), parse_clock(ts[1])
        bad = _interval_problem(start, end, ts)
        if bad:
            problems.append(f"reference event {i}: {bad}; dropped")
            continue
        if not isinstance(cap, str):
            problems.append(f"reference event {i}: caption is not a string; dropped")
            continue
        if not cap.strip():
            problems.append(f"reference event {i}: empty caption (kept)")
        times.append((start, end))
        caps.append(cap)
    dur = parse_clock(duration)
    arr = np.asarray(times, dtype=np.float64).reshape(-1, 2)
    return RefVideo(str(vid), dur, arr, caps, problems)


def _field_list(rec: dict, name: str) -> list | str:
    """rec[name] as a list (absent or null: empty), else a problem: a number is not iterable,
    and a string would be read as one sentence (or timestamp) per character."""
    value = rec.get(name)
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    return f"'{name}' is {type(value).__name__}, not a list"


def _bad_fields(vid: Any, *fields: list | str) -> RefVideo | None:
    """A video without events whose problems name the fields that are not lists; None if all are."""
    bad = [f for f in fields if isinstance(f, str)]
    return RefVideo(str(vid), None, np.zeros((0, 2)), [], bad) if bad else None


def _refs_longvale(obj: dict) -> Iterable[RefVideo]:
    for vid, rec in obj.items():
        if not isinstance(rec, dict):
            yield RefVideo(str(vid), None, np.zeros((0, 2)), [], [f"reference record is {type(rec).__name__}, not an object"])
            continue
        times, caps = _field_list(rec, "timestamps"), _field_list(rec, "sentences")
        yield _bad_fields(vid, times, caps) or _ref_video(vid, rec.get("duration"), times, caps)


def _refs_chronusav(obj: list) -> Iterable[RefVideo]:
    for n, rec in enumerate(obj):
        if not isinstance(rec, dict) or "id" not in rec:
            yield RefVideo(f"<record {n}>", None, np.zeros((0, 2)), [], ["ChronusAV record without an id"])
            continue
        seg, vis, aud = (_field_list(rec, k) for k in ("seg_time", "video_captions", "audio_captions"))
        bad = _bad_fields(rec["id"], seg, vis, aud)
        if bad:
            yield bad
            continue
        caps = [f"Visual: {v} Audio: {a}" for v, a in zip(vis, aud)]
        video = _ref_video(rec["id"], rec.get("duration"), seg[: len(caps)], caps)
        if not (len(seg) == len(vis) == len(aud)):  # the first problem listed
            video.problems.insert(0, f"seg_time/video_captions/audio_captions lengths {len(seg)}/{len(vis)}/{len(aud)} differ")
        yield video


def _refs_youcook2(obj: dict) -> Iterable[RefVideo]:
    for vid, rec in obj["database"].items():
        anns = _field_list(rec, "annotations") if isinstance(rec, dict) else []
        if isinstance(anns, str):
            yield _bad_fields(vid, anns)
            continue
        times = [a.get("segment") if isinstance(a, dict) else None for a in anns]
        caps = [a.get("sentence") if isinstance(a, dict) else None for a in anns]
        yield _ref_video(vid, rec.get("duration") if isinstance(rec, dict) else None, times, caps)


def _shard_metas(src: Any) -> Iterable[dict]:
    """Sample objects, meta dicts, or WebDataset tars (dir / glob / file) -> meta dicts."""
    if isinstance(src, (str, os.PathLike)):
        path = str(src)
        paths = sorted(glob.glob(os.path.join(path, "**", "*.tar"), recursive=True)) if os.path.isdir(path) else sorted(glob.glob(path))
        if not paths:
            raise InputError(f"no WebDataset shards found at {path}")
        from pipeline import schema

        for tar_path in paths:
            try:
                with tarfile.open(tar_path) as tar:
                    metas = [json.loads(tar.extractfile(m).read().decode("utf-8"))
                             for m in tar if m.isfile() and m.name.endswith("." + schema.META)]
            except (OSError, tarfile.TarError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise InputError(f"cannot read shard {tar_path}: {exc}") from exc
            yield from metas
        return
    for item in src:
        if isinstance(item, dict):
            yield item
        else:  # a pipeline.schema.Sample (duck-typed: no import needed)
            yield {
                "video_id": item.video_id,
                "duration": item.duration,
                "events": [{"start": e.start, "end": e.end, "caption": e.caption} for e in item.events],
            }


def _refs_shards(src: Any) -> Iterable[RefVideo]:
    for meta in _shard_metas(src):
        events = meta.get("events") or []
        times = [[e.get("start"), e.get("end")] if isinstance(e, dict) else None for e in events]
        caps = [e.get("caption") if isinstance(e, dict) else None for e in events]
        yield _ref_video(meta.get("video_id", "<no id>"), meta.get("duration"), times, caps)


def read_references(src: Any, fmt: str | None = None) -> tuple[dict[str, RefVideo], list[dict[str, str]], str]:
    """References -> ({video_id: RefVideo}, problems, format). Videos keep input order."""
    fmt = fmt or None
    is_shard_path = isinstance(src, (str, os.PathLike)) and (os.path.isdir(src) or str(src).endswith(".tar") or "*" in str(src))
    obj = src if (fmt == "shards" or (fmt is None and is_shard_path)) else load_json(src)
    fmt = fmt or detect_ref_format(obj)
    if fmt not in REF_FORMATS:
        raise InputError(f"unknown reference format {fmt!r}; expected one of {REF_FORMATS}")
    # format -> (its reader, the JSON type it reads; None: anything _shard_metas takes)
    reader, expect = {"longvale": (_refs_longvale, dict), "activitynet": (_refs_longvale, dict), "chronusav": (_refs_chronusav, list),
                      "youcook2": (_refs_youcook2, dict), "shards": (_refs_shards, None)}[fmt]
    if expect is not None and not isinstance(obj, expect):
        raise InputError(f"{fmt} references must be a JSON {expect.__name__}, got {type(obj).__name__}")
    refs: dict[str, RefVideo] = {}
    problems: list[dict[str, str]] = []
    for video in reader(obj):
        if video.video_id in refs:
            problems.append({"video_id": video.video_id, "source": "reference", "problem": "duplicate reference video id; kept the first"})
            continue
        refs[video.video_id] = video
        problems.extend({"video_id": video.video_id, "source": "reference", "problem": p} for p in video.problems)
    return refs, problems, fmt


# ---------------------------------------------------------------- predictions


def _pred_event(i: int, ev: Any) -> tuple[float, float, str] | str:
    """One predicted event -> (start, end, caption), or a problem string."""
    if not isinstance(ev, dict):
        return f"event {i}: not an object ({type(ev).__name__}); dropped"
    if "timestamp" in ev:
        ts = ev["timestamp"]
        if not isinstance(ts, (list, tuple)) or len(ts) != 2:
            return f"event {i}: timestamp {ts!r} is not [start, end]; dropped"
        raw = ts
    elif "start" in ev or "end" in ev:
        raw = [ev.get("start"), ev.get("end")]
    else:
        return f"event {i}: no timestamp; dropped"
    start, end = _number(raw[0]), _number(raw[1])
    bad = _interval_problem(start, end, list(raw))
    if bad:
        return f"event {i}: {bad}; dropped"
    cap = ev.get("sentence", ev.get("caption"))
    if not isinstance(cap, str):
        return f"event {i}: caption is {'missing' if cap is None else type(cap).__name__}; dropped"
    if not cap.strip():
        return f"event {i}: empty caption; dropped"
    return start, end, cap


def _pred_video(vid: str, value: Any, max_predictions: int) -> PredVideo:
    empty = np.zeros((0, 2), dtype=np.float64)
    if isinstance(value, dict):
        if isinstance(value.get("events"), list):
            events = value["events"]
        elif isinstance(value.get("text"), str):  # a raw text output: pipeline/textual.py
            return _text_video(vid, value["text"], max_predictions)
        elif "error" in value:
            return PredVideo(vid, empty, [], UNPARSABLE, [f"output is an error: {value['error']!r}"])
        else:
            return PredVideo(vid, empty, [], UNPARSABLE, ["output has no 'events' list"])
    elif isinstance(value, list):
        events = value
    else:
        return PredVideo(vid, empty, [], UNPARSABLE, [f"output is {type(value).__name__}, not a list of events"])
    problems: list[str] = []
    raw_count = len(events)
    if raw_count > max_predictions:
        problems.append(f"{raw_count} events; kept the first {max_predictions}")
        events = events[:max_predictions]
    times, caps = [], []
    for i, ev in enumerate(events):
        parsed = _pred_event(i, ev)
        if isinstance(parsed, str):
            problems.append(parsed)
        else:
            times.append(parsed[:2])
            caps.append(parsed[2])
    if not events:
        return PredVideo(vid, empty, [], EMPTY, problems + ["no events predicted"], raw_count)
    if not caps:
        return PredVideo(vid, empty, [], UNPARSABLE, problems + ["no valid event in the output"], raw_count)
    return PredVideo(vid, np.asarray(times, dtype=np.float64).reshape(-1, 2), caps, OK, problems, raw_count)


def _text_video(vid: str, text: str, max_predictions: int) -> PredVideo:
    """A text output ("s-e seconds: caption" lines, or a plan and numbered captions) parsed
    into events; no valid event: unparsable (empty text: empty), the reasons recorded."""
    from pipeline.textual import parse_events_text

    parsed, problems = parse_events_text(text)
    if not text.strip():
        return PredVideo(vid, np.zeros((0, 2)), [], EMPTY, ["empty text output"])
    if not parsed:
        return PredVideo(vid, np.zeros((0, 2)), [], UNPARSABLE, problems + ["no valid event in the text output"])
    events = [{"start": s, "end": e, "caption": c} for s, e, c in parsed]
    video = _pred_video(vid, events, max_predictions)
    video.problems = problems + video.problems
    return video


def read_predictions(src: Any, max_predictions: int = MAX_PREDICTIONS) -> tuple[dict[str, PredVideo], list[dict[str, str]], str]:
    """Predictions -> ({video_id: PredVideo}, problems, format)."""
    obj = load_json(src)
    problems: list[dict[str, str]] = []
    items: list[tuple[str, Any]]
    if isinstance(obj, dict) and isinstance(obj.get("results"), dict):
        fmt, items = "activitynet", [(str(k), v) for k, v in obj["results"].items()]
    elif isinstance(obj, dict):
        fmt, items = "engine", [(str(k), v) for k, v in obj.items()]
    elif isinstance(obj, list):
        fmt, items = "engine", []
        for n, rec in enumerate(obj):
            vid = rec.get("video_id", rec.get("id")) if isinstance(rec, dict) else None
            if vid is None:
                problems.append({"video_id": f"<record {n}>", "source": "prediction", "problem": "prediction record without a video_id; ignored"})
                continue
            items.append((str(vid), rec))
    else:
        raise InputError(f"unrecognised prediction object of type {type(obj).__name__}")
    preds: dict[str, PredVideo] = {}
    for vid, value in items:
        if vid in preds:
            problems.append({"video_id": vid, "source": "prediction", "problem": "duplicate prediction record; kept the first"})
            continue
        preds[vid] = _pred_video(vid, value, max_predictions)
    return preds, problems, fmt


# ---------------------------------------------------------------- alignment


def load_inputs(pred: Any, ref: Any, ref_format: str | None = None, max_predictions: int = MAX_PREDICTIONS) -> EvalInput:
    """Read and align: one PredVideo per evaluable reference video, all problems listed."""
    refs_all, problems, rfmt = read_references(ref, ref_format)
    preds_all, pred_problems, pfmt = read_predictions(pred, max_predictions)
    refs: dict[str, RefVideo] = {}
    for vid, video in refs_all.items():
        if len(video.captions) == 0:
            problems.append({"video_id": vid, "source": "reference", "problem": "no valid reference event; video not evaluated"})
        else:
            refs[vid] = video
    if not refs:
        raise InputError(f"no {rfmt} reference video with a valid event (are --pred and --ref swapped?)")
    if preds_all and not set(preds_all) & set(refs_all):
        # every video would count as missing: scores of 0 that say nothing about the predictions
        raise InputError(f"none of the {len(preds_all)} predicted video ids is a reference video id "
                         f"(predictions: {sorted(preds_all)[:3]}, references: {list(refs_all)[:3]}); "
                         "are they from the same split, with the same id form (e.g. a 'v_' prefix)?")
    problems.extend(pred_problems)
    preds: dict[str, PredVideo] = {}
    for vid in refs:
        preds[vid] = p = preds_all.get(vid) or PredVideo(vid, np.zeros((0, 2)), [], MISSING, ["no prediction for this video"])
        problems.extend({"video_id": vid, "source": "prediction", "problem": msg} for msg in p.problems)
    for vid in preds_all:
        if vid not in refs_all:
            problems.append({"video_id": vid, "source": "prediction", "problem": "prediction for a video not in the references; ignored"})
    return EvalInput(refs, preds, problems, rfmt, pfmt)
