"""Training checkpoints: the model's save_pretrained format plus the training state.

A checkpoint directory:

    model/               PadCaptioner.save_pretrained (adapter/, extra.safetensors,
                         tokenizer/, padcaptioner.json) + config.json (the run's Config),
                         loadable on its own by PadCaptioner.from_pretrained / infer.loading.
                         Not written for a model whose saved form is a full merged copy
                         (`merged_at_end`: the release fine-tune, ~9.4 GB at 3B): its
                         checkpoints hold the trained tensors only, and the merged
                         directory is made from one at the end or on demand
                         (train/export.py: `python -m train.export CHECKPOINT OUT`)
    train_state.pt       step, data position (epoch, records consumed in it), resumes,
                         the trainable tensors (exact, in training dtype), optimizer and
                         scheduler state (DDP backend), data stats
    history.json         per-step metrics so far (loss components, lr, tokens/s, validation)
    rng/rank_<r>.pt      every rank's RNG states (torch, python, CUDA, its data-jitter generator)
    deepspeed/           DeepSpeed backend only: engine.save_checkpoint (ZeRO partitions
                         of every rank; frozen weights excluded)
    config.json          the run's Config

Rank 0 writes everything except rng/ and deepspeed/, which every rank writes its part of; Ray
Train merges the ranks' directories. Pure torch; no ray.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

STATE_FILE = "train_state.pt"
HISTORY_FILE = "history.json"
MODEL_DIR = "model"
DEEPSPEED_DIR = "deepspeed"
CONFIG_FILE = "config.json"
DS_TAG = "state"


@dataclass
class TrainState:
    """Where training is: optimizer steps done and the data position after them."""

    step: int = 0
    epoch: int = 0
    records_in_epoch: int = 0  # records of `epoch` already consumed
    resumes: int = 0  # how many times this run was resumed from a checkpoint
    history: list[dict[str, Any]] = field(default_factory=list)
    data_stats: dict[str, Any] = field(default_factory=dict)


def save_rank_state(path: str | Path, rank: int, generator: torch.Generator | None) -> None:
    """Every rank: its RNG states (torch, python, `generator`, CUDA)."""
    d = Path(path) / "rng"
    d.mkdir(parents=True, exist_ok=True)
    torch.save({"torch": torch.get_rng_state(), "python": random.getstate(),
                "generator": generator.get_state() if generator is not None else None,
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}, d / f"rank_{rank}.pt")


def load_rank_state(path: str | Path, rank: int, generator: torch.Generator | None) -> None:
    """Restore this rank's RNG states; none when the checkpoint has none for it (another world size)."""
    f = Path(path) / "rng" / f"rank_{rank}.pt"
    if not f.exists():
        return
    state = torch.load(f, map_location="cpu", weights_only=False)
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if generator is not None and state.get("generator") is not None:
        generator.set_state(state["generator"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(path: str | Path, *, model, state: TrainState, config_json: str,
                    optimizer=None, scheduler=None) -> Path:
    """Rank 0's part of a checkpoint (see the module doc)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if not model.checkpoint.merged_at_end:
        model.save_pretrained(path / MODEL_DIR)
        # a release-format model dir already has config.json (the HF config): the run config goes beside it
        (path / MODEL_DIR / model.checkpoint.config_file).write_text(config_json)
    (path / CONFIG_FILE).write_text(config_json)
    payload = {
        "step": state.step, "epoch": state.epoch, "records_in_epoch": state.records_in_epoch,
        "data_stats": state.data_stats, "resumes": state.resumes,
        "trainable": {k: v.detach().cpu().clone() for k, v in model.trainable_parameters().items()},
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
    }
    torch.save(payload, path / STATE_FILE)
    (path / HISTORY_FILE).write_text(json.dumps(state.history))
    return path


def load_checkpoint(path: str | Path, *, model, optimizer=None, scheduler=None) -> TrainState:
    """Restore what `save_checkpoint` wrote into a freshly built model / optimizer / scheduler."""
    path = Path(path)
    payload = torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)
    load_trainable(path, payload, model)
    for part, key in ((optimizer, "optimizer"), (scheduler, "scheduler")):
        if part is not None and payload[key] is not None:
            part.load_state_dict(payload[key])
    return TrainState(step=payload["step"], epoch=payload["epoch"], records_in_epoch=payload["records_in_epoch"],
                      history=read_history(path), data_stats=payload.get("data_stats") or {}, resumes=payload.get("resumes", 0))


def load_trainable(path: Path, payload: dict, model) -> None:
    """The checkpoint's trained tensors into a freshly built model of the same config (exact match)."""
    params = model.trainable_parameters()
    missing = sorted(set(params) - set(payload["trainable"]))
    unexpected = sorted(set(payload["trainable"]) - set(params))
    unexpected += [f"{n} {tuple(payload['trainable'][n].shape)}" for n, p in params.items()
                   if n in payload["trainable"] and payload["trainable"][n].shape != p.shape]
    if missing or unexpected:
        raise ValueError(f"{path}: trainable parameters differ from the model's "
                         f"(missing {missing[:3]}, unexpected {unexpected[:3]}); was it made with another model config?")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(payload["trainable"][name].to(p.device, p.dtype))


def read_history(path: str | Path) -> list[dict[str, Any]]:
    p = Path(path) / HISTORY_FILE
    return json.loads(p.read_text()) if p.exists() else []
