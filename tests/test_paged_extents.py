"""Prefix extents (infer/engine/paged.py) and the gathering kernels' in-place reads (infer/engine/attn_meta.py).

A prefix's pages are set aside at admission as one run of consecutive page ids when the pool has one;
a kernel then reads the run as a view of the pool instead of gathering it. Where the pages sit must
never change a result: the same keys on a run and on scattered pages give identical outputs, and
the engine decodes the same tokens with extents and without.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from infer.engine import paged
from infer.engine.attn_meta import AttnMeta
from infer.engine.kernels import choose_kernel
from infer.engine.packing import QueryBlock
from infer.engine.paged import FREE_SEQ, PagePool
from tests.test_engine_batch import CPU, assert_same, decode_all

HKV, G, D, S = 2, 4, 16, 16


def test_an_extent_is_a_run_taken_from_the_reservation_and_trimmed_back():
    pool = PagePool(1, 40, 4, HKV, D, torch.float32, torch.device("cpu"))
    assert pool.reserve(20)
    seq = pool.open(extent=12)
    assert pool.free_pages == 19 and pool.allocated == 0  # set aside, not yet allocated nor free
    pool.grow(seq, 30)  # 8 pages, all from the run
    assert seq.pages == list(range(seq.pages[0], seq.pages[0] + 8)) and pool.allocated == 8
    pool.trim(seq)  # 4 unwritten pages back to the free list, still promised
    assert pool.allocated == 8 and pool.free_pages == 19
    pool.unreserve(8 + 4)  # the video gives back the rest of its promise
    pool.close(seq)
    assert pool.allocated == 0 and pool.free_pages == pool.usable
    assert pool.extents == {"contiguous": 1, "scattered": 0}


def test_a_fragmented_pool_gives_scattered_pages_and_counts_it():
    pool = PagePool(1, 12, 4, HKV, D, torch.float32, torch.device("cpu"))
    assert pool.reserve(pool.free_pages)
    holes = [pool.open() for _ in range(11)]
    for h in holes:
        pool.grow(h, 4)
    for h in holes[::2]:
        pool.close(h)  # every other page free: no run of 2
    assert pool.reserve(3)
    seq = pool.open(extent=3)
    pool.grow(seq, 12)
    assert pool.extents["scattered"] == 1 and len(seq.pages) == 3
    assert any(b - a != 1 for a, b in zip(seq.pages, seq.pages[1:]))


def _step(pool: PagePool, pages: list[int], kernel, gen):
    """One prefix of 150 keys on `pages` and a step over it (7 prefill rows with causal limits, a planning
    row): -> the kernel's output and whether a call read the pages in place."""
    seq = pool.open()
    seq.pages = list(pages)
    seq.length = 150
    pool.owner[pages] = seq.id
    pool.start[pages] = torch.arange(len(pages)) * S
    pool.layer[0][pool.slots(seq, 0, 150)] = torch.randn(150, 2, HKV, D, generator=gen)
    lims = [140 + i for i in range(7)] + [150]
    meta = AttnMeta.build([QueryBlock(range(7), pages), QueryBlock([7], pages)], [seq.id] * 8, lims, [FREE_SEQ] * 8,
                          [0] * 8, q_block=16, pool=pool, kernel=kernel, group=G)
    q = torch.randn(8, HKV * G, D, generator=gen)
    return kernel(q, pool, 0, meta, D ** -0.5), any(c.at >= 0 for c in meta.calls)


@pytest.mark.parametrize("name", ["sdpa", "reference"])
def test_the_same_keys_on_a_run_and_on_scattered_pages_give_identical_outputs(name):
    """Physical placement never changes a result: a run read in place, the same pages permuted (gathered)."""
    kernel = choose_kernel(name, torch.float32, torch.device("cpu"))
    outs = []
    for pages in (list(range(20, 30)), [27, 3, 21, 9, 30, 14, 2, 25, 11, 6]):
        pool = PagePool(1, 32, S, HKV, D, torch.float32, torch.device("cpu"), zero=True)
        o, viewed = _step(pool, pages, kernel, torch.Generator().manual_seed(0))
        assert viewed == (pages[1] == pages[0] + 1)
        outs.append(o)
    assert torch.equal(outs[0], outs[1])


def test_engine_decodes_the_same_with_and_without_contiguous_extents(monkeypatch):
    """Batched with extents (read in place) == batched with every prefix on scattered pages, exact in fp32."""
    from infer.engine.sampling import DecodeControl
    from tests.support.padcap import decoding_model, sample

    model = decoding_model()
    videos = [sample(num_segments=t, seed=t, video_id=f"v{t}") for t in (9, 14, 7)]
    controls = [DecodeControl(num_events=k, lengths=lens, trace=True) for k, lens in ((2, [5, 2]), (3, [4, 9, 2]),
                                                                                        (1, [6]))]
    cfg = dataclasses.replace(CPU, step_tokens=64, page_size=4)
    got, _, _, eng = decode_all(model, cfg, videos, controls)
    assert eng.pool.extents == {"contiguous": 3, "scattered": 0}
    monkeypatch.setattr(paged, "free_run", lambda free, n: [])
    scattered, _, _, eng2 = decode_all(model, cfg, videos, controls)
    assert eng2.pool.extents == {"contiguous": 0, "scattered": 3}
    for a, b in zip(got, scattered):
        assert_same(a, b, atol=0)


def test_flex_refuses_blocks_that_span_pages():
    from infer.engine.attn_meta import check_flex_block

    check_flex_block(16, 16, 16)
    for kv_block, block_n in ((32, 0), (16, 24), (12, 0)):
        with pytest.raises(ValueError, match="page placement"):
            check_flex_block(16, kv_block, block_n)

