"""The anchor guide (pipeline/anchor_attention.py): its mass is the layer's own attention, its
loss is a hinge that stops at the target, and it trains the route it is meant to."""

from __future__ import annotations

import math

import torch

from pipeline.anchor_attention import anchor_guide_loss, branch_anchor_pairs
from pipeline.model import PadCaptioner
from tests.support.padcap import randomize, sample, tiny_cfg
from train.data import Batcher
from train.losses import compute_losses


def guided_model(**over) -> PadCaptioner:
    m = PadCaptioner(tiny_cfg(anchor_guide_weight=1.0, attn_implementation="eager", **over))
    randomize(m)  # LoRA B != 0, so the mass goes through the adapters too
    return m


def eager_mass(m: PadCaptioner, batch, layer: int) -> torch.Tensor:
    """The same masses read from HF's own attention maps (full sequence, eager)."""
    pk = batch.packed
    seen = []
    run = m.run_decoder

    def record(embeds, *args, **kwargs):
        seen.append(embeds)
        return run(embeds, *args, **kwargs)

    m.run_decoder = record
    try:
        m.forward_train(batch)
    finally:
        del m.run_decoder
    res = m.decoder(inputs_embeds=torch.cat(seen, 1), attention_mask=m.additive(pk.mask),
                    position_ids=m.position_ids(pk), output_attentions=True)
    rows, anchors = branch_anchor_pairs(pk, [ex.layout for ex in batch.examples], pk.split)
    att = res.attentions[layer]  # [B, H, L, L]
    return att[rows[:, 0], :, rows[:, 1], anchors].mean(-1)


def test_mass_equals_the_layers_own_attention_at_every_layer():
    samples = [sample(seed=0), sample(num_segments=10, intervals=((1.0, 3.0), (4.0, 6.0), (7.0, 9.0)), seed=1)]
    for layer in (0, 1):
        m = guided_model().eval()
        m.anchor_guide_layer = layer  # the guide reads layer 0; the mass is the same read at any layer
        batch = next(Batcher(m, 2)(samples))
        with torch.no_grad():
            out = m.forward_train(batch)
            want = eager_mass(m, batch, layer)
        assert out["anchor_mass"].shape == want.shape and want.numel() > 10
        torch.testing.assert_close(out["anchor_mass"], want.float(), atol=1e-6, rtol=1e-5)


def test_guide_is_a_hinge_in_log_mass():
    mass = torch.tensor([0.01, 0.25, 0.5])
    assert math.isclose(float(anchor_guide_loss(mass, 0.25)), math.log(0.25 / 0.01) / 3, rel_tol=1e-6)
    assert float(anchor_guide_loss(torch.tensor([0.3, 0.9]), 0.25)) == 0.0
    assert float(anchor_guide_loss(torch.zeros(0), 0.25)) == 0.0


def test_guide_enters_the_total_and_raises_the_mass_when_trained():
    torch.manual_seed(0)
    m = guided_model()
    batch = next(Batcher(m, 2)([sample(seed=0), sample(seed=1)]))
    cfg = m.cfg
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=3e-3)
    first = None
    for _ in range(30):
        losses = compute_losses(m.forward_train(batch), cfg)
        unguided = sum(losses.components[k] * w for k, w in
                       (("lm", 1.0), ("branch_lm", cfg.branch_loss_weight), ("grounding", cfg.grounding_loss_weight)))
        assert math.isclose(losses.components["total"],
                            unguided + cfg.anchor_guide_weight * losses.components["anchor_guide"], rel_tol=1e-5)
        first = first if first is not None else losses.components["anchor_mass"]
        opt.zero_grad()
        losses.total.backward()
        opt.step()
    assert losses.components["anchor_mass"] > 3 * first


def test_off_by_default_adds_nothing():
    m = PadCaptioner(tiny_cfg())
    out = m.forward_train(next(Batcher(m, 1)([sample(seed=0)])))
    assert "anchor_mass" not in out and "anchor_guide" not in compute_losses(out, m.cfg).components
