"""train/optim.py: warmup + cosine schedule, parameter groups; train/deepspeed_config.py."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.config import TrainConfig
from train.deepspeed_config import deepspeed_config
from train.optim import build_optimizer, build_scheduler, lr_factor, param_groups


def test_warmup_is_linear_and_reaches_the_peak():
    assert [lr_factor(s, 4, 100) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(4, 4, 100) == pytest.approx(1.0)


def test_cosine_decays_to_the_floor_and_stays():
    w, total, floor = 10, 110, 0.1
    assert lr_factor(w + 50, w, total, floor) == pytest.approx(floor + (1 - floor) * 0.5)  # half way
    assert lr_factor(total, w, total, floor) == pytest.approx(floor)
    assert lr_factor(total + 50, w, total, floor) == pytest.approx(floor)
    values = [lr_factor(s, w, total, floor) for s in range(w, total + 1)]
    assert all(a >= b for a, b in zip(values, values[1:]))  # monotone after warmup
    assert lr_factor(0, 0, 10) == 1.0 and lr_factor(10, 0, 10) == pytest.approx(0.0)


def test_scheduler_drives_the_optimizer_lr():
    cfg = TrainConfig(lr=1e-2, warmup_steps=2, max_steps=6, min_lr_ratio=0.0)
    p = torch.nn.Parameter(torch.zeros(3, 3))
    opt = build_optimizer({"w": p}, cfg)
    sched = build_scheduler(opt, cfg)
    seen = []
    for _ in range(7):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    want = [1e-2 * lr_factor(s, 2, 6) for s in range(7)]
    assert seen == pytest.approx(want)
    assert seen[1] == pytest.approx(1e-2) and seen[6] == pytest.approx(0.0, abs=1e-12)
    assert math.isclose(seen[4], 1e-2 * 0.5 * (1 + math.cos(math.pi * 0.5)))


def test_weight_decay_only_on_matrices():
    params = {"lora_A": torch.nn.Parameter(torch.zeros(4, 2)), "bias": torch.nn.Parameter(torch.zeros(4)),
              "new_embed": torch.nn.Parameter(torch.zeros(2, 4))}
    groups = param_groups(params, 0.1, 1e-3)
    assert [len(g["params"]) for g in groups] == [1, 2]
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0
    with pytest.raises(ValueError):
        build_optimizer({}, TrainConfig())


def test_deepspeed_config_from_train_config():
    cfg = TrainConfig(batch_size=2, grad_accum=4, grad_clip=0.5, zero_stage=2)
    ds = deepspeed_config(cfg, world_size=8, on_gpu=True)
    assert ds["train_batch_size"] == 2 * 4 * 8 and ds["train_micro_batch_size_per_gpu"] == 2
    assert ds["gradient_accumulation_steps"] == 4 and ds["gradient_clipping"] == 0.5
    assert ds["zero_optimization"]["stage"] == 2 and ds["bf16"]["enabled"] is True
    cpu = deepspeed_config(TrainConfig(zero_stage=1), world_size=2, on_gpu=False)
    assert cpu["bf16"]["enabled"] is False and cpu["zero_optimization"]["overlap_comm"] is False
    assert deepspeed_config(TrainConfig(zero_stage=0), 1, False)["zero_optimization"] == {"stage": 0}
    with pytest.raises(ValueError, match="zero_stage"):
        deepspeed_config(TrainConfig(zero_stage=4), 1, False)


def test_zero_stage_3_is_refused_before_any_worker_starts(tmp_path):
    # PadCaptioner reads new_embed / new_out / modality_embed.weight outside submodule forwards
    # and trains through forward_train: under ZeRO-3 those weights would never be gathered.
    from pipeline.config import Config
    from train.trainer import build_trainer

    with pytest.raises(ValueError, match="zero_stage=3 is not supported.*new_embed"):
        deepspeed_config(TrainConfig(zero_stage=3), 2, True)
    cfg = Config()
    cfg.train.backend, cfg.train.zero_stage = "deepspeed", 3
    with pytest.raises(ValueError, match="zero_stage=3 is not supported"):  # before the manifest is even read
        build_trainer(cfg, str(tmp_path / "no shards here"), str(tmp_path / "out"))


def test_lr_scales_give_groups_their_own_lr_under_the_same_schedule():
    params = {"layer.lora_A.w": torch.nn.Parameter(torch.zeros(4, 2)), "layer.lora_B.w": torch.nn.Parameter(torch.zeros(2, 4)),
              "new_embed": torch.nn.Parameter(torch.zeros(2, 4))}
    cfg = TrainConfig(lr=1e-2, warmup_steps=2, max_steps=6, lr_scales={"lora_B": 16.0})
    opt = build_optimizer(params, cfg)
    by_param = {id(p): g for g in opt.param_groups for p in g["params"]}
    assert by_param[id(params["layer.lora_B.w"])]["lr"] == pytest.approx(1e-2 * 16)
    sched = build_scheduler(opt, cfg)
    assert by_param[id(params["layer.lora_B.w"])]["lr"] == pytest.approx(1e-2 / 2 * 16)  # warmup step 0: 1/2
    for _ in range(3):
        opt.step()
        sched.step()
    base = by_param[id(params["layer.lora_A.w"])]["lr"]
    assert by_param[id(params["layer.lora_B.w"])]["lr"] == pytest.approx(16 * base)
    assert by_param[id(params["new_embed"])]["lr"] == pytest.approx(base)
    assert by_param[id(params["new_embed"])]["weight_decay"] == 0.0
