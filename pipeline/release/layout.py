"""The release's token layout of one video: prompt ids, AV interleave, index sets, M-RoPE ids.

    grid = AVGrid(timesteps=T, rows=H', cols=W', seconds_per_step=d, audio_tokens=A_total)
    lay = build_layout(tokenizer, ids, grid, instruction)
    lay.input_ids [L]; lay.video_slots / lay.audio_slots (sequence index of each token);
    lay.video_sets / lay.audio_sets (per-timestep index lists); lay.query_index (aggregation row)
    pos, delta = mrope_ids(lay, mode)      # [3, L] and the rope delta; mode "release" | "training"

Facts (docs/design/release.md 2, 3, 4.3):
  * prompt: `<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n<|im_start|>user\\n
    <|vision_start|>` AV `<|vision_end|>\\n{instruction}<|im_end|>\\n<|im_start|>assistant\\n`;
  * AV block: per timestep t its V = H'W' `<|video_pad|>` then a_t `<|audio_pad|>`, with
    tau(t) = int(float32(float32(t d) * 2)), a_t = tau(t+1) - tau(t), the last timestep
    taking the rest of A_total = 60 ceil(samples / 480000) (none without an audio track);
  * grounding / aggregation index sets (not the interleave counts): timestep t covers
    [t d, (t+1) d] in float64; its video tokens are those of segments
    [floor(t d / d), ceil((t+1) d / d)) and its audio tokens [floor(t d / 0.5),
    ceil((t+1) d / 0.5)), both clamped; neighbours' audio ranges overlap, and float error
    can give a timestep two segments: both are kept, as the release keeps them;
  * the aggregation query is the user turn's `<|im_end|>`; grounding reads the last row.
Positions: "training" is what the model learnt (video (t, r, c) -> (p0 + tau(t), p0 + r,
p0 + c), audio j -> (p0 + j, p0, p0 + j), text after the block from its temporal max + 1);
"release" is what the release computes at test time (the first T V tokens after p0 take
the video grid in raster order whatever their type, everything later is text from
p0 + max(tau(T-1), H'-1, W'-1) + 1). After the prompt every token is text in both modes:
position = cache index + delta on all three axes (pipeline/layout.py `shared_position`,
`anchor_position`, `branch_position` with the rope delta).
Masks: the project's visibility rule (pipeline/layout.py `mask_between`) over the release's
tokens (`prompt_meta`, `event_meta`): the prompt causal with its AV block bidirectional,
serial <G>s shared, anchor and branch tokens of one event seeing the shared tokens and
their own event only. Pure torch; no ray.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pipeline.layout import LayoutError, LayoutOptions, Role, TokenMeta, event_order, mask_between
from pipeline.release.geometry import RELEASE, Geometry

SYSTEM = "You are a helpful assistant."
POSITION_MODES = ("release", "training")
MASK = LayoutOptions()  # factorized, AV bidirectional, every serial <G> visible: the release's masks


@dataclass(frozen=True)
class AVGrid:
    """What the layout needs to know of one video's encoded media."""

    timesteps: int  # T: temporal grid steps (two frames each)
    rows: int  # H': merged token rows per timestep
    cols: int  # W': merged token columns per timestep
    seconds_per_step: float  # d = 2 / fps
    audio_tokens: int  # A_total (0: no audio track)
    tokens_per_second: float = RELEASE.tokens_per_second  # the checkpoint's (pipeline/release/geometry.py)
    audio_seconds_per_token: float = RELEASE.audio_seconds_per_token

    @property
    def per_step(self) -> int:
        return self.rows * self.cols


def av_grid(grid_thw: tuple[int, int, int], d: float, audio_total: int, geo: Geometry = RELEASE) -> AVGrid:
    """The layout's view of one video: the vision tower's patch grid (T, H, W) merged by the checkpoint's
    spatial merge, seconds per timestep d, A_total audio tokens, the checkpoint's token rates."""
    m = geo.spatial_merge_size
    return AVGrid(timesteps=int(grid_thw[0]), rows=int(grid_thw[1]) // m, cols=int(grid_thw[2]) // m,
                  seconds_per_step=float(d), audio_tokens=int(audio_total), tokens_per_second=geo.tokens_per_second,
                  audio_seconds_per_token=geo.audio_seconds_per_token)


def tau(grid: AVGrid) -> torch.Tensor:
    """[T] int64: the temporal position offset of each timestep, float32 as the release computes it."""
    return (torch.arange(grid.timesteps) * float(grid.seconds_per_step) * grid.tokens_per_second).long()


def audio_counts(grid: AVGrid) -> list[int]:
    """Audio tokens after each timestep's video tokens in the interleave (sums to A_total).

    Bounds are clamped to A_total, so an audio track shorter than the video gives the late
    timesteps no tokens instead of negative counts.
    """
    bounds = [min(int(b), grid.audio_tokens) for b in tau(grid).tolist()] + [grid.audio_tokens]
    return [bounds[t + 1] - bounds[t] for t in range(grid.timesteps)]


def index_sets(grid: AVGrid) -> tuple[list[list[int]], list[list[int]]]:
    """Per timestep the video-token and audio-token indices (into each modality's own sequence)."""
    d = float(grid.seconds_per_step)
    video, audio = [], []
    for t in range(grid.timesteps):
        start, end = t * d, (t + 1) * d
        s0, s1 = math.floor(start / d), min(math.ceil(end / d), grid.timesteps)
        video.append(list(range(s0 * grid.per_step, s1 * grid.per_step)))
        a0 = min(math.floor(start / grid.audio_seconds_per_token), grid.audio_tokens)  # none without audio
        a1 = min(math.ceil(end / grid.audio_seconds_per_token), grid.audio_tokens)
        audio.append(list(range(a0, a1)))
    return video, audio


