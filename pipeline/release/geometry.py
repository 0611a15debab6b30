"""The release model's media geometry, read from its checkpoint's config.json.

    geo = Geometry.from_config(json.load(open(dir / "config.json")))   # or Geometry.from_dir(dir)
    geo.factor, geo.audio_tokens_per_chunk

What the media preparation, the layout and the towers must agree on (docs/design/release.md 1.2, 2, 4.1-4.3), with
the published 3B's values as the defaults when a key is absent: `vision_config.patch_size` (14 px),
`temporal_patch_size` (2 frames per timestep), `spatial_merge_size` (2: H/2 x W/2 LLM tokens per
timestep), `tokens_per_second` (2: the M-RoPE temporal step per second, also the audio
interleave's bound), and `audio_config.second_per_window` (0.5 s per audio token: one Q-Former
query per window of Whisper's 30 s chunk). One place for these numbers; nothing else hard-codes
them. Pure python.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHUNK_SECONDS = 30.0  # Whisper's input window (its 1500 encoder frames)


@dataclass(frozen=True)
class Geometry:
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    tokens_per_second: float = 2.0
    audio_seconds_per_token: float = 0.5

    @property
    def factor(self) -> int:
        """Resized frame sides are multiples of this (28 for the 3B)."""
        return self.patch_size * self.spatial_merge_size

    @property
    def audio_tokens_per_chunk(self) -> int:
        """Audio tokens per 30 s Whisper chunk (60 for the 3B)."""
        return round(CHUNK_SECONDS / self.audio_seconds_per_token)

    @classmethod
    def from_config(cls, raw: dict[str, Any]) -> Geometry:
        """From a release config.json's dict (absent keys: the 3B's values)."""
        vision = raw.get("vision_config") or {}
        audio = raw.get("audio_config") or {}
        d = cls()
        geo = cls(patch_size=int(vision.get("patch_size", d.patch_size)),
                  temporal_patch_size=int(vision.get("temporal_patch_size", d.temporal_patch_size)),
                  spatial_merge_size=int(vision.get("spatial_merge_size", d.spatial_merge_size)),
                  tokens_per_second=float(vision.get("tokens_per_second", d.tokens_per_second)),
                  audio_seconds_per_token=float(audio.get("second_per_window", d.audio_seconds_per_token)))
        if min(geo.patch_size, geo.temporal_patch_size, geo.spatial_merge_size) < 1 or geo.tokens_per_second <= 0 \
                or not 0 < geo.audio_seconds_per_token <= CHUNK_SECONDS:
            raise ValueError(f"config.json gives an impossible media geometry: {geo}")
        return geo

    @classmethod
    def from_dir(cls, path: str | Path) -> Geometry:
        return cls.from_config(json.loads((Path(path) / "config.json").read_text()))


RELEASE = Geometry()  # the published PadCaptioner-3B's
