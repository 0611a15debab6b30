"""How a step's query blocks become a gathering kernel's calls: few calls, little padded work.

    calls = pack_calls(blocks, sizes=(4, 8, 16), group=4, page_size=16)   # -> [Call(q_block, bins), ...]

The scheduler cuts a step's tokens into blocks of one video each (its decode rows, a planning
row, a prefill piece), so their token counts and page counts differ widely. A gathering kernel
(infer/engine/kernels.py: gather the pages, one dense SDPA) pads every block of one call to the call's
fullest block (F tokens) and widest block (W pages): 16 videos with prefixes of 1k to 4k keys in
one call compute every row against 4k keys, twice the attention they need. Two levers:

  packing   blocks longer than F are split into pieces (each sees its block's pages), and the
            pieces are packed first-fit-decreasing into bins of at most F tokens whose pages (a
            union: pieces of one sequence share pages) stay within W: a planning row rides in
            the spare rows of another video's block instead of a block of its own.
  calls     the blocks, sorted by width, are cut into at most `max_calls` runs of similar
            width, one call each, W per call: a 1k-key video is no longer padded to 4k. A call
            costs a fixed few host ops per layer, so their number is bounded whatever the number
            of videos, and a cut is made only where the padded work it saves outweighs that.

Cost model, per layer, in units of one key seen by one query row of SDPA: a call's bins x W x S x
(max(F * group, MIN_ROWS) + GATHER_ROWS) (the query rows, no fewer than SDPA's GEMMs run at full
speed with, plus the gather of the keys) + CALL_COST. Exact
either way: each token still sees only its own sequences (the kernels' visibility rule is per
token); packing and cutting only change which tokens share a block. Python and numpy; no torch.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# gathering a key costs about what 24 query rows attending to it cost (fp32 on the 2-core CPU box: 0.12-0.14 us a
# key gathered, 0.0045-0.005 us a key per query row in SDPA; both scale with Hkv x D, so the ratio holds across
# shapes), and SDPA over fewer than 32 query rows a head runs no faster than over 32 (its small GEMMs)
GATHER_ROWS = 24
MIN_ROWS = 32
# a call's fixed cost per layer (its SDPA set-up, the views around it: ~25 us on that box) in the same units
CALL_COST = 2800
SIZES = (4, 8, 16, 32, 64)  # the query-block sizes tried
MAX_CALLS = 3
_CUT_CANDIDATES = 12  # width boundaries tried for the cuts (the distinct widths, thinned evenly)


@dataclass
class QueryBlock:
    """One query block as the scheduler describes it (host): its step tokens and the pages they may see."""

    tokens: Sequence[int]
    pages: Sequence[int]


@dataclass
class Call:
    """One kernel call: `bins` of at most `q_block` tokens each, all padded to the widest bin's pages."""

    q_block: int
    bins: list[QueryBlock]

    @property
    def width(self) -> int:
        return max(1, max(len(b.pages) for b in self.bins))

    def rows(self, multiple: int = 1) -> int:
        """The query tokens a gathering kernel pads every bin to: the fullest bin's, rounded up to `multiple`
        (the kernel's query-block alignment); at most q_block."""
        return round_up(max(1, max(len(b.tokens) for b in self.bins)), multiple)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


Piece = tuple[list[int], list[int]]  # (tokens, pages)


def _per_page(F: int, group: int, page_size: int) -> int:
    """The cost of a page of keys in a bin of F tokens (module doc)."""
    return page_size * (max(F * group, MIN_ROWS) + GATHER_ROWS)


def _pieces(blocks: Sequence[QueryBlock], F: int) -> list[Piece]:
    """Blocks split into pieces of at most F tokens, widest first (then fullest)."""
    out = []
    for b in blocks:
        pages = list(b.pages)  # one list per block, shared by its pieces
        out += [(list(b.tokens[lo:lo + F]), pages) for lo in range(0, len(b.tokens), F)]
    out.sort(key=lambda t: (-len(t[1]), -len(t[0])))
    return out


def _pack(pieces: Sequence[Piece], F: int, W: int) -> list[list[Piece]]:
    """First-fit-decreasing into bins of at most F tokens and W pages (pieces sorted widest first)."""
    # a bin: [tokens, {first page: widest piece starting there}, pages, members]; pieces that start on the same
    # page are one sequence's (a prefix and its prefixes): their union is the widest of them
    bins: list[list] = []
    open_: list[list] = []  # bins with tokens to spare (a full one is never scanned again)
    for toks, pages in pieces:
        head = pages[0] if pages else -1
        for b in open_:
            old = b[1].get(head, 0)
            if b[0] + len(toks) <= F and b[2] - old + max(old, len(pages)) <= W:
                b[0] += len(toks)
                b[1][head] = max(old, len(pages))
                b[2] += max(old, len(pages)) - old
                b[3].append((toks, pages))
                if b[0] == F:
                    open_.remove(b)
                break
        else:
            bins.append([len(toks), {head: len(pages)}, len(pages), [(toks, pages)]])
            if len(toks) < F:
                open_.append(bins[-1])
    return [b[3] for b in bins]


