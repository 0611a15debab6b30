"""Cascade attention and its kernels (infer/attention.py, the kernels of infer/step.py).

Oracle: plain masked attention over the concatenated keys (float64). The decode step as a
whole is checked against HF's forward in tests/test_engine.py and tests/test_engine_batch.py.
Run: .venv/bin/python -m pytest tests/test_attention.py -q
"""

from __future__ import annotations

import pytest
import torch

from infer.attention import (
    cascade_attention,
    flash_attn_available,
    lse_attention_math,
    lse_attention_sdpa,
    merge_lse,
)


# ----------------------------------------------------------------------------------
# reference


def reference_attention(q, prefix_k, prefix_v, branch_k, branch_v, scale):
    """Masked attention over [prefix ; all branches' KV] in float64 (slow, obvious).

    q [K, Hq, t, D]; prefix [Hkv, Lp, D]; branch [K, Hkv, Lb, D]. Query (k, i) sees the
    whole prefix and branch k's keys up to Lb - t + i; nothing of other branches.
    """
    K, Hq, t, D = q.shape
    Hkv, Lp, _ = prefix_k.shape
    Lb = branch_k.shape[2]
    g = Hq // Hkv
    keys = torch.cat([prefix_k.double(), branch_k.double().transpose(0, 1).reshape(Hkv, K * Lb, D)], dim=1)
    vals = torch.cat([prefix_v.double(), branch_v.double().transpose(0, 1).reshape(Hkv, K * Lb, D)], dim=1)
    keys, vals = keys.repeat_interleave(g, dim=0), vals.repeat_interleave(g, dim=0)  # [Hq, N, D]
    mask = torch.full((K, t, Lp + K * Lb), float("-inf"), dtype=torch.float64)
    mask[:, :, :Lp] = 0
    for b in range(K):
        for i in range(t):
            mask[b, i, Lp + b * Lb : Lp + b * Lb + Lb - t + i + 1] = 0
    s = torch.einsum("khtd,hnd->khtn", q.double(), keys) * scale + mask[:, None]
    return torch.einsum("khtn,hnd->khtd", s.softmax(-1), vals)


def random_inputs(K, Hq, Hkv, t, Lp, Lb, D=16, dtype=torch.float32, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen).to(device=device, dtype=dtype)  # noqa: E731
    return r(K, Hq, t, D), r(Hkv, Lp, D), r(Hkv, Lp, D), r(K, Hkv, Lb, D), r(K, Hkv, Lb, D)


# ----------------------------------------------------------------------------------
# the pure function


@pytest.mark.parametrize("backend", ["sdpa", "math"])
@pytest.mark.parametrize("heads", [(14, 2), (4, 2), (4, 4)])
@pytest.mark.parametrize("K", [1, 8])
@pytest.mark.parametrize("t", [1, 3])
def test_cascade_equals_masked_attention_fp32(backend, heads, K, t):
    Hq, Hkv = heads
    q, pk, pv, bk, bv = random_inputs(K, Hq, Hkv, t, Lp=37, Lb=t + 4)
    out = cascade_attention(q, pk, pv, bk, bv, scale=0.3, backend=backend)
    ref = reference_attention(q, pk, pv, bk, bv, scale=0.3)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert out.transpose(1, 2).is_contiguous()  # [K, t, Hq, D] storage: HF's reshape is free
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,atol", [(torch.float16, 4e-3), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("backend", ["sdpa", "math"])
def test_cascade_half_precision(dtype, atol, backend):
    q, pk, pv, bk, bv = random_inputs(8, 14, 2, 1, Lp=300, Lb=6, D=64, dtype=dtype)
    out = cascade_attention(q, pk, pv, bk, bv, backend=backend)
    assert out.dtype == dtype
    ref = reference_attention(*(x.float() for x in (q, pk, pv, bk, bv)), scale=64**-0.5)
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=0)


@pytest.mark.parametrize("splits,Lp", [(4, 64), (5, 67), (7, 100)])
def test_split_prefix_equals_unsplit(splits, Lp):
    """Split-KV over the prefix (the CUDA default for long prefixes), incl. a remainder."""
    q, pk, pv, bk, bv = random_inputs(3, 14, 2, 1, Lp=Lp, Lb=4)
    for backend in ("sdpa", "math"):
        out, lse = cascade_attention(q, pk, pv, bk, bv, backend=backend, prefix_splits=splits, return_lse=True)
        _, want_lse = cascade_attention(q, pk, pv, bk, bv, backend="math", prefix_splits=1, return_lse=True)
        torch.testing.assert_close(out.double(), reference_attention(q, pk, pv, bk, bv, 16**-0.5), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)


def test_auto_prefix_splits_only_for_long_prefixes_on_cuda():
    from infer.attention import SPLIT_CHUNK, SPLIT_MIN_PREFIX, auto_prefix_splits

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert auto_prefix_splits(1 << 20, cpu) == 1
    assert auto_prefix_splits(SPLIT_MIN_PREFIX - 1, cuda) == 1  # launch-bound: one kernel
    assert auto_prefix_splits(SPLIT_MIN_PREFIX, cuda) == SPLIT_MIN_PREFIX // SPLIT_CHUNK > 1
    assert auto_prefix_splits(1 << 22, cuda) == 64


