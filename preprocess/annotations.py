"""Dense-captioning annotation readers: LongVALE, ActivityNet Captions, ChronusAV, YouCook2.

Every reader turns one annotation file into per-video records

    VideoAnnotation(video_id, duration, events: list[pipeline.schema.Event], split, source, clipped)

and, for every video it cannot use, an explained `AnnotationError(video_id, reason, kind)`
instead of an exception: a missing field, a non-numeric time, end <= start, a start
beyond the duration, a time far past the duration, caption/time count mismatches,
a duplicate video id (the first record is kept), a caption or video id that is not
valid Unicode (a lone UTF-16 surrogate such as "\\ud83d", half an emoji: JSON allows
it, but UTF-8, Arrow and the shards cannot hold it). Times a little past the duration
(at most max(overshoot_s, overshoot_frac * duration)) are clipped to it and counted
in `clipped`. Events come out sorted by (start, end).

Formats (times in seconds; ChronusAV also takes "HH:MM:SS.fff" strings, every
reader takes "MM:SS" / "HH:MM:SS" strings and numeric strings):
    longvale / activitynet  {"<id>": {"duration", "timestamps": [[s, e]], "sentences": [..]}}
    chronusav               [{"id", "duration", "category", "segment_num", "seg_time": [[s, e]],
                              "video_captions": [..], "audio_captions": [..]}]  (or JSON lines,
                             or an object keyed by id); caption = "Visual: {v} Audio: {a}"
    youcook2                {"database": {"<id>": {"duration", "subset",
                              "annotations": [{"segment": [s, e], "sentence"}]}}}

    anns, errors = read_annotations("s3://bucket/longvale_train.json", "longvale", "train")
    anns, errors = read_annotations("youcookii_annotations.json", "auto", "val")

Paths are local or any fsspec URI (s3:// through pipeline.storage). Pure python, no ray.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pipeline import storage
from pipeline.schema import Event

FORMATS = ("longvale", "activitynet", "chronusav", "youcook2")
DEFAULT_OVERSHOOT_S = 1.0
DEFAULT_OVERSHOOT_FRAC = 0.03


@dataclass
class VideoAnnotation:
    """One usable video: its events (sorted by start) and how many times were clipped."""

    video_id: str
    duration: float
    events: list[Event]
    split: str = ""
    source: str = ""
    clipped: int = 0


@dataclass
class AnnotationError:
    """Why one video's annotation was rejected. `kind` is a short machine-readable class."""

    video_id: str
    reason: str
    kind: str = "invalid"
    source: str = ""


class AnnotationFormatError(ValueError):
    """The file as a whole cannot be read (not found, not JSON, wrong top-level shape)."""


class _Bad(Exception):
    """Internal: one video's record is unusable (carries the kind and reason)."""

    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind, self.reason = kind, reason


@dataclass
class _Limits:
    overshoot_s: float = DEFAULT_OVERSHOOT_S
    overshoot_frac: float = DEFAULT_OVERSHOOT_FRAC

    def tolerance(self, duration: float) -> float:
        return max(self.overshoot_s, self.overshoot_frac * duration)


# --------------------------------------------------------------------------- times

def parse_time(value: Any) -> float:
    """Seconds from a number, a numeric string, or "SS.fff" / "MM:SS.fff" / "HH:MM:SS.fff".

    Raises ValueError (with the offending value) for anything else: booleans, None,
    NaN/inf, malformed clock strings, minutes or seconds >= 60 inside a clock string.
    """
    if isinstance(value, bool) or value is None:
        raise ValueError(f"non-numeric time {value!r}")
    if isinstance(value, (int, float)):
        out = float(value)
    elif isinstance(value, str):
        text = value.strip()
        try:
            out = float(text)
        except ValueError:
            out = _parse_clock(text)
    else:
        raise ValueError(f"non-numeric time {value!r}")
    if not math.isfinite(out):
        raise ValueError(f"non-finite time {value!r}")
    return out


def _parse_clock(text: str) -> float:
    neg = text.startswith("-")
    parts = text.lstrip("-").split(":")
    if not 2 <= len(parts) <= 3 or not all(parts):
        raise ValueError(f"non-numeric time {text!r}")
    try:
        *upper, last = parts
        units = [int(p) for p in upper]
        if any(not p.isdigit() for p in upper):
            raise ValueError
        seconds = float(last)
        if not re.fullmatch(r"\d+(\.\d*)?", last):
            raise ValueError
    except ValueError:
        raise ValueError(f"non-numeric time {text!r}") from None
    if seconds >= 60 or (len(units) == 2 and units[1] >= 60):
        raise ValueError(f"time {text!r} has minutes or seconds >= 60")
    total = seconds
    for scale, unit in zip((60, 3600)[: len(units)], reversed(units)):
        total += scale * unit
    return -total if neg else total


