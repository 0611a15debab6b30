"""The release family's decoding rules, shared by the engine's program (infer/engine/programs.py), the
reference decoders (infer/oracles/) and fine-tuning (pipeline/release/finetune.py).

    video = decodable_video(model, video)                   # the checkpoint's media geometry (DecodeError)
    lay, embeds [L, d], pos [3, L], delta = prefill_inputs(model, video)
    pre = prefill(model, video, cache)                      # HF's forward; grounding / aggregation states
    row [L] = aggregation_row(model, lay, pos, h_agg)       # the user turn's <|im_end|> attention, layer 6
    anchors [K, d] = anchor_inputs(g_emb, agg, steps)       # E[<G>] + agg(interval of event j)
    seconds((a, b), d) -> (a d, (b + 1) d)                  # timestep interval -> seconds, not clipped

The prompt: the AV interleave with M-RoPE ids in the settings' mode, causal and the AV block
bidirectional within itself (pipeline/release/layout.py `prompt_visible`); hidden_states[-2]
grounds, the input of `vision_audio_layer_index` aggregates. Pure torch + HF; no ray.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.aggregation import attention_row
from pipeline.family import DecodeError
from pipeline.release.layout import LayoutError, ReleaseLayout, build_layout, mrope_ids, prompt_visible
from pipeline.release.video import ReleaseVideo, as_release_video


@dataclass
class ReleasePrefill:
    """What the prefill of one video leaves for planning (and for parity checks)."""

    layout: ReleaseLayout
    positions: torch.Tensor  # [3, L]
    delta: int
    inputs_embeds: torch.Tensor  # [L, d]
    h_ground: torch.Tensor  # [L, d] hidden_states[-2]
    h_agg: torch.Tensor  # [L, d] input of the aggregation layer
    last_hidden: torch.Tensor  # [d] final-norm state of the last row
    last_ground: torch.Tensor  # [d] hidden_states[-2] of the last row
    attn_row: torch.Tensor  # [L] aggregation probabilities (0 on hidden keys)
    segments: torch.Tensor  # [T, d] segment keys


def media_tokens(model, video: ReleaseVideo) -> tuple[torch.Tensor, torch.Tensor]:
    """(video tokens [T*V, d], audio tokens [A, d]) of a video: stored, or encoded now."""
    if video.video_embeds is not None:
        vis = video.video_embeds
    elif video.pixel_values is not None:
        vis = model.encode_video(video.pixel_values, torch.tensor([list(video.grid_thw)]))
    else:
        raise DecodeError(f"{video.video_id}: neither pixel values nor video tokens")
    if video.audio_embeds is not None:
        aud = video.audio_embeds
    elif video.mel is not None:
        aud = model.encode_audio(video.mel)
    else:
        aud = vis.new_zeros(0, vis.shape[-1])
    return vis.to(model.device, model.dtype), aud.to(model.device, model.dtype)


def prefill_inputs(model, video: ReleaseVideo, embed=None) -> tuple[ReleaseLayout, torch.Tensor, torch.Tensor, int]:
    """A video's prompt for prefill: (layout, input embeddings [L, d], M-RoPE ids [3, L], rope delta).

    embed: ids -> embeddings (default the model's table; fine-tuning passes its own, with the
    trained <G>/<S> rows); the media tokens come from the frozen towers, without gradients.
    Raises DecodeError for a video that cannot be decoded as given (the engine records it
    for that video alone): bad timing, features that do not match the grid, a prompt over
    the settings' max_seq_len."""
    if not (video.duration > 0 and video.seconds_per_step > 0):
        raise DecodeError(f"{video.video_id}: duration and seconds per timestep must be positive")
    with torch.no_grad():
        vis, aud = media_tokens(model, video)
    try:
        grid = video.grid(aud.shape[0])
        lay = build_layout(model.tokenizer, model.ids, grid, video.instruction or model.settings.instruction)
    except LayoutError as e:
        raise DecodeError(f"{video.video_id}: {e}") from e
    if vis.shape[0] != grid.timesteps * grid.per_step:
        raise DecodeError(f"{video.video_id}: {vis.shape[0]} video tokens for a grid of {grid.timesteps} x "
                          f"{grid.per_step}")
    if lay.length > model.settings.max_seq_len:
        raise DecodeError(f"{video.video_id}: prompt of {lay.length} tokens is over the model's {model.settings.max_seq_len}")
    pos, delta = mrope_ids(lay, model.settings.positions)
    dev = model.device
    emb = (model.embed_tokens if embed is None else embed)(lay.input_ids.to(dev))
    emb = emb.index_copy(0, lay.video_slots.to(dev), vis)
    if aud.shape[0]:
        emb = emb.index_copy(0, lay.audio_slots.to(dev), aud)
    return lay, emb, pos, delta


def aggregation_row(model, lay: ReleaseLayout, pos: torch.Tensor, h_agg: torch.Tensor) -> torch.Tensor:
    """[L] aggregation probabilities of the user turn's <|im_end|> (layer-6 attention, fp32 softmax cast to
    the model dtype, mean over heads; 0 on hidden keys) from the aggregation layer's input states."""
    dev = h_agg.device
    q = lay.query_index
    keys = torch.arange(lay.length, device=dev) <= q
    return attention_row(model.decoder, model.aggregation_layer, model.adapter, h_agg, pos.T.to(dev), q, keys,
                         probs_dtype=model.dtype)


def prefill(model, video: ReleaseVideo, cache, embed=None) -> ReleasePrefill:
    """Steps 1-3 of the module doc for one video (HF's forward), with gradients where the caller has
    them: fine-tuning's prefill (pipeline/release/finetune.py passes its `embed` and, when it reruns
    the prompt under activation checkpointing, no cache); decoding runs the same inputs and mask
    through the engine's program (infer/engine/programs.py, infer/oracles/front.py). The mask: causal,
    and the AV block bidirectional within itself (pipeline/release/layout.py `prompt_visible`)."""
    lay, emb, pos, delta = prefill_inputs(model, video, embed)
    out = model.run_decoder(emb[None], ~prompt_visible(lay)[None, None], pos[:, None], cache, output_hidden_states=True)
    hs = out.hidden_states
    h_ground, h_agg = hs[-2][0], hs[model.aggregation_layer][0]
    row = aggregation_row(model, lay, pos, h_agg.detach())
    segments = model.segment_vectors(h_ground, lay)
    return ReleasePrefill(lay, pos, delta, emb, h_ground, h_agg, out.last_hidden_state[0, -1], h_ground[-1], row,
                          segments)


def seconds(step: tuple[int, int], d: float) -> tuple[float, float]:
    """Timestep interval (a, b) -> seconds [a d, (b + 1) d] (not clipped, as the release reads them out)."""
    return step[0] * d, (step[1] + 1) * d


def decodable_video(model, video) -> ReleaseVideo:
    """A ReleaseVideo (or a stored schema-2 sample) read with the checkpoint's media geometry;
    DecodeError when it cannot be (the engine records that for the video alone)."""
    try:
        return as_release_video(video, model.geometry)
    except ValueError as e:
        raise DecodeError(str(e)) from e


def anchor_inputs(g_emb: torch.Tensor, agg, steps: list[tuple[int, int]]) -> torch.Tensor:
    """[K, d] anchors E[<G>] + agg(interval of event j) (module doc, step 5); [0, d] when K = 0."""
    return torch.stack([g_emb + agg(st) for st in steps]) if steps else g_emb.new_zeros(0, g_emb.shape[0])
