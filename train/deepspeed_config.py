"""The DeepSpeed config of the training loop, built from TrainConfig.

    ds_config = deepspeed_config(cfg.train, world_size=8, on_gpu=True)
    engine, *_ = deepspeed.initialize(model=step_module, model_parameters=params,
                                      optimizer=adamw, lr_scheduler=make_sched, config=ds_config)

ZeRO stage `train.zero_stage` (0-2; the GPU presets use 2: optimizer state and gradients
partitioned, weights replicated). Stage 3 is refused (`check_zero_stage`; ZERO3_REFUSED
says why). The optimizer (AdamW) and the warmup + cosine schedule stay the loop's own
(train/optim.py) and are handed to `deepspeed.initialize` as client objects, so both
backends train with the same maths; hence `zero_allow_untested_optimizer`. Batch sizes:
micro batch per rank = `batch_size`, global = batch_size * grad_accum * world. Gradient
clipping is DeepSpeed's (`gradient_clipping`), bf16 mixed precision on GPU only (on CPU
the loop trains in the model dtype). Pure python.
"""

from __future__ import annotations

from typing import Any

ZERO3_REFUSED = (
    "train.zero_stage=3 is not supported: ZeRO-3 partitions the weights and gathers a module's "
    "parameters only inside that module's forward, while PadCaptioner reads new_embed, new_out and "
    "modality_embed.weight directly and trains through forward_train, so those weights would be "
    "empty partitions. Use train.zero_stage=2 (optimizer state and gradients partitioned) or "
    "train.backend=ddp."
)


def check_zero_stage(train_cfg) -> int:
    """The ZeRO stage of `train_cfg`, or ValueError (out of range, or 3: ZERO3_REFUSED)."""
    stage = int(train_cfg.zero_stage)
    if not 0 <= stage <= 3:
        raise ValueError(f"train.zero_stage must be 0..2, got {stage}")
    if stage == 3:
        raise ValueError(ZERO3_REFUSED)
    return stage


def deepspeed_config(train_cfg, world_size: int, on_gpu: bool) -> dict[str, Any]:
    """The ds_config dict for this run."""
    stage = check_zero_stage(train_cfg)
    zero: dict[str, Any] = {"stage": stage}
    if stage >= 1:
        zero.update(
            contiguous_gradients=True,
            overlap_comm=on_gpu,  # overlap needs streams; on CPU it only adds copies
            reduce_scatter=True,
            allgather_partitions=True,
            reduce_bucket_size=int(5e7),
            allgather_bucket_size=int(5e7),
        )
    return {
        "train_micro_batch_size_per_gpu": int(train_cfg.batch_size),
        "gradient_accumulation_steps": int(train_cfg.grad_accum),
        "train_batch_size": int(train_cfg.batch_size) * int(train_cfg.grad_accum) * int(world_size),
        "gradient_clipping": float(train_cfg.grad_clip),
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": bool(on_gpu and train_cfg.bf16)},
        "fp16": {"enabled": False},
        "steps_per_print": 10**9,  # the loop logs; DeepSpeed stays quiet
        "wall_clock_breakdown": False,
        "checkpoint": {"load_universal": False},
    }
