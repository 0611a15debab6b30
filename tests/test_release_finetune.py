"""Fine-tuning the release-format model: what trains, the training layout, release-format saves."""

from __future__ import annotations

import io
import shutil

import pytest
import torch
from transformers.cache_utils import DynamicCache

from bench.release_models import CHECKPOINT, FIXTURE, fixture_video, load, random_video
from infer.engine.core import CaptionEngine
from infer.oracles.release_loop import release_reference
from infer.parity import check as parity
from pipeline.config import InferConfig
from pipeline.release.checkpoint import read_state_dict
from pipeline.release.decoding import prefill
from pipeline.release.finetune import ReleaseFinetune, TrainVideo, timestep_interval
from pipeline.release.model import ReleaseCaptioner, ReleaseSettings
from pipeline.schema import Event
from train.losses import compute_losses

EVENTS = [Event(0.5, 3.0, "a dog barks"), Event(4.0, 8.0, "a car passes by")]


def tuner(**over) -> ReleaseFinetune:
    torch.manual_seed(0)
    return ReleaseFinetune(load(ReleaseSettings(positions="training")), lora_r=4, lora_alpha=8, **over)


def test_only_lora_on_the_llm_qkv_heads_and_the_new_rows_train():
    t = tuner()
    names = list(t.trainable_parameters())
    assert "rows" in names
    lora = [n for n in names if "lora_" in n]
    assert lora and all("language_model.layers" in n and any(p in n for p in ("q_proj", "k_proj", "v_proj"))
                        for n in lora)
    assert not any("audio" in n or "visual" in n or "embed_tokens" in n for n in names)
    assert {n.split(".")[1] for n in names if n.startswith("model.") and "lora_" not in n} == {"frm_head", "evi_head"}


def test_an_untrained_save_is_the_release_checkpoint_again(tmp_path):
    case = tmp_path / "case"
    shutil.copytree(FIXTURE, case, ignore=shutil.ignore_patterns("checkpoint"))
    tuner_ = ReleaseFinetune(load(), lora_r=4, lora_alpha=8)
    tuner_.save_pretrained(case / "checkpoint")
    saved, original = read_state_dict(case / "checkpoint"), read_state_dict(CHECKPOINT)
    for k, v in saved.items():
        assert torch.equal(v, original[k]), k
    assert set(original) - set(saved) == {k for k in original if k.startswith("score_head.") or k.endswith("position_ids")}
    out = io.StringIO()
    assert all(c.passed for c in parity.run(case, out=out).items), out.getvalue()


def test_the_prompt_rows_of_the_training_forward_equal_decoding():
    t = tuner()
    video = random_video(3, timesteps=4)
    out = t.forward_train(t.collate([t.make_example(TrainVideo(video, EVENTS))]))
    with torch.no_grad():
        pre = prefill(t.model, video, DynamicCache(config=t.model.hf_config))
    want = t.model.lm_logits(pre.last_hidden[None])[0]
    assert torch.allclose(out["text_logits"][0], want, atol=1e-5)
    assert out["text_labels"].tolist() == [t.model.g_id, t.model.g_id, t.model.s_id]
    assert out["branch_labels"].tolist()[-1] == t.model.eos_id
    assert out["grounding_logits"][0].shape == (2, 4)


