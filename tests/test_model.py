"""PadCaptioner on a tiny random-init Qwen2 (fp32, CPU): masks really used, branch isolation,
K=1 == plain causal LM, mixed batches, trainable set, aggregation, save/load round trip."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pipeline.backbone import BackboneError, position_adapter, preset_config
from pipeline.examples import collate
from pipeline.layout import IGNORE, Role, mask_between
from pipeline.model import NEW_TOKEN_NOISE, PadCaptioner
from tests.support.padcap import sample, tiny_cfg
from train.losses import compute_losses

ATOL = 1e-5


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = PadCaptioner(tiny_cfg(av_bidirectional=False))
    randomize_lora(m)
    return m.eval()


def randomize_lora(m, std=0.05):
    """LoRA B starts at 0 (a no-op adapter); make the adapters do something."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * std)


def full_hidden(m, batch):
    """Oracle: ONE forward over all columns (anchors with their aggregated features) with the packed mask."""
    pk, exs = batch.packed, batch.examples
    s = pk.split
    pos = m.position_ids(pk)
    out1 = m.run_decoder(m.embed(pk, exs, slice(0, s)), pk.mask[:, :, :s, :s], pos[:, :s], output_hidden_states=True)
    h_agg = out1.hidden_states[m.aggregation_layer]
    emb = m.embed(pk, exs)
    for b, ex in enumerate(exs):
        lay = ex.layout
        if lay.num_events:
            keys = pk.mask[b, 0, lay.instruction_end, :s] == 0
            feats, _ = m.anchor_features(h_agg[b], lay, ex.segment_times, ex.agg_intervals, pos[b, :s], keys)
            emb[b, s : s + lay.num_events] += feats
    return emb, m.run_decoder(emb, pk.mask, pos).last_hidden_state


def logits_at(m, hidden, rows):
    return m.lm_logits(hidden[rows])


@torch.no_grad()
def test_custom_4d_mask_is_really_used():
    """Hiding key k from query q must equal deleting k (same positions); for sdpa and eager."""
    for impl in ("sdpa", "eager"):
        m = PadCaptioner(tiny_cfg(attn_implementation=impl, av_bidirectional=False)).eval()
        ex = m.make_example(sample(num_segments=3))
        emb = m.embed(collate([ex]).packed, [ex])[:, :20]
        n = emb.shape[1]
        pos = torch.arange(n)[None]
        causal = torch.tril(torch.ones(n, n, dtype=torch.bool))
        as_mask = lambda v: torch.where(v, 0.0, torch.finfo(torch.float32).min)[None, None]
        plain = m.decoder(inputs_embeds=emb, attention_mask=torch.ones(1, n, dtype=torch.long)).last_hidden_state
        ours = m.run_decoder(emb, as_mask(causal), pos).last_hidden_state
        assert torch.allclose(plain, ours, atol=ATOL)
        hide = causal.clone()
        hide[:, 5] = False  # nobody but itself sees token 5
        hide[5, 5] = True
        hidden = m.run_decoder(emb, as_mask(hide), pos).last_hidden_state
        keep = torch.tensor([i for i in range(n) if i != 5])
        removed = m.run_decoder(emb[:, keep], as_mask(causal[keep][:, keep]), pos[:, keep]).last_hidden_state
        assert torch.allclose(hidden[:, keep], removed, atol=ATOL)
        assert (hidden[0, 6:] - ours[0, 6:]).abs().max() > 1e-3  # and it did change the later rows


@torch.no_grad()
def test_two_stage_forward_equals_one_packed_forward(model):
    ex = model.make_example(sample(intervals=((1, 3), (4, 8), (9, 11))))
    batch = collate([ex])
    out = model.forward_train(batch)
    _, h = full_hidden(model, batch)
    s = batch.packed.split
    rows = batch.packed.labels[:, s:] != IGNORE
    assert torch.allclose(out["branch_logits"], model.lm_logits(h[:, s:][rows]), atol=ATOL)
    rows1 = batch.packed.labels[:, :s] != IGNORE
    assert torch.allclose(out["text_logits"], model.lm_logits(h[:, :s][rows1]), atol=ATOL)