def _cuts(blocks: Sequence[QueryBlock], sizes: Sequence[int], group: int, page_size: int, max_calls: int) -> list[int]:
    """Where to cut the blocks (sorted widest first) into calls: indices (exclusive ends). A run's bins at
    bin size F are estimated as the sum over its blocks of the larger of t / F and w / W (t tokens, w pages,
    W the run's widest), each run costing, at the F that suits it best,
    bins x W x S x (max(F * group, MIN_ROWS) + GATHER_ROWS) + CALL_COST."""
    n = len(blocks)
    widths = np.array([len(b.pages) for b in blocks], dtype=np.float64)
    tok = np.array([len(b.tokens) for b in blocks], dtype=np.float64)
    starts = [i for i in range(1, n) if widths[i] != widths[i - 1]]
    if len(starts) > _CUT_CANDIDATES:
        starts = [starts[round(j * (len(starts) - 1) / (_CUT_CANDIDATES - 1))] for j in range(_CUT_CANDIDATES)]
    cost = {}  # (lo, hi) -> estimated cost of one call over blocks[lo:hi], at its best bin size
    ends = np.array([*starts, n])
    for lo in [0, *starts]:
        W = max(1.0, widths[lo])
        his = ends[ends > lo]
        best = np.full(len(his), np.inf)
        for F in sizes:
            bins = np.ceil(np.cumsum(np.maximum(tok[lo:] / F, widths[lo:] / W)) - 1e-9)
            best = np.minimum(best, bins[his - lo - 1] * W * _per_page(F, group, page_size))
        for hi, c in zip(his.tolist(), best.tolist()):
            cost[lo, hi] = c + CALL_COST
    best_cuts = (cost[0, n], [n])
    for k in range(1, max_calls):
        for cut in itertools.combinations(starts, k):
            bounds = [0, *cut, n]
            c = sum(cost[lo, hi] for lo, hi in zip(bounds, bounds[1:]))
            if c < best_cuts[0]:
                best_cuts = (c, bounds[1:])
    return best_cuts[1]


def pack_calls(blocks: Sequence[QueryBlock], sizes: Sequence[int], group: int, page_size: int,
               max_calls: int = MAX_CALLS) -> list[Call]:
    """The step's blocks -> at most `max_calls` calls of packed bins (module doc): the cuts into width
    classes that cost least (estimated, each class at its best bin size), then each class packed at every
    bin size and its cheapest packing kept. Every token is in exactly one bin, whose pages hold all its
    block's pages.

    One cut plan, priced at every bin size at once: choosing the cuts per bin size and packing each (the
    first version) gave 0.7 % less padded work on random 4-64-video steps at 3x the host time (3.9 ms
    against 1.3 ms a step on the 2-core box)."""
    real = sorted((b for b in blocks if len(b.tokens)), key=lambda b: -len(b.pages))  # stable: step order in ties
    if not real:
        return [Call(1, list(blocks) or [QueryBlock((), ())])]
    calls, lo = [], 0
    for hi in _cuts(real, sizes, group, page_size, max_calls):  # cuts fall between blocks
        run, W = real[lo:hi], max(1, len(real[lo].pages))
        options = [(len(bins) * W * _per_page(F, group, page_size), F, bins)
                   for F in sizes for bins in [_pack(_pieces(run, F), F, W)]]
        _, F, bins = min(options, key=lambda o: o[0])
        # the exact union of each bin's pages (W above only bounds them)
        calls.append(Call(F, [QueryBlock([t for toks, _ in members for t in toks],
                                        list(dict.fromkeys(p for _, pages in members for p in pages)))
                              for members in bins]))
        lo = hi
    return calls


def exact_calls(blocks: Sequence[QueryBlock], multiple: int = 1) -> list[Call]:
    """One call per query block with tokens, as many rows (rounded up to `multiple`) and pages as it has: no
    padding, at one call per block (`infer.attention_calls=0`; bench/packing.py measures both ways)."""
    real = [b for b in blocks if len(b.tokens)]
    if not real:
        return [Call(1, list(blocks) or [QueryBlock((), ())])]
    return [Call(round_up(len(b.tokens), multiple), [b]) for b in real]


def kernel_calls(blocks: Sequence[QueryBlock], group: int, page_size: int, max_calls: int = MAX_CALLS,
                 multiple: int = 1) -> list[Call]:
    """The calls a gathering kernel makes for a step's blocks: `pack_calls` over the bin sizes aligned to
    `multiple` (the kernel's query-block alignment), at most `max_calls`; 0 = `exact_calls`."""
    if not max_calls:
        return exact_calls(blocks, multiple)
    return pack_calls(blocks, sorted({round_up(f, multiple) for f in SIZES}), group, page_size, max_calls)


def padded_work(calls: Sequence[Call], group: int, multiple: int = 1) -> int:
    """Query rows x keys (in pages) a gathering kernel computes for the calls, padding included (each bin at
    `Call.rows(multiple)` tokens and the call's width; for tests and benchmarks)."""
    return sum(len(c.bins) * c.rows(multiple) * group * c.width for c in calls)
