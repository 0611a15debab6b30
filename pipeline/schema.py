"""THE shard schema: one WebDataset sample = one video's interleaved audio-visual features.

Nothing else in the project names a shard column. A sample holds, for T time
segments of one video:

    segment_times  float32 [T, 2]      start/end of each segment in seconds
    visual         float16 [T, V, Dv]  visual tokens of the segment (frames x tokens/frame)
    audio          float16 [T, A, Da]  audio tokens of the segment (zeros if no audio track)
    has_audio      bool
    events         list[Event]         ground-truth intervals (seconds) + captions
    video_id, duration, source (dataset name), feature_hash (config that made it)

Version 2 adds what the released PadCaptioner-3B's features need (preprocess/release_encoders.py), all
optional and None for the project's own encoders, whose samples keep the version-1 layout:

    audio_counts        int32 [T] or None  ragged audio: a_t tokens after segment t; `audio` is then
                                           [sum(a_t), Da], all audio tokens of the file in order
                                           (A_total = 60 per started 30 s chunk, padding included;
                                           [0, Da] and all zeros without audio)
    grid_thw            (T, gh, gw) or None  the frame grid in 14-px patches (the release's
                                           video_grid_thw); V = (gh/2)(gw/2) merged tokens per segment
    seconds_per_timestep  float or None    d = 2 / fps (segment t covers [t d, (t+1) d])

They travel in meta.json (a few numbers), so the WebDataset fields stay the four of version 1.
Version-1 shards decode as before (the three fields None).

`encode(sample)` gives the dict of WebDataset fields (bytes), `decode(fields)`
the sample back, `validate(sample)` raises `SchemaError` with a clear reason.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)  # decode accepts these

# WebDataset field names (the extension decides nothing: we decode ourselves).
KEY = "__key__"
META = "meta.json"
TIMES = "times.npy"
VISUAL = "visual.npy"
AUDIO = "audio.npy"
FIELDS = (META, TIMES, VISUAL, AUDIO)

FEATURE_DTYPE = np.float16
TIME_DTYPE = np.float32
COUNT_DTYPE = np.int32


class SchemaError(ValueError):
    """A sample does not satisfy the schema; the message says how."""


@dataclass
class Event:
    """One annotated (or predicted) event: an interval in seconds and its caption."""

    start: float
    end: float
    caption: str
    visual_caption: str | None = None
    audio_caption: str | None = None


@dataclass
class Sample:
    """One video, ready for training or captioning."""

    video_id: str
    duration: float
    segment_times: np.ndarray  # float32 [T, 2]
    visual: np.ndarray  # float16 [T, V, Dv]
    audio: np.ndarray  # float16 [T, A, Da]
    has_audio: bool
    events: list[Event] = field(default_factory=list)
    source: str = ""
    feature_hash: str = ""
    split: str = ""
    audio_counts: np.ndarray | None = None  # v2: int32 [T], ragged audio (module doc)
    grid_thw: tuple[int, int, int] | None = None  # v2: (T, gh, gw) frame grid in 14-px patches
    seconds_per_timestep: float | None = None  # v2: d

    @property
    def num_segments(self) -> int:
        return int(self.segment_times.shape[0])

    @property
    def ragged_audio(self) -> bool:
        """True when `audio` is [sum(audio_counts), Da] (the release's layout), not [T, A, Da]."""
        return self.audio_counts is not None


def sample_key(video_id: str) -> str:
    """A WebDataset-safe key for a video id: no dots or slashes, stable, unique."""
    safe = re.sub(r"[^A-Za-z0-9_-]+", "_", video_id)[:80]
    digest = hashlib.sha1(video_id.encode("utf-8")).hexdigest()[:10]
    return f"{safe}-{digest}"


def _npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


def _npy_load(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


def encode(sample: Sample) -> dict[str, Any]:
    """Sample -> WebDataset fields (`__key__` plus bytes per field). Validates first."""
    if not isinstance(sample, Sample):
        raise SchemaError(f"{getattr(sample, 'video_id', '?')!r}: a {type(sample).__name__} is not a Sample; encoder "
                          "inputs (features.release_features=online) are encoded by the engine, not stored")
    validate(sample)
    meta = {
        "schema_version": SCHEMA_VERSION,
        "video_id": sample.video_id,
        "duration": float(sample.duration),
        "has_audio": bool(sample.has_audio),
        "events": [asdict(e) for e in sample.events],
        "source": sample.source,
        "feature_hash": sample.feature_hash,
        "split": sample.split,
    }
    if sample.audio_counts is not None:
        meta["audio_counts"] = [int(c) for c in sample.audio_counts]
    if sample.grid_thw is not None:
        meta["grid_thw"] = [int(g) for g in sample.grid_thw]
    if sample.seconds_per_timestep is not None:
        meta["seconds_per_timestep"] = float(sample.seconds_per_timestep)
    return {
        KEY: sample_key(sample.video_id),
        META: json.dumps(meta, ensure_ascii=False).encode("utf-8"),
        TIMES: _npy_bytes(np.ascontiguousarray(sample.segment_times, dtype=TIME_DTYPE)),
        VISUAL: _npy_bytes(np.ascontiguousarray(sample.visual, dtype=FEATURE_DTYPE)),
        AUDIO: _npy_bytes(np.ascontiguousarray(sample.audio, dtype=FEATURE_DTYPE)),
    }


def decode(fields: dict[str, Any]) -> Sample:
    """WebDataset fields (as written by `encode`) -> a validated Sample."""
    missing = [f for f in FIELDS if f not in fields]
    if missing:
        raise SchemaError(f"sample {fields.get(KEY, '?')!r} lacks fields {missing}")
    raw_meta = fields[META]
    meta = json.loads(raw_meta.decode("utf-8") if isinstance(raw_meta, (bytes, bytearray)) else raw_meta)
    version = meta.get("schema_version")
    if version not in READABLE_VERSIONS:
        raise SchemaError(f"sample {meta.get('video_id')!r} has schema version {version}, "
                          f"this code reads {list(READABLE_VERSIONS)}")
    counts, grid, d = meta.get("audio_counts"), meta.get("grid_thw"), meta.get("seconds_per_timestep")
    sample = Sample(
        video_id=meta["video_id"],
        duration=float(meta["duration"]),
        segment_times=_npy_load(fields[TIMES]),
        visual=_npy_load(fields[VISUAL]),
        audio=_npy_load(fields[AUDIO]),
        has_audio=bool(meta["has_audio"]),
        events=[Event(**e) for e in meta["events"]],
        source=meta.get("source", ""),
        feature_hash=meta.get("feature_hash", ""),
        split=meta.get("split", ""),
        audio_counts=None if counts is None else np.asarray(counts, dtype=COUNT_DTYPE),
        grid_thw=None if grid is None else tuple(int(g) for g in grid),
        seconds_per_timestep=None if d is None else float(d),
    )
    validate(sample)
    return sample


def validate(sample: Sample) -> None:
    """Raise SchemaError naming the first problem: shapes, dtypes, times, events, NaNs."""
    vid = sample.video_id
    if not isinstance(vid, str) or not vid:
        raise SchemaError("video_id must be a non-empty string")
    if not np.isfinite(sample.duration) or sample.duration <= 0:
        raise SchemaError(f"{vid}: duration must be positive, got {sample.duration}")
    times, vis, aud = sample.segment_times, sample.visual, sample.audio
    if times.ndim != 2 or times.shape[1] != 2 or times.shape[0] < 1:
        raise SchemaError(f"{vid}: segment_times must be [T, 2] with T >= 1, got {list(times.shape)}")
    t = times.shape[0]
    if vis.ndim != 3 or vis.shape[0] != t:
        raise SchemaError(f"{vid}: visual must be [T={t}, V, Dv], got {list(vis.shape)}")
    if sample.audio_counts is not None:
        _validate_ragged(sample, t)
    elif aud.ndim != 3 or aud.shape[0] != t:
        raise SchemaError(f"{vid}: audio must be [T={t}, A, Da], got {list(aud.shape)}")
    _validate_grid(sample, t)
    if vis.dtype != FEATURE_DTYPE or aud.dtype != FEATURE_DTYPE:
        raise SchemaError(f"{vid}: features must be float16, got visual {vis.dtype} / audio {aud.dtype}")
    for name, arr in (("segment_times", times), ("visual", vis), ("audio", aud)):
        if not np.isfinite(arr).all():
            raise SchemaError(f"{vid}: {name} contains NaN or inf")
    if (times[:, 1] <= times[:, 0]).any():
        raise SchemaError(f"{vid}: a segment has end <= start")
    if (np.diff(times[:, 0]) < 0).any():
        raise SchemaError(f"{vid}: segments are not in time order")
    if times[-1, 1] > sample.duration + 1e-3:
        raise SchemaError(f"{vid}: segments end at {times[-1, 1]:.3f}s, after the duration {sample.duration:.3f}s")
    if not sample.has_audio and np.any(aud != 0):
        raise SchemaError(f"{vid}: has_audio is false but audio features are not zero")
    for i, e in enumerate(sample.events):
        if not (np.isfinite(e.start) and np.isfinite(e.end)):
            raise SchemaError(f"{vid}: event {i} has a non-finite time")
        if e.end <= e.start:
            raise SchemaError(f"{vid}: event {i} has end {e.end} <= start {e.start}")
        if e.start < 0 or e.end > sample.duration + 1e-3:
            raise SchemaError(f"{vid}: event {i} [{e.start}, {e.end}] lies outside the duration {sample.duration}")
        if not isinstance(e.caption, str):
            raise SchemaError(f"{vid}: event {i} caption must be a string")


def _validate_ragged(sample: Sample, t: int) -> None:
    """Version-2 ragged audio: counts [T] >= 0 summing to the audio rows."""
    vid, aud, counts = sample.video_id, sample.audio, np.asarray(sample.audio_counts)
    if counts.ndim != 1 or counts.shape[0] != t or not np.issubdtype(counts.dtype, np.integer):
        raise SchemaError(f"{vid}: audio_counts must be integers [T={t}], got {counts.dtype} {list(counts.shape)}")
    if (counts < 0).any():
        raise SchemaError(f"{vid}: audio_counts has a negative count")
    if aud.ndim != 2 or aud.shape[0] != int(counts.sum()):
        raise SchemaError(f"{vid}: ragged audio must be [sum(audio_counts)={int(counts.sum())}, Da], got {list(aud.shape)}")
    if not sample.has_audio and aud.shape[0] != 0:
        raise SchemaError(f"{vid}: has_audio is false but {aud.shape[0]} audio tokens are stored")


def _validate_grid(sample: Sample, t: int) -> None:
    """Version-2 frame grid and timestep length, when present."""
    vid = sample.video_id
    if sample.grid_thw is not None:
        g = tuple(sample.grid_thw)
        if len(g) != 3 or g[0] != t or g[1] % 2 or g[2] % 2 or min(g) < 1:
            raise SchemaError(f"{vid}: grid_thw must be (T={t}, even gh, even gw), got {list(g)}")
        if sample.visual.shape[1] != (g[1] // 2) * (g[2] // 2):
            raise SchemaError(f"{vid}: grid_thw {list(g)} means {(g[1] // 2) * (g[2] // 2)} visual tokens per segment, "
                              f"visual has {sample.visual.shape[1]}")
    d = sample.seconds_per_timestep
    if d is not None and not (np.isfinite(d) and d > 0):
        raise SchemaError(f"{vid}: seconds_per_timestep must be positive, got {d}")
