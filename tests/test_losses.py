"""Losses: components, EOS-padding switch, plain-only batches, and overfitting one synthetic sample."""

from __future__ import annotations

import math

import torch

from pipeline.examples import collate
from pipeline.model import PadCaptioner
from tests.support.padcap import sample, tiny_cfg
from train.losses import compute_losses


def test_components_are_finite_and_total_is_their_sum():
    m = PadCaptioner(tiny_cfg())
    batch = collate([m.make_example(sample(), generator=torch.Generator().manual_seed(0))])
    out = m.forward_train(batch)
    loss = compute_losses(out, m.cfg)
    c = loss.components
    assert all(math.isfinite(v) for v in c.values())
    assert math.isclose(c["total"], c["lm"] + c["branch_lm"] + 5.0 * c["grounding"], rel_tol=1e-5)
    assert c["lm_tokens"] == 3  # <G>, <G>, <S> for K = 2
    # untrained: about log(vocab) per token
    assert abs(c["lm"] - math.log(len(m.tokenizer))) < 1.0
    assert "branch_eos_pad_lm" in c  # the two captions differ in length: one branch is padded
    m.cfg.branch_loss_weight = 3.0
    c3 = compute_losses(out, m.cfg).components
    assert math.isclose(c3["total"], c["lm"] + 3.0 * c["branch_lm"] + 5.0 * c["grounding"], rel_tol=1e-5)


def test_eos_padding_loss_switch_changes_only_padding_rows():
    on = PadCaptioner(tiny_cfg(eos_padding_loss=True))
    off = PadCaptioner(tiny_cfg(eos_padding_loss=False))
    smp = sample()
    out_on = on.forward_train(collate([on.make_example(smp)]))
    out_off = off.forward_train(collate([off.make_example(smp)]))
    n_pad = int(out_on["branch_pad"].sum())
    assert n_pad > 0 and out_off["branch_pad"].sum() == 0
    assert out_on["branch_labels"].numel() == out_off["branch_labels"].numel() + n_pad
    assert (out_on["branch_labels"][out_on["branch_pad"]] == on.eos_id).all()


def test_plain_only_batch_has_zero_grounding_and_branch_loss():
    m = PadCaptioner(tiny_cfg())
    ex = m.make_example(sample(), response="A plain answer about the video.")
    loss = compute_losses(m.forward_train(collate([ex])), m.cfg)
    assert loss.components["grounding"] == 0 and loss.components["branch_lm"] == 0
    assert loss.components["lm"] > 0
    loss.total.backward()  # still differentiable


def test_overfit_one_sample_then_ground_it():
    """~50 AdamW steps on one sample: every loss falls and the readout finds the true intervals.

    A random-init backbone has tiny logit ranges through its frozen tied embeddings, so the
    LM part can only be learnt with `train_backbone_embeddings` (a real checkpoint does not
    need it). With 1-second segments a neighbour of an event gets the soft target
    0.5 ** 0.5 = 0.71, so the readout threshold is set above it to recover the exact bounds.
    """
    torch.manual_seed(0)
    m = PadCaptioner(tiny_cfg(train_backbone_embeddings=True, grounding_threshold=0.8)).train()
    smp = sample(intervals=((2.0, 5.0), (7.0, 10.0)))
    opt = torch.optim.AdamW(m.trainable_parameters().values(), lr=3e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    history = []
    for _ in range(50):
        loss = compute_losses(m.forward_train(collate([m.make_example(smp, generator=gen)])), m.cfg)
        opt.zero_grad()
        loss.total.backward()
        opt.step()
        history.append(loss.components)
    first, last = history[0], history[-1]
    assert all(math.isfinite(v) for h in history for v in h.values())
    assert last["lm"] < 0.3 * first["lm"]
    assert last["branch_lm"] < 0.3 * first["branch_lm"]
    assert last["grounding"] < 0.7 * first["grounding"]
    m.eval()
    with torch.no_grad():
        ex = m.make_example(smp)
        out = m.forward_train(collate([ex]))
    assert m.ground(out["grounding_logits"][0], ex.segment_times) == [(2.0, 5.0), (7.0, 10.0)]


def test_attribute_token_weight_counts_attribute_rows_w_times():
    import pytest

    from pipeline.config import Config
    from train.losses import attribute_ids

    cfg = Config()
    m = PadCaptioner(tiny_cfg())
    assert attribute_ids(m, cfg) is None  # weight 1: off, the paper's loss
    cfg.model.attribute_token_weight = 3.0
    ids = attribute_ids(m, cfg)
    words = {m.tokenizer.decode([i]) for i in ids.tolist()}
    assert {" red", " circle", " beep", " silence"} <= words and not {" the", "Visual", " Audio"} & words
    smp = sample(captions=("Visual: the red circle moves up. Audio: a low beep.",
                           "Visual: the blue square grows. Audio: silence."))
    out = m.forward_train(collate([m.make_example(smp, generator=torch.Generator().manual_seed(0))]))
    c = compute_losses(out, m.cfg, ids, 3.0).components
    ce = torch.nn.functional.cross_entropy(out["branch_logits"].float(), out["branch_labels"], reduction="none")
    on = torch.isin(out["branch_labels"], ids)
    assert 0 < int(on.sum()) < on.numel()
    assert math.isclose(c["branch_lm"], float(ce.mean()), rel_tol=1e-5)  # logged unweighted
    assert math.isclose(c["branch_lm_weighted"], float((ce.sum() + 2.0 * ce[on].sum()) / ce.numel()), rel_tol=1e-5)
    assert math.isclose(c["total"], c["lm"] + c["branch_lm_weighted"] + 5.0 * c["grounding"], rel_tol=1e-5)
    with pytest.raises(ValueError, match="no attribute ids"):
        compute_losses(out, m.cfg, attribute_weight=3.0)
    cfg.data.dataset = "longvale"
    with pytest.raises(ValueError, match="synthetic"):
        attribute_ids(m, cfg)
    cfg.data.dataset, cfg.model.attribute_token_weight = "synthetic", 0.0
    with pytest.raises(ValueError, match="> 0"):
        attribute_ids(m, cfg)


def test_the_train_stage_refuses_the_attribute_weight_on_other_data_before_it_starts(tmp_path):
    """The config error comes before the stage reads its shards or starts Ray (no manifest here)."""
    import pytest

    from pipeline.config import Config
    from train.trainer import run_train

    cfg = Config()
    cfg.data.dataset, cfg.model.attribute_token_weight = "longvale", 3.0
    with pytest.raises(ValueError, match="attribute_token_weight=1 for other data"):
        run_train(cfg, str(tmp_path / "no-shards"), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_the_train_loop_refuses_the_attribute_weight_on_captions_the_grammar_does_not_spell():
    """Shards of other data under the synthetic config: the loop's held-out captions give it away before
    the model is built (no context or data needed to get there)."""
    import pytest

    from pipeline.config import Config
    from train.loop import train_loop

    cfg = Config()
    cfg.model.attribute_token_weight = 3.0
    other = sample(captions=("Visual: the red circle moves up. Audio: a low beep.", "A man opens a door."))
    with pytest.raises(ValueError, match="'A man opens a door.'; set model.attribute_token_weight=1"):
        train_loop(cfg, None, None, [other], visual_dim=8, audio_dim=8)
