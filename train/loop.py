"""The PadCaptioner training loop: plain torch, run by Ray Train workers or in-process.

    summary = train_loop(cfg, ctx, data, val_samples, visual_dim=14, audio_dim=34)

`ctx` is all the loop knows about its surroundings: rank, world size, device,
`report(metrics, checkpoint_dir)` (every rank calls it the same number of times),
`latest_checkpoint()` (a local directory to resume from, or None), `release_checkpoint()`
(called once that directory is loaded) and `on_step(step)`. `LocalContext` runs it in
this process (tests, debugging); train/trainer.py provides the Ray Train one. `data.epoch(i)` yields this rank's raw
records of epoch i (train/data.py: `InMemoryEpochs`, or the Ray Data shard).

Per optimizer step: `grad_accum` micro-batches (forward_train -> compute_losses ->
backward; DDP syncs gradients on the last one only), clip, AdamW, warmup + cosine
schedule. bf16 autocast on GPU only. Backends: "ddp" (torch DDP; gloo on CPU, nccl on
GPU; plain module with one rank) or "deepspeed" (ZeRO stage `zero_stage`,
train/deepspeed_config.py); "auto" = deepspeed on GPU, ddp on CPU. Every step logs the
total loss, each component, lr, tokens/s and the gradient norm (all ranks averaged), and the
video ids each rank trained on (`samples`: one list per rank, in rank order; history.json keeps
them, so a run can be audited for samples skipped or repeated, e.g. across a restart);
every `val_every` steps the held-out numbers of train/evaluate.py. Every
`checkpoint_every` steps and at the end a checkpoint (train/checkpoint.py) is reported.
An epoch ends for all ranks when it ends for one (a tiny all-reduce per micro-batch),
so ranks never wait on each other's data. A restart resumes from the latest checkpoint:
same step, same optimizer/scheduler state, same data position (skipping the records
already consumed in that epoch) and RNG states.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from pipeline.config import Config
from pipeline.model import PadCaptioner
from train import checkpoint as ckpt
from train.data import Augment, Batcher
from train.deepspeed_config import deepspeed_config
from train.evaluate import ATTRIBUTES, EvalCounts, heldout_counts, summary
from train.losses import attribute_ids, check_attribute_captions, compute_losses
from train.optim import build_optimizer, build_scheduler

LOSS_KEYS = ("total", "lm", "branch_lm", "grounding")


class EpochSource(Protocol):
    def epoch(self, index: int) -> Iterable[Any]: ...


@dataclass
class LocalContext:
    """One rank in this process; reported checkpoints are copied to `root/checkpoint_<step>`."""

    root: str
    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    reports: list[dict[str, Any]] = field(default_factory=list)
    stop_after: int | None = None  # tests: raise StopTraining after this step (a "crash")

    def report(self, metrics: dict[str, Any], checkpoint_dir: str | None) -> None:
        self.reports.append(dict(metrics))
        if checkpoint_dir:
            dest = Path(self.root) / f"checkpoint_{int(metrics['step']):07d}"
            if dest.exists():
                shutil.rmtree(dest)
            shutil.copytree(checkpoint_dir, dest)

    def latest_checkpoint(self) -> str | None:
        found = sorted(Path(self.root).glob("checkpoint_*"))
        return str(found[-1]) if found else None

    def release_checkpoint(self) -> None:
        """The checkpoint dir is the run's own: nothing to free."""

    def on_step(self, step: int) -> None:
        if self.stop_after is not None and step >= self.stop_after:
            raise StopTraining(step)


class StopTraining(RuntimeError):
    """Raised by a context to end the loop early (tests simulate a crash with it)."""


def resolve_backend(train_cfg, on_gpu: bool) -> str:
    if train_cfg.backend == "auto":
        return "deepspeed" if on_gpu else "ddp"
    return train_cfg.backend


# --------------------------------------------------------------------------- distributed helpers


def _distributed(ctx) -> bool:
    return ctx.world_size > 1 and dist.is_available() and dist.is_initialized()


