"""Grounding targets/readout and aggregation weights: literal cases."""

from __future__ import annotations

import math

import pytest
import torch

import tests.support.padcap  # noqa: F401  (one intra-op thread)
from pipeline.aggregation import Aggregator, interval_mask, jitter_intervals, normalise_inside
from pipeline.grounding import (
    GroundingHead,
    grounding_bce,
    readout,
    readout_one,
    segment_hidden,
    similarity_logits,
    soft_targets,
)

TIMES = torch.tensor([[float(t), t + 1.0] for t in range(10)])  # ten 1-second segments


def test_soft_targets_literal():
    tg = soft_targets(torch.tensor([[2.0, 4.0], [2.5, 2.6]]), TIMES)
    r = 2 ** -0.5
    want0 = [2 ** -1.5, r, 1, 1, r, 2 ** -1.5, 2 ** -2.5, 2 ** -3.5, 2 ** -4.5, 2 ** -5.5]
    assert torch.allclose(tg[0], torch.tensor(want0))
    # a short interval inside segment 2: neighbours by their centres' distance (1.0 s and 0.9 s)
    assert tg[1, 2] == 1 and tg[1, 1] == 0.5
    assert math.isclose(float(tg[1, 3]), 0.5 ** 0.9, rel_tol=1e-5)


def test_similarity_scale_and_bce():
    ev, seg = torch.ones(2, 16), torch.ones(3, 16) * 2
    logits = similarity_logits(ev, seg)
    assert logits.shape == (2, 3) and torch.allclose(logits, torch.full((2, 3), 32 / 4.0))
    # precision="product" (the release fine-tune): the product in the inputs' dtype, the result float32
    g = torch.Generator().manual_seed(0)
    e16, s16 = torch.randn(2, 16, generator=g).bfloat16(), torch.randn(3, 16, generator=g).bfloat16()
    low = similarity_logits(e16, s16, precision="product")
    assert low.dtype == torch.float32 and torch.equal(low, (e16 @ s16.T).float() / 4.0)
    assert torch.equal(similarity_logits(ev, seg, precision="product"), logits)  # float32 inputs: the same
    # precision="inputs", one event (the release's decoding similarity): segments @ event / sqrt(d), all bf16
    one = similarity_logits(e16[0], s16, precision="inputs")
    assert one.dtype == torch.bfloat16 and torch.equal(one, s16 @ e16[0] / 4.0)
    assert float(grounding_bce(torch.tensor([[0.0]]), torch.tensor([[1.0]]))) == pytest.approx(math.log(2))
    head = GroundingHead(16)
    assert head(torch.randn(5, 16)).shape == (5, 16)
    assert [m.__class__.__name__ for m in head.net] == ["LayerNorm", "Linear", "GELU", "Linear"]
    assert head.net[1].out_features == 8


