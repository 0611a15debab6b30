"""`CascadeCache`: an HF KV cache that keeps one shared prefix and K branch KVs apart.

Lifecycle for one video (batch 1 until branching):
  1. prefix mode: the cache is a plain dynamic cache; prefill and the serial `<G>`
     planning steps append to a [1, Hkv, Lp, D] store per layer, attention is the
     ordinary masked SDPA of "padcap_cascade" (infer/attention.py).
  2. `start_branches(K)`: the prefix is frozen (kept as is, batch 1, never copied) and
     an empty branch store [K, Hkv, 0, D] per layer opens. Every later forward has
     batch = active branches, one (or t) token each, all at the same position; the
     layer appends the new keys to the branch store and hands the attention a
     `CascadeKV` (prefix + branch KV) instead of dense tensors. The K anchors are
     step 0 of this phase.
  3. `keep(indices)`: finished branches leave at once (index_select on the branch
     store only; the prefix is untouched). The engine drops the same rows from its
     query batch.

Sequence-length reporting: `get_seq_length()` is what one branch sees, Lp + Lb (the
prefix plus its own tokens). In branch mode the cache reports mask sizes covering only
the new tokens (kv_length == q_length), so HF's mask builders return None and build
nothing per step; the visibility rule lives in cascade attention.

Run: used by the decoding engine with a model set to attn_implementation
"padcap_cascade"; tests in tests/test_attention.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache, DynamicLayer, get_layer_types_and_kwargs

from infer.attention import Backend, CascadeKV


class CascadeLayer(DynamicLayer):
    """One layer's cache: a dense prefix store, then (branch mode) a per-branch store.

    keys, values:               [1, Hkv, Lp, D]  the prefix (DynamicLayer's storage)
    branch_keys, branch_values: [K, Hkv, cap, D] preallocated, first `branch_len` valid
    """

    def __init__(self, backend: Backend = "auto", prefix_splits: int | None = None, **kwargs):
        super().__init__(**kwargs)
        self.backend = backend
        self.prefix_splits = prefix_splits
        self.branch_keys: torch.Tensor | None = None
        self.branch_values: torch.Tensor | None = None
        self.branch_len = 0

    # -- state ------------------------------------------------------------------

    @property
    def in_branch_mode(self) -> bool:
        return self.branch_keys is not None

    @property
    def prefix_len(self) -> int:
        return super().get_seq_length()

    @property
    def prefix_keys(self) -> torch.Tensor:
        """[Hkv, Lp, D], a view of the batch-1 prefix store."""
        return self.keys[0]

    @property
    def prefix_values(self) -> torch.Tensor:
        return self.values[0]

    @property
    def num_branches(self) -> int:
        return 0 if self.branch_keys is None else self.branch_keys.shape[0]

    def start_branches(self, num_branches: int, capacity: int = 64) -> None:
        """Freeze the prefix and open an empty branch store for `num_branches` branches."""
        if self.in_branch_mode:
            raise RuntimeError("branches already started; call end_branches() first")
        if self.prefix_len == 0:
            raise RuntimeError("start_branches needs a prefilled prefix (the cache is empty)")
        if self.keys.shape[0] != 1:
            raise ValueError(f"the prefix must have batch 1 (one video per cache), got {self.keys.shape[0]}")
        if num_branches < 1:
            raise ValueError(f"num_branches must be >= 1, got {num_branches}")
        _, hkv, _, d = self.keys.shape
        self.branch_keys = self.keys.new_empty(num_branches, hkv, max(capacity, 1), d)
        self.branch_values = self.values.new_empty(num_branches, hkv, max(capacity, 1), self.values.shape[-1])
        self.branch_len = 0

    def end_branches(self) -> None:
        """Drop all branch KV and go back to prefix mode (the prefix is kept)."""
        self.branch_keys = self.branch_values = None
        self.branch_len = 0

    def keep(self, indices: torch.Tensor) -> None:
        """Keep only the branches at `indices` (positions among the active ones, in order)."""
        if not self.in_branch_mode:
            raise RuntimeError("keep() is only meaningful after start_branches()")
        indices = indices.to(self.branch_keys.device)
        self.branch_keys = self.branch_keys.index_select(0, indices)
        self.branch_values = self.branch_values.index_select(0, indices)

    def _grow(self, needed: int) -> None:
        cap = self.branch_keys.shape[2]
        new_cap = max(needed, 2 * cap)
        for name in ("branch_keys", "branch_values"):
            old = getattr(self, name)
            new = old.new_empty(old.shape[0], old.shape[1], new_cap, old.shape[3])
            new[:, :, : self.branch_len] = old[:, :, : self.branch_len]
            setattr(self, name, new)

    # -- HF Cache layer API ------------------------------------------------------

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Prefix mode: append and return dense (keys, values) [1, Hkv, L, D].

        Branch mode: key_states/value_states [K, Hkv, t, D] are appended to the branch
        store; returns (kv, kv) with kv a `CascadeKV` (prefix [Hkv, Lp, D], branch
        [K, Hkv, Lb, D]) that the "padcap_cascade" attention consumes.
        """
        if not self.in_branch_mode:
            return super().update(key_states, value_states, *args, **kwargs)
        k, hkv, t, _ = key_states.shape
        if k != self.num_branches or hkv != self.branch_keys.shape[1]:
            raise ValueError(
                f"branch-mode update got keys {tuple(key_states.shape)} but the cache holds "
                f"{self.num_branches} branches x {self.branch_keys.shape[1]} KV heads"
            )
        end = self.branch_len + t
        if end > self.branch_keys.shape[2]:
            self._grow(end)
        self.branch_keys[:, :, self.branch_len : end] = key_states
        self.branch_values[:, :, self.branch_len : end] = value_states
        self.branch_len = end
        kv = CascadeKV(
            prefix_k=self.prefix_keys,
            prefix_v=self.prefix_values,
            branch_k=self.branch_keys[:, :, :end],
            branch_v=self.branch_values[:, :, :end],
            backend=self.backend,
            prefix_splits=self.prefix_splits,
        )
        return kv, kv

    def get_seq_length(self) -> int:
        """Tokens one sequence sees: Lp in prefix mode, Lp + Lb (own branch) in branch mode."""
        return self.prefix_len + self.branch_len

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if not self.in_branch_mode:
            return super().get_mask_sizes(query_length)
        return query_length, 0  # visibility is structural in branch mode: let HF build nothing

    def crop(self, tokens_to_remove: int) -> None:
        if self.in_branch_mode:
            raise NotImplementedError("crop() is not supported in branch mode")
        super().crop(tokens_to_remove)

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("a CascadeCache never repeats KV; use start_branches(K)")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.in_branch_mode:
            self.keep(indices)
        else:
            super().batch_select_indices(indices)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.in_branch_mode:
            self.keep(beam_idx)
        else:
            super().reorder_cache(beam_idx)

    def reset(self) -> None:
        self.end_branches()
        super().reset()


class CascadeCache(Cache):
    """HF Cache for one video: shared prefix + lock-step branches (see module doc).

    Build with the model's config; use with a model whose attn_implementation is
    "padcap_cascade" (`infer.attention.register()` first). `backend` picks the cascade
    kernel ("auto" | "sdpa" | "math" | "flash"); `prefix_splits` the prefix KV chunks of
    the torch backends (None or 0 = auto, see infer.attention.auto_prefix_splits).
    """

    def __init__(self, config, backend: Backend = "auto", prefix_splits: int | None = None):
        text_config = config.get_text_config(decoder=True)
        layer_types, _ = get_layer_types_and_kwargs(text_config)
        if any(lt != "full_attention" for lt in layer_types):
            raise NotImplementedError(f"CascadeCache supports full-attention layers only, got {sorted(set(layer_types))}")
        splits = prefix_splits or None
        super().__init__(layers=[CascadeLayer(backend=backend, prefix_splits=splits) for _ in layer_types])
        self.backend = backend

    @property
    def in_branch_mode(self) -> bool:
        return self.layers[0].in_branch_mode

    @property
    def num_branches(self) -> int:
        return self.layers[0].num_branches

    @property
    def prefix_length(self) -> int:
        return self.layers[0].prefix_len

    @property
    def branch_length(self) -> int:
        """Tokens per branch so far (anchor included)."""
        return self.layers[0].branch_len

    def start_branches(self, num_branches: int, capacity: int = 64) -> None:
        """Freeze the prefix of every layer and open `num_branches` empty branch stores.

        capacity: initial branch-store length (grows by doubling), e.g. 1 + max tokens.
        """
        for layer in self.layers:
            layer.start_branches(num_branches, capacity)

    def end_branches(self) -> None:
        for layer in self.layers:
            layer.end_branches()

    def keep(self, branch_indices: torch.Tensor | Sequence[int]) -> None:
        """Keep the active branches at `branch_indices` (in that order); drop the rest."""
        idx = torch.as_tensor(branch_indices, dtype=torch.long)
        if idx.ndim != 1 or (idx.numel() and (idx.min() < 0 or idx.max() >= self.num_branches)):
            raise ValueError(f"branch indices {idx.tolist()} out of range for {self.num_branches} branches")
        for layer in self.layers:
            layer.keep(idx)

    def get_query_offset(self, layer_idx: int = 0) -> int:
        # branch mode: masks (if HF builds any) cover only the new tokens
        return 0 if self.in_branch_mode else super().get_query_offset(layer_idx)
