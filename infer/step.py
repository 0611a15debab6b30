"""The decode step: one forward of the caption-phase rows of many videos, layer by layer.

    runner = StepRunner(StepWeights.of(model), choose_kernel(...), rows=128, branch_tokens=320)
    runner.admit(video_slot, prefix_kv)                                     # a video's prefix KV
    hidden = runner.step(embeds, meta)                                      # [R, d] -> [R, d]
    logits = runner.logits(hidden)                                          # [R, V]

This is the inference path of the caption phase, in the style of an LLM server's model
runner: it loops over the backbone's decoder layers itself and calls the cascade
attention explicitly, with the HF module weights it was given (nothing is forked: the
norms and activations are the HF modules themselves, the linear weights are read from
them; HF's forward stays the training path and the test oracle).

Rows. A step carries R rows, each one caption branch of one video: an anchor (branch
step 0) or the last token of its branch. Rows of one video are contiguous; videos are
in admission order. Per row the step needs (`StepMeta`, all device tensors):

    positions  [R] long   layout position of the row's token (A + branch step)
    lengths    [R] long   branch KV entries before this token (0 for an anchor)
    slots      [R] long   the video slot of the row
    ranks      [R] long   the row's index among its video's rows
and per video (host ints, used only by the eager attention): `spans` (slot, first row,
rows). The new token's key/value is written into the branch KV pool at
[row, :, lengths[row]] and attends to (a) its video's prefix KV (chat preamble,
audio-visual block, instruction, serial <G>s; stored once per video, read once per step
by all of that video's rows) and (b) its own branch KV; (a) and (b) are merged by their
log-sum-exps in fp32 (exact up to the output rounding, also in bf16).

Attention over many videos (infer/kv_pool.py):
  "varlen"  (eager, the default) per video one packed query block [1, Hkv, n*g, D]
            against that video's prefix [Hkv, Lp, D], no mask, no padding;
  "padded"  (static shapes, for torch.compile / CUDA graphs) the prefixes live in a
            pool [S, Hkv, Lcap, D]; the rows are scattered into [S, Hkv, Rv*g, D] by
            (slot, rank) and masked by each slot's prefix length. One call, no
            Python loop over videos, so a bucket of R rows is one graph.
Both give the same numbers (tests/test_engine_batch.py).

Pure torch + the loaded HF modules; no ray. The weights are a `StepWeights` snapshot
(infer/step_weights.py: LoRA merged, <G>/<S> folded into inference copies of the tables);
the kernel a `Kernel` chosen once (infer/attention.py `choose_kernel`).
"""

from __future__ import annotations

import enum

import torch
import torch.nn.functional as F

from infer.attention import Kernel, merge_lse
from infer.kv_pool import BranchPool, PaddedPrefix, StepMeta, VarlenPrefix
from infer.step_weights import StepWeights


class Mode(enum.Enum):
    """What a forward computes. PREFILL and PLAN run through HF's forward (infer/front.py:
    one video, the layout mask); ANCHOR and BRANCH rows go through `StepRunner.step`, mixed
    in one step (an anchor row is a branch at step 0)."""

    PREFILL = "prefill"
    PLAN = "plan"
    ANCHOR = "anchor"
    BRANCH = "branch"


# ----------------------------------------------------------------------------------- weights


# ----------------------------------------------------------------------------------- kernels


# ----------------------------------------------------------------------------------- KV storage


# ----------------------------------------------------------------------------------- the step