@pytest.mark.parametrize("order", ["blocked", "round_robin"])
@torch.no_grad()
def test_branch_isolation_exact(order):
    m = PadCaptioner(tiny_cfg(av_bidirectional=False, branch_order=order))
    randomize_lora(m)
    m.eval()
    smp = sample(intervals=((1, 3), (4, 8), (9, 11)))
    ex = m.make_example(smp)
    batch = collate([ex])
    lay = ex.layout
    emb, h = full_hidden(m, batch)
    s, k = lay.split, lay.num_events
    for i in range(k):
        own = torch.nonzero(lay.event == i).flatten()  # anchor i then its branch tokens (layout order)
        idx = torch.cat([torch.arange(s), own])
        # the separate sequence [prefix, serial G's, anchor i, branch i] has contiguous positions: plain causal LM
        assert torch.equal(lay.position[idx], torch.arange(idx.numel()))
        sep = m.decoder(inputs_embeds=emb[:, idx], attention_mask=torch.ones(1, idx.numel(), dtype=torch.long)).last_hidden_state
        packed_rows = m.lm_logits(h[0, idx[s:]])
        assert torch.allclose(packed_rows, m.lm_logits(sep[0, s:]), atol=ATOL), f"branch {i}"
    # changing the caption of branch 2 leaves branches 0 and 1 unchanged, exactly
    other = sample(intervals=((1, 3), (4, 8), (9, 11)))
    other.events[2].caption = "Visual: a yellow stripes shrinks. Audio: white noise. And more words here."
    out_a = m.forward_train(batch)
    ex_b = m.make_example(other)
    out_b = m.forward_train(collate([ex_b]))
    lab_a = lay.labels[lay.split :]
    ev_a = lay.event[lay.split :][lab_a != IGNORE]
    ev_b = ex_b.layout.event[ex_b.layout.split :][ex_b.layout.labels[ex_b.layout.split :] != IGNORE]
    for i in (0, 1):
        la, lb = out_a["branch_logits"][ev_a == i], out_b["branch_logits"][ev_b == i]
        n = min(len(la), len(lb))  # the padding length may differ; the common steps must agree
        assert n > 0 and torch.allclose(la[:n], lb[:n], atol=1e-6)
    la, lb = out_a["branch_logits"][ev_a == 2], out_b["branch_logits"][ev_b == 2]
    n = min(len(la), len(lb))
    assert not torch.allclose(la[:n], lb[:n], atol=1e-3)  # branch 2 itself did change


@torch.no_grad()
def test_branch_isolation_with_av_bidirectional():
    m = PadCaptioner(tiny_cfg(av_bidirectional=True))
    randomize_lora(m)
    m.eval()
    ex = m.make_example(sample(intervals=((1, 3), (4, 8))))
    batch = collate([ex])
    lay = ex.layout
    emb, h = full_hidden(m, batch)
    for i in range(2):
        idx = torch.cat([torch.arange(lay.split), torch.nonzero(lay.event == i).flatten()])
        sub = mask_between(lay.meta(idx), lay.meta(idx), m.options)
        sep = m.run_decoder(emb[:, idx], torch.where(sub, 0.0, -1e30)[None, None], lay.position[idx][None]).last_hidden_state
        assert torch.allclose(h[0, idx], sep[0], atol=ATOL)


