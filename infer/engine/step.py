"""The decode step: one forward of every token the scheduler put in it, over the paged KV pool.

    batch = ForwardBatch(embeds, positions, slots, attn, capture=(g_layer, agg_layer))
    hidden, states = ModelRunner(weights, pool, kernel).forward(batch)   # [N, d], {layer: [N, d]}
    logits = runner.logits(hidden[rows])                                 # [M, V]

A step carries N tokens of many videos at once (infer/engine/scheduler.py fills it): chunks of
prefill, planning rows (one serial <G> each) and caption-branch rows (one token each). They
differ only in their metadata, never in the code they run, so one step reads top to bottom:

    cos, sin = rope(positions)                                  # once per step, [N, D]
    x = embeds
    for each decoder layer:
        h = input_norm(x); q, k, v = linear(h); q, k = rotate(q, k; cos, sin)
        pool.kv[layer][slots] = (k, v)                          # the tokens' own KV, paged
        o = kernel(q, pool, layer, attn, scale)                 # infer/engine/kernels.py
        x = x + o_proj(o); x = x + mlp(post_norm(x))
    hidden = norm(x)

Every token writes its KV before attending, so a token sees itself and earlier tokens of the
same step exactly as it would in a separate forward (the kernels' visibility rule decides).
Host work is per step, not per video or per layer: the metadata (`ForwardBatch`, built once)
is a handful of device tensors; the layer loop issues the same ops whatever the mix (a layered
block's parts, `LayerJob`, build their metadata as they run).

This is the inference path; HF's forward stays the training path and the test oracle (the
norms and activations are the HF modules themselves, the linear weights are read from them:
infer/engine/step_weights.py). Pure torch; no ray.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from infer.engine.attn_meta import AttnMeta
from infer.engine.kernels import Kernel
from infer.engine.paged import PagePool
from infer.engine.step_weights import StepWeights


@dataclass
class LayerJob:
    """A bidirectional block of one video's prefix, prefilled layer by layer: exact, since every token
    of the block needs the whole block's keys at each layer. At the first part of a layer the keys
    and values of all B tokens are projected and written (a small share of a layer's work with GQA);
    each part then runs the rest of the layer (queries, attention, MLP) for a range of the block's
    tokens. A step carries as many parts as its budget pays for, in order: the scheduler charges a
    token through one layer 1/layers of a token (infer/engine/scheduler.py), so a block moves through
    several layers a step at the cost of a chunk of the same size.

    x [B, d]: the block's input to `layer`; out: that layer's output as the parts fill it; cos,
    sin [B, 1, D]; slots [B]; layer, at: the next part starts at token `at` of `layer`; parts: this
    step's (layer, a, b), in order; meta(a, b): the attention metadata of tokens [a, b), built when
    their part runs (one part's masks alive at a time); capture / states: hidden-state indices to
    keep and what was kept; hidden: the final-norm states once the last layer is done; span: the
    block's prefix positions.
    """

    x: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    slots: torch.Tensor
    capture: tuple[int, ...]
    span: tuple[int, int]
    meta: Callable[[int, int], AttnMeta]
    layer: int = 0
    at: int = 0
    parts: tuple[tuple[int, int, int], ...] = ()
    states: dict[int, torch.Tensor] = field(default_factory=dict)
    hidden: torch.Tensor | None = None
    normed: torch.Tensor | None = None
    out: torch.Tensor | None = None

    @property
    def tokens(self) -> int:
        return int(self.x.shape[0])


@dataclass
class ForwardBatch:
    """One step's inputs and metadata (module doc); device tensors of N tokens.

    embeds [N, d] input embeddings; positions [3, N] long (M-RoPE axes; text tokens carry one
    id on all three, which is 1D RoPE); slots [N] long: flat pool slot of each token's KV;
    attn: the kernels' metadata; capture: hidden-state indices to return (HF's numbering:
    i < layers is the input of layer i, `layers` the final-norm output); jobs: layered blocks
    with parts in this step (`LayerJob`).
    """

    embeds: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    attn: AttnMeta
    capture: tuple[int, ...] = ()
    jobs: tuple[LayerJob, ...] = ()


class ModelRunner:
    """The decoder stack run over a ForwardBatch against the paged pool (module doc)."""

    def __init__(self, weights: StepWeights, pool: PagePool, kernel: Kernel):
        self.w, self.pool, self.kernel = weights, pool, kernel
        self.scale = weights.head_dim ** -0.5

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [R] -> [R, d] from the inference embedding table (<G>/<S> rows folded in)."""
        return self.w.embed[ids]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, d] -> [R, V] (the LM head with the <G>/<S> rows folded in)."""
        return F.linear(hidden, self.w.head, self.w.head_bias)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [3, N] -> cos, signed sin [N, 1, D] by the backbone's own rotary module (elementwise
        in the position, so batch-invariant). HF rotates x * cos + rotate_half(x) * sin with
        rotate_half(x) = (-x2, x1); (x2, x1) is x.roll(D/2) and the sign moves into sin: (-s1, s2),
        the same products bit for bit, two ops fewer per layer."""
        probe = torch.zeros(1, dtype=dtype, device=positions.device)
        pos = positions[:, None] if self.w.mrope else positions[:1]
        cos, sin = self.w.rope(probe, pos)
        half = sin.shape[-1] // 2
        sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
        return cos[0, :, None], sin[0, :, None]

    def forward(self, batch: ForwardBatch) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """-> final-norm hidden [N, d] and the captured hidden states {index: [N, d]}; each job in
        the batch runs its parts at their layers (its states kept as it passes the capture layers)."""
        w = self.w
        cos, sin = self.rope(batch.positions, batch.embeds.dtype)
        x = batch.embeds
        states: dict[int, torch.Tensor] = {}
        at = self.parts_by_layer(batch)
        for li, lw in enumerate(w.layers):
            if li in batch.capture:
                states[li] = x
            q = self.qkv(lw, li, x, cos, sin, batch.slots)
            x = self.out_and_mlp(lw, x, self.attend(li, q, batch.attn, at.get(li, ())))
        hidden = w.norm(x)
        if len(w.layers) in batch.capture:
            states[len(w.layers)] = hidden
        return hidden, states

    @staticmethod
    def parts_by_layer(batch: ForwardBatch) -> dict[int, list[tuple[LayerJob, int, int]]]:
        """The layered blocks' parts of the step by layer: {layer: [(job, a, b)]}, in order."""
        at: dict[int, list[tuple[LayerJob, int, int]]] = {}
        for job in batch.jobs:
            for li, a, b in job.parts:
                at.setdefault(li, []).append((job, a, b))
        return at

    def attend(self, li: int, q: torch.Tensor, attn: AttnMeta, parts=()) -> torch.Tensor:
        """Layer li's attention: q [N, Hq, D] -> [N, Hq * D]; then the layered blocks' parts at li (they read
        only the pool's layer li, which this step's tokens have written: the main batch's MLP may follow them).
        The step's eager part between the pieces of a piecewise replay (infer/engine/pieces.py)."""
        o = self.kernel(q, self.pool, li, attn, self.scale)
        for job, a, b in parts:
            self._job_part(self.w.layers[li], li, job, a, b)
        return o

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return x * cos + x.roll(self.w.head_dim // 2, dims=-1) * sin

    def _job_part(self, lw, li: int, job: LayerJob, a: int, b: int) -> None:
        """Tokens [a, b) of a layered block at layer li (LayerJob doc); the same arithmetic per token
        as `qkv`, `attend` and `out_and_mlp`."""
        w, n = self.w, job.tokens
        if (li, a) != (job.layer, job.at):
            raise RuntimeError(f"a layered block's part at ({li}, {a}), its next is ({job.layer}, {job.at})")
        if a == 0:  # the layer's first part: keys and values of the whole block
            if li in job.capture:
                job.states[li] = job.x
            job.normed = lw.input_norm(job.x)
            k = self._rotate(F.linear(job.normed, *lw.k).view(n, w.kv_heads, w.head_dim), job.cos, job.sin)
            v = F.linear(job.normed, *lw.v).view(n, w.kv_heads, w.head_dim)
            self.pool.layer[li].index_copy_(0, job.slots, torch.stack([k, v], dim=1))
            job.out = torch.empty_like(job.x)
        q = self._rotate(F.linear(job.normed[a:b], *lw.q).view(b - a, w.heads, w.head_dim), job.cos[a:b], job.sin[a:b])
        job.out[a:b] = self.out_and_mlp(lw, job.x[a:b], self.kernel(q, self.pool, li, job.meta(a, b), self.scale))
        job.at = b
        if b < n:
            return
        job.x, job.out, job.normed, job.at = job.out, None, None, 0
        job.layer += 1
        if job.layer == len(w.layers):
            job.hidden = w.norm(job.x)
            if job.layer in job.capture:
                job.states[job.layer] = job.hidden

    def qkv(self, lw, li: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            slots: torch.Tensor) -> torch.Tensor:
        """A layer's work before attention over tokens x [N, d]: the norm, q, k, v, the rotation; the keys and
        values written to the pool at `slots` [N]. -> the rotated queries [N, Hq, D]."""
        w = self.w
        n = x.shape[0]
        hq, hkv = w.heads, w.kv_heads
        h = lw.input_norm(x)
        q = F.linear(h, *lw.q).view(n, hq, w.head_dim)
        k = F.linear(h, *lw.k).view(n, hkv, w.head_dim)
        v = F.linear(h, *lw.v).view(n, hkv, w.head_dim)
        qk = self._rotate(torch.cat([q, k], dim=1), cos, sin)  # one rotation for q and k
        self.pool.layer[li].index_copy_(0, slots, torch.stack([qk[:, hq:], v], dim=1))
        return qk[:, :hq]

    @staticmethod
    def out_and_mlp(lw, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """The rest of a layer after attention: x [n, d] + o_proj(a [n, Hq * D]), then the MLP's residual."""
        x = torch.addmm(x, a, lw.o_t) if lw.o_t is not None else x + F.linear(a, *lw.o)
        h = lw.post_norm(x)
        m = lw.act(F.linear(h, *lw.gate)) * F.linear(h, *lw.up)
        return torch.addmm(x, m, lw.down_t) if lw.down_t is not None else x + F.linear(m, *lw.down)
