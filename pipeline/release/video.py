"""One video as the release model takes it: its encoder inputs or its encoded tokens.

    video = ReleaseVideo(video_id, duration, seconds_per_step=d, grid_thw=[T, H, W],
                         pixel_values=..., mel=...)               # raw: encoded online
    video = ReleaseVideo(..., video_embeds=[T*V, d], audio_embeds=[A, d])   # stored tokens

grid_thw is the patch grid of the vision tower (T timesteps of `temporal_patch_size` frames,
H x W patches); the LLM sees H/m x W/m merged tokens per timestep, m the checkpoint's
spatial merge (`geometry`, pipeline/release/geometry.py: the 3B's 2 frames, 14 px, m = 2 by
default). `mel` [C, 128, 3000] is the
Whisper log-mel of each 30 s chunk of the audio stream, None for a video without audio
(then it gets no audio tokens at all, as in the release). Pure torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pipeline.release.geometry import RELEASE, Geometry
from pipeline.release.layout import AVGrid, av_grid


@dataclass
class ReleaseVideo:
    video_id: str
    duration: float
    seconds_per_step: float  # d = 2 / fps: seconds per timestep
    grid_thw: tuple[int, int, int]  # patch grid (T, H, W)
    pixel_values: torch.Tensor | None = None  # [T*H*W, 3*2*14*14]
    mel: torch.Tensor | None = None  # [C, 128, 3000]
    video_embeds: torch.Tensor | None = None  # [T*H'*W', d] (merged, raster order per timestep)
    audio_embeds: torch.Tensor | None = None  # [A_total, d]
    instruction: str | None = None  # None: the settings' instruction
    geometry: Geometry = RELEASE  # the checkpoint's media geometry

    @property
    def num_segments(self) -> int:
        return int(self.grid_thw[0])

    def grid(self, audio_tokens: int) -> AVGrid:
        return av_grid(self.grid_thw, self.seconds_per_step, audio_tokens, self.geometry)


def as_release_video(item, geometry: Geometry = RELEASE) -> ReleaseVideo:
    """A ReleaseVideo as it is, or a stored schema-2 Sample of the release encoders -> its ReleaseVideo
    (tokens in place of encoder inputs; `geometry`: the checkpoint's, as the model's
    `geometry`). Anything else is refused with the reason."""
    if isinstance(item, ReleaseVideo):
        return item
    from pipeline.schema import SchemaError

    if getattr(item, "audio_counts", None) is None or getattr(item, "grid_thw", None) is None \
            or getattr(item, "seconds_per_timestep", None) is None:
        raise SchemaError(f"{getattr(item, 'video_id', '?')}: not a release-encoder sample (no audio_counts / grid_thw / "
                          "seconds_per_timestep): features from other encoders cannot feed the release model")
    t, v, d = item.visual.shape
    return ReleaseVideo(video_id=item.video_id, duration=float(item.duration),
                        seconds_per_step=float(item.seconds_per_timestep), grid_thw=tuple(item.grid_thw),
                        video_embeds=torch.from_numpy(np.ascontiguousarray(item.visual).reshape(t * v, d)).float(),
                        audio_embeds=torch.from_numpy(np.ascontiguousarray(item.audio)).float(), geometry=geometry)
