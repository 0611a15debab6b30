"""The paged attention kernels (infer/engine/kernels.py) and the KV pool (infer/engine/paged.py).

Each kernel against torch's own dense SDPA on random paged layouts (sequences scattered over
a pool, pages shared by several queries, prefix + own-branch visibility, causal and
bidirectional limits); the contract checks fire on misaligned and mis-typed calls; the kernel
is the one the config asked for. Also the pool's accounting: reservations, page reuse with
fresh ownership, freed pages never visible to their old owner's ids.

Run: .venv/bin/python -m pytest tests/test_kernels.py -q
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from infer.engine.attn_meta import AttnMeta
from infer.engine.kernels import FLEX_CONTRACT, choose_kernel
from infer.engine.packing import QueryBlock
from infer.engine.paged import FREE_SEQ, OutOfPages, PagePool, pages_for

HKV, G, D = 2, 3, 16


def _layout(seed: int, page_size: int, q_block: int, kernel, dtype=torch.float32, device: str = "cpu"):
    """A pool with a few prefixes and branches at random pages, and a step of queries over them.

    Returns (pool, q [N, Hq, D], meta, dense: list of (k [Hkv, L, D], v, token) per query) where
    dense holds exactly the keys each query may see, in order, for a dense SDPA oracle (on the CPU;
    the pool, q and meta on `device`)."""
    gen = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    pool = PagePool(1, 64, page_size, HKV, D, dtype, torch.device(device),  # kv: [1, 64 * S, 2, Hkv, D]
                    zero=kernel.reads_whole_pool)
    pool.reserve(pool.free_pages)
    # churn: open and close sequences so live pages are scattered and reused
    for _ in range(3):
        junk = pool.open()
        pool.grow(junk, rnd.randint(1, 3 * page_size))
        pool.sync()
        pool.layer[0][pool.slots(junk, 0, junk.length).to(device)] = 9.0  # stale keys of a dead owner
        pool.close(junk)
        pool.reserve(pool.free_pages)
    seqs = []
    for length in (rnd.randint(5, 40), rnd.randint(1, 9), rnd.randint(1, 9), rnd.randint(3, 30)):
        s = pool.open()
        pool.grow(s, length)
        pool.sync()  # pages handed out (zeroed) before the step writes them, as in the engine
        keys = torch.randn(HKV, length, D, generator=gen).to(dtype)
        vals = torch.randn(HKV, length, D, generator=gen).to(dtype)
        slots = pool.slots(s, 0, length).to(device)
        pool.layer[0][slots, 0] = keys.transpose(0, 1).to(device)
        pool.layer[0][slots, 1] = vals.transpose(0, 1).to(device)
        seqs.append((s, keys, vals))
    prefix, b1, b2, other = seqs
    rows = []  # (seq_a, lim_a, seq_b, lim_b)
    lp = prefix[0].length
    rows += [(prefix, min(lp, i + 1 if i % 3 else lp), None, 0) for i in range(7)]  # prefill-like, some bidirectional
    rows += [(prefix, lp, b1, b1[0].length), (prefix, lp, b2, rnd.randint(1, b2[0].length))]  # branch rows
    rows += [(other, rnd.randint(1, other[0].length), None, 0) for _ in range(3)]  # another video
    q = torch.randn(len(rows), HKV * G, D, generator=gen).to(dtype)
    blocks, start = [], 0
    for group in (rows[:7], rows[7:9], rows[9:]):
        for lo in range(0, len(group), q_block):
            chunk = group[lo:lo + q_block]
            pages = list(dict.fromkeys(p for a, la, b, lb in chunk for p in a[0].pages[: pages_for(la, page_size)]))
            pages += [p for _, _, b, lb in chunk if b is not None for p in b[0].pages[: pages_for(lb, page_size)]]
            blocks.append(QueryBlock(range(start + lo, start + lo + len(chunk)), pages))
        start += len(group)
    meta = AttnMeta.build(blocks, [a[0].id for a, *_ in rows], [la for _, la, _, _ in rows],
                          [b[0].id if b is not None else FREE_SEQ for _, _, b, _ in rows],
                          [lb for *_, lb in rows], q_block=q_block, pool=pool, kernel=kernel, group=G)
    dense = []
    for a, la, b, lb in rows:
        ks, vs = [a[1][:, :la]], [a[2][:, :la]]
        if b is not None:
            ks.append(b[1][:, :lb])
            vs.append(b[2][:, :lb])
        dense.append((torch.cat(ks, 1), torch.cat(vs, 1)))
    return pool, q.to(device), meta, dense


def _oracle(q, dense, scale):
    """Dense SDPA per query (fp64), GQA by repeating the KV heads."""
    out = []
    for t, (k, v) in enumerate(dense):
        qt = q[t].double().view(HKV, G, 1, D)
        o = F.scaled_dot_product_attention(qt, k.double()[:, None], v.double()[:, None], scale=scale)
        out.append(o.reshape(HKV * G, D))
    return torch.stack(out)


@pytest.mark.parametrize("name", ["reference", "sdpa", "flex"])
@pytest.mark.parametrize("seed,page_size,q_block", [(0, 4, 2), (1, 16, 16), (2, 1, 5), (3, 16, 4)])
def test_kernel_equals_dense_sdpa_on_random_paged_layouts(name, seed, page_size, q_block):
    kernel = choose_kernel(name, torch.float32, torch.device("cpu"))
    if name == "flex" and (page_size % 16 or q_block % 16):
        pytest.skip("flex takes pages and query blocks of multiples of 16")
    pool, q, meta, dense = _layout(seed, page_size, q_block, kernel)
    scale = D ** -0.5
    got = kernel(q, pool, 0, meta, scale)
    torch.testing.assert_close(got.double(), _oracle(q, dense, scale).flatten(1), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["reference", "sdpa"])
@pytest.mark.parametrize("seed,page_size,q_block", [(0, 4, 2), (1, 16, 16), (3, 16, 4), (6, 2, 8)])
def test_gathering_kernels_over_several_calls_equal_dense_sdpa(name, seed, page_size, q_block, monkeypatch):
    """With calls free (CALL_COST 0), the planner cuts the step into calls of different widths and bin
    sizes: each call's queries, pages and mask, and the outputs put back in step order, still give every
    token exactly its own attention."""
    from infer.engine import packing

    monkeypatch.setattr(packing, "CALL_COST", 0)
    kernel = choose_kernel(name, torch.float32, torch.device("cpu"))
    pool, q, meta, dense = _layout(seed, page_size, q_block, kernel)
    assert len(meta.calls) > 1
    assert len({(c.q_block, c.width) for c in meta.calls}) == len(meta.calls)
    scale = D ** -0.5
    got = kernel(q, pool, 0, meta, scale)
    torch.testing.assert_close(got.double(), _oracle(q, dense, scale).flatten(1), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["reference", "sdpa"])
@pytest.mark.parametrize("seed,page_size,q_block", [(0, 4, 2), (1, 16, 16), (2, 1, 5), (6, 2, 8)])
def test_one_call_per_block_equals_dense_sdpa(name, seed, page_size, q_block):
    """infer.attention_calls=0: every query block its own call, with its own rows and pages (no bin is padded
    to another block's width), and every token still gets exactly its own attention."""
    kernel = choose_kernel(name, torch.float32, torch.device("cpu"), max_calls=0)
    pool, q, meta, dense = _layout(seed, page_size, q_block, kernel)
    assert len(meta.calls) == sum(-(-n // q_block) for n in (7, 2, 3))  # the layout's blocks
    assert all(c.bins == 1 and c.q_block <= q_block for c in meta.calls)
    # each call as wide as its own block: its mask has a visible key in its last page
    assert all(bool((c.visible[..., -page_size:] == 0).any()) for c in meta.calls)
    scale = D ** -0.5
    got = kernel(q, pool, 0, meta, scale)
    torch.testing.assert_close(got.double(), _oracle(q, dense, scale).flatten(1), atol=1e-5, rtol=0)


def test_one_call_per_block_pads_rows_to_the_contract():
    """The reference kernel standing in for flex (query blocks in multiples of 16) with a call per block:
    blocks of 2-7 tokens become calls of 16 padded rows, whose padding rows see one key and are never read."""
    kernel = choose_kernel("reference", torch.float32, torch.device("cpu"), stand_in_for="flex", max_calls=0)
    pool, q, meta, dense = _layout(1, 16, 16, kernel)
    assert [c.q_block for c in meta.calls] == [16] * len(meta.calls) and len(meta.calls) == 3
    got = kernel(q, pool, 0, meta, D ** -0.5)
    torch.testing.assert_close(got.double(), _oracle(q, dense, D ** -0.5).flatten(1), atol=1e-5, rtol=0)


def test_compiled_flex_equals_dense_sdpa():
    """FlexAttention compiled (inductor; its C++ backend here, Triton on CUDA) on the step's BlockMask:
    the same lowering a GPU runs, and what the eager tests cannot check (block lists as wide as the
    pool, blocks padded to a power of two)."""
    from infer.engine.kernels import FLEX_CONTRACT, FlexKernel

    kernel = FlexKernel("compiled on the CPU for this test", FLEX_CONTRACT, compiled=True)
    pool, q, meta, dense = _layout(3, 16, 16, kernel)
    assert meta.blocks & (meta.blocks - 1) == 0  # a power of two
    got = kernel(q, pool, 0, meta, D ** -0.5)
    torch.testing.assert_close(got.double(), _oracle(q, dense, D ** -0.5).flatten(1), atol=1e-5, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_flex_equals_dense_sdpa_on_a_random_paged_layout(dtype):
    """The CUDA default: FlexAttention compiled through Triton, pages and query blocks of 128 (its contract),
    on a churned pool with prefixes, branches and stale keys, against the fp64 oracle; chosen by "auto"."""
    kernel = choose_kernel("auto", dtype, torch.device("cuda"))
    assert kernel.name == "flex" and kernel.compiled
    pool, q, meta, dense = _layout(4, 128, 128, kernel, dtype=dtype, device="cuda")
    got = kernel(q, pool, 0, meta, D ** -0.5)
    assert got.dtype == dtype and got.device.type == "cuda"
    err = float((got.double().cpu() - _oracle(q.cpu(), dense, D ** -0.5).flatten(1)).abs().max())
    assert err < (1e-5 if dtype == torch.float32 else 2e-2), err


def test_bf16_kernels_stay_within_one_rounding_of_fp64():
    """bf16 inputs: the reference and sdpa outputs are within bf16 rounding of the fp64 oracle."""
    for name in ("reference", "sdpa"):
        kernel = choose_kernel(name, torch.bfloat16, torch.device("cpu"))
        pool, q, meta, dense = _layout(5, 4, 3, kernel, dtype=torch.bfloat16)
        got = kernel(q, pool, 0, meta, D ** -0.5)
        assert got.dtype == torch.bfloat16
        err = float((got.double() - _oracle(q, dense, D ** -0.5).flatten(1)).abs().max())
        assert err < 2e-2, (name, err)


def test_contract_checks_fire():
    kernel = choose_kernel("reference", torch.float32, torch.device("cpu"), stand_in_for="flex")
    assert kernel.contract == FLEX_CONTRACT
    pool, q, meta, _ = _layout(0, 4, 2, kernel)
    with pytest.raises(ValueError, match="page size 4 must be a multiple of 16"):
        kernel(q, pool, 0, meta, 1.0)
    plain = choose_kernel("sdpa", torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="dtypes"):
        plain(q.double(), pool, 0, meta, 1.0)
    with pytest.raises(ValueError, match="head dims"):
        plain(q[:, :5], pool, 0, meta, 1.0)
    with pytest.raises(ValueError, match="queries for a step"):
        plain(q[:3], pool, 0, meta, 1.0)
    pool16, q16, meta16, _ = _layout(1, 16, 6, plain)
    flex = choose_kernel("flex", torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"query block \d+ must be a multiple of 16"):
        flex(q16, pool16, 0, meta16, 1.0)


def test_kernel_choice_is_explicit():
    cpu = torch.device("cpu")
    assert choose_kernel("auto", torch.float32, cpu).name == "sdpa"
    assert choose_kernel("flex", torch.float32, cpu).name == "flex"
    assert choose_kernel("reference", torch.float32, cpu).name == "reference"
    with pytest.raises(ValueError, match="unknown infer.kernel"):
        choose_kernel("flash", torch.float32, cpu)
    assert choose_kernel("sdpa", torch.float32, cpu).max_calls == 3
    exact = choose_kernel("sdpa", torch.float32, cpu, max_calls=0)
    assert exact.max_calls == 0 and "one call per query block" in exact.reason
    with pytest.raises(ValueError, match="attention_calls must be >= 0"):
        choose_kernel("sdpa", torch.float32, cpu, max_calls=-1)


def test_no_private_aten_calls():
    """The decode path calls no torch.ops.aten._* kernel (their signatures change between releases)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "infer"
    offenders = [p.name for p in root.glob("*.py") if "ops.aten._" in p.read_text()]
    assert offenders == []


# ------------------------------------------------------------------------ the pool


def test_pool_reservations_pages_and_fresh_owners():
    pool = PagePool(2, 10, 4, HKV, D, torch.float32, torch.device("cpu"))
    assert pool.usable == 9 and pool.free_pages == 9
    assert pool.reserve(6) and not pool.reserve(4) and pool.free_pages == 3
    a = pool.open()
    pool.grow(a, 9)  # 3 pages from the reservation
    assert len(a.pages) == 3 and pool.allocated == 3 and pool.free_pages == 3
    with pytest.raises(OutOfPages):
        pool.grow(a, 30)
    pool.sync()
    assert pool.owner[a.pages].tolist() == [a.id] * 3 and pool.start[a.pages].tolist() == [0, 4, 8]
    old = list(a.pages)
    pool.close(a)
    b = pool.open()
    pool.grow(b, 12)
    pool.sync()
    assert set(b.pages) == set(old) and b.id != a.id  # the same pages, a new owner id
    assert pool.owner[b.pages].tolist() == [b.id] * 3
    assert (pool.kv[:, pool.slots(b, 0, 12)] == 0).all()  # handed out zeroed
    pool.close(b)
    pool.sync()
    assert (pool.owner[1:] == FREE_SEQ).all()
    assert pool.free_pages == pool.usable and pool.peak_pages == 3


def test_plan_calls_keeps_every_token_once_with_its_pages_and_pads_less():
    """Decode-like blocks of unequal rows and pages (a video each) and a planning row: planned into at most
    MAX_CALLS calls, every token sits in exactly one bin of at most F tokens whose pages hold all its
    block's pages; the padded work is less than one call of one block per video, and less than the best
    single call; blocks of one width (one video) make one call."""
    from infer.engine.packing import GATHER_ROWS, MAX_CALLS, pack_calls, padded_work

    rnd = random.Random(0)
    blocks, n, first = [], 0, 1
    for rows, pages in [(rnd.randint(1, 16), rnd.randint(60, 250)) for _ in range(16)] + [(1, 90)]:
        blocks.append(QueryBlock(range(n, n + rows), list(range(first, first + pages))))
        n, first = n + rows, first + pages
    calls = pack_calls(blocks, (4, 8, 16), group=4, page_size=16)
    assert 1 < len(calls) <= MAX_CALLS
    owner = {t: b for b in blocks for t in b.tokens}
    seen = [t for c in calls for b in c.bins for t in b.tokens]
    assert sorted(seen) == list(range(n))
    for c in calls:
        assert c.q_block <= 16
        for b in c.bins:
            assert len(b.tokens) <= c.q_block
            for t in b.tokens:
                assert set(owner[t].pages) <= set(b.pages)
    unpacked = len(blocks) * 16 * 4 * max(len(b.pages) for b in blocks)
    one = pack_calls(blocks, (4, 8, 16), group=4, page_size=16, max_calls=1)
    assert len(one) == 1
    assert padded_work(calls, 4) < padded_work(one, 4) < unpacked
    # against the work needed (each token against its block's pages) and one gather of each block's pages
    needed = sum(len(b.tokens) * 4 * len(b.pages) for b in blocks)
    gathers = lambda cs: sum(len(b.pages) for c in cs for b in c.bins)  # noqa: E731
    cost = lambda cs: padded_work(cs, 4) + GATHER_ROWS * gathers(cs)  # noqa: E731
    assert cost(calls) < 1.6 * (needed + GATHER_ROWS * sum(len(b.pages) for b in blocks))
    # blocks of one sequence (prefill pieces over a prefix and its prefixes) share their pages: one bin
    pre = list(range(1, 41))
    same = [QueryBlock(range(0, 4), pre[:10]), QueryBlock(range(4, 8), pre[:25]), QueryBlock(range(8, 12), pre)]
    got = pack_calls(same, (16,), group=1, page_size=16)
    assert len(got) == 1 and len(got[0].bins) == 1
    assert got[0].bins[0].pages == pre and sorted(got[0].bins[0].tokens) == list(range(12))
    # one video's decode rows (one width): one call
    video = [QueryBlock(range(lo, lo + 4), list(range(1, 200))) for lo in range(0, 16, 4)]
    assert len(pack_calls(video, (4, 8, 16), group=4, page_size=16)) == 1
