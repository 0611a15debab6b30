"""train/loop.py in-process (no Ray): it learns, checkpoints round-trip, and a run resumed from a
checkpoint continues exactly like an uninterrupted one (same step, optimizer state, data, RNG)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline.config import Config, TrainConfig
from pipeline.model import PadCaptioner
from tests.support.padcap import DA, DV, sample, tiny_cfg
from train import checkpoint as ckpt
from train.data import InMemoryEpochs
from train.loop import DDPBackend, LocalContext, StopTraining, train_loop
from train.optim import build_optimizer, build_scheduler

CAPS = ("Visual: a red circle moves up. Audio: a high beep.", "Visual: a blue square grows. Audio: silence.",
        "Visual: a green triangle blinks. Audio: a low beep.")


def corpus(n=4):
    return [sample(num_segments=10, intervals=((1.0, 4.0), (6.0, 9.0)), captions=CAPS[i % 3:] + CAPS[: i % 3],
                   seed=i, video_id=f"v{i}") for i in range(n)]


def config(**train) -> Config:
    base = dict(max_steps=6, batch_size=2, grad_accum=2, lr=3e-3, warmup_steps=2, checkpoint_every=3,
                val_every=0, val_samples=2, log_every=100, torch_threads=1, seed=0)
    base.update(train)
    return Config(model=tiny_cfg(), train=TrainConfig(**base))


def run(cfg, root, stop_after=None, data=None):
    ctx = LocalContext(str(root), stop_after=stop_after)
    from preprocess.synthetic import parse_caption

    out = train_loop(cfg, ctx, InMemoryEpochs(corpus() if data is None else data, seed=cfg.train.seed), corpus(2),
                     visual_dim=DV, audio_dim=DA, parse=parse_caption)
    return out, ctx


LOSSES = ("total", "lm", "branch_lm", "grounding")


def test_resume_equals_uninterrupted_run(tmp_path):
    cfg = config()
    full, full_ctx = run(cfg, tmp_path / "a")
    with pytest.raises(StopTraining):
        run(cfg, tmp_path / "b", stop_after=3)  # "crashes" right after the step-3 checkpoint
    assert [p.name for p in sorted((tmp_path / "b").glob("checkpoint_*"))] == ["checkpoint_0000003"]
    resumed, ctx = run(cfg, tmp_path / "b")
    assert resumed["steps"] == 6
    ha = ckpt.read_history(full_ctx.latest_checkpoint())
    hb = ckpt.read_history(ctx.latest_checkpoint())
    assert [h["step"] for h in hb] == [1, 2, 3, 4, 5, 6]
    assert [h["resumes"] for h in hb] == [0, 0, 0, 1, 1, 1]
    for a, b in zip(ha, hb):
        for k in LOSSES:
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-6), (a["step"], k)
        assert b["lr"] == pytest.approx(a["lr"]) and b["epoch"] == a["epoch"]
        assert b["samples"] == a["samples"]  # the same videos at every step, across the resume
    # one rank; 4 videos, 2 micro-batches of 2 per step: every step is a whole epoch, each video once
    assert [sorted(v for rank_ids in h["samples"] for v in rank_ids) for h in hb] == [[f"v{i}" for i in range(4)]] * 6
    sa = torch.load(Path(full_ctx.latest_checkpoint()) / ckpt.STATE_FILE, weights_only=False)
    sb = torch.load(Path(ctx.latest_checkpoint()) / ckpt.STATE_FILE, weights_only=False)
    for name, t in sa["trainable"].items():
        assert torch.allclose(t, sb["trainable"][name], atol=1e-6), name
    assert (sa["epoch"], sa["records_in_epoch"]) == (sb["epoch"], sb["records_in_epoch"])
    # the loss went down over the 6 steps (the loop trains at all)
    assert ha[-1]["total"] < ha[0]["total"]


def test_checkpoint_round_trip(tmp_path):
    cfg = config(max_steps=3, checkpoint_every=3, grad_accum=1)
    _, ctx = run(cfg, tmp_path / "run")
    path = Path(ctx.latest_checkpoint())
    assert {p.name for p in path.iterdir()} >= {"model", "train_state.pt", "history.json", "config.json", "rng"}
    assert Config.from_json((path / "model" / "config.json").read_text()) == cfg

    # the model/ dir alone is the inference format
    torch.manual_seed(cfg.train.seed)
    loaded = PadCaptioner.from_pretrained(path / "model").eval()
    state = torch.load(path / ckpt.STATE_FILE, weights_only=False)
    for name, p in loaded.trainable_parameters().items():
        assert torch.equal(p.detach(), state["trainable"][name]), name

    # train_state restores parameters, optimizer and scheduler into fresh objects
    torch.manual_seed(cfg.train.seed)
    fresh = PadCaptioner(cfg.model, visual_dim=DV, audio_dim=DA)
    params = fresh.trainable_parameters()
    opt, sched = build_optimizer(params, cfg.train), None
    sched = build_scheduler(opt, cfg.train)
    st = ckpt.load_checkpoint(path, model=fresh, optimizer=opt, scheduler=sched)
    assert st.step == 3 and len(st.history) == 3
    assert sched.last_epoch == 3 and opt.param_groups[0]["lr"] == pytest.approx(state["scheduler"]["_last_lr"][0])
    saved_opt = state["optimizer"]["state"]
    assert len(opt.state) == len(saved_opt) > 0
    for i, p in enumerate(opt.param_groups[0]["params"] + opt.param_groups[1]["params"]):
        assert torch.equal(opt.state[p]["exp_avg"], saved_opt[i]["exp_avg"])
    for name, p in params.items():
        assert torch.equal(p.detach(), state["trainable"][name])
    batch_model = loaded
    from train.data import Batcher

    batch = next(Batcher(batch_model, 1)(corpus(1)))
    with torch.no_grad():
        a = loaded.forward_train(batch)["branch_logits"]
        b = fresh.eval().forward_train(batch)["branch_logits"]
    assert torch.allclose(a, b, atol=1e-5)

    with pytest.raises(ValueError, match="trainable parameters differ"):
        other = PadCaptioner(tiny_cfg(lora_r=4), visual_dim=DV, audio_dim=DA)
        ckpt.load_checkpoint(path, model=other)


def test_validation_numbers_and_history(tmp_path):
    cfg = config(max_steps=4, val_every=2, checkpoint_every=0)
    out, ctx = run(cfg, tmp_path / "run")
    hist = ckpt.read_history(ctx.latest_checkpoint())
    vals = [h for h in hist if "val_token_acc" in h]
    assert [h["step"] for h in vals] == [2, 4]
    for h in vals:
        assert h["val_videos"] == 2 and h["val_events"] == 4
        for k in ("val_planning_acc", "val_grounding_f1@0.5", "val_token_acc", "val_colour_acc", "val_attr_acc"):
            assert 0.0 <= h[k] <= 1.0
    for h in hist:
        assert h["tokens_per_s"] > 0 and h["lr"] > 0 and all(k in h for k in LOSSES)
    assert out["data"]["skipped"] == 0 and out["data"]["used"] >= 8
    json.dumps(hist)  # the history is plain JSON


def test_epoch_ends_when_data_runs_out_and_no_data_is_an_error(tmp_path):
    cfg = config(max_steps=3, grad_accum=1, batch_size=2, checkpoint_every=0)
    out, ctx = run(cfg, tmp_path / "a", data=corpus(3))  # 3 samples, batch 2: epochs of 2 batches
    hist = ckpt.read_history(ctx.latest_checkpoint())
    assert [h["epoch"] for h in hist] == [0, 0, 1]
    with pytest.raises(RuntimeError, match="no usable training batch"):
        run(cfg, tmp_path / "b", data=[])


def test_ddp_backend_clips_and_accumulates():
    cfg = config(grad_accum=2, grad_clip=1e-3)
    torch.manual_seed(0)
    model = PadCaptioner(cfg.model, visual_dim=DV, audio_dim=DA)
    be = DDPBackend(model, cfg, LocalContext("unused"))
    from train.data import Batcher

    batches = list(Batcher(model, 2)(corpus(4)))
    before = {n: p.detach().clone() for n, p in model.trainable_parameters().items()}
    be.micro_step(batches[0], last=False)
    g1 = {n: p.grad.clone() for n, p in model.trainable_parameters().items() if p.grad is not None}
    be.micro_step(batches[1], last=True)
    assert any(not torch.equal(p.grad, g1[n]) for n, p in model.trainable_parameters().items() if n in g1)
    norm = be.optimizer_step()
    assert norm > 1e-3  # reported before clipping
    assert all(p.grad is None for p in model.trainable_parameters().values())
    moved = max((p.detach() - before[n]).abs().max().item() for n, p in model.trainable_parameters().items())
    assert 0 < moved < 1e-2


def test_log_every_zero_logs_first_and_last_step_only(tmp_path, capsys):
    """0 means "only at the end", as for val_every and checkpoint_every (it divided by zero)."""
    out, ctx = run(config(max_steps=3, checkpoint_every=0, log_every=0), tmp_path)
    assert out["steps"] == 3
    logged = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[train] step ")]
    assert [line.split()[2] for line in logged] == ["1", "3"]
    assert [r["step"] for r in ctx.reports] == [3]  # the final checkpoint only


def test_probe_sees_gradients_records_into_history_and_changes_nothing(tmp_path):
    from bench.attr_probe import AttributeProbe
    from preprocess.synthetic import parse_caption

    cfg = config(max_steps=4, checkpoint_every=0, grad_accum=1)
    probe = AttributeProbe(corpus(2), parse_caption, every=2, linear=(corpus(4), corpus(2)), linear_layers=(0,))
    ctx = LocalContext(str(tmp_path / "probed"))
    train_loop(cfg, ctx, InMemoryEpochs(corpus(), seed=0), corpus(2), visual_dim=DV, audio_dim=DA,
               parse=parse_caption, probe=probe)
    probed = ckpt.read_history(ctx.latest_checkpoint())
    _, plain_ctx = run(cfg, tmp_path / "plain")
    plain = ckpt.read_history(plain_ctx.latest_checkpoint())
    assert [h["total"] for h in probed] == [h["total"] for h in plain]  # the probe draws no random numbers
    rows = [h for h in probed if "probe_anchor_mass" in h]
    assert [h["step"] for h in rows] == [1, 2, 4]
    for h in rows:
        assert 0.0 < h["probe_anchor_mass"] < 1.0 and h["probe_grad_lora_vo"] > 0.0
        assert h["probe_branch_attr_lm"] > 0.0 and h["probe_branch_other_lm"] > 0.0
        assert {"probe_lin_colour", "probe_lin_shape", "probe_lin_sound", "probe_lin_colour_l0"} <= set(h)
        assert all(0.0 <= h[f"probe_lin_{a}"] <= 1.0 for a in ("colour", "shape", "sound"))


def test_linear_probe_reads_a_planted_attribute_and_not_noise():
    from bench.attr_probe import linear_probe_accuracy

    g = torch.Generator().manual_seed(0)
    y = torch.arange(240) % 4
    centres = torch.randn(4, 16, generator=g) * 3.0
    x = centres[y] + torch.randn(240, 16, generator=g)
    assert linear_probe_accuracy(x[:160], y[:160], x[160:], y[160:], 4) >= 0.95
    noise = torch.randn(240, 16, generator=g)  # features that carry nothing: held-out accuracy near 1/4
    assert linear_probe_accuracy(noise[:160], y[:160], noise[160:], y[160:], 4) <= 0.45


def test_anchor_halves_sum_to_the_anchor_and_shares_are_fractions():
    """bench/attr_probe.py's anchor_parts: the pooled visual and audio halves add up to the aggregated
    feature the model uses, at its own layer and at another; anchor_feature_rows pairs each anchor row
    with its event's parsed caption; attribute_shares reads every attribute."""
    from bench.attr_probe import anchor_feature_rows, anchor_parts, attribute_shares
    from preprocess.synthetic import parse_caption

    model = PadCaptioner(config().model, visual_dim=DV, audio_dim=DA).eval()
    samples = corpus(4)
    with torch.no_grad():
        parts = anchor_parts(model, samples)
        feats, attrs = anchor_feature_rows(model, samples, parse_caption)
    assert parts["anchor"].shape[0] == len(feats) == len(attrs) == sum(len(s.events) for s in samples)
    assert all({"colour", "shape", "sound"} <= set(a) for a in attrs)  # one parsed caption per anchor row
    torch.testing.assert_close(parts["visual"] + parts["audio"], parts["anchor"], rtol=1e-5, atol=1e-6)
    shares = attribute_shares(model, samples, parse_caption, layer=0)
    assert model.aggregation_layer != 0  # restored after the layer-0 read-out
    assert set(shares) == {"anchor", "visual", "audio"}
    for part in shares.values():
        assert {"colour", "shape", "sound"} <= set(part)
        assert all(0.0 <= v <= 1.0 for k, v in part.items() if k != "norm")
