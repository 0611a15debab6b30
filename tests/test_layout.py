"""Layout: literal masks/positions/labels, the visibility rule, packing of mixed batches."""

from __future__ import annotations

import pytest
import torch

from pipeline.examples import pack
from pipeline.layout import (
    FEATURE_ID,
    IGNORE,
    LayoutError,
    LayoutOptions,
    Role,
    TokenMeta,
    additive_mask,
    anchor_position,
    branch_position,
    dense_layout,
    event_order,
    mask_between,
    plain_layout,
    prefix_layout,
    shared_position,
)

G, S, EOS = 5, 6, 2


def small(mask="factorized", order="blocked", av=False, pad_loss=True):
    """prefix 4 (preamble, 1 visual, 1 audio, instruction), K = 2, branch lengths 2 and 3."""
    opts = LayoutOptions(mask=mask, av_bidirectional=av, branch_order=order, eos_padding_loss=pad_loss)
    return dense_layout([10], [11], 1, 1, 1, [[20], [30, 31]], g_id=G, s_id=S, eos_id=EOS, options=opts)


def vis(lay):
    return (lay.mask[0, 0] == 0).int().tolist()


FACTORIZED_BLOCKED = [
    # p  v  a  i  G  G a1 a2 b1 b1 b2 b2
    [1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    [1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    [1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    [1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0],
    [1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0],
    [1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0],
    [1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0],  # anchor 1
    [1, 1, 1, 1, 1, 1, 0, 1, 0, 0, 0, 0],  # anchor 2
    [1, 1, 1, 1, 1, 1, 1, 0, 1, 0, 0, 0],  # branch 1 step 1
    [1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 0, 0],  # branch 1 step 2
    [1, 1, 1, 1, 1, 1, 0, 1, 0, 0, 1, 0],  # branch 2 step 1
    [1, 1, 1, 1, 1, 1, 0, 1, 0, 0, 1, 1],  # branch 2 step 2
]


def test_literal_factorized_blocked():
    lay = small()
    assert lay.input_ids.tolist() == [10, FEATURE_ID, FEATURE_ID, 11, G, G, G, G, 20, EOS, 30, 31]
    assert lay.labels.tolist() == [IGNORE, IGNORE, IGNORE, G, G, S, 20, 30, EOS, EOS, 31, EOS]
    assert lay.position.tolist() == [0, 1, 2, 3, 4, 5, 6, 6, 7, 8, 7, 8]
    assert lay.event.tolist() == [-1, -1, -1, -1, -1, -1, 0, 1, 0, 0, 1, 1]
    assert lay.role.tolist() == [0, 1, 2, 3, 4, 4, 5, 5, 6, 6, 6, 6]
    assert lay.segment.tolist() == [-1, 0, 0] + [-1] * 9
    assert lay.step.tolist() == [-1] * 6 + [0, 0, 1, 2, 1, 2]
    assert vis(lay) == FACTORIZED_BLOCKED
    assert (lay.prefix_len, lay.split, lay.num_events, lay.instruction_end) == (4, 6, 2, 3)
    assert lay.event_query_index.tolist() == [3, 4]
    assert lay.anchor_index.tolist() == [6, 7]
    assert lay.mask.shape == (1, 1, 12, 12) and lay.mask.dtype == torch.float32
    assert lay.mask.min() == torch.finfo(torch.float32).min and lay.mask.max() == 0


def test_literal_causal_blocked():
    # causal: branches keep their own lengths (no <eos> padding a later branch could see)
    lay = small(mask="causal")
    assert lay.input_ids.tolist() == [10, FEATURE_ID, FEATURE_ID, 11, G, G, G, G, 20, 30, 31]
    assert lay.labels.tolist() == [IGNORE, IGNORE, IGNORE, G, G, S, 20, 30, EOS, 31, EOS]
    assert vis(lay) == torch.tril(torch.ones(11, 11, dtype=torch.int32)).tolist()
    assert lay.position.tolist() == [0, 1, 2, 3, 4, 5, 6, 6, 7, 7, 8]  # anchors share A, step j at A + j
    assert lay.step.tolist() == [-1] * 6 + [0, 0, 1, 1, 2]


OWN_G_BLOCKED = [
    # p  v  a  i  G  G a1 a2 b1 b1 b2 b2
    [1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    [1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    [1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    [1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0],
    [1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0],  # serial <G>_1
    [1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0],  # serial <G>_2 still sees <G>_1 (planning is shared)
    [1, 1, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0],  # anchor 1: its own <G>_1 only
    [1, 1, 1, 1, 0, 1, 0, 1, 0, 0, 0, 0],  # anchor 2: its own <G>_2 only
    [1, 1, 1, 1, 1, 0, 1, 0, 1, 0, 0, 0],
    [1, 1, 1, 1, 1, 0, 1, 0, 1, 1, 0, 0],
    [1, 1, 1, 1, 0, 1, 0, 1, 0, 0, 1, 0],
    [1, 1, 1, 1, 0, 1, 0, 1, 0, 0, 1, 1],
]


def test_literal_own_g_visibility():
    opts = LayoutOptions(av_bidirectional=False, g_visibility="own")
    lay = dense_layout([10], [11], 1, 1, 1, [[20], [30, 31]], g_id=G, s_id=S, eos_id=EOS, options=opts)
    assert vis(lay) == OWN_G_BLOCKED
    assert lay.meta().plan_index.tolist() == [-1, -1, -1, -1, 0, 1] + [-1] * 6
    assert lay.position.tolist() == small().position.tolist()  # only visibility changes
    causal = dense_layout([10], [11], 1, 1, 1, [[20], [30, 31]], g_id=G, s_id=S, eos_id=EOS,
                          options=LayoutOptions(mask="causal", av_bidirectional=False, g_visibility="own"))
    m = vis(causal)
    assert m[6][4:8] == [1, 0, 1, 0] and m[7][4:8] == [0, 1, 1, 1]  # anchors: own <G>, the earlier anchors
    with pytest.raises(LayoutError, match="g_visibility"):
        LayoutOptions(g_visibility="none")


def test_literal_chain_layout():
    # latent planning, sequential: anchor_1 b_1 anchor_2 b_2 in one causal chain, consecutive positions
    opts = LayoutOptions(mask="causal", av_bidirectional=False, chain=True)
    lay = dense_layout([10], [11], 1, 1, 1, [[20], [30, 31]], g_id=G, s_id=S, eos_id=EOS, options=opts)
    assert lay.input_ids.tolist() == [10, FEATURE_ID, FEATURE_ID, 11, G, G, G, 20, G, 30, 31]
    assert lay.labels.tolist() == [IGNORE, IGNORE, IGNORE, G, G, S, 20, EOS, 30, 31, EOS]
    assert lay.role.tolist() == [0, 1, 2, 3, 4, 4, 5, 6, 5, 6, 6]
    assert lay.event.tolist() == [-1] * 6 + [0, 0, 1, 1, 1]
    assert lay.position.tolist() == list(range(11))
    assert vis(lay) == torch.tril(torch.ones(11, 11, dtype=torch.int32)).tolist()
    assert lay.anchor_index.tolist() == [6, 8] and lay.split == 6
    with pytest.raises(LayoutError, match="mask=causal"):
        LayoutOptions(chain=True)


def test_literal_round_robin():
    lay = small(order="round_robin")
    assert lay.input_ids.tolist() == [10, FEATURE_ID, FEATURE_ID, 11, G, G, G, G, 20, 30, EOS, 31]
    assert lay.labels.tolist() == [IGNORE, IGNORE, IGNORE, G, G, S, 20, 30, EOS, 31, EOS, EOS]
    assert lay.position.tolist() == [0, 1, 2, 3, 4, 5, 6, 6, 7, 7, 8, 8]
    assert lay.event.tolist() == [-1] * 6 + [0, 1, 0, 1, 0, 1]
    shared = [[1] * (r + 1) + [0] * (5 - r) for r in range(6)]
    expect = [row + [0] * 6 for row in shared] + [
        [1] * 6 + [1, 0, 0, 0, 0, 0],
        [1] * 6 + [0, 1, 0, 0, 0, 0],
        [1] * 6 + [1, 0, 1, 0, 0, 0],
        [1] * 6 + [0, 1, 0, 1, 0, 0],
        [1] * 6 + [1, 0, 1, 0, 1, 0],
        [1] * 6 + [0, 1, 0, 1, 0, 1],
    ]
    assert vis(lay) == expect
    # causal + round robin: plain lower-triangular in step-major order, branches unpadded
    causal = small(mask="causal", order="round_robin")
    assert causal.input_ids.tolist() == [10, FEATURE_ID, FEATURE_ID, 11, G, G, G, G, 20, 30, 31]
    assert vis(causal) == torch.tril(torch.ones(11, 11, dtype=torch.int32)).tolist()


def test_eos_padding_loss_off_ignores_padding_only():
    lay = small(pad_loss=False)
    # branch 1 = [20, eos] padded to [20, eos, eos]: the padded eos label (last of b1) is ignored
    assert lay.labels.tolist() == [IGNORE, IGNORE, IGNORE, G, G, S, 20, 30, EOS, IGNORE, 31, EOS]


def test_av_bidirectional_block():
    opts = LayoutOptions(av_bidirectional=True)
    lay = dense_layout([10, 12], [11], 2, 2, 1, [[20]], g_id=G, s_id=S, eos_id=EOS, options=opts)
    av = torch.nonzero((lay.role == Role.VISUAL) | (lay.role == Role.AUDIO)).flatten()
    assert av.tolist() == list(range(2, 8))
    m = lay.mask[0, 0] == 0
    assert m[av[:, None], av[None, :]].all()  # AV block fully bidirectional
    assert not m[0, 2] and not m[1, av].any()  # preamble does not see the AV block
    assert m[av, 1].all()  # AV block sees the preamble
    assert lay.segment[av].tolist() == [0, 0, 0, 1, 1, 1]
    assert lay.slot[av].tolist() == [0, 1, 0, 2, 3, 1]
    assert lay.visual_index.tolist() == [[2, 3], [5, 6]] and lay.audio_index.tolist() == [[4], [7]]


def test_positions_functions_and_order_keys():
    assert anchor_position(prefix_len=100, num_events=3) == 103
    assert branch_position(103, 0) == 103 and branch_position(103, 5) == 108
    # after an M-RoPE prompt (the release model) every position is shifted by its rope delta
    assert shared_position(100, delta=16) == 116 and anchor_position(100, 3, delta=-36) == 67
    for order in ("blocked", "round_robin"):
        lay = dense_layout([1, 2], [3, 4], 3, 2, 2, [[7, 7, 7], [8], [9, 9]], g_id=G, s_id=S, eos_id=EOS,
                           options=LayoutOptions(branch_order=order))
        assert (lay.order[1:] > lay.order[:-1]).all()
        ev = lay.role >= Role.ANCHOR
        recomputed = event_order(lay.event[ev], lay.step[ev], lay.split, lay.num_events, order)
        assert torch.equal(recomputed, lay.order[ev])
        a = anchor_position(lay.prefix_len, lay.num_events)
        assert torch.equal(lay.position[ev], branch_position(a, lay.step[ev]))


def test_mask_between_arbitrary_sets_matches_full_mask():
    lay = small(av=True)
    q = torch.tensor([11, 8, 3, 7])
    k = torch.tensor([0, 2, 1, 6, 9, 10, 7])
    sub = mask_between(lay.meta(q), lay.meta(k), LayoutOptions(av_bidirectional=True))
    assert torch.equal(sub, (lay.mask[0, 0] == 0)[q][:, k])
    # additive form
    add = additive_mask(sub, torch.bfloat16)
    assert add.dtype == torch.bfloat16 and torch.equal(add == 0, sub)


def test_k0_and_plain_and_prefix_layouts():
    k0 = dense_layout([1], [2, 3], 1, 1, 0, [], g_id=G, s_id=S, eos_id=EOS)
    assert k0.labels.tolist() == [IGNORE, IGNORE, IGNORE, S] and k0.split == len(k0) == 4
    plain = plain_layout([1], [2], 1, 1, 1, [40, 41], eos_id=EOS, options=LayoutOptions(av_bidirectional=False))
    assert plain.labels.tolist() == [IGNORE, IGNORE, IGNORE, 40, 41, EOS]
    assert plain.input_ids.tolist() == [1, FEATURE_ID, FEATURE_ID, 2, 40, 41]
    assert vis(plain) == torch.tril(torch.ones(6, 6, dtype=torch.int32)).tolist()
    pre = prefix_layout([1], [2], 2, 1, 1)
    assert (pre.labels == IGNORE).all() and pre.kind == "prefix" and len(pre) == 6


def test_bad_inputs_raise():
    with pytest.raises(LayoutError):
        dense_layout([1], [], 1, 1, 1, [[3]], g_id=G, s_id=S, eos_id=EOS)
    with pytest.raises(LayoutError):
        dense_layout([1], [2], 0, 1, 1, [[3]], g_id=G, s_id=S, eos_id=EOS)
    with pytest.raises(LayoutError):
        pack([])


def test_pack_mixed_batch_keeps_each_mask():
    dense = small()
    plain = plain_layout([1], [2], 2, 1, 1, [40, 41, 42], eos_id=EOS, options=LayoutOptions(av_bidirectional=False))
    batch = pack([dense, plain])
    assert batch.split == max(dense.split, plain.split) == 9
    total = batch.split + (len(dense) - dense.split)
    assert batch.input_ids.shape == (2, total) and batch.mask.shape == (2, 1, total, total)
    for b, lay in enumerate([dense, plain]):
        col = batch.columns[b]
        assert torch.equal(batch.mask[b, 0][col[:, None], col[None, :]], lay.mask[0, 0])
        assert torch.equal(batch.labels[b, col], lay.labels) and torch.equal(batch.position[b, col], lay.position)
        pad = torch.ones(total, dtype=torch.bool)
        pad[col] = False
        assert (batch.role[b, pad] == Role.PAD).all() and (batch.labels[b, pad] == IGNORE).all()
        # no real row sees a PAD column; PAD rows see only themselves
        m = batch.mask[b, 0] == 0
        assert not m[col][:, pad].any()
        assert torch.equal(m[pad][:, pad], torch.eye(int(pad.sum()), dtype=torch.bool))
    # the dense sample's anchors/branches sit after the common split, its prefix at the start
    assert batch.columns[0].tolist() == [0, 1, 2, 3, 4, 5, 9, 10, 11, 12, 13, 14]
    # the factorized mask survives in the mixed batch (the public release's defect)
    assert not (batch.mask[0, 0, 13, 9] == 0)  # branch 2 step 1 does not see anchor 1
    assert torch.equal(TokenMeta(batch.order[0], batch.role[0], batch.event[0]).event[batch.columns[0]], dense.event)