@torch.no_grad()
def test_k1_equals_plain_causal_lm(model):
    ex = model.make_example(sample(intervals=((2, 6),)))
    batch = collate([ex])
    out = model.forward_train(batch)
    emb, _ = full_hidden(model, batch)
    ones = torch.ones(emb.shape[:2], dtype=torch.long)
    hf = model.backbone.get_base_model()(inputs_embeds=emb, attention_mask=ones, output_hidden_states=True)
    ours = torch.cat([out["text_logits"], out["branch_logits"]])
    rows = ex.layout.labels != IGNORE  # stage 1 then stage 2: the layout order for one sample
    # HF's own LM head has no <G>/<S> columns of ours: compare every other column directly ...
    old = torch.ones(ours.shape[-1], dtype=torch.bool)
    old[model.new_ids] = False
    assert torch.allclose(ours[:, old], hf.logits[0][rows][:, old], atol=ATOL)
    # ... and all columns through our head on HF's hidden states
    assert torch.allclose(ours, model.lm_logits(hf.hidden_states[-1][0][rows]), atol=ATOL)


@torch.no_grad()
def test_mixed_batch_each_sample_gets_its_own_mask(model):
    dense = model.make_example(sample(intervals=((1, 3), (5, 9)), seed=1))
    plain = model.make_example(sample(num_segments=9, seed=2, video_id="p"), response="A plain summary of the whole video.")
    both = model.forward_train(collate([dense, plain]))
    alone_d = model.forward_train(collate([dense]))
    alone_p = model.forward_train(collate([plain]))
    n_d = int((dense.layout.labels[: dense.layout.split] != IGNORE).sum())
    assert torch.allclose(both["text_logits"][:n_d], alone_d["text_logits"], atol=ATOL)
    assert torch.allclose(both["text_logits"][n_d:], alone_p["text_logits"], atol=ATOL)
    assert torch.allclose(both["branch_logits"], alone_d["branch_logits"], atol=ATOL)
    assert torch.allclose(both["grounding_logits"][0], alone_d["grounding_logits"][0], atol=ATOL)
    pk = collate([dense, plain]).packed
    assert (pk.mask[0, 0] == 0).sum() < torch.tril(torch.ones(len(dense.layout), len(dense.layout))).sum()


def test_gradients_reach_exactly_the_trainable_parameters():
    for mode in ("attention", "scoring_head"):
        m = PadCaptioner(tiny_cfg(aggregation=mode))
        randomize_lora(m)
        m.train()
        trainable = m.trainable_parameters()
        names = set(trainable)
        assert all(("lora_" in n) or not n.startswith("backbone.") for n in names)
        assert {"new_embed", "visual_proj.net.0.weight", "audio_proj.net.2.weight", "modality_embed.weight",
                "time_embed.weight", "event_head.net.1.weight", "segment_head.net.3.weight"} <= names
        assert any("lora_A" in n for n in names) and any("lora_B" in n for n in names)
        assert ("aggregator.scorer.net.1.weight" in names) == (mode == "scoring_head")
        batch = collate([m.make_example(sample(), generator=torch.Generator().manual_seed(0))])
        loss = compute_losses(m.forward_train(batch), m.cfg).total
        loss.backward()
        shift_invariant = {"aggregator.scorer.net.3.bias"}  # adds one constant to every score of a softmax: grad 0
        for n, p in m.named_parameters():
            if p.requires_grad:
                assert p.grad is not None and (n in shift_invariant or p.grad.abs().sum() > 0), n
            else:
                assert p.grad is None, n
        emb = m.decoder.embed_tokens.weight
        before = emb.detach().clone()
        new_before = m.new_embed.detach().clone()
        opt = torch.optim.AdamW(trainable.values(), lr=1e-2, weight_decay=0.1)
        opt.step()
        assert torch.equal(emb, before)  # old rows: no grad, no update, no weight decay
        assert not torch.equal(m.new_embed, new_before)  # <G>/<S> rows train


