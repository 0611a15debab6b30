"""The driver with the published model's format: preprocess with the release encoders, fine-tune the
tiny release-format checkpoint with Ray Train, caption with the result, evaluate (local Ray)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline.config import Config, apply_overrides
from pipeline.release.checkpoint import is_release_dir, read_state_dict

pytestmark = [pytest.mark.integration, pytest.mark.slow]
CHECKPOINT = Path(__file__).parent / "data" / "release_golden" / "checkpoint"


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


@pytest.fixture
def local_ray():
    """The driver starts a local Ray instance; stop it after the test (later tests start their own)."""
    import ray

    yield
    ray.shutdown()


def test_finetune_and_caption_with_the_release_format_model(tmp_path, local_ray):
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