def all_reduce(t: torch.Tensor, ctx, op=None) -> torch.Tensor:
    """Sum (or `op`) over ranks; identity with one rank. CPU tensors go through gloo as they are."""
    if not _distributed(ctx):
        return t
    dev = t.device
    if dist.get_backend() == "nccl" and dev.type != "cuda":
        t = t.to(ctx.device)
    dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
    return t.to(dev)


def gather_ids(ids: list[str], ctx) -> list[list[str]]:
    """Every rank's `ids`, in rank order (the same list on every rank). Two small all-reduces of the
    JSON text's bytes, so it works on any backend and device (gloo or nccl) like `all_reduce`."""
    if not _distributed(ctx):
        return [list(ids)]
    data = torch.tensor(list(json.dumps(ids).encode("ascii")), dtype=torch.int32)  # ASCII: no NUL byte
    width = int(all_reduce(torch.tensor([len(data)]), ctx, dist.ReduceOp.MAX)[0])
    table = torch.zeros(ctx.world_size, width, dtype=torch.int32)
    table[ctx.rank, : len(data)] = data
    table = all_reduce(table, ctx)
    return [json.loads(bytes(row.tolist()).rstrip(b"\0")) for row in table]


# --------------------------------------------------------------------------- backends


class TrainStep(nn.Module):
    """forward(batch) -> (total loss, components): what DDP / DeepSpeed wrap."""

    def __init__(self, model: PadCaptioner, cfg: Config):
        super().__init__()
        self.model = model
        self.attribute_ids = attribute_ids(model, cfg)
        self.attribute_weight = cfg.model.attribute_token_weight

    def forward(self, batch):
        losses = compute_losses(self.model.forward_train(batch), self.model.cfg, self.attribute_ids, self.attribute_weight)
        return losses.total, losses.components


class DDPBackend:
    """torch DDP (or the bare module with one rank), the loop's AdamW + schedule, manual clipping."""

    name = "ddp"

    def __init__(self, model: PadCaptioner, cfg: Config, ctx):
        self.cfg = cfg
        params = model.trainable_parameters()
        self.params = list(params.values())
        self.module = TrainStep(model, cfg)
        if _distributed(ctx):
            ids = [ctx.device.index] if ctx.device.type == "cuda" else None
            self.module = nn.parallel.DistributedDataParallel(self.module, device_ids=ids, find_unused_parameters=True)
        self.optimizer = build_optimizer(params, cfg.train)
        self.scheduler = build_scheduler(self.optimizer, cfg.train)
        self.in_train_state = {"optimizer": self.optimizer, "scheduler": self.scheduler}  # rank 0's train_state.pt
        self.autocast = ctx.device.type == "cuda" and cfg.train.bf16

    def micro_step(self, batch, last: bool) -> dict[str, float]:
        sync = contextlib.nullcontext() if (last or not isinstance(self.module, nn.parallel.DistributedDataParallel)) \
            else self.module.no_sync()
        amp = torch.autocast("cuda", dtype=torch.bfloat16) if self.autocast else contextlib.nullcontext()
        with sync:
            with amp:
                loss, comps = self.module(batch)
            (loss / self.cfg.train.grad_accum).backward()
        return comps

    def optimizer_step(self) -> float:
        clip = self.cfg.train.grad_clip
        norm = torch.nn.utils.clip_grad_norm_(self.params, clip if clip > 0 else float("inf"))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def save(self, path: Path) -> None:  # rank 0's train_state carries optimizer + scheduler (in_train_state)
        pass

    def load(self, path: Path) -> None:
        pass