class StepRunner:
    """One decode step over R caption rows of many videos (module doc).

    weights: StepWeights; kernel: the `Kernel` chosen once (`choose_kernel`);
    rows: branch rows the pool holds (infer.max_batch_rows); branch_tokens: KV entries per
    branch (infer.max_branch_tokens); prefix: "varlen" | "padded" (with slots, rows per
    video and the prefix cap for the padded pool).
    """

    def __init__(self, weights: StepWeights, kernel: Kernel, rows: int, branch_tokens: int, *, prefix: str = "varlen",
                 prefix_splits: int = 0, slots: int = 1, rows_per_video: int = 1, prefix_cap: int = 1):
        w = weights
        self.w = w
        self.kernel = kernel
        self.scale = w.head_dim ** -0.5
        self.group = w.heads // w.kv_heads
        dev, dt = w.device, w.dtype
        self.branch = BranchPool(w.num_layers, rows, w.kv_heads, branch_tokens, w.head_dim, dt, dev)
        if prefix == "varlen":
            self.prefix = VarlenPrefix(self.kernel, prefix_splits)
        elif prefix == "padded":
            self.prefix = PaddedPrefix(self.kernel, w.num_layers, slots, rows_per_video, prefix_cap, w.kv_heads,
                                       w.head_dim, dt, dev)
        else:
            raise ValueError(f"unknown prefix attention {prefix!r}")
        self.padded = prefix == "padded"

    def admit(self, slot: int, prefix_kv) -> None:
        self.prefix.admit(slot, prefix_kv)

    def release(self, slot: int) -> None:
        self.prefix.release(slot)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [R] -> [R, d] from the inference embedding table (<G>/<S> rows folded in)."""
        return self.w.embed[ids]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, d] -> [R, V] (the LM head with the <G>/<S> rows folded in)."""
        return F.linear(hidden, self.w.head, self.w.head_bias)

    def branch_keys(self, meta: StepMeta) -> int:
        """Branch KV entries a step reads per row: the live maximum (eager) or the whole pool (padded)."""
        return self.branch.tokens if self.padded else meta.max_length

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [R, H, D], cos/sin [R, 1, D] -> x rotated (HF's apply_rotary_pos_emb, per row)."""
        return x * cos + self.w.rotate_half(x) * sin

    def _attention(self, layer: int, q: torch.Tensor, meta: StepMeta, visible: torch.Tensor) -> torch.Tensor:
        """q [R, Hq, D] (this step's tokens already in the branch pool) -> [R, Hq, D];
        visible: which branch KV entries each row sees (its own, this token included)."""
        R, hq, d = q.shape
        hkv, g = self.w.kv_heads, self.group
        qg = q.reshape(R, hkv, g, d)  # the g query heads of one KV head are adjacent
        o_a, lse_a = self.prefix.attend(layer, qg, meta, self.scale)
        t = self.branch_keys(meta)
        kb, vb = self.branch.k[layer][:R, :, :t], self.branch.v[layer][:R, :, :t]
        o_b, lse_b = self.kernel(qg, kb, vb, self.scale, visible)
        o, _ = merge_lse(o_a, lse_a, o_b, lse_b, with_lse=False)  # fp32 weights and blend, one rounding
        return o.to(q.dtype).reshape(R, hq, d)

    def step(self, embeds: torch.Tensor, meta: StepMeta) -> torch.Tensor:
        """embeds [R, d] of the step's tokens -> final-norm hidden states [R, d].

        Per layer: norm -> q, k, v -> RoPE at the rows' positions -> write k, v into the
        branch pool -> cascade attention (prefix part, own-branch part, LSE merge) ->
        o_proj + residual -> norm -> MLP + residual. Same arithmetic as the HF layer.
        """
        w = self.w
        R = embeds.shape[0]
        cos_t, sin_t = w.rope_tables(0)
        cos, sin = cos_t[meta.positions][:, None], sin_t[meta.positions][:, None]  # [R, 1, D]
        visible = self.kernel.visible(meta.lengths + 1, self.branch_keys(meta), embeds.dtype)  # once per step
        x = embeds
        for li, lw in enumerate(w.layers):
            h = lw.input_norm(x)
            q = F.linear(h, *lw.q).view(R, w.heads, w.head_dim)
            k = F.linear(h, *lw.k).view(R, w.kv_heads, w.head_dim)
            v = F.linear(h, *lw.v).view(R, w.kv_heads, w.head_dim)
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            self.branch.write(li, k, v, meta.lengths)
            a = self._attention(li, q, meta, visible)
            x = x + F.linear(a.reshape(R, w.heads * w.head_dim), *lw.o)
            h = lw.post_norm(x)
            x = x + F.linear(lw.act(F.linear(h, *lw.gate)) * F.linear(h, *lw.up), *lw.down)
        return w.norm(x)


class GraphedStep:
    """The padded step replayed from CUDA graphs, one graph per bucket of rows (CUDA only).

    graphed = GraphedStep(runner); hidden = graphed(embeds, meta)   # same contract as runner.step

    A bucket (R rows) is captured on its first use: its inputs (embeds, positions, lengths,
    slots, ranks) are copied into static tensors, the step is run twice on a side stream
    (warm-up), then captured; later steps of R rows copy their inputs in and replay. Every
    other tensor the step reads is persistent and updated in place (branch pool, prefix pool
    and its lengths, weights, RoPE tables sized at set-up), so a replay sees the live state.
    If the RoPE tables had to grow, the graphs are dropped and recaptured.
    """

    def __init__(self, runner: StepRunner):
        if not runner.padded:
            raise ValueError("CUDA graphs need the padded (static-shape) step: infer.step_attention=padded")
        self.runner = runner
        self.graphs: dict[int, tuple] = {}
        self.pool = None
        self._rope_id = None

    def __call__(self, embeds: torch.Tensor, meta: StepMeta) -> torch.Tensor:
        cos, _ = self.runner.w.rope_tables(0)
        if self._rope_id != id(cos):
            self.graphs.clear()
            self._rope_id = id(cos)
        r = embeds.shape[0]
        if r not in self.graphs:
            self.graphs[r] = self._capture(embeds, meta)
        graph, static_in, static_meta, out = self.graphs[r]
        static_in.copy_(embeds)
        for name in ("positions", "lengths", "slots", "ranks"):
            getattr(static_meta, name).copy_(getattr(meta, name))
        graph.replay()
        return out

    def _capture(self, embeds: torch.Tensor, meta: StepMeta):
        static_in = embeds.clone()
        static_meta = StepMeta(positions=meta.positions.clone(), lengths=meta.lengths.clone(), slots=meta.slots.clone(),
                               ranks=meta.ranks.clone(), spans=[], max_length=meta.max_length)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.runner.step(static_in, static_meta)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.runner.step(static_in, static_meta)
        self.pool = graph.pool()
        return graph, static_in, static_meta, out