def test_segment_hidden_means():
    h = torch.arange(12, dtype=torch.float32)[:, None].repeat(1, 2)
    vis, aud = torch.tensor([[0, 1], [4, 5]]), torch.tensor([[2, 3], [6, 7]])
    assert segment_hidden(h, vis, aud)[:, 0].tolist() == [0.5 + 2.5, 4.5 + 6.5]
    assert segment_hidden(h, vis, aud[:, :0])[:, 0].tolist() == [0.5, 4.5]
    # the release's form: index lists of different sizes (an empty audio set adds nothing), a weight, its own rows
    heads = torch.arange(8, dtype=torch.float32)[:, None] * 10
    assert segment_hidden(h, [[0, 1], [4, 5, 6]], [[1], []], 0.5, heads)[:, 0].tolist() == [0.5 + 5.0, 5.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_segment_hidden_lists_equal_the_grid_to_the_bit(dtype):
    """Per-timestep index lists (the release's) and an index grid (the project's) are one arithmetic."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(200, 96, generator=g).to(dtype)
    vis, aud = torch.randperm(200, generator=g)[:120].view(20, 6), torch.randperm(200, generator=g)[:80].view(20, 4)
    assert torch.equal(segment_hidden(h, vis, aud), segment_hidden(h, vis.tolist(), aud.tolist()))


def logit(p):
    p = torch.as_tensor(p, dtype=torch.float32)
    return torch.log(p / (1 - p))


def test_readout_threshold_gaps_and_mass():
    # kept (>= 0.5 * 0.9): t=1,2 | 4 (gap of 1 -> joined) | 8,9 (gap of 3 -> separate)
    p = [0.1, 0.9, 0.8, 0.2, 0.6, 0.1, 0.1, 0.1, 0.7, 0.7]
    assert readout_one(logit(p), TIMES, threshold=0.5, max_gap=2) == (1.0, 5.0)
    # no bridging: runs {1,2} (mass 1.7), {4} (0.6), {8,9} (1.4) -> the first
    assert readout_one(logit(p), TIMES, threshold=0.5, max_gap=0) == (1.0, 3.0)
    # the run with the largest mass wins, not the one holding the max
    p2 = [0.95, 0.1, 0.1, 0.1, 0.8, 0.8, 0.8, 0.1, 0.1, 0.1]
    assert readout_one(logit(p2), TIMES, threshold=0.7, max_gap=2) == (4.0, 7.0)
    assert readout(torch.stack([logit(p), logit(p2)]), TIMES, 0.7, 2) == [(1.0, 3.0), (4.0, 7.0)]


def test_interval_mask_and_jitter():
    m = interval_mask(torch.tensor([[2.0, 4.0], [3.2, 3.2], [20.0, 30.0]]), TIMES)
    assert m[0].nonzero().flatten().tolist() == [2, 3]
    assert m[1].nonzero().flatten().tolist() == [3]  # zero length: nearest segment
    assert m[2].nonzero().flatten().tolist() == [9]  # outside: nearest segment
    iv = torch.tensor([[2.0, 4.0], [0.0, 10.0]])
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        j = jitter_intervals(iv, duration=10.0, frac=0.1, generator=g)
        assert ((j - iv).abs() <= 0.1 * (iv[:, 1:] - iv[:, :1]) + 1e-6).all()
        assert (j[:, 1] > j[:, 0]).all() and (j >= 0).all() and (j <= 10).all()
    assert torch.equal(jitter_intervals(iv, 10.0, 0.0), iv)


def test_normalise_inside_is_a_proper_normalisation():
    scores = torch.tensor([1e-4, 3e-4, 0.0, 6e-4])  # attention probabilities are tiny
    inside = torch.tensor([[True, True, False, False], [False, False, True, False]])
    w = normalise_inside(scores, inside)
    assert torch.allclose(w[0], torch.tensor([0.25, 0.75, 0.0, 0.0]))  # not ~uniform as a softmax would be
    assert torch.allclose(w[1], torch.tensor([0.0, 0.0, 1.0, 0.0]))  # zero mass inside -> uniform inside


@pytest.mark.parametrize("mode", ["mean", "attention", "scoring_head", "none"])
def test_aggregator_weights(mode):
    torch.manual_seed(0)
    agg = Aggregator(mode, 8)
    h = torch.randn(30, 8)
    vis = torch.arange(20).view(10, 2)
    aud = torch.arange(20, 30).view(10, 1)
    inside = interval_mask(torch.tensor([[2.0, 4.0], [6.5, 9.0]]), TIMES)
    row = torch.rand(30)
    feats, w = agg(h, vis, aud, inside, row if mode == "attention" else None)
    assert feats.shape == (2, 8)
    if mode == "none":
        assert w == {} and (feats == 0).all()
        return
    for name, per, idx in (("visual", 2, vis), ("audio", 1, aud)):
        tok_inside = inside.repeat_interleave(per, 1)
        assert torch.allclose(w[name].sum(1), torch.ones(2)) and (w[name][~tok_inside] == 0).all()
    want = w["visual"] @ h[vis.flatten()] + w["audio"] @ h[aud.flatten()]
    assert torch.allclose(feats, want, atol=1e-6)
    if mode == "attention":
        expect = row[vis.flatten()] * inside.repeat_interleave(2, 1)[0]
        assert torch.allclose(w["visual"][0], expect / expect.sum())
    if mode == "mean":
        assert torch.allclose(w["visual"][0, 4:8], torch.full((4,), 0.25))


def test_one_run_rule_with_the_two_mass_rules():
    """The project's readout and the release's find_and_merge share the bridging; they differ in the mass."""
    from pipeline.aggregation import token_weights as weights_inside
    from pipeline.grounding import bridged_runs, heaviest_run
    from pipeline.release.grounding import WEIGHT_RULES, find_and_merge

    def token_weights(scores, mode):  # the release's aggregation modes over every selected token
        return weights_inside(scores, torch.ones(1, scores.numel(), dtype=torch.bool), WEIGHT_RULES[mode])[0]

    p = torch.tensor([0.9, 0.2, 0.85, 0.0, 0.0, 0.0, 0.95, 0.9])
    keep = (p >= 0.8).tolist()
    runs = bridged_runs(keep, 1)
    assert runs == [(0, 2), (6, 7)]
    assert heaviest_run(p, keep, runs, "kept") == (6, 7)  # 1.85 over 1.75: the gap step does not count
    assert heaviest_run(p, keep, runs, "span") == (0, 2)  # 1.75 + 0.2 with the gap step: the release's
    assert find_and_merge(p, 0.8 / 0.95, 1) == (0, 2)
    with pytest.raises(ValueError):
        bridged_runs(keep, -1)
    w = token_weights(torch.tensor([0.2, 0.6, 0.2]), "renormalised")
    assert torch.allclose(w, torch.tensor([0.2, 0.6, 0.2]))
    assert torch.equal(token_weights(torch.zeros(4), "renormalised"), torch.full((4,), 0.25))
    assert torch.allclose(token_weights(torch.tensor([0.0, 1.0]), "release"), torch.tensor([0.0, 1.0]).softmax(-1))