@torch.no_grad()
def test_attention_row_equals_hf_eager_attention():
    m = PadCaptioner(tiny_cfg(attn_implementation="eager", av_bidirectional=True))
    randomize_lora(m)
    m.eval()
    ex = m.make_example(sample(intervals=((2, 5),)))
    pk = collate([ex]).packed
    s = pk.split
    pos = m.position_ids(pk)[:, :s]
    out = m.decoder(inputs_embeds=m.embed(pk, [ex], slice(0, s)), attention_mask=m.additive(pk.mask[:, :, :s, :s]),
                    position_ids=pos, output_attentions=True, output_hidden_states=True)
    q = ex.layout.instruction_end
    layer = m.aggregation_layer
    want = out.attentions[layer][0, :, q, :].mean(0)
    from pipeline.aggregation import attention_row

    got = attention_row(m.decoder, layer, m.adapter, out.hidden_states[layer][0], pos[0], q, pk.mask[0, 0, q, :s] == 0)
    assert torch.allclose(got, want, atol=1e-6)
    assert abs(float(got.sum()) - 1) < 1e-5 and (got[q + 1 :] == 0).all()


@pytest.mark.parametrize("mode", ["none", "mean", "scoring_head", "attention"])
@torch.no_grad()
def test_aggregation_modes_run_and_weights_normalise(mode):
    m = PadCaptioner(tiny_cfg(aggregation=mode))
    ex = m.make_example(sample(intervals=((2, 5), (7, 10))), generator=torch.Generator().manual_seed(3))
    out = m.forward_train(collate([ex]))
    assert torch.isfinite(out["branch_logits"]).all()
    weights = out["aggregation_weights"][0]
    if mode == "none":
        assert weights == {}
        return
    from pipeline.aggregation import interval_mask

    inside = interval_mask(ex.agg_intervals, ex.segment_times)
    for name, per in (("visual", 2), ("audio", 2)):
        w = weights[name]  # [K, T * per]
        tok_inside = inside.repeat_interleave(per, dim=1)
        assert torch.allclose(w.sum(1), torch.ones(2), atol=1e-5)
        assert (w[~tok_inside] == 0).all() and (w >= 0).all()


def test_no_audio_track_drops_audio_slots(model):
    ex = model.make_example(sample(has_audio=False))
    assert ex.layout.audio_per_segment == 0 and not (ex.layout.role == Role.AUDIO).any()
    out = model.forward_train(collate([ex]))
    assert torch.isfinite(out["grounding_logits"][0]).all()


def test_activation_checkpointing_path_matches():
    m = PadCaptioner(tiny_cfg())
    randomize_lora(m)
    batch = collate([m.make_example(sample())])
    m.train()
    ref = m.forward_train(batch)["branch_logits"]
    m.enable_activation_checkpointing()
    assert all(layer.gradient_checkpointing for layer in m.decoder.layers)
    ck = m.forward_train(batch)
    assert torch.allclose(ck["branch_logits"], ref, atol=ATOL)
    compute_losses(ck, m.cfg).total.backward()
    assert all(p.grad is not None for p in m.trainable_parameters().values())


@torch.no_grad()
def test_save_load_round_trip(tmp_path):
    m = PadCaptioner(tiny_cfg(aggregation="scoring_head"))
    g = torch.Generator().manual_seed(5)
    for p in m.trainable_parameters().values():
        p.add_(torch.randn(p.shape, generator=g) * 0.05)
    m.eval()
    batch = collate([m.make_example(sample())])
    ref = m.forward_train(batch)
    m.save_pretrained(tmp_path / "ck")
    m2 = PadCaptioner.from_pretrained(tmp_path / "ck").eval()
    assert (m2.g_id, m2.s_id, m2.eos_id) == (m.g_id, m.s_id, m.eos_id)
    assert m2.tokenizer.encode("<G><S>", add_special_tokens=False) == [m.g_id, m.s_id]
    assert m2.tokenizer.get_vocab() == m.tokenizer.get_vocab() and m2.prompt == m.prompt
    assert m2.cfg == m.cfg and m2.base_ref == {"kind": "preset", "name": "tiny", "seed": 0}
    out = m2.forward_train(collate([m2.make_example(sample())]))
    for key in ("text_logits", "branch_logits"):
        assert torch.equal(out[key], ref[key]), key
    assert torch.equal(out["grounding_logits"][0], ref["grounding_logits"][0])
    fresh = PadCaptioner(tiny_cfg(aggregation="scoring_head")).eval()
    assert not torch.allclose(fresh.forward_train(batch)["branch_logits"], ref["branch_logits"])


