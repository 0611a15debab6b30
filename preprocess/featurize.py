"""One video + its annotation -> one validated `pipeline.schema.Sample` (decode, encode, align).

This is what the preprocessing Ray Data job calls per video (pure python, no ray):

    featurizer = Featurizer(cfg)          # builds the encoders once (an actor's __init__)
    sample = featurizer(uri, annotation)  # annotation: .video_id, .duration, .events (+ .split, .source)

It runs in two halves, so that the decoding and the encoders can live in different processes:

    media = featurizer.reader(uri)             # MediaReader: decode only, no weights (DecodedVideo /
                                               # the release media preparation's ReleaseInputs: picklable arrays)
    sample = featurizer.encode(media, annotation)   # the encoders (towers), then align the events

A Serve replica's decode workers run a `MediaReader` alone (infer/serving/media_pool.py) and the
replica encodes what they send back with its one Featurizer (infer/serving/service.py).

The sample's duration is the media's (see `preprocess.media`), not the annotated
one. Annotated events are checked against it: an event whose start or end lies
more than `features.duration_tolerance_s` past the media's end raises
MediaError(kind="annotation") ("annotation points beyond the video"); a smaller
overshoot is clipped to the media's end (and a negative start to 0). An event
that would be empty after clipping is an error too, never dropped silently.
feature_hash = section_hash(cfg.features), so shards record the settings that made them.
With the `release` encoders the release's own media preparation and towers run instead
(preprocess/release_encoders.py `ReleaseFeaturizer`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeline.config import Config, section_hash
from pipeline.schema import Sample
from preprocess.encoders import get_audio_encoder, get_visual_encoder
from preprocess.events import annotated_sample
from preprocess.media import DecodedVideo, decode_video
from preprocess.release_encoders import ReleaseFeaturizer, ReleaseReader, uses_release
from preprocess.release_media import ReleaseInputs


class MediaReader:
    """The decode half of a Featurizer: uri -> the media as arrays, no encoder built (no weights).

    A DecodedVideo (frames uint8, audio float32: preprocess/media.py), or with the `release`
    encoders the release media preparation's ReleaseInputs (resized uint8 frames, log-mel chunks).
    Callable as reader(uri, annotation) too (the annotation is not needed to decode)."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.release = ReleaseReader(cfg) if uses_release(cfg.features) else None

    def __call__(self, uri: str, annotation: Any = None) -> DecodedVideo | ReleaseInputs:
        if self.release is not None:
            return self.release(uri)
        return decode_video(uri, self.cfg.features)


class Featurizer:
    """Encoders built once from `cfg.features`; call it per video (or `reader` then `encode`)."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.reader = MediaReader(cfg)
        self.feature_hash = section_hash(cfg.features)
        self.release = None
        if uses_release(cfg.features):  # the release's own media rules and towers (preprocess/release_encoders.py)
            self.release = ReleaseFeaturizer(cfg, reader=self.reader.release)
            return
        self.visual = get_visual_encoder(cfg.features)
        self.audio = get_audio_encoder(cfg.features)

    def __call__(self, uri: str, annotation: Any) -> Sample:
        return self.encode(self.reader(uri), annotation)

    def encode(self, media: DecodedVideo | ReleaseInputs, annotation: Any) -> Sample:
        """What `reader` gave -> the Sample (a schema-2 Sample, or a ReleaseVideo with release_features=online)."""
        if self.release is not None:
            return self.release.encode(media, annotation)
        return annotated_sample(annotation, media.duration, self.cfg, self.feature_hash, lambda: dict(
            segment_times=media.segment_times, visual=self.visual.encode(media), audio=self.audio.encode(media),
            has_audio=media.has_audio))


@dataclass
class Unannotated:
    """What the featurizer gets for a video to caption: an id, no events (`source` names who asked)."""

    video_id: str
    source: str = "archive"
    events: tuple = ()
    duration: float | None = None
    split: str = ""