class DeepSpeedBackend:
    """deepspeed.initialize around the same module, optimizer and schedule; ZeRO per config."""

    name = "deepspeed"

    def __init__(self, model: PadCaptioner, cfg: Config, ctx):
        import deepspeed

        params = model.trainable_parameters()
        ds_cfg = deepspeed_config(cfg.train, ctx.world_size, on_gpu=ctx.device.type == "cuda")
        optimizer = build_optimizer(params, cfg.train)
        self.engine, *_ = deepspeed.initialize(
            model=TrainStep(model, cfg), model_parameters=list(params.values()), optimizer=optimizer,
            lr_scheduler=lambda opt: build_scheduler(opt, cfg.train), config=ds_cfg, dist_init_required=False)
        self.in_train_state = {}  # the engine's own checkpoint (save) holds optimizer and scheduler

    def micro_step(self, batch, last: bool) -> dict[str, float]:
        loss, comps = self.engine(batch)
        self.engine.backward(loss)
        self.engine.step()  # applies the update at the accumulation boundary only
        return comps

    def optimizer_step(self) -> float:
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def lr(self) -> float:
        return float(self.engine.get_lr()[0])

    def save(self, path: Path) -> None:
        self.engine.save_checkpoint(str(path / ckpt.DEEPSPEED_DIR), tag=ckpt.DS_TAG, exclude_frozen_parameters=True)

    def load(self, path: Path) -> None:
        load_path, _ = self.engine.load_checkpoint(str(path / ckpt.DEEPSPEED_DIR), tag=ckpt.DS_TAG,
                                                   load_module_strict=False, load_optimizer_states=True,
                                                   load_lr_scheduler_states=True)
        if load_path is None:
            raise RuntimeError(f"{path}: no DeepSpeed state to resume from")


# --------------------------------------------------------------------------- data stream


class BatchStream:
    """Endless micro-batches over epochs; tracks (epoch, records consumed) for resuming.

    An epoch ends for every rank as soon as one rank's runs out (the others drop their
    remainder), so DDP ranks always take the same number of steps and a source whose
    epochs start together on all ranks (Ray Data's streaming split) never deadlocks.
    """

    def __init__(self, source: EpochSource, batcher: Batcher, state: ckpt.TrainState, ctx):
        self.source, self.batcher, self.state, self.ctx = source, batcher, state, ctx
        self._records: Iterator[Any] | None = None
        self._batches: Iterator[Any] | None = None

    def _count(self, records: Iterable[Any]) -> Iterator[Any]:
        for rec in records:
            self.state.records_in_epoch += 1
            yield rec

    def next(self):
        while True:
            if self._batches is None:  # a new epoch
                skip = self.state.records_in_epoch
                self._resumed_mid_epoch = skip > 0
                records = iter(self.source.epoch(self.state.epoch))
                self.state.records_in_epoch = sum(1 for _ in itertools.islice(records, skip))  # resume: those already given
                self._records = self._count(records)
                self._batches = self.batcher(self._records)
                self._produced = 0
            batch = next(self._batches, None)
            empty = batch is None and self._produced == 0 and not self._resumed_mid_epoch
            flags = all_reduce(torch.tensor([float(batch is None), float(empty)]), self.ctx, dist.ReduceOp.MAX)
            if flags[0] == 0:
                self._produced += 1
                return batch
            if flags[1] > 0:
                raise RuntimeError(f"epoch {self.state.epoch} gave a rank no usable training batch (rank "
                                   f"{self.ctx.rank} data stats: {self.batcher.stats.as_dict()})")
            for _ in self._records:  # drain: the epoch is over for everyone
                pass
            self.state.epoch += 1
            self.state.records_in_epoch = 0
            self._batches = None


# --------------------------------------------------------------------------- validation


@torch.no_grad()
def validate(model: PadCaptioner, samples: list, ctx, parse=None, autocast: bool = False) -> dict[str, float]:
    """Teacher-forced held-out numbers (train/evaluate.py), samples split over ranks: one sample
    per forward, the same number of forwards on every rank (the last rank repeats a sample it
    does not count)."""
    if not samples:
        return {}
    was_training = model.training
    model.eval()
    per_rank = math.ceil(len(samples) / ctx.world_size)
    mine = samples[ctx.rank::ctx.world_size]
    counts = EvalCounts()
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    for i in range(per_rank):
        batch = next(Batcher(model, 1)([mine[i] if i < len(mine) else samples[0]]))
        with amp:
            out = model.forward_train(batch)
        if i < len(mine):
            counts += heldout_counts(model, batch, out, parse)
    counts = EvalCounts(*all_reduce(counts.tensor(), ctx).tolist())  # float64 -> Python floats
    model.train(was_training)
    out = summary(counts, prefix="val_")
    if model.counting == "loss":  # counted from the loss (free-text captions): no attribute words
        out = {k: v for k, v in out.items() if not any(k == f"val_{a}_acc" for a in (*ATTRIBUTES, "attr"))}
    return out


