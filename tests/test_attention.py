"""Cascade attention (infer/attention.py) and CascadeCache (infer/kv_cache.py).

Oracles: plain masked attention over the concatenated keys (float64), and a tiny
random-init HF Qwen2 run on the full sequence with an explicit additive 4D mask.
Run: .venv/bin/python -m pytest tests/test_attention.py -q
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import AttentionInterface, Qwen2Config, Qwen2ForCausalLM

from infer.attention import (
    ATTN_IMPLEMENTATION,
    cascade_attention,
    flash_attn_available,
    lse_attention_math,
    lse_attention_sdpa,
    merge_lse,
    register,
)
from infer.kv_cache import CascadeCache, CascadeLayer

register()


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
# the cache layer on its own


def _attend(layer, k_new, v_new, q):
    kv, _ = layer.update(k_new, v_new)
    return cascade_attention(q, kv.prefix_k, kv.prefix_v, kv.branch_k, kv.branch_v, backend="sdpa")


def test_keep_drops_a_branch_without_touching_the_others():
    gen = torch.Generator().manual_seed(2)
    Hq, Hkv, D, Lp, K, steps = 4, 2, 16, 20, 4, 6
    pk, pv = torch.randn(1, Hkv, Lp, D, generator=gen), torch.randn(1, Hkv, Lp, D, generator=gen)
    new = [(torch.randn(K, Hkv, 1, D, generator=gen), torch.randn(K, Hkv, 1, D, generator=gen),
            torch.randn(K, Hq, 1, D, generator=gen)) for _ in range(steps)]
    survivors = torch.tensor([0, 2, 3])
    a, b = CascadeLayer(backend="sdpa"), CascadeLayer(backend="sdpa")  # b never had branch 1
    a.update(pk, pv)
    b.update(pk.clone(), pv.clone())
    a.start_branches(K, capacity=2)  # small capacity: growth is exercised too
    b.start_branches(len(survivors), capacity=2)
    for step, (kn, vn, q) in enumerate(new):
        if step == 3:
            a.keep(survivors)
        rows = torch.arange(K) if step < 3 else survivors
        out_a = _attend(a, kn[rows], vn[rows], q[rows])
        out_b = _attend(b, kn[survivors], vn[survivors], q[survivors])
        torch.testing.assert_close(out_a if step >= 3 else out_a[survivors], out_b, atol=1e-6, rtol=1e-6)
    assert a.num_branches == 3 and a.branch_len == steps and a.get_seq_length() == Lp + steps


# ----------------------------------------------------------------------------------
# end to end with a stock HF Qwen2


def tiny_qwen2(attn: str) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=256,
    )
    model = Qwen2ForCausalLM(copy.deepcopy(cfg)).eval()  # a fresh config each: HF mutates it
    model.set_attn_implementation(attn)
    return model


@pytest.fixture(scope="module")
def models():
    fast = tiny_qwen2(ATTN_IMPLEMENTATION)
    ref = tiny_qwen2("eager")
    ref.load_state_dict(fast.state_dict())
    return fast, ref


def reference_branch_logits(ref, prefix_ids, branches):
    """Full-sequence oracle: logits of every branch token, [n_branches, n_tokens, V].

    Sequence = prefix, then every branch's tokens; prefix positions 0..Lp-1, branch
    token j at A + j (A = Lp). Additive float mask: prefix causal and visible to all;
    a branch token sees its own earlier tokens only.
    """
    Lp, nb, nt = prefix_ids.shape[1], len(branches), len(branches[0])
    ids = torch.cat([prefix_ids[0], torch.tensor([tok for br in branches for tok in br])])[None]
    pos = torch.cat([torch.arange(Lp), torch.arange(Lp, Lp + nt).repeat(nb)])[None]
    n = ids.shape[1]
    visible = torch.zeros(n, n, dtype=torch.bool)
    visible[:Lp, :Lp] = torch.ones(Lp, Lp).tril().bool()
    visible[Lp:, :Lp] = True
    for b in range(nb):
        s = Lp + b * nt
        visible[s : s + nt, s : s + nt] = torch.ones(nt, nt).tril().bool()
    mask = torch.zeros(1, 1, n, n).masked_fill(~visible, torch.finfo(torch.float32).min)
    with torch.no_grad():
        logits = ref(input_ids=ids, attention_mask=mask, position_ids=pos).logits[0]
    return logits[Lp:].reshape(nb, nt, -1)


def prefill(model, cache, prefix_ids):
    """Prefill in two chunks (the second one needs HF's offset causal mask)."""
    Lp, dev = prefix_ids.shape[1], prefix_ids.device
    cut = Lp - 4
    with torch.no_grad():
        model(input_ids=prefix_ids[:, :cut], position_ids=torch.arange(cut, device=dev)[None], cache=cache,
              use_cache=True)
        return model(
            input_ids=prefix_ids[:, cut:], position_ids=torch.arange(cut, Lp, device=dev)[None], cache=cache,
            use_cache=True,
        ).logits


def test_attention_registered():
    assert ATTN_IMPLEMENTATION in AttentionInterface()


def decode_and_compare(fast, ref, device: str, atol: float):
    """Prefill 30 tokens, start 3 branches from 3 anchors at A = Lp, decode 6 greedy
    steps (branch 1 finishes after step 2) and compare every step's logits with the
    full-sequence reference (run on CPU)."""
    gen = torch.Generator().manual_seed(3)
    prefix_ids = torch.randint(0, 256, (1, 30), generator=gen)
    Lp = prefix_ids.shape[1]
    cache = CascadeCache(fast.config, backend="sdpa")
    prefix_logits = prefill(fast, cache, prefix_ids.to(device))
    with torch.no_grad():
        ref_prefix = ref(input_ids=prefix_ids, position_ids=torch.arange(Lp)[None]).logits[:, -4:]
    torch.testing.assert_close(prefix_logits.cpu(), ref_prefix, atol=atol, rtol=atol)
    assert cache.get_seq_length() == Lp

    cache.start_branches(3, capacity=4)
    tokens = {0: [11], 1: [22], 2: [33]}  # three different anchors, all at position A = Lp
    active = [0, 1, 2]
    for j in range(6):
        if j == 3:  # branch 1 finishes: it leaves the cache and the query batch at once
            cache.keep([0, 2])
            active = [0, 2]
        step_ids = torch.tensor([[tokens[b][-1]] for b in active], device=device)
        with torch.no_grad():
            logits = fast(
                input_ids=step_ids, position_ids=torch.full((len(active), 1), Lp + j, device=device),
                cache=cache, use_cache=True,
            ).logits[:, -1].cpu()
        want = reference_branch_logits(ref, prefix_ids, [tokens[b] for b in active])[:, -1]
        torch.testing.assert_close(logits, want, atol=atol, rtol=atol)
        for row, b in enumerate(active):
            tokens[b].append(int(want[row].argmax()))
        assert cache.get_seq_length() == Lp + j + 1 and cache.num_branches == len(active)
    assert cache.branch_length == 6


def test_end_to_end_tiny_qwen2(models):
    fast, ref = models
    decode_and_compare(fast, ref, "cpu", atol=1e-4)


@pytest.mark.gpu
def test_end_to_end_tiny_qwen2_cuda(models):
    fast, ref = models
    decode_and_compare(copy.deepcopy(fast).to("cuda"), ref, "cuda", atol=1e-3)


def test_several_tokens_per_branch_step(models):
    fast, ref = models
    gen = torch.Generator().manual_seed(4)
    prefix_ids = torch.randint(0, 256, (1, 16), generator=gen)
    Lp = prefix_ids.shape[1]
    branches = [[5, 6, 7], [8, 9, 10]]
    cache = CascadeCache(fast.config, backend="sdpa")
    prefill(fast, cache, prefix_ids)
    cache.start_branches(2)
    with torch.no_grad():
        first = fast(input_ids=torch.tensor([[5], [8]]), position_ids=torch.full((2, 1), Lp),
                     cache=cache, use_cache=True).logits
        rest = fast(input_ids=torch.tensor([[6, 7], [9, 10]]), position_ids=torch.tensor([[Lp + 1, Lp + 2]] * 2),
                    cache=cache, use_cache=True).logits
    want = reference_branch_logits(ref, prefix_ids, branches)
    torch.testing.assert_close(torch.cat([first, rest], dim=1), want, atol=1e-4, rtol=1e-4)


class _MaxNumel(TorchDispatchMode):
    """Records the largest tensor that any aten op allocates while active (views of
    existing storage, e.g. a weight's transpose, are not allocations)."""

    def __init__(self):
        super().__init__()
        self.max_numel, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        seen = {x.untyped_storage().data_ptr() for x in inputs}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                if t.numel() > self.max_numel:
                    self.max_numel, self.op = t.numel(), str(func)
        return out


def test_prefix_is_never_copied_or_expanded(models, monkeypatch):
    fast, _ = models
    gen = torch.Generator().manual_seed(5)
    Lp, K = 96, 3
    prefix_ids = torch.randint(0, 256, (1, Lp), generator=gen)
    cache = CascadeCache(fast.config, backend="sdpa")
    prefill(fast, cache, prefix_ids)
    cache.start_branches(K, capacity=8)
    ptrs = [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in cache.layers]
    cfg = fast.config
    prefix_numel = cfg.num_key_value_heads * Lp * (cfg.hidden_size // cfg.num_attention_heads)

    def no_repeat(*a, **k):
        raise AssertionError("repeat_kv called during a branch step")

    import transformers.integrations.sdpa_attention as hf_sdpa
    import transformers.models.qwen2.modeling_qwen2 as hf_qwen2

    monkeypatch.setattr(hf_sdpa, "repeat_kv", no_repeat)
    monkeypatch.setattr(hf_qwen2, "repeat_kv", no_repeat)
    ids = torch.tensor([[1], [2], [3]])
    for j in range(4):
        if j == 2:
            cache.keep([0, 2])
            ids = ids[[0, 2]]
        spy = _MaxNumel()
        with torch.no_grad(), spy:
            logits = fast(input_ids=ids, position_ids=torch.full((ids.shape[0], 1), Lp + j),
                          cache=cache, use_cache=True).logits
        # nothing created in a step is as large as one layer's prefix K (let alone K copies)
        assert spy.max_numel < prefix_numel, (spy.max_numel, spy.op, prefix_numel)
        ids = logits[:, -1].argmax(-1, keepdim=True)
        for layer, (kp, vp) in zip(cache.layers, ptrs):
            assert layer.keys.shape[0] == 1 and layer.prefix_keys.shape == (cfg.num_key_value_heads, Lp, 16)
            assert (layer.keys.data_ptr(), layer.values.data_ptr()) == (kp, vp)


def test_cache_guards(models):
    fast, _ = models
    cache = CascadeCache(fast.config)
    with pytest.raises(RuntimeError):
        cache.start_branches(2)  # nothing prefilled
    prefill(fast, cache, torch.randint(0, 256, (1, 8)))
    cache.start_branches(2)
    with pytest.raises(ValueError):
        cache.keep([0, 5])
    with pytest.raises(ValueError):  # wrong batch for the active branches
        fast(input_ids=torch.tensor([[1], [2], [3]]), position_ids=torch.full((3, 1), 8), cache=cache, use_cache=True)
    cache.end_branches()
    assert not cache.in_branch_mode and cache.get_seq_length() == 8


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
