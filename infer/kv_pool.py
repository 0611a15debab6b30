"""The KV a decode step reads, and the per-row metadata it is indexed by.

    meta = StepMeta(positions, lengths, slots, ranks, spans, max_length)   # one step's rows
    pool = BranchPool(layers, rows, kv_heads, tokens, head_dim, dtype, device)
    prefix = VarlenPrefix(kernel) | PaddedPrefix(kernel, layers, slots, rows_per_video, cap, ...)

`BranchPool`: every row's own branch KV, preallocated, written at its length, compacted
in place when rows end. The prefix KV of each video (prefix + serial <G>s), stored once:
`VarlenPrefix` keeps the tensors prefill produced and attends per video (one packed
query block each, no padding: the eager form); `PaddedPrefix` copies them into a pool
[slots, Hkv, cap, D] per layer and attends in one masked call (static shapes: the form
torch.compile and CUDA graphs take). Both return the prefix part of the cascade (o, lse)
that infer/step.py merges with the branch part. Pure torch; no ray.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infer.attention import auto_prefix_splits, merge_partials, prefix_partials


@dataclass
class StepMeta:
    """Per-row metadata of one step (module doc); device tensors of R rows unless noted.

    spans: per video in the step (slot, first row, number of rows), host ints.
    max_length: max(lengths) + 1 over the real rows (host int), the branch KV the eager
    step reads; the padded step reads the whole pool.
    """

    positions: torch.Tensor
    lengths: torch.Tensor
    slots: torch.Tensor
    ranks: torch.Tensor
    spans: list[tuple[int, int, int]]
    max_length: int


class BranchPool:
    """Branch KV of every row, preallocated: k, v per layer [rows, Hkv, tokens, D].

    Row r's first `lengths[r]` entries are valid. `compact(keep)` moves the kept rows
    (in order) to the front in place; rows past the live count are scratch.
    """

    def __init__(self, layers: int, rows: int, kv_heads: int, tokens: int, head_dim: int, dtype, device):
        shape = (rows, kv_heads, max(1, tokens), head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.tokens = max(1, tokens)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor) -> None:
        """k, v [R, Hkv, D] of the step's tokens -> entry lengths[r] of rows 0..R-1."""
        rows = torch.arange(k.shape[0], device=k.device)
        self.k[layer][rows, :, lengths] = k
        self.v[layer][rows, :, lengths] = v

    def compact(self, keep: torch.Tensor, live_tokens: int, start: int = 0) -> None:
        """Rows `keep` (device long, increasing) -> rows 0..len(keep)-1, first live_tokens entries.

        start: rows before it are already in place (keep[:start] == arange(start)): not copied.
        """
        n, t = keep.shape[0], max(1, live_tokens)
        if start >= n:
            return
        moved = keep[start:]
        for store in (self.k, self.v):
            for buf in store:
                buf[start:n, :, :t] = buf[:, :, :t].index_select(0, moved)


class VarlenPrefix:
    """Eager prefix attention: each video's prefix KV as it came out of prefill (no copy).

    Per layer the queries are laid out once as [Hkv, R*g, D] (rows of one video, then its
    g query heads per KV head, adjacent), so a video's packed block is a view of that and its
    result lands in a view of one output buffer: per video one kernel call and two copies.
    """

    name = "varlen"

    def __init__(self, kernel, splits: int = 0):
        self.kernel = kernel
        self.splits = splits  # 0 = auto per video (infer.attention.auto_prefix_splits)
        self.kv: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.video_splits: dict[int, int] = {}

    def admit(self, slot: int, prefix_kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """prefix_kv: per layer (k, v) [Hkv, Lp, D]."""
        self.kv[slot] = prefix_kv
        lp = prefix_kv[0][0].shape[1]
        splits = self.splits or auto_prefix_splits(lp, prefix_kv[0][0].device)
        self.video_splits[slot] = max(1, min(splits, lp))  # never more chunks than keys

    def release(self, slot: int) -> None:
        self.kv.pop(slot, None)
        self.video_splits.pop(slot, None)

    def attend(self, layer: int, qg: torch.Tensor, meta: StepMeta, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """qg [R, Hkv, g, D] -> o [R, Hkv, g, D], lse [R, Hkv, g] (fp32 views) over each row's video prefix."""
        R, hkv, g, d = qg.shape
        qt = qg.transpose(0, 1).reshape(1, hkv, R * g, d)  # one copy per layer
        o = qg.new_empty(1, hkv, R * g, d)
        lse = qg.new_empty(1, hkv, R * g, dtype=torch.float32)
        for slot, first, n in meta.spans:
            pk, pv = self.kv[slot][layer]
            rows = slice(first * g, (first + n) * g)
            o_v, l_v = prefix_partials(self.kernel, qt[:, :, rows], pk, pv, scale, self.video_splits[slot])
            if o_v.shape[0] > 1:  # a split prefix: merge its chunks by their LSEs
                o_v, l_v = merge_partials(o_v, l_v)
            else:
                o_v, l_v = o_v[0], l_v[0]
            o[0, :, rows] = o_v
            lse[0, :, rows] = l_v
        return o[0].view(hkv, R, g, d).transpose(0, 1), lse[0].view(hkv, R, g).transpose(0, 1)


class PaddedPrefix:
    """Static-shape prefix attention: a pool [slots, Hkv, cap, D] per layer, masked by length.

    Every tensor the step reads has a shape fixed by (rows, slots, rows_per_video, cap), so a
    step over a bucket of rows compiles to one graph (torch.compile fullgraph, CUDA graphs).
    """

    name = "padded"

    def __init__(self, kernel, layers: int, slots: int, rows_per_video: int, cap: int, kv_heads: int, head_dim: int,
                 dtype, device):
        shape = (slots + 1, kv_heads, cap, head_dim)  # the last slot is scratch for padding rows
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.lengths = torch.ones(slots + 1, dtype=torch.long, device=device)  # >= 1: no all-masked row
        self.kernel, self.slots, self.rows_per_video, self.cap = kernel, slots, rows_per_video, cap
        self._visible = None

    def admit(self, slot: int, prefix_kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        lp = prefix_kv[0][0].shape[1]
        if lp > self.cap:
            raise ValueError(f"prefix of {lp} tokens over the padded pool's {self.cap} (model.max_seq_len)")
        for layer, (k, v) in enumerate(prefix_kv):
            self.k[layer][slot, :, :lp] = k
            self.v[layer][slot, :, :lp] = v
        self.lengths[slot] = lp

    def release(self, slot: int) -> None:
        self.lengths[slot] = 1

    def attend(self, layer: int, qg: torch.Tensor, meta: StepMeta, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        R, hkv, g, d = qg.shape
        s1, rv = self.slots + 1, self.rows_per_video
        qs = qg.new_zeros(s1, rv, hkv, g, d)
        qs[meta.slots, meta.ranks] = qg
        qs = qs.permute(0, 2, 1, 3, 4).reshape(s1, hkv, rv * g, d)
        if layer == 0 or self._visible is None:  # one mask per step, shared by the layers
            self._visible = self.kernel.visible(self.lengths, self.cap, qg.dtype)
        o, lse = self.kernel(qs, self.k[layer], self.v[layer], scale, self._visible)
        o = o.reshape(s1, hkv, rv, g, d).permute(0, 2, 1, 3, 4)[meta.slots, meta.ranks]
        lse = lse.reshape(s1, hkv, rv, g).permute(0, 2, 1, 3)[meta.slots, meta.ranks]
        return o.float(), lse.float()