def test_a_few_steps_lower_the_loss_and_the_result_captions(tmp_path):
    t = tuner()
    data = [TrainVideo(random_video(i, timesteps=4), EVENTS) for i in range(2)]
    opt = torch.optim.AdamW(t.trainable_parameters().values(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss = compute_losses(t.forward_train(t.collate([t.make_example(v) for v in data])), t.cfg)
        opt.zero_grad()
        loss.total.backward()
        opt.step()
        losses.append(loss.components["total"])
    assert sum(losses[-3:]) / 3 < losses[0] * 0.5
    saved = ReleaseCaptioner.from_release(t.save_pretrained(tmp_path / "tuned"), ReleaseSettings(positions="training"))
    base = read_state_dict(CHECKPOINT)
    new = saved.release_state_dict()
    assert not torch.equal(new["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(new["model.layers.0.mlp.up_proj.weight"], base["model.layers.0.mlp.up_proj.weight"])
    res = CaptionEngine(saved, InferConfig(max_events=4, max_branch_tokens=8, device="cpu")).caption([data[0].video])
    assert res[0].error is None


def test_timestep_interval_of_seconds():
    assert timestep_interval(0.5, 3.0, 2.0, 4) == (0, 1)
    assert timestep_interval(4.0, 8.0, 2.0, 4) == (2, 3)
    assert timestep_interval(7.9, 30.0, 2.0, 4) == (3, 3)


def test_activation_checkpointing_gives_the_same_outputs_and_gradients():
    video = random_video(5, timesteps=4)
    results = []
    for checkpointed in (False, True):
        t = tuner()
        with torch.no_grad():  # LoRA B starts at zero: make the adapters matter
            for n, p in t.trainable_parameters().items():
                if "lora_B" in n:
                    p.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(len(n)))
        if checkpointed:
            t.enable_activation_checkpointing()
            assert all(layer.gradient_checkpointing for layer in t.model.decoder.layers)
            assert all(b.gradient_checkpointing for b in t.model.visual.blocks)
            assert all(layer.gradient_checkpointing for layer in t.model.audio.whisper.layers)
        t.train()
        out = t.forward_train(t.collate([t.make_example(TrainVideo(video, EVENTS))]))
        compute_losses(out, t.cfg).total.backward()
        grads = {n: p.grad.clone() for n, p in t.trainable_parameters().items() if p.grad is not None}
        assert set(grads) == set(t.trainable_parameters())
        results.append((out, grads))
    (ref, ref_grads), (ck, ck_grads) = results
    for key in ("text_logits", "branch_logits"):
        assert torch.allclose(ck[key], ref[key], atol=1e-5), key
    assert torch.allclose(ck["grounding_logits"][0], ref["grounding_logits"][0], atol=1e-5)
    for n, g in ref_grads.items():
        err = float((ck_grads[n] - g).abs().max())
        assert err <= 1e-4 * float(g.abs().max()) + 1e-6, (n, err)


def test_checkpoints_hold_the_trained_tensors_and_export_makes_the_merged_model(tmp_path):
    from pipeline.config import Config, apply_overrides
    from pipeline.release.checkpoint import weight_files
    from pipeline.release.finetune import release_tuner
    from train import checkpoint as ckpt
    from train.export import main as export_main

    cfg = apply_overrides(Config(), [f"model.backbone={CHECKPOINT}", "model.lora_r=4", "model.lora_alpha=8"])
    torch.manual_seed(0)
    t = release_tuner(cfg)
    with torch.no_grad():  # "trained": every trained tensor moved
        for p in t.trainable_parameters().values():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    opt = torch.optim.AdamW(t.trainable_parameters().values())
    path = ckpt.save_checkpoint(tmp_path / "ck", model=t, state=ckpt.TrainState(step=7), config_json=cfg.to_json(),
                                optimizer=opt)
    assert not (path / ckpt.MODEL_DIR).exists()
    ck_bytes = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    model_bytes = sum(f.stat().st_size for f in weight_files(CHECKPOINT))
    trained = sum(p.numel() * p.element_size() for p in t.trainable_parameters().values())
    assert ck_bytes < model_bytes / 10 and ck_bytes < 3 * trained + 200_000, (ck_bytes, model_bytes, trained)
    assert export_main([str(path), str(tmp_path / "merged")]) == 0  # the one command
    merged, want = read_state_dict(tmp_path / "merged"), t.merged_release_state()
    assert merged.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(merged[k], v), k
    assert (tmp_path / "merged" / "run_config.json").read_text() == cfg.to_json()


def _recording(decoder):
    """Wrap a decoder's forward to record each call's position ids [3, n]."""
    calls, forward = [], decoder.forward

    def record(*args, **kwargs):
        calls.append(kwargs["position_ids"][:, 0].detach().cpu().clone())
        return forward(*args, **kwargs)

    decoder.forward = record
    return calls


# (mode, LoRA B scale): cases where the fixture video plans 2-3 events and <S> ends planning
@pytest.mark.parametrize("mode, lora_scale", [("release", 0.0), ("training", 0.05)])
def test_training_rows_are_decoding_rows_in_both_position_modes(mode, lora_scale):
    """Decode a video, then run the training forward on exactly what decoding did (its intervals and its
    tokens as the captions): every row (prompt, serial <G>s, anchors, branch tokens) has the position
    decoding gave it, and predicts what decoding predicted there."""
    from pipeline.release.finetune import ReleaseExample

    torch.manual_seed(0)
    t = ReleaseFinetune(load(ReleaseSettings(positions=mode)), lora_r=4, lora_alpha=8)
    with torch.no_grad():
        for n, p in t.trainable_parameters().items():
            if "lora_B" in n:
                p.normal_(0.0, lora_scale + 1e-12, generator=torch.Generator().manual_seed(len(n)))
    t.eval()
    video = fixture_video()
    calls = _recording(t.model.decoder)
    with torch.no_grad():
        ref = release_reference(t.model, video, t.model.max_events, 8)
    k, toks = ref.front.num_events, ref.decoded.tokens
    assert k >= 2 and all(toks), (k, toks)
    prefill, serial = calls[0], calls[1: 1 + k]
    calls.clear()
    ex = ReleaseExample(video, list(ref.front.steps), torch.tensor(ref.front.intervals).reshape(-1, 2),
                        [list(x) for x in toks], num_tokens=0)
    with torch.no_grad():
        out = t.forward_one(ex)
    train_prompt, train_rest = calls
    assert torch.equal(train_prompt, prefill)
    assert torch.equal(train_rest[:, :k], torch.cat(serial, 1))  # serial <G>_1..K
    col = k
    rows = []
    for j, branch in enumerate(toks):
        n = len(branch)  # anchor + the tokens fed after it, the last one predicting the branch's last token
        for r in range(n):
            assert torch.equal(train_rest[:, col + r], ref.calls[r].position_ids[:, j]), (j, r)
            rows.append(ref.calls[r].logits[j])
        col += n
    assert col == train_rest.shape[1]
    # the same rows predict the same: planning and every branch token
    assert torch.allclose(out["branch_logits"].float(), torch.stack(rows), atol=1e-4)
    decided = ref.front.planning_logits.float().cpu()  # [K+1, 2] (<G>, <S>); K rows when the cap ended planning
    plan = out["text_logits"][: len(decided), [t.model.g_id, t.model.s_id]].float()
    assert torch.allclose(plan, decided, atol=1e-4)
    assert len(decided) == k + 1  # planning ended by <S>, not the cap: every planning row was compared
    assert plan.argmax(-1).tolist() == [0] * k + [1]  # planning is <G> vs <S>: K <G>s, then <S>
    assert out["text_labels"].tolist() == [t.model.g_id] * k + [t.model.s_id]
    scores = out["branch_logits"].float().clone()
    scores[:, [t.model.g_id, t.model.s_id, t.model.shift_id]] = float("-inf")  # decoding's bans
    assert scores.argmax(-1).tolist() == [x for b in toks for x in b] == out["branch_labels"].tolist()
