"""The driver with the published model's format: preprocess with the release encoders, fine-tune the
tiny release-format checkpoint with Ray Train, caption with the result, evaluate (on the shared local Ray instance of tests/conftest.py, which the
driver's `init_ray` finds connected); and
preprocess + train with every training option of cluster/configs/release-3b.yaml."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from pipeline.config import Config, apply_overrides, load_config
from pipeline.release.checkpoint import is_release_dir, read_state_dict
from train import checkpoint as ckpt

pytestmark = [pytest.mark.integration, pytest.mark.slow]
CHECKPOINT = Path(__file__).parent / "data" / "release_golden" / "checkpoint"
PRESET = Path(__file__).parents[1] / "cluster" / "configs" / "release-3b.yaml"


def release_run_config(run_dir: Path) -> Config:
    return apply_overrides(Config(), [
        f"run_dir={run_dir}", "data.synthetic.num_videos=4", "data.synthetic.min_duration=8",
        "data.synthetic.max_duration=10", "data.synthetic.max_events=2", "data.synthetic.test_fraction=0.5",
        "features.visual_encoder=release", "features.audio_encoder=release", f"features.release_path={CHECKPOINT}",
        "features.min_frames=16", "features.max_frames=32", "features.device=cpu",
        f"model.backbone={CHECKPOINT}", "model.lora_r=4", "model.lora_alpha=8", "model.max_caption_tokens=16",
        "train.num_workers=1", "train.max_steps=3", "train.checkpoint_every=2", "train.val_every=3",
        "train.val_samples=1", "train.log_every=1", "train.batch_size=1", "train.augment_crop=0",
        "infer.max_events=3", "infer.max_branch_tokens=5", "infer.device=cpu", "cluster.preprocess_actors=1",
        "cluster.num_cpus=2",
    ])


def test_finetune_and_caption_with_the_release_format_model(tmp_path, ray_local):
    from pipeline.run import run

    cfg = release_run_config(tmp_path / "run")
    results = run(cfg)
    model_dir = tmp_path / "run" / "train" / "model"
    assert is_release_dir(model_dir) and (model_dir / "pytorch_model.bin").is_file()
    assert results["train"]["steps"] == 3
    assert results["caption"]["captioned"] == 2 and results["caption"]["failed"] == 0
    rows = [json.loads(line) for f in (tmp_path / "run" / "caption").rglob("*.jsonl") for line in f.read_text().splitlines()]
    assert sorted(r["video_id"] for r in rows) == sorted({r["video_id"] for r in rows}) and len(rows) == 2
    assert all(r["status"] == "ok" and r["model_id"].startswith("model-") for r in rows)
    # the captions came from the fine-tuned weights (LoRA merged into q/k/v), not the base checkpoint
    tuned, base = read_state_dict(model_dir), read_state_dict(CHECKPOINT)
    key = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(tuned[key], base[key])
    assert json.loads((model_dir / "run_config.json").read_text())["model"]["backbone"] == str(CHECKPOINT)


# What the CPU test changes of the 3B preset's model and train sections: paths, the GPU, the run's length.
# Everything else (gradient checkpointing, LoRA r 128 / alpha 256 on the LLM's q/k/v, bfloat16 weights,
# DeepSpeed ZeRO-2, batch 1 x 8 accumulated, lr, no crop, the grounding weight) is the preset's.
CPU_CHANGES = {"model.backbone", "train.use_gpu", "train.gpus_per_worker", "train.max_steps", "train.checkpoint_every",
               "train.val_every", "train.val_samples", "train.log_every", "train.warmup_steps"}


def _flat(section, prefix: str) -> dict:
    from dataclasses import asdict

    return {f"{prefix}.{k}": v for k, v in asdict(section).items()}


def test_the_3b_preset_fine_tunes_with_all_its_training_options(tmp_path, ray_local):
    from pipeline.run import run

    preset = load_config(PRESET)
    cfg = load_config(PRESET, [
        f"run_dir={tmp_path / 'run'}", "data.dataset=synthetic", "data.video_root=", "data.annotations={}",
        "data.synthetic.num_videos=3", "data.synthetic.min_duration=8", "data.synthetic.max_duration=10",
        "data.synthetic.max_events=2", "data.synthetic.test_fraction=0.34", f"features.release_path={CHECKPOINT}",
        "features.min_frames=16", "features.max_frames=32", "features.device=cpu", "cluster.num_cpus=2",
        f"model.backbone={CHECKPOINT}", "train.use_gpu=false", "train.gpus_per_worker=0", "train.max_steps=2",
        "train.checkpoint_every=0", "train.val_every=0", "train.val_samples=1", "train.log_every=1",
        "train.warmup_steps=1",
    ])
    changed = {k for sec in ("model", "train") for k, v in _flat(getattr(cfg, sec), sec).items()
               if v != _flat(getattr(preset, sec), sec)[k]}
    assert changed <= CPU_CHANGES, changed - CPU_CHANGES
    tc, mc = cfg.train, cfg.model
    assert tc.gradient_checkpointing and tc.backend == "deepspeed" and tc.zero_stage == 2 and tc.grad_accum == 8
    assert mc.dtype == "bfloat16" and (mc.lora_r, mc.lora_alpha) == (128, 256)

    results = run(cfg, ["synth", "preprocess", "train"])  # synth: the corpus the test preprocesses
    assert results["train"]["steps"] == 2
    summary = json.loads(Path(results["train"]["details"]).read_text())
    assert summary["backend"] == "deepspeed"
    final = Path(summary["checkpoint"])
    parts = [p.name for p in (final / ckpt.DEEPSPEED_DIR / ckpt.DS_TAG).iterdir()]
    assert any("zero_pp_rank_0" in p for p in parts), parts  # ZeRO partitions, written by the engine
    assert not (final / ckpt.MODEL_DIR).exists()  # checkpoints: trained tensors + optimizer, no merged model
    trained = torch.load(final / ckpt.STATE_FILE, weights_only=False)["trainable"]
    lora = [n for n in trained if "lora_" in n]
    assert lora and all(".language_model.layers." in n and n.split(".self_attn.")[1].split(".")[0] in
                        ("q_proj", "k_proj", "v_proj") for n in lora)
    assert {v.dtype for v in trained.values()} == {torch.bfloat16}
    history = json.loads((tmp_path / "run" / "train" / "history.json").read_text())
    assert [h["step"] for h in history] == [1, 2] and all(math.isfinite(h["total"]) for h in history)
    model_dir = tmp_path / "run" / "train" / "model"
    tuned, base = read_state_dict(model_dir), read_state_dict(CHECKPOINT)
    key = "model.layers.0.self_attn.q_proj.weight"
    assert tuned[key].dtype == torch.bfloat16 and not torch.equal(tuned[key].float(), base[key].float())
