"""The paged KV cache of the decode engine: one pool of fixed-size pages, block tables per sequence.

    pool = PagePool.for_budget(weights, page_size=16, memory_bytes=2 << 30)
    seq = pool.open()                       # a new sequence (a video's prefix, or one branch)
    pool.reserve(n_pages); pool.grow(seq, 300)   # pages for 300 keys, from the reservation
    seq = pool.open(extent=20)              # a prefix: 20 consecutive pages set aside from the reservation
    slots = pool.slots(seq, 290, 300)       # flat slot index of keys 290..299 (where the step writes)
    pool.close(seq)                         # its pages go back to the free list (no copy)

Layout. Keys and values are one tensor for all layers, `kv` [layers, pages * page_size, 2,
Hkv, D]: page p holds flat slots [p*S, (p+1)*S), keys and values side by side, one contiguous
run (gathering a page is one memcpy for both; a fused kernel takes a layer's keys as the
[1, Hkv, keys, D] view it wants). A sequence's keys live in the pages of its block
table in order (key i at page table[i // S], offset i % S). Page 0 is the scratch page:
padding rows of a step write there and see only its first key, so no real page is ever
touched by padding.

Ownership. Every page records its owner sequence id and the logical index of its first key
(`owner`, `start`, device tensors of [pages]); the attention kernels decide visibility from
them (infer/engine/kernels.py). Sequence ids are never reused, so a page freed by one video and
handed to another can never be read as the old owner's (no leak from a previous owner).

Sharing. A video's branches do not copy its prefix: each branch row sees two sequences, the
video's prefix (prompt + serial <G>s) and its own branch (anchor + tokens): the cascade
layout without copies.

Extents. A video's prefix length is known at admission, so its pages are set aside then as one run of
consecutive page ids when the free list has one (`open(extent=n)`, best fit): a kernel can then read the
prefix as a view of the pool, with no gather copy (infer/engine/kernels.py). When the pool is too
fragmented the prefix takes scattered pages as any sequence does, which is exact all the same (the
block table says where each key is). Pages set aside but never written (`trim`) go back to the free list.

Budget. The pool is sized from a memory budget (`infer.kv_memory_gb`, or a fraction of the
free device memory on CUDA), never from max_seq_len x slots. Admission reserves a video's
worst case (`reserve`) so no sequence can run out of pages mid-decode; pages are taken from
the free list only when keys arrive (`grow`), so what is allocated tracks what is live.
Pure torch; no ray.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from infer.engine.staging import Staging

log = logging.getLogger("padcap.infer")

SCRATCH_SEQ = -2  # owner id of the scratch page (page 0)
FREE_SEQ = -1  # owner id of a page nobody holds


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold `tokens` keys."""
    return -(-int(tokens) // int(page_size))


def page_bytes(layers: int, kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype) -> int:
    """Bytes one page takes over all layers, keys and values."""
    return 2 * layers * page_size * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


def taken_pages(table: torch.Tensor) -> torch.Tensor:
    """The pages a `PagePool.pending` table hands out (owner >= 0), on the table's device."""
    return table[0][table[1] >= 0]


def max_pages(kv_heads: int, head_dim: int, page_size: int, max_layer_elements: int) -> int:
    """The most pages a pool layer of at most `max_layer_elements` (> 0) elements holds."""
    return max_layer_elements // (2 * page_size * kv_heads * head_dim)


@dataclass
class Seq:
    """One sequence in the pool: its id, block table (page ids, host) and key count."""

    id: int
    pages: list[int] = field(default_factory=list)
    length: int = 0
    spare: list[int] = field(default_factory=list)  # pages set aside for it (an extent), last first


def free_run(free: list[int], n: int) -> list[int]:
    """The n consecutive page ids to take from the free ids `free` (best fit: the shortest run that holds n,
    its highest ids, away from the low pages scattered takes use first); [] if no run holds n.

    >>> free_run([9, 1, 2, 3, 6, 7], 2), free_run([9, 1, 2, 3, 6, 7], 3), free_run([1, 3], 2)
    ([6, 7], [1, 2, 3], [])
    """
    if n < 1 or len(free) < n:
        return []
    ids = np.sort(np.asarray(free, dtype=np.int64))
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts, ends = np.r_[0, breaks], np.r_[breaks, len(ids)]
    fits = np.flatnonzero(ends - starts >= n)
    if not len(fits):
        return []
    best = fits[np.lexsort((-ends[fits], ends[fits] - starts[fits]))[0]]
    return ids[ends[best] - n:ends[best]].tolist()


class OutOfPages(RuntimeError):
    """The pool has no free page for a key that was not reserved (a scheduler bug, never user input)."""


class PagePool:
    """The engine's KV pool (module doc)."""

    def __init__(self, layers: int, pages: int, page_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, zero: bool = False):
        if pages < 2 or page_size < 1:
            raise ValueError(f"a KV pool needs at least 2 pages of >= 1 key (got {pages} of {page_size})")
        self.layers, self.pages, self.page_size = layers, pages, page_size
        self.kv_heads, self.head_dim, self.dtype, self.device = kv_heads, head_dim, dtype, device
        shape = (layers, pages * page_size, 2, kv_heads, head_dim)
        # empty, not zeros: pages are zeroed when handed out (`sync`); untouched pages cost no RAM on CPU.
        # zero=True for kernels that read pages no block lists (eager FlexAttention reads the whole pool).
        self.kv = (torch.zeros if zero else torch.empty)(shape, dtype=dtype, device=device)
        self.kv[:, :page_size].zero_()
        self.layer = list(self.kv.unbind(0))  # per layer [P*S, 2, Hkv, D] views, taken once
        self.layer_pages = [t.view(pages, -1) for t in self.layer]  # per layer [P, S*2*Hkv*D]: a row per page
        self.owner = torch.full((pages,), FREE_SEQ, dtype=torch.long, device=device)
        self.staging = Staging(device)  # a step's host metadata to the device (infer/engine/staging.py)
        self.start = torch.zeros(pages, dtype=torch.long, device=device)
        self.owner[0] = SCRATCH_SEQ
        self._free = list(range(pages - 1, 0, -1))  # pop() gives the lowest page first
        self._reserved = 0
        self._spare = 0  # pages set aside in extents, not yet written
        self.extents = {"contiguous": 0, "scattered": 0}  # prefixes opened with an extent, by outcome
        self._ids = itertools.count()  # sequence ids, never reused
        self._pending: list[tuple[int, int, int]] = []  # (page, owner, start) not yet on the device
        self.peak_pages = 0

    @classmethod
    def for_budget(cls, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                   page_size: int, memory_bytes: int, zero: bool = False, max_layer_elements: int = 0) -> PagePool:
        """A pool of as many pages as `memory_bytes` holds (at least 2), and no more than keep one layer
        within `max_layer_elements` (a kernel's addressing limit, infer/engine/kernels.py Contract; 0 = none)."""
        per = page_bytes(layers, kv_heads, head_dim, page_size, dtype)
        pages = int(memory_bytes) // per
        if max_layer_elements and pages > max_pages(kv_heads, head_dim, page_size, max_layer_elements):
            pages = max_pages(kv_heads, head_dim, page_size, max_layer_elements)
            log.warning("KV pool capped at %d pages (%.1f GB of the %.1f GB budget): the kernel addresses a pool "
                        "layer with int32 offsets (%d elements at most)", pages, pages * per / 1e9,
                        memory_bytes / 1e9, max_layer_elements)
        return cls(layers, max(2, pages), page_size, kv_heads, head_dim, dtype, device, zero)

    # ------------------------------------------------------------------ accounting

    @property
    def usable(self) -> int:
        """Pages a sequence can ever get (all but the scratch page)."""
        return self.pages - 1

    @property
    def free_pages(self) -> int:
        """Pages neither allocated nor promised to an admitted video."""
        return len(self._free) - self._reserved

    @property
    def allocated(self) -> int:
        return self.usable - len(self._free) - self._spare

    @property
    def bytes_per_page(self) -> int:
        return page_bytes(self.layers, self.kv_heads, self.head_dim, self.page_size, self.dtype)

    def reserve(self, n: int) -> bool:
        """Promise n pages to a video (its worst case); False (nothing promised) if they are not free."""
        if n > self.free_pages:
            return False
        self._reserved += n
        return True

    def unreserve(self, n: int) -> None:
        """Give back n promised pages that will not be used."""
        if n < 0 or n > self._reserved:
            raise ValueError(f"cannot give back {n} of {self._reserved} reserved pages")
        self._reserved -= n

    # ------------------------------------------------------------------ sequences

    def open(self, extent: int = 0) -> Seq:
        """A new sequence; extent > 0: set aside that many consecutive pages of the reservation for its keys
        (module doc), or none if no free run holds them (its pages are then taken one by one)."""
        seq = Seq(next(self._ids))
        if extent > 0:
            run = free_run(self._free, extent) if extent <= self._reserved else []
            self.extents["contiguous" if run else "scattered"] += 1
            if run:
                taken = set(run)
                self._free = [p for p in self._free if p not in taken]
                seq.spare = run[::-1]
                self._reserved -= extent
                self._spare += extent
        return seq

    def trim(self, seq: Seq) -> None:
        """Pages set aside for seq that it did not write go back to the free list, still promised to its
        video (the caller unreserves them)."""
        self._free.extend(seq.spare)
        self._reserved += len(seq.spare)
        self._spare -= len(seq.spare)
        seq.spare = []

    def grow(self, seq: Seq, length: int) -> None:
        """Make room for keys [0, length) of seq, taking new pages from the reservation."""
        need = pages_for(length, self.page_size) - len(seq.pages)
        if need > 0:
            own = min(need, len(seq.spare))
            rest = need - own
            if rest > len(self._free) or rest > self._reserved:
                raise OutOfPages(f"sequence {seq.id} needs {rest} pages: {len(self._free)} free, "
                                 f"{self._reserved} reserved")
            for i in range(need):
                page = seq.spare.pop() if i < own else self._free.pop()
                self._pending.append((page, seq.id, len(seq.pages) * self.page_size))
                seq.pages.append(page)
            self._reserved -= rest
            self._spare -= own
            self.peak_pages = max(self.peak_pages, self.allocated)
        seq.length = max(seq.length, length)

    def close(self, seq: Seq) -> None:
        """Free the pages of seq (a block-table edit; the data stays until a new owner writes); its unwritten
        extent pages go back as `trim` says."""
        self.trim(seq)
        self._free.extend(reversed(seq.pages))
        self._pending.extend((p, FREE_SEQ, 0) for p in seq.pages)
        seq.pages = []
        seq.length = 0

    def slots(self, seq: Seq, lo: int, hi: int) -> torch.Tensor:
        """Flat slot ids [hi - lo] (host long) of keys lo..hi-1 of seq (pages must exist)."""
        i = torch.arange(lo, hi)
        table = torch.tensor(seq.pages, dtype=torch.long)
        return table[i // self.page_size] * self.page_size + i % self.page_size

    def sync(self) -> None:
        """Apply the step's page ownership changes on the device (`pending`, then `apply`; one copy)."""
        table = self.pending()
        if table is not None:
            self.apply(*self.staging.to_device([table, taken_pages(table)]))

    def pending(self) -> torch.Tensor | None:
        """The page ownership changes since the last one as a host table [3, M] long (page, owner, start; a page
        freed and retaken: its last change), or None; they are then the caller's to `apply`."""
        if not self._pending:
            return None
        last = {page: (own, start) for page, own, start in self._pending}
        self._pending.clear()
        return torch.tensor([list(last), *zip(*last.values())], dtype=torch.long)

    def apply(self, table: torch.Tensor, taken: torch.Tensor) -> None:
        """A `pending` table and its `taken_pages`, on the device: one scatter each, once per step, and the taken
        pages zeroed: a new page's unwritten slots are read (masked) by the kernels, 0 * NaN would be NaN, and
        torch.empty can hold anything (one fill, all layers at once; nothing read back to the host)."""
        idx, own, start = table
        self.owner.index_copy_(0, idx, own)
        self.start.index_copy_(0, idx, start)
        if taken.numel():
            self.kv.view(self.layers, self.pages, -1).index_fill_(1, taken, 0)

    def describe(self) -> dict[str, float]:
        return {"pages": self.pages, "page_size": self.page_size, "bytes_per_page": self.bytes_per_page,
                "pool_gb": self.pages * self.bytes_per_page / 1e9}