# --------------------------------------------------------------------------- checks


def _field(rec: dict, name: str, where: str = "") -> Any:
    if not isinstance(rec, dict):
        raise _Bad("bad_record", f"{where or 'record'} is a {type(rec).__name__}, expected an object")
    if name not in rec or rec[name] is None:
        raise _Bad("missing_field", f"missing field {name!r}" + (f" in {where}" if where else ""))
    return rec[name]


def _list(value: Any, name: str) -> list:
    if not isinstance(value, list):
        raise _Bad("bad_record", f"field {name!r} is a {type(value).__name__}, expected a list")
    return value


def _duration(value: Any) -> float:
    try:
        d = parse_time(value)
    except ValueError as e:
        raise _Bad("bad_time", f"duration: {e}") from None
    if d <= 0:
        raise _Bad("bad_time", f"duration must be positive, got {value!r}")
    return d


def _is_unicode(text: str) -> bool:
    """False for strings with lone surrogates, which UTF-8 (Arrow, Parquet, the shards) cannot encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _printable_id(video_id: str) -> str:
    """The id as UTF-8-safe text (lone surrogates spelled as \\udxxx) for error rows."""
    return video_id if _is_unicode(video_id) else video_id.encode("utf-8", "backslashreplace").decode("utf-8")


def _caption(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise _Bad("bad_record", f"{where} is a {type(value).__name__}, expected a string")
    if not _is_unicode(value):
        raise _Bad("bad_record", f"{where} is not valid Unicode (it holds a lone UTF-16 surrogate, e.g. half an "
                                 f"emoji): {value.encode('utf-8', 'backslashreplace').decode('utf-8')[:80]!r}")
    text = " ".join(value.split())
    if not text:
        raise _Bad("empty", f"{where} is empty")
    return text


def _interval(pair: Any, i: int, duration: float, limits: _Limits) -> tuple[float, float, bool]:
    """Checked (start, end, was_clipped) of event i."""
    if not isinstance(pair, (list, tuple)) or len(pair) != 2:
        raise _Bad("bad_time", f"event {i}: time {pair!r} is not a [start, end] pair")
    try:
        start, end = parse_time(pair[0]), parse_time(pair[1])
    except ValueError as e:
        raise _Bad("bad_time", f"event {i}: {e}") from None
    if end <= start:
        raise _Bad("end_before_start", f"event {i}: end {end:g} <= start {start:g}")
    if start >= duration:
        raise _Bad("out_of_range", f"event {i}: start {start:g} is at or beyond the duration {duration:g}")
    tol = limits.tolerance(duration)
    if start < -tol:
        raise _Bad("out_of_range", f"event {i}: start {start:g} is negative")
    if end > duration + tol:
        raise _Bad("out_of_range", f"event {i}: end {end:g} is past the duration {duration:g} by more than "
                                   f"the tolerance {tol:g}s")
    clipped = start < 0 or end > duration
    return max(start, 0.0), min(end, duration), clipped


def _build(video_id: str, duration: float, times: list, captions: list[tuple[str, str | None, str | None]],
           split: str, source: str, limits: _Limits) -> VideoAnnotation:
    if len(times) != len(captions):
        raise _Bad("count_mismatch", f"{len(times)} time intervals but {len(captions)} captions")
    if not times:
        raise _Bad("empty", "no events")
    events, clipped = [], 0
    for i, (pair, (cap, vis, aud)) in enumerate(zip(times, captions)):
        start, end, was_clipped = _interval(pair, i, duration, limits)
        clipped += was_clipped
        events.append(Event(start=start, end=end, caption=cap, visual_caption=vis, audio_caption=aud))
    events.sort(key=lambda e: (e.start, e.end))
    return VideoAnnotation(video_id, duration, events, split, source, clipped)


# --------------------------------------------------------------------------- readers

Record = VideoAnnotation | AnnotationError


class _Obj(dict):
    """A JSON object that remembers which keys it saw more than once (first value kept)."""

    duplicates: Counter


def _pairs_hook(pairs: list[tuple[str, Any]]) -> _Obj:
    obj, dup = _Obj(), Counter()
    for k, v in pairs:
        if k in obj:
            dup[k] += 1
        else:
            obj[k] = v
    obj.duplicates = dup
    return obj


def _duplicate_errors(obj: dict, source: str) -> Iterator[AnnotationError]:
    for vid, extra in getattr(obj, "duplicates", Counter()).items():
        yield AnnotationError(str(vid), f"duplicate video id: {extra} more record(s) with this id; the first is used",
                              "duplicate_id", source)


def read_longvale(data: Any, split: str, source: str, limits: _Limits) -> Iterator[Record]:
    """LongVALE / ActivityNet Captions: {id: {duration, timestamps, sentences}}."""
    if not isinstance(data, dict):
        raise AnnotationFormatError(f"{source}: expected an object keyed by video id, got {type(data).__name__}")
    yield from _duplicate_errors(data, source)
    for vid, rec in data.items():
        try:
            duration = _duration(_field(rec, "duration"))
            times = _list(_field(rec, "timestamps"), "timestamps")
            sentences = _list(_field(rec, "sentences"), "sentences")
            caps = [(_caption(s, f"sentence {i}"), None, None) for i, s in enumerate(sentences)]
            yield _build(str(vid), duration, times, caps, split, source, limits)
        except _Bad as e:
            yield AnnotationError(str(vid), e.reason, e.kind, source)


def read_chronusav(data: Any, split: str, source: str, limits: _Limits) -> Iterator[Record]:
    """ChronusAV: a list of per-video records (or an object keyed by id)."""
    if isinstance(data, dict):
        yield from _duplicate_errors(data, source)
        items = [(str(k), v) for k, v in data.items()]
    elif isinstance(data, list):
        items = []
        for n, rec in enumerate(data):
            vid = rec.get("id") if isinstance(rec, dict) else None
            if vid is not None and (isinstance(vid, bool) or not isinstance(vid, (str, int))):
                yield AnnotationError(f"<record {n}>", f"field 'id' is a {type(vid).__name__} ({vid!r}), expected a "
                                      "string or an integer", "bad_record", source)
                continue
            items.append((None if vid is None else str(vid), rec, n))
    else:
        raise AnnotationFormatError(f"{source}: expected a list of records, got {type(data).__name__}")
    seen: set[str] = set()
    for item in items:
        vid, rec = item[0], item[1]
        if vid is None or vid == "":
            yield AnnotationError(f"<record {item[2]}>", "missing field 'id'" if isinstance(rec, dict)
                                  else f"record is a {type(rec).__name__}, expected an object",
                                  "missing_field" if isinstance(rec, dict) else "bad_record", source)
            continue
        if len(item) == 3:  # list form: duplicates are checked here
            if vid in seen:
                yield AnnotationError(vid, "duplicate video id: a later record with this id; the first is used",
                                      "duplicate_id", source)
                continue
            seen.add(vid)
        try:
            duration = _duration(_field(rec, "duration"))
            times = _list(_field(rec, "seg_time"), "seg_time")
            vis = _list(_field(rec, "video_captions"), "video_captions")
            aud = _list(_field(rec, "audio_captions"), "audio_captions")
            if len(vis) != len(aud):
                raise _Bad("count_mismatch", f"{len(vis)} video captions but {len(aud)} audio captions")
            num = rec.get("segment_num")
            if num is not None and (isinstance(num, bool) or not str(num).strip().isdigit() or int(num) != len(times)):
                raise _Bad("count_mismatch", f"segment_num {num!r} but {len(times)} seg_time entries")
            caps = []
            for i, (v, a) in enumerate(zip(vis, aud)):
                v, a = _caption(v, f"video caption {i}"), _caption(a, f"audio caption {i}")
                caps.append((f"Visual: {v} Audio: {a}", v, a))
            yield _build(vid, duration, times, caps, split, source, limits)
        except _Bad as e:
            yield AnnotationError(vid, e.reason, e.kind, source)


_SUBSETS = {"training": "train", "train": "train", "validation": "val", "val": "val", "valid": "val",
            "dev": "val", "testing": "test", "test": "test"}


def normalize_split(name: str) -> str:
    """'training' -> 'train', 'validation' -> 'val', 'testing' -> 'test'; others unchanged (lower case)."""
    return _SUBSETS.get(name.strip().lower(), name.strip().lower())


def read_youcook2(data: Any, split: str, source: str, limits: _Limits) -> Iterator[Record]:
    """YouCook2: {"database": {id: {duration, subset, annotations: [{segment, sentence}]}}}.

    With `split` one of train/val/test (or training/validation/testing), only videos of
    that subset are read; with any other `split` every video is read and labelled with
    it; with no `split`, each video is labelled with its own subset.
    """
    db = data.get("database") if isinstance(data, dict) else None
    if not isinstance(db, dict):
        raise AnnotationFormatError(f"{source}: expected {{'database': {{id: record}}}}")
    wanted = normalize_split(split) if split else ""
    filtering = wanted in ("train", "val", "test")
    for err in _duplicate_errors(db, source):
        rec = db.get(err.video_id)
        subset = normalize_split(str(rec.get("subset", ""))) if isinstance(rec, dict) else ""
        if not filtering or subset == wanted:
            yield err
    for vid, rec in db.items():
        vid = str(vid)
        try:
            subset = normalize_split(str(_field(rec, "subset")))
            if filtering and subset != wanted:
                continue
            duration = _duration(_field(rec, "duration"))
            anns = _list(_field(rec, "annotations"), "annotations")
            times = [_field(a, "segment", f"annotation {i}") for i, a in enumerate(anns)]
            caps = [(_caption(_field(a, "sentence", f"annotation {i}"), f"sentence {i}"), None, None)
                    for i, a in enumerate(anns)]
            yield _build(vid, duration, times, caps, split or subset, source, limits)
        except _Bad as e:
            yield AnnotationError(vid, e.reason, e.kind, source)


READERS = {"longvale": read_longvale, "activitynet": read_longvale, "chronusav": read_chronusav,
           "youcook2": read_youcook2}


# --------------------------------------------------------------------------- files


def load_json(path: str) -> Any:
    """Parse a JSON (or JSON-lines) annotation file from a local path or fsspec URI."""
    try:
        raw = storage.read_bytes(path)
    except FileNotFoundError:
        raise AnnotationFormatError(f"annotation file not found: {path}") from None
    except OSError as e:
        raise AnnotationFormatError(f"cannot read annotation file {path}: {e}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise AnnotationFormatError(f"{path} is not UTF-8 text: {e}") from None
    try:
        return json.loads(text, object_pairs_hook=_pairs_hook)
    except json.JSONDecodeError as first:
        lines = [ln for ln in text.splitlines() if ln.strip()]
        try:
            return [json.loads(ln, object_pairs_hook=_pairs_hook) for ln in lines]
        except json.JSONDecodeError:
            raise AnnotationFormatError(f"{path} is neither JSON nor JSON lines: {first}") from None


def detect_format(data: Any, path: str = "") -> str:
    """Guess the format of parsed annotation data (the file name breaks the LongVALE/ActivityNet tie)."""
    if isinstance(data, dict) and isinstance(data.get("database"), dict):
        return "youcook2"
    if isinstance(data, list):
        return "chronusav"
    if isinstance(data, dict):
        sample = next((v for v in data.values() if isinstance(v, dict)), None)
        if sample is not None and "seg_time" in sample:
            return "chronusav"
        if sample is not None and ("timestamps" in sample or "sentences" in sample):
            name = path.rsplit("/", 1)[-1].lower()
            return "activitynet" if ("activitynet" in name or "anet" in name) else "longvale"
    raise AnnotationFormatError(f"cannot detect the annotation format of {path or 'the data'}; pass one of {FORMATS}")


def guess_split(path: str) -> str:
    """'train' / 'val' / 'test' from a file name such as longvale_train.json, else ''."""
    name = path.rsplit("/", 1)[-1].lower()
    for token in re.split(r"[^a-z]+", name):
        if token in _SUBSETS:
            return _SUBSETS[token]
    return ""


def read_annotations(path: str, fmt: str = "auto", split: str | None = None, *,
                     overshoot_s: float = DEFAULT_OVERSHOOT_S, overshoot_frac: float = DEFAULT_OVERSHOOT_FRAC,
                     ) -> tuple[list[VideoAnnotation], list[AnnotationError]]:
    """Read one annotation file -> (usable videos, explained errors), in file order.

    `fmt`: longvale | activitynet | chronusav | youcook2 | auto. `split`: the label
    given to every record (None: guessed from the file name; for YouCook2 it also
    selects the subset, see `read_youcook2`). Raises AnnotationFormatError only for
    file-level problems (unreadable, not JSON, wrong top-level shape, unknown format).
    """
    data = load_json(path)
    if fmt in ("auto", "", None):
        fmt = detect_format(data, path)
    if fmt not in READERS:
        raise AnnotationFormatError(f"unknown annotation format {fmt!r}; expected one of {FORMATS} or 'auto'")
    if split is None:
        split = "" if fmt == "youcook2" else guess_split(path)
    anns: list[VideoAnnotation] = []
    errors: list[AnnotationError] = []
    for r in READERS[fmt](data, split, fmt, _Limits(overshoot_s, overshoot_frac)):  # every record's source is fmt
        if not _is_unicode(r.video_id):  # would break every Arrow row and the manifest later
            reason = "video id is not valid Unicode (it holds a lone UTF-16 surrogate)"
            if isinstance(r, AnnotationError):
                reason = f"{reason}; {r.reason}"
            r = AnnotationError(_printable_id(r.video_id), reason, "bad_record", fmt)
        (errors if isinstance(r, AnnotationError) else anns).append(r)
    return anns, errors
