"""One video as the release model takes it: its encoder inputs or its encoded tokens.

    video = ReleaseVideo(video_id, duration, seconds_per_step=d, grid_thw=[T, H, W],
                         pixel_values=..., mel=...)               # raw: encoded online
    video = ReleaseVideo(..., video_embeds=[T*V, d], audio_embeds=[A, d])   # stored tokens

grid_thw is the patch grid of the vision tower (T timesteps of `temporal_patch_size` frames,
H x W patches); the LLM sees H/m x W/m merged tokens per timestep, m the checkpoint's
spatial merge (`geometry`, pipeline/release/geometry.py: the 3B's 2 frames, 14 px, m = 2 by
default). `mel` [C, 128, 3000] is the
Whisper log-mel of each 30 s chunk of the audio stream, None for a video without audio
(then it gets no audio tokens at all, as in the release).

    videos = encode_videos(model, videos)    # raw ones -> stored tokens, the towers run once per batch
    video.tokens_to_encode                    # LLM tokens its towers still have to make (the encoder budget's unit)

The vision tower attends within windows (and within frames, in its full-attention blocks): HF runs
each window as its own SDPA call unless the attention speaks the flash varlen API, which is
decided by the implementation's name (`is_flash_attention_requested`). `window_attention`,
registered as WINDOW_ATTENTION, is that API over torch SDPA: the windows grouped by length, one
call per distinct length (a handful per video size), never a Python loop over windows; the
release's towers use it on every device (pipeline/release/model.py). Pure torch + HF.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AttentionInterface

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

    @property
    def raw_video(self) -> bool:
        return self.video_embeds is None and self.pixel_values is not None

    @property
    def raw_audio(self) -> bool:
        return self.audio_embeds is None and self.mel is not None

    @property
    def tokens_to_encode(self) -> int:
        """LLM tokens its towers still have to make (0: its tokens are stored, or it has no media)."""
        t, h, w = (int(x) for x in self.grid_thw)
        vision = t * h * w // self.geometry.spatial_merge_size ** 2 if self.raw_video else 0
        return vision + (self.mel.shape[0] * self.geometry.audio_tokens_per_chunk if self.raw_audio else 0)


def encode_videos(model, videos: list[ReleaseVideo]) -> list[ReleaseVideo]:
    """Raw videos -> the same videos with stored tokens (inputs dropped): the vision tower once over every
    raw video's patches (grid_thw [B, 3]), the audio tower once over every raw video's mel chunks. Each
    video's tokens equal encoding it alone (the towers work per frame / per 30 s chunk)."""
    vis = [v for v in videos if v.raw_video]
    aud = [v for v in videos if v.raw_audio]
    out = {id(v): {} for v in videos}
    if vis:
        pixels = torch.cat([v.pixel_values for v in vis])
        tokens = model.encode_video(pixels, torch.tensor([list(v.grid_thw) for v in vis]))
        merge = pixels.shape[0] // tokens.shape[0]  # patches per token
        for v, t in zip(vis, tokens.split([v.pixel_values.shape[0] // merge for v in vis])):
            out[id(v)].update(video_embeds=t, pixel_values=None)
    if aud:
        mel = torch.cat([v.mel for v in aud])
        tokens = model.encode_audio(mel)
        per_chunk = tokens.shape[0] // mel.shape[0]
        for v, t in zip(aud, tokens.split([v.mel.shape[0] * per_chunk for v in aud])):
            out[id(v)].update(audio_embeds=t, mel=None)
    return [replace(v, **out[id(v)]) if out[id(v)] else v for v in videos]


def window_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask=None,
                     scaling: float | None = None, cu_seq_lens_q: torch.Tensor | None = None, **_) -> tuple:
    """query, key, value [1, H, N, hd], windows at cu_seq_lens_q [W + 1] -> ([1, N, H, hd], None): each
    window attends within itself, the windows of one length in one SDPA call ([w, H, L, hd]).

    >>> q = torch.randn(1, 2, 7, 4)
    >>> out, _ = window_attention(None, q, q, q, cu_seq_lens_q=torch.tensor([0, 3, 6, 7]))
    >>> alone = F.scaled_dot_product_attention(q[:, :, 3:6], q[:, :, 3:6], q[:, :, 3:6]).transpose(1, 2)
    >>> out.shape, torch.allclose(out[:, 3:6], alone)
    (torch.Size([1, 7, 2, 4]), True)
    """
    _, heads, n, hd = query.shape
    cu = cu_seq_lens_q.tolist()
    out = query.new_empty(n, heads, hd)
    by_length: dict[int, list[int]] = {}
    for a, b in zip(cu, cu[1:]):
        by_length.setdefault(b - a, []).append(a)
    for length, starts in by_length.items():
        idx = (torch.tensor(starts)[:, None] + torch.arange(length)).flatten().to(query.device)
        q, k, v = (t[0][:, idx].unflatten(1, (len(starts), length)).transpose(0, 1) for t in (query, key, value))
        o = F.scaled_dot_product_attention(q, k, v, scale=scaling)  # [w, H, L, hd]
        out[idx] = o.transpose(1, 2).flatten(0, 1)
    return out[None], None


WINDOW_ATTENTION = "sdpa_windows_flash_api"  # "flash" in the name: HF hands it the packed windows
AttentionInterface.register(WINDOW_ATTENTION, window_attention)


def use_window_attention(vision_tower) -> None:
    """The vision tower attends through `window_attention` (its config alone: the LLM keeps its own)."""
    vision_tower.config._attn_implementation = WINDOW_ATTENTION


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
