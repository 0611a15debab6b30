"""What captioning one video gives: `CaptionResult`, the offline job's row and the Python API's result.

    result = CaptionResult.from_decoded(decoded, video_id="a", uri="/videos/a.mp4", model_id=..., config_hash=...)
    result.to_dict()   # events as a list of {"start", "end", "caption"} (seconds), timings as a dict
    result.to_row()    # the same fields as the offline Parquet / JSONL columns (`RESULT_COLUMNS`): events,
                       # timings and capped as JSON text
    results = caption_each(engine, [(video_id, uri, sample), ...], model_id=..., config_hash=...)

A video that could not be captioned is a result too: `status` "error", the reason in `error` and its
kind in `error_kind` ("input": bad media or annotation; "refused": the engine cannot fit it to the model;
"engine": the engine raised on it). `caption_each` never lets one video sink the others: when a batch
raises, its videos are captioned one by one. Pure python + the engine's output; no Ray.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import pyarrow as pa

from pipeline.config import Config, section_hash

Status = Literal["ok", "error"]
ERROR_KINDS = ("input", "refused", "engine")

RESULT_COLUMNS: dict[str, pa.DataType] = {
    "video_id": pa.string(),
    "uri": pa.string(),
    "status": pa.string(),  # ok | error
    "error": pa.string(),
    "duration": pa.float64(),
    "events": pa.string(),  # JSON list of {start, end, caption}
    "timings": pa.string(),  # JSON object
    "model_id": pa.string(),
    "config_hash": pa.string(),
    "chunk": pa.string(),
    "capped": pa.string(),  # JSON list of bool, per event: caption cut at infer.max_branch_tokens
    "segments_kept": pa.int64(),  # segments the model saw (fewer than segments_total: shortened to fit)
    "segments_total": pa.int64(),
    "error_kind": pa.string(),  # "" | input (bad media / annotation) | refused (by the engine) | engine (raised on it)
}
JSON_COLUMNS = ("events", "timings", "capped")


def caption_config_hash(cfg: Config) -> str:
    """What makes a result reusable: the feature, model and decoding settings (not the failure threshold,
    which only judges the rows)."""
    infer = {k: v for k, v in dataclasses.asdict(cfg.infer).items() if k != "max_failed_fraction"}
    return section_hash({"features": dataclasses.asdict(cfg.features), "model": dataclasses.asdict(cfg.model),
                         "infer": infer})


def video_ids(uris: list[str], root: str = "") -> list[str]:
    """One distinct id per video: its file's stem; when that is taken, its file name; when that is taken
    too (the same name in several folders), its path under `root`; at last the whole URI.

    >>> video_ids(["/v/cam1/0001.mp4", "/v/cam2/0001.mp4", "/v/cam3/0001.mp4"], root="/v")
    ['0001', '0001.mp4', 'cam3/0001.mp4']
    """
    out, seen = [], set()
    for uri in uris:
        name = uri.rstrip("/").rsplit("/", 1)[-1]
        under_root = uri[len(root) + 1:] if root and uri.startswith(root + "/") else uri
        vid = next((c for c in (name.rsplit(".", 1)[0], name, under_root) if c not in seen), uri)
        seen.add(vid)
        out.append(vid)
    return out


@dataclass
class CaptionResult:
    """One video's captions, or why there are none. Field names are the offline output's columns."""

    video_id: str
    uri: str = ""
    status: Status = "ok"
    error: str = ""  # why there are no captions ("" when status is ok)
    error_kind: str = ""  # "" | input | refused | engine
    duration: float | None = None  # seconds, the media's length as decoded
    events: list[dict[str, Any]] = field(default_factory=list)  # {"start": s, "end": s, "caption": text}, by start
    timings: dict[str, Any] = field(default_factory=dict)  # seconds per phase, and which processes ran it
    model_id: str = ""  # the model's name and a fingerprint of its weights ("tiny-random-..." for a random one)
    config_hash: str = ""  # the feature, model and decoding settings that made it
    capped: list[bool] = field(default_factory=list)  # per event: the caption was cut at infer.max_branch_tokens
    segments_kept: int = 0  # segments the model saw (fewer than segments_total: the video was shortened to fit)
    segments_total: int = 0
    chunk: str = ""  # the offline job's commit unit that holds the row

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_row(self) -> dict[str, Any]:
        """The offline Parquet / JSONL row (`RESULT_COLUMNS`).

        >>> CaptionResult("a", events=[{"start": 0.0, "end": 1.5, "caption": "a dog barks"}], capped=[False]).to_row()["events"]
        '[{"start": 0.0, "end": 1.5, "caption": "a dog barks"}]'
        """
        row = self.to_dict()
        for c in JSON_COLUMNS:
            row[c] = json.dumps(row[c], ensure_ascii=False)
        return {c: row[c] for c in RESULT_COLUMNS}

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> CaptionResult:
        """The inverse of `to_row` (a row read back from captions.parquet or captions.jsonl)."""
        values = {c: row[c] for c in RESULT_COLUMNS if c in row}
        for c in JSON_COLUMNS:
            if isinstance(values.get(c), str):
                values[c] = json.loads(values[c])
        return cls(**values)

    @classmethod
    def failed(cls, video_id: str, uri: str, kind: str, error: str, **fields: Any) -> CaptionResult:
        if kind not in ERROR_KINDS:
            raise ValueError(f"error kind {kind!r}: one of {ERROR_KINDS}")
        return cls(video_id=video_id, uri=uri, status="error", error=error, error_kind=kind, **fields)

    @classmethod
    def from_decoded(cls, decoded: Any, video_id: str, uri: str = "", **fields: Any) -> CaptionResult:
        """From what the engine returns for one video (`infer.engine.decoded` results)."""
        if getattr(decoded, "error", None):  # the engine refused this video (does not fit the model)
            return cls.failed(video_id, uri, "refused", f"engine: {decoded.error}", **fields)
        return cls(video_id=video_id, uri=uri, duration=float(decoded.duration),
                   events=[{"start": e.start, "end": e.end, "caption": e.caption} for e in decoded.events],
                   capped=list(decoded.capped), segments_kept=decoded.segments_kept,
                   segments_total=decoded.segments_total, timings=dict(decoded.timings), **fields)


def caption_each(engine: Any, items: Iterable[tuple[str, str, Any] | CaptionResult], **fields: Any) -> list[CaptionResult]:
    """Caption (video_id, uri, engine input) items with `engine.caption`, in one call when it can; an item
    that is a CaptionResult already (a video that failed before the engine) stays as it is, in its place.

    When the batch raises, each video is captioned alone, so only the video at fault gets an "engine"
    error. `fields` (model_id, config_hash, ...) go into every result the engine gives."""
    items = list(items)
    todo = [item for item in items if not isinstance(item, CaptionResult)]
    try:
        decoded: list[Any] = list(engine.caption([sample for _, _, sample in todo])) if todo else []
    except Exception:  # one bad video must not sink its batch: retry one by one
        decoded = []
        for _, _, sample in todo:
            try:
                decoded.extend(engine.caption([sample]))
            except Exception as e:
                decoded.append(e)
    out = []
    for (video_id, uri, _), res in zip(todo, decoded):
        if isinstance(res, Exception):
            out.append(CaptionResult.failed(video_id, uri, "engine", f"{type(res).__name__}: {res}", **fields))
        else:
            out.append(CaptionResult.from_decoded(res, video_id, uri, **fields))
    captioned = iter(out)
    return [item if isinstance(item, CaptionResult) else next(captioned, None) for item in items]
