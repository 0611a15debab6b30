"""The training loop on CUDA (skipped without it): bf16 autocast with the DDP backend, and
DeepSpeed ZeRO-2 in bf16 on one rank with a checkpoint and an exact resume of the step."""

from __future__ import annotations

import socket

import pytest
import torch

from pipeline.config import Config, TrainConfig
from tests.support.padcap import DA, DV, tiny_cfg
from tests.test_train_loop import corpus
from train import checkpoint as ckpt
from train.data import InMemoryEpochs
from train.loop import LocalContext, StopTraining, train_loop

pytestmark = pytest.mark.gpu


def _config(model_dtype: str = "float32", **train) -> Config:
    base = dict(max_steps=6, batch_size=2, grad_accum=1, lr=3e-3, warmup_steps=1, checkpoint_every=3, val_every=0,
                val_samples=2, log_every=100, torch_threads=1, bf16=True)
    base.update(train)
    return Config(model=tiny_cfg(dtype=model_dtype), train=TrainConfig(**base))


def _run(cfg, root, stop_after=None):
    ctx = LocalContext(str(root), device=torch.device("cuda"), stop_after=stop_after)
    out = train_loop(cfg, ctx, InMemoryEpochs(corpus(), seed=0), corpus(2), visual_dim=DV, audio_dim=DA)
    return out, ctx


def test_ddp_backend_bf16_autocast_on_cuda(tmp_path):
    out, ctx = _run(_config(backend="ddp"), tmp_path)
    hist = ckpt.read_history(ctx.latest_checkpoint())
    assert out["backend"] == "ddp" and len(hist) == 6
    assert all(torch.isfinite(torch.tensor(h["total"])) for h in hist)
    assert hist[-1]["total"] < hist[0]["total"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_deepspeed_zero2_bf16_on_cuda_resumes(tmp_path, monkeypatch):
    import torch.distributed as dist

    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0", "WORLD_SIZE": "1",
                 "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        cfg = _config("bfloat16", backend="deepspeed", zero_stage=2)
        with pytest.raises(StopTraining):
            _run(cfg, tmp_path, stop_after=3)
        out, ctx = _run(cfg, tmp_path)
        assert out["backend"] == "deepspeed" and out["steps"] == 6
        hist = ckpt.read_history(ctx.latest_checkpoint())
        assert [h["resumes"] for h in hist] == [0, 0, 0, 1, 1, 1]
        assert all(torch.isfinite(torch.tensor(h["total"])) for h in hist)
        assert any(p.name.startswith("zero_pp_rank_0") for p in
                   (tmp_path / "checkpoint_0000006" / ckpt.DEEPSPEED_DIR / ckpt.DS_TAG).iterdir())
    finally:
        dist.destroy_process_group()