# --------------------------------------------------------------------------- the loop


def torch_threads(train_cfg) -> int:
    """Torch threads of a training worker: `train.torch_threads`, else one per CPU it is given."""
    return train_cfg.torch_threads or max(1, int(train_cfg.cpus_per_worker))


@torch.no_grad()
def jitter_(model: torch.nn.Module, scale: float, seed: int) -> None:
    """Every floating parameter times (1 + scale * N(0, 1)), the same on every rank: a stand-in
    for another machine's rounding (scale 1e-7 is about one fp32 ulp) in seed studies.

    >>> m = torch.nn.Linear(4, 4); w = m.weight.clone(); jitter_(m, 1e-7, seed=0)
    >>> bool((m.weight != w).any()), bool(torch.allclose(m.weight, w, rtol=1e-6, atol=0))
    (True, True)
    """
    gen = torch.Generator().manual_seed(seed + 7919)
    for p in model.parameters():
        if p.is_floating_point():
            p.mul_((1 + scale * torch.randn(p.shape, generator=gen, dtype=torch.float64)).to(p.device))


def build_model(cfg: Config, visual_dim: int, audio_dim: int):
    """The model a run trains: a PadCaptioner, or the release model when model.backbone is a
    release checkpoint directory (pipeline/release/finetune.py)."""
    from pipeline.release.checkpoint import is_release_dir

    if is_release_dir(cfg.model.backbone):
        from pipeline.release.finetune import release_tuner

        return release_tuner(cfg)
    return PadCaptioner(cfg.model, visual_dim=visual_dim, audio_dim=audio_dim)