def test_presets_have_the_real_qwen_shapes():
    counts = {}
    for name in ("qwen2.5-0.5b", "qwen2.5-3b"):
        cfg = preset_config(name, vocab_size=151667)
        with torch.device("meta"):
            lm = AutoModelForCausalLM.from_config(cfg)
        counts[name] = sum(p.numel() for p in lm.parameters())
        assert cfg.vocab_size == 151936 and cfg.tie_word_embeddings
    assert counts == {"qwen2.5-0.5b": 494_032_768, "qwen2.5-3b": 3_085_938_688}
    assert preset_config("tiny", 1026).num_key_value_heads == 2


def test_unsupported_backbone_is_a_clear_error(tmp_path):
    class Cfg:
        model_type = "gemma"

    class VL:
        model_type = "qwen2_5_vl"

    with pytest.raises(BackboneError, match="no position adapter for model_type 'gemma'"):
        position_adapter(Cfg())
    assert position_adapter(VL()).kind == "mrope"  # the release LLM's M-RoPE
    with pytest.raises(BackboneError, match="neither a preset"):
        PadCaptioner(tiny_cfg(backbone=str(tmp_path / "missing")))


@torch.no_grad()
def test_local_backbone_directory_round_trip(tmp_path):
    """A local HF directory (config + weights + tokenizer files) is the real loading path."""
    from pipeline.tokens import bpe_tokenizer

    tok = bpe_tokenizer()
    src = tmp_path / "qwen-local"
    lm = AutoModelForCausalLM.from_config(preset_config("tiny", len(tok) + 2))
    lm.save_pretrained(str(src))
    tok.save_pretrained(str(src))
    cfg = tiny_cfg(backbone=str(src), tokenizer="auto")
    m = PadCaptioner(cfg).eval()
    assert m.base_ref == {"kind": "path", "path": str(src.resolve())}
    assert torch.equal(m.decoder.embed_tokens.weight, lm.model.embed_tokens.weight)
    randomize_lora(m)
    batch = collate([m.make_example(sample())])
    ref = m.forward_train(batch)["branch_logits"]
    m.save_pretrained(tmp_path / "ck")
    m2 = PadCaptioner.from_pretrained(tmp_path / "ck").eval()
    assert torch.equal(m2.forward_train(batch)["branch_logits"], ref)


@torch.no_grad()
def test_decoding_pieces_agree_with_training(model):
    """The engine's path (prefix layout -> embed -> decoder -> anchor_embeddings) gives the
    same prefix states and the same anchors as the training forward."""
    smp = sample(intervals=((2, 5), (7, 10)))
    train_ex = model.make_example(smp)
    pre = model.make_example(smp, with_targets=False)
    lay = pre.layout
    assert lay.kind == "prefix" and len(lay) == train_ex.layout.prefix_len
    pk = collate([pre]).packed
    emb = model.embed(pk, [pre])
    pos = model.position_ids(pk)
    out = model.run_decoder(emb, pk.mask, pos, output_hidden_states=True)
    h_in = out.hidden_states[model.aggregation_layer][0]
    keys = pk.mask[0, 0, lay.instruction_end] == 0
    anchors = model.anchor_embeddings(h_in, lay, pre.segment_times, train_ex.intervals, pos[0], keys)
    tb = collate([train_ex])
    emb_train, _ = full_hidden(model, tb)
    s = train_ex.layout.split
    assert torch.allclose(anchors, emb_train[0, s : s + 2], atol=ATOL)
    # the planning step: the last prefix token's logits equal the training row that predicts <G>_1
    first = model.lm_logits(out.last_hidden_state[0, -1:])
    assert torch.allclose(first, model.forward_train(tb)["text_logits"][:1], atol=ATOL)
    assert model.g_id != model.s_id and len(model.decoder.layers) == 4