def test_cascade_empty_prefix_and_lse():
    q, pk, pv, bk, bv = random_inputs(3, 4, 2, 1, Lp=0, Lb=5)
    out, lse = cascade_attention(q, pk, pv, bk, bv, scale=0.25, backend="sdpa", return_lse=True)
    torch.testing.assert_close(out.double(), reference_attention(q, pk, pv, bk, bv, 0.25), atol=1e-6, rtol=1e-6)
    assert lse.shape == (3, 4, 1) and torch.isfinite(lse).all()


def test_lse_merge_is_exact():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 3, 5, 8, generator=gen)
    k = torch.randn(2, 3, 40, 8, generator=gen)
    v = torch.randn(2, 3, 40, 8, generator=gen)
    full_o, full_lse = lse_attention_math(q.double(), k.double(), v.double(), 0.5)
    for split in (1, 17, 39):
        oa, la = lse_attention_math(q, k[:, :, :split], v[:, :, :split], 0.5)
        ob, lb = lse_attention_sdpa(q, k[:, :, split:], v[:, :, split:], 0.5)
        o, lse = merge_lse(oa, la, ob, lb)
        torch.testing.assert_close(o.double(), full_o, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(lse.double(), full_lse, atol=1e-5, rtol=1e-6)
    # a side with no visible key (lse = -inf) contributes nothing
    empty = torch.full_like(full_lse, float("-inf")).float()
    o, lse = merge_lse(torch.zeros_like(q), empty, full_o.float(), full_lse.float())
    torch.testing.assert_close(o.double(), full_o, atol=1e-6, rtol=1e-6)


def test_lse_backends_agree_with_mask():
    q, _, _, bk, bv = random_inputs(2, 4, 4, 1, Lp=0, Lb=9)
    q = torch.randn(2, 4, 6, 16)
    mask = torch.rand(6, 9) > 0.3
    mask[:, 0] = True
    om, lm = lse_attention_math(q, bk, bv, 0.25, mask)
    os_, ls = lse_attention_sdpa(q, bk, bv, 0.25, mask)
    torch.testing.assert_close(os_, om, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ls, lm, atol=1e-5, rtol=1e-5)


def test_cascade_rejects_bad_shapes():
    q, pk, pv, bk, bv = random_inputs(3, 6, 4, 1, Lp=5, Lb=2)  # 6 q heads over 4 KV heads
    with pytest.raises(ValueError):
        cascade_attention(q, pk, pv, bk, bv)
    q, pk, pv, bk, bv = random_inputs(3, 4, 2, 1, Lp=5, Lb=2)
    with pytest.raises(ValueError):
        cascade_attention(q, pk, pv, bk[:2], bv[:2])
    with pytest.raises(RuntimeError):
        cascade_attention(q, pk, pv, bk, bv, backend="flash")  # CPU: flash cannot run


# ----------------------------------------------------------------------------------
# the step's kernels (infer/step.py): keys [0, lengths[b]) visible per batch element


@pytest.mark.parametrize("name", ["sdpa", "math"])
def test_step_kernel_length_masks(name):
    from infer.attention import Kernel

    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(3, 2, 4, 16, generator=gen) for _ in range(3))
    k, v = torch.randn(3, 2, 9, 16, generator=gen), torch.randn(3, 2, 9, 16, generator=gen)
    lengths = torch.tensor([1, 5, 9])
    kern = Kernel(name, "")
    o, lse = kern(q, k, v, 0.25, kern.visible(lengths, 9, q.dtype))
    for b, n in enumerate(lengths.tolist()):
        o_ref, lse_ref = lse_attention_math(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n], 0.25)
        torch.testing.assert_close(o[b:b + 1], o_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[b:b + 1], lse_ref, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t,Lp", [(1, 1000), (1, 5000), (3, 5000)])
def test_sdpa_backend_cuda(dtype, t, Lp):
    """CUDA fused kernels with LSE; Lp=5000 takes the split-KV path (9 chunks + a rest)."""
    q, pk, pv, bk, bv = random_inputs(8, 14, 2, t, Lp=Lp, Lb=t + 6, D=64, dtype=dtype, device="cuda")
    out = cascade_attention(q, pk, pv, bk, bv, backend="sdpa")
    ref = reference_attention(*(x.float().cpu() for x in (q, pk, pv, bk, bv)), scale=64**-0.5)
    atol = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out.double().cpu(), ref, atol=atol, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not flash_attn_available(), reason="flash-attn not installed")
@pytest.mark.parametrize("t", [1, 3])
def test_flash_backend(t):
    q, pk, pv, bk, bv = random_inputs(8, 14, 2, t, Lp=1000, Lb=t + 5, D=64, dtype=torch.bfloat16, device="cuda")
    out = cascade_attention(q, pk, pv, bk, bv, backend="flash")
    ref = reference_attention(*(x.float().cpu() for x in (q, pk, pv, bk, bv)), scale=64**-0.5)
    torch.testing.assert_close(out.double().cpu(), ref, atol=2e-2, rtol=0)
