"""Annotated events against a video's media length: clipped a little, refused when far off.

`annotated_sample` (events aligned by `align_events`, then the encoded media) is used by both
featurizers (`preprocess/featurize.py`, the release's in `preprocess/release_encoders.py`); it lives
here so neither imports the other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from pipeline.config import Config
from pipeline.schema import Event, Sample, validate
from preprocess.media_errors import MediaError


def align_events(events: Sequence[Event], media_duration: float, tolerance: float, video_id: str,
                 annotated_duration: float | None = None) -> list[Event]:
    """Clip events to [0, media_duration]; raise MediaError for any beyond the tolerance."""
    out = []
    for i, e in enumerate(events):
        if max(e.start, e.end) > media_duration + tolerance:
            note = f" (annotated duration {annotated_duration:.3f}s)" if annotated_duration is not None else ""
            raise MediaError(
                f"{video_id}: annotation points beyond the video: event {i} [{e.start:.3f}, {e.end:.3f}]s, "
                f"media duration {media_duration:.3f}s{note}, tolerance {tolerance:.3f}s",
                "annotation",
            )
        start, end = max(0.0, float(e.start)), min(float(e.end), media_duration)
        if end <= start:
            raise MediaError(
                f"{video_id}: event {i} [{e.start:.3f}, {e.end:.3f}]s is empty once clipped to the media "
                f"duration {media_duration:.3f}s",
                "annotation",
            )
        out.append(dataclasses.replace(e, start=start, end=end))
    return out


def annotated_sample(annotation: Any, duration: float, cfg: Config, feature_hash: str,
                     media: Callable[[], dict[str, Any]]) -> Sample:
    """A validated Sample of one video: its annotation's events aligned to the media's `duration` first, then
    `media()`, the encoded media's Sample fields (segment_times, visual, audio, has_audio, ...)."""
    events = align_events(annotation.events, duration, cfg.features.duration_tolerance_s, annotation.video_id,
                          getattr(annotation, "duration", None))
    sample = Sample(video_id=annotation.video_id, duration=duration, events=events, feature_hash=feature_hash,
                    source=getattr(annotation, "source", "") or cfg.data.dataset,
                    split=getattr(annotation, "split", "") or "", **media())
    validate(sample)
    return sample