@dataclass
class ReleaseLayout:
    """One video's prompt (module doc); index tensors are positions in the token sequence."""

    input_ids: torch.Tensor  # [L]
    grid: AVGrid
    p0: int  # first AV token
    video_slots: torch.Tensor  # [T*V] sequence index of the k-th <|video_pad|>
    audio_slots: torch.Tensor  # [A_total]
    video_sets: list[list[int]]  # per timestep: indices into the video tokens
    audio_sets: list[list[int]]
    query_index: int  # the user turn's <|im_end|> (aggregation query)

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def block_len(self) -> int:
        return self.grid.timesteps * self.grid.per_step + self.grid.audio_tokens


def build_layout(tokenizer, ids: dict[str, int], grid: AVGrid, instruction: str) -> ReleaseLayout:
    """The dense-captioning prompt of one video (module doc). ids: the release token ids
    (`vision_start`, `vision_end`, `video`, `audio`, `im_end`)."""
    if grid.timesteps < 1 or grid.per_step < 1:
        raise LayoutError(f"a video needs at least one timestep of video tokens, got {grid}")

    def enc(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    head = enc(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n") + enc("<|im_start|>user\n") + [ids["vision_start"]]
    block: list[int] = []
    for count in audio_counts(grid):
        block += [ids["video"]] * grid.per_step + [ids["audio"]] * count
    tail = [ids["vision_end"]] + enc(f"\n{instruction}<|im_end|>\n") + enc("<|im_start|>assistant\n")
    input_ids = torch.tensor(head + block + tail, dtype=torch.long)
    p0 = len(head)
    video_slots = torch.nonzero(input_ids == ids["video"]).flatten()
    audio_slots = torch.nonzero(input_ids == ids["audio"]).flatten()
    if video_slots.numel() != grid.timesteps * grid.per_step or audio_slots.numel() != grid.audio_tokens:
        raise LayoutError("the instruction text contains video/audio placeholder tokens")
    im_end = torch.nonzero(input_ids == ids["im_end"]).flatten().tolist()
    query = next(i for i in im_end if i > p0)
    video_sets, audio_sets = index_sets(grid)
    return ReleaseLayout(input_ids, grid, p0, video_slots, audio_slots, video_sets, audio_sets, query)


def mrope_ids(lay: ReleaseLayout, mode: str) -> tuple[torch.Tensor, int]:
    """[3, L] M-RoPE ids (t, h, w) of the prompt and the rope delta (max + 1 - L)."""
    if mode not in POSITION_MODES:
        raise LayoutError(f"position mode {mode!r} is not one of {POSITION_MODES}")
    g, p0, L = lay.grid, lay.p0, lay.length
    pos = torch.arange(L).repeat(3, 1)
    taus = tau(g)
    n_grid = g.timesteps * g.per_step
    k = torch.arange(n_grid)
    grid_ids = torch.stack([p0 + taus[k // g.per_step], p0 + (k % g.per_step) // g.cols, p0 + k % g.cols])
    if mode == "release":  # the grid on the first T V tokens whatever their type, then text
        pos[:, p0:p0 + n_grid] = grid_ids
        start = p0 + max(int(taus[-1]), g.rows - 1, g.cols - 1) + 1
        pos[:, p0 + n_grid:] = start + torch.arange(L - p0 - n_grid)
    else:
        pos[:, lay.video_slots] = grid_ids
        j = torch.arange(g.audio_tokens)
        pos[:, lay.audio_slots] = torch.stack([p0 + j, torch.full_like(j, p0), p0 + j])
        block_end = p0 + lay.block_len
        start = p0 + max(int(taus[-1]), g.audio_tokens - 1) + 1
        pos[:, block_end:] = start + torch.arange(L - block_end)
    delta = int(pos.max()) + 1 - L
    return pos, delta


def shared_meta(count: int, start: int = 0, role: Role = Role.INSTRUCTION) -> TokenMeta:
    """`count` shared tokens (event -1: prompt text, serial <G>s) at order keys start, start + 1, ..."""
    return TokenMeta(order=torch.arange(start, start + count), role=torch.full((count,), int(role)),
                     event=torch.full((count,), -1))


def prompt_meta(lay: ReleaseLayout) -> TokenMeta:
    """The prompt's tokens for the visibility rule: order = index, all shared, the AV slots VISUAL /
    AUDIO (so the AV block is bidirectional), text PREAMBLE before the block, INSTRUCTION after it."""
    meta = shared_meta(lay.length)
    meta.role[: lay.p0] = int(Role.PREAMBLE)
    meta.role[lay.video_slots] = int(Role.VISUAL)
    meta.role[lay.audio_slots] = int(Role.AUDIO)
    return meta


def event_meta(base: int, num_events: int, event: list[int], step: list[int], branch_order: str) -> TokenMeta:
    """Anchor (step 0) and branch tokens (step j) of events `event`: order keys pipeline/layout.py
    `event_order` with base = the index of the first anchor (prompt + serial <G>s)."""
    ev, st = torch.tensor(event, dtype=torch.long), torch.tensor(step, dtype=torch.long)
    role = torch.where(st == 0, int(Role.ANCHOR), int(Role.BRANCH))
    return TokenMeta(order=event_order(ev, st, base, num_events, branch_order).reshape(-1), role=role, event=ev)


def release_visible(queries: TokenMeta, keys: TokenMeta) -> torch.Tensor:
    """bool [Lq, Lk]: the project's visibility rule with the release's mask options (`MASK`)."""
    return mask_between(queries, keys, MASK)


def prompt_visible(lay: ReleaseLayout) -> torch.Tensor:
    """bool [L, L] of the prompt: causal, and the AV block bidirectional within itself."""
    meta = prompt_meta(lay)
    return release_visible(meta, meta)