def _save(ctx, backend, model, state: ckpt.TrainState, cfg: Config, generator, metrics: dict) -> None:
    """All ranks: write this rank's part of a checkpoint to a temp dir and report it."""
    tmp = Path(tempfile.mkdtemp(prefix=f"padcap-ckpt-r{ctx.rank}-"))
    try:
        if ctx.rank == 0:
            ckpt.save_checkpoint(tmp, model=model, state=state, config_json=cfg.to_json(), **backend.in_train_state)
        ckpt.save_rank_state(tmp, ctx.rank, generator)
        backend.save(tmp)
        ctx.report(metrics, str(tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def train_loop(cfg: Config, ctx, data: EpochSource, val_samples: list, *, visual_dim: int, audio_dim: int,
               parse=None, probe=None) -> dict[str, Any]:
    """Train to `cfg.train.max_steps` (resuming from ctx.latest_checkpoint()); returns rank-local summary.

    probe: optional `probe(step, model) -> dict`, called after the step's backward and before its
    update (gradients in place); what it returns goes into that step's history record
    (bench/attr_probe.py measures how the caption branches learn with it)."""
    tc = cfg.train
    check_attribute_captions(val_samples, cfg.model.attribute_token_weight)  # the aid's data, before any work
    torch.set_num_threads(torch_threads(tc))
    t_start = time.perf_counter()
    torch.manual_seed(tc.seed)  # identical LoRA init on every rank
    model = build_model(cfg, visual_dim, audio_dim).to(ctx.device)
    if tc.init_jitter:
        jitter_(model, tc.init_jitter, tc.seed)
    if tc.gradient_checkpointing:
        model.enable_activation_checkpointing()
    model.train()
    on_gpu = ctx.device.type == "cuda"
    backend = (DeepSpeedBackend if resolve_backend(tc, on_gpu) == "deepspeed" else DDPBackend)(model, cfg, ctx)
    generator = torch.Generator().manual_seed(tc.seed * 1000 + ctx.rank + 1)
    state = ckpt.TrainState()

    resume = ctx.latest_checkpoint()
    if resume:
        state = ckpt.load_checkpoint(resume, model=model, **backend.in_train_state)
        backend.load(Path(resume))
        ckpt.load_rank_state(resume, ctx.rank, generator)
        ctx.release_checkpoint()  # everything is loaded: a restored copy is not kept for the run's length
        state.resumes += 1
        if ctx.rank == 0:
            print(f"[train] resumed from {resume} at step {state.step} (epoch {state.epoch}, "
                  f"{state.records_in_epoch} records into it)", flush=True)

    probe_val = Batcher(model, 1)  # keeps the samples that become examples (the same list on every rank)
    val_samples = [s for s in val_samples[: tc.val_samples or None] if probe_val.example(s) is not None]
    batcher = Batcher(model, tc.batch_size, generator=generator,
                      augment=Augment(tc.augment_crop, tc.augment_noise, generator))
    stream = BatchStream(data, batcher, state, ctx)
    autocast = on_gpu and tc.bf16 and backend.name == "ddp"
    last_metrics: dict[str, Any] = {}
    while state.step < tc.max_steps:
        t0 = time.perf_counter()
        sums = torch.zeros(len(LOSS_KEYS) + 1, dtype=torch.float64)
        step_ids: list[str] = []
        for micro in range(tc.grad_accum):
            batch = stream.next()
            step_ids.extend(batcher.batch_ids)
            comps = backend.micro_step(batch, last=micro == tc.grad_accum - 1)
            sums[:-1] += torch.tensor([comps[k] for k in LOSS_KEYS], dtype=torch.float64) / tc.grad_accum
            sums[-1] += batch.num_tokens
        lr = backend.lr()
        probed = probe(state.step + 1, model) if probe is not None else {}
        grad_norm = backend.optimizer_step()
        state.step += 1
        sums = all_reduce(sums, ctx)
        dt = time.perf_counter() - t0
        rec = {"step": state.step, **{k: float(sums[i]) / ctx.world_size for i, k in enumerate(LOSS_KEYS)},
               "lr": lr, "grad_norm": grad_norm, "tokens": float(sums[-1]), "tokens_per_s": float(sums[-1]) / dt,
               "step_s": dt, "epoch": state.epoch, "resumes": state.resumes, "elapsed_s": time.perf_counter() - t_start,
               "samples": gather_ids(step_ids, ctx), **probed}
        state.history.append(rec)
        last = state.step == tc.max_steps
        if (tc.val_every and state.step % tc.val_every == 0) or last:
            val = validate(model, val_samples, ctx, parse, autocast)
            rec.update(val)
            if ctx.rank == 0 and val:
                print("[train] validation " + "  ".join(f"{k} {v:.3f}" for k, v in val.items()), flush=True)
        state.data_stats = batcher.stats.as_dict()
        logged = bool(tc.log_every) and state.step % tc.log_every == 0  # 0: first and last step only
        if ctx.rank == 0 and (logged or state.step == 1 or last):
            parts = [f"step {rec['step']}", *(f"{k} {rec[k]:.4f}" for k in LOSS_KEYS if k in rec),
                     f"lr {rec['lr']:.2e}", f"tok/s {rec['tokens_per_s']:.0f}", f"{rec['elapsed_s']:.0f}s"]
            print("[train] " + "  ".join(parts), flush=True)
        last_metrics = {k: v for k, v in rec.items() if isinstance(v, (int, float))}
        if (tc.checkpoint_every and state.step % tc.checkpoint_every == 0) or last:
            _save(ctx, backend, model, state, cfg, generator, last_metrics)
        elif logged:
            ctx.report(last_metrics, None)
        ctx.on_step(state.step)

    return {"steps": state.step, "seconds": time.perf_counter() - t_start, "metrics": last_metrics,
            "data": batcher.stats.as_dict(), "backend": backend.name}
