"""Optimizer and learning-rate schedule of the training loop.

    opt = build_optimizer(model.trainable_parameters(), cfg.train)      # AdamW, decay on matrices only,
                                                                          # lr multipliers per name (train.lr_scales)
    sched = build_scheduler(opt, cfg.train)                               # linear warmup, cosine decay
    lr_factor(step, warmup=20, total=300, min_ratio=0.1)                  # the multiplier at a step

The schedule is a pure function of the optimizer step: `lr = lr * lr_factor(step)`,
rising linearly over `warmup_steps` (step 0 already gets 1/warmup of the peak, so no
step is wasted at lr 0), then a half cosine from the peak to `min_lr_ratio * lr` at
`max_steps`, flat after it. Pure torch; no ray.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def lr_factor(step: int, warmup: int, total: int, min_ratio: float = 0.0) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based)."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, max(0.0, (step - warmup) / span))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def param_groups(params: dict[str, nn.Parameter], weight_decay: float, lr: float,
                 scales: dict[str, float] | None = None) -> list[dict]:
    """Weight decay on matrices (LoRA A/B, projector and head weights); none on biases,
    norms and the new-token rows / embeddings' 1-D parts. Each group's lr is `lr` times the
    multiplier of the first of `scales` (name substring -> multiplier, `train.lr_scales`) in the
    parameter's name, else 1 (one group per decay x multiplier)."""
    groups: dict[tuple[bool, float], list[nn.Parameter]] = {}
    for n, p in params.items():
        decay = p.ndim >= 2 and "new_embed" not in n and "new_out" not in n
        scale = next((float(s) for key, s in (scales or {}).items() if key in n), 1.0)
        groups.setdefault((decay, scale), []).append(p)
    return [{"params": ps, "weight_decay": weight_decay if decay else 0.0, "lr": lr * scale}
            for (decay, scale), ps in sorted(groups.items(), key=lambda kv: (not kv[0][0], kv[0][1]))]


def build_optimizer(params: dict[str, nn.Parameter], train_cfg) -> torch.optim.Optimizer:
    if not params:
        raise ValueError("the model has no trainable parameters")
    groups = param_groups(params, train_cfg.weight_decay, train_cfg.lr, train_cfg.lr_scales)
    return torch.optim.AdamW(groups, lr=train_cfg.lr, betas=(train_cfg.adam_beta1, train_cfg.adam_beta2), eps=1e-8)


def build_scheduler(optimizer: torch.optim.Optimizer, train_cfg) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, train_cfg.warmup_steps, train_cfg.max_steps, train_cfg.min_lr_ratio))