def test_dtype_follows_the_weights_not_the_config():
    # DeepSpeed bf16 casts the module of a float32-config model; the mask must be built in bf16 then.
    m = PadCaptioner(tiny_cfg())
    assert m.cfg.dtype == "float32" and m.dtype == torch.float32
    m.to(torch.bfloat16)
    assert m.dtype == torch.bfloat16
    mask = torch.tensor([[0.0, 1.0]])
    additive = m.additive(mask)
    assert additive.dtype == torch.bfloat16 and additive[0, 1] == torch.finfo(torch.bfloat16).min


@torch.no_grad()
def test_new_rows_start_at_the_mean_row_plus_noise():
    """The <G>/<S> rows: the mean embedding row + noise of NEW_TOKEN_NOISE (0.1) embedding stds."""
    raw = PadCaptioner(tiny_cfg())
    spread = lambda m: float((m.new_embed - m.decoder.embed_tokens.weight.mean(0)).std())  # noqa: E731
    std = float(raw.decoder.embed_tokens.weight.std())
    assert NEW_TOKEN_NOISE == 0.1 and spread(raw) == pytest.approx(0.1 * std, rel=0.3)


def test_preset_init_std():
    assert preset_config("tiny", 100).initializer_range == 0.02
    m = PadCaptioner(tiny_cfg())  # model.backbone_init_std was removed: presets use HF's 0.02
    w = m.decoder.layers[0].self_attn.q_proj.base_layer.weight
    assert float(w.std()) == pytest.approx(0.02, rel=0.1)


def test_attention_init_std_scales_queries_and_keys_only():
    """model.attention_init_std: the same seeded backbone with its q/k projections (only) rescaled."""
    base = PadCaptioner(tiny_cfg()).decoder.layers[1].self_attn
    sharp = PadCaptioner(tiny_cfg(attention_init_std=0.1)).decoder.layers[1].self_attn
    for name in ("q_proj", "k_proj"):
        torch.testing.assert_close(getattr(sharp, name).base_layer.weight, 5 * getattr(base, name).base_layer.weight)
    for name in ("v_proj", "o_proj"):
        torch.testing.assert_close(getattr(sharp, name).base_layer.weight, getattr(base, name).base_layer.weight)


def test_plan_logits_are_the_g_and_s_columns_of_lm_logits(model):
    """What the engine reads for a planning decision (plan_logits, two columns) is lm_logits' <G>, <S>."""
    with torch.no_grad():
        h = torch.randn(4, model.new_embed.shape[1], generator=torch.Generator().manual_seed(0))
        full = model.lm_logits(h)[:, [model.g_id, model.s_id]]
        torch.testing.assert_close(model.plan_logits(h), full, atol=1e-6, rtol=1e-6)


def test_saved_files_do_not_depend_on_the_hash_seed(tmp_path, monkeypatch):
    """The same model saved by two processes with different PYTHONHASHSEED gives the same bytes
    (peft writes its target_modules set in hash order; the model_id hashes these files)."""
    from infer.loading import weights_fingerprint

    script = ("import sys, torch; from pipeline.model import PadCaptioner; from tests.support.padcap import tiny_cfg; "
              "torch.manual_seed(0); PadCaptioner(tiny_cfg()).save_pretrained(sys.argv[1])")
    monkeypatch.setenv("PADCAP_CACHE_DIR", str(tmp_path / "cache"))
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        subprocess.run([sys.executable, "-c", script, str(tmp_path / seed)], check=True, env=env,
                       cwd=Path(__file__).resolve().parents[1])
    conf = [json.loads((tmp_path / s / "adapter" / "adapter_config.json").read_text()) for s in ("1", "2")]
    assert conf[0]["target_modules"] == sorted(conf[0]["target_modules"]) and conf[0] == conf[1]
    assert weights_fingerprint(tmp_path / "1") == weights_fingerprint(tmp_path / "2")
