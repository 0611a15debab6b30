"""The training stage on a real local Ray cluster: TorchTrainer with 2 CPU workers (DDP over gloo)
reading preprocess shards from S3 and writing to S3, DeepSpeed ZeRO-2 on CPU, and a worker killed
mid-run that Ray Train restarts from the latest checkpoint.

Tiny corpus (4 short synthetic videos through the real preprocess job), a few steps each.
Run under the machine-wide Ray lock: flock /tmp/padcap-ray.lock .venv/bin/python -m pytest ..."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
import torch

from pipeline import storage
from pipeline.config import load_config
from pipeline.model import PadCaptioner
from preprocess import manifest as mf
from preprocess.job import run_preprocess
from preprocess.synthetic import generate_corpus
from train import checkpoint as ckpt

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "torch_extensions"))


def small_cfg(*extra):
    return load_config(ROOT / "cluster/configs/default.yaml", [
        "data.synthetic.num_videos=4", "data.synthetic.min_duration=8", "data.synthetic.max_duration=9",
        "data.synthetic.max_events=2", "features.min_frames=8", "features.max_frames=16",
        "cluster.preprocess_actors=1",
        "train.num_workers=2", "train.batch_size=1", "train.log_every=1", "train.val_samples=1",
        "train.eval_samples=1", "train.warmup_steps=1", "train.torch_threads=1",
        "infer.max_events=3", "infer.max_branch_tokens=6", *extra])


@pytest.fixture(scope="module")
def shards(ray_local, tmp_path_factory):
    cfg = small_cfg()
    root = tmp_path_factory.mktemp("train-corpus")
    info = generate_corpus(str(root / "synth"), cfg.data.synthetic, progress=False)
    out = str(root / "shards")
    summary = run_preprocess(cfg, {s: (p, "longvale") for s, p in info.longvale.items()}, info.video_dir, out)
    assert summary["ok"] == 4 and summary["splits"] == {"test": 1, "train": 3}
    return out


def check_outputs(summary, out_dir, steps, local_dir=None):
    assert summary["steps"] == steps and summary["loss_total"] > 0
    assert any(row.startswith("held-out") for row in summary["table"])
    summary = storage.read_json(summary["details"])  # the full record
    model = PadCaptioner.from_pretrained(_local(storage.join(out_dir, "model"), local_dir))
    assert model.trainable_parameters()
    assert storage.exists(storage.join(out_dir, "learning_curve.png"))
    hist = storage.read_json(storage.join(out_dir, "history.json"))
    assert [h["step"] for h in hist] == list(range(1, steps + 1))
    assert all(h["total"] > 0 and h["tokens_per_s"] > 0 for h in hist)
    assert "grounding_f1@0.5" in summary["val"] and summary["heldout"]["videos"] == 1
    # the end-of-stage evaluation really decoded with the engine (a failure would fall back to teacher-forced)
    assert summary["heldout"]["headline"] == "free_running", summary["heldout"]["free_running"]
    assert summary["heldout"]["free_running"]["decoder"] == "parallel"
    return hist


def _local(path, local_dir):
    """A remote model dir copied under the test's own tmp dir (a fixed /tmp path would outlive the test and
    could hand a later run a stale model)."""
    if not storage.is_remote(path):
        return path
    local = Path(local_dir) / "model"
    fs, inner = storage.filesystem(path)
    fs.get(inner.rstrip("/") + "/", str(local), recursive=True)
    return local


def test_ddp_two_workers_s3_in_and_out(ray_local, shards, s3_server, tmp_path):
    from train.trainer import run_train

    storage.upload_dir(shards, "s3://test/train-shards")
    rows = mf.read_table(mf.manifest_path(shards))
    for r in rows:  # the manifest names local shard files: point it at the uploaded copies
        r["shard"] = r["shard"].replace(shards, "s3://test/train-shards")
    mf.write_table(mf.manifest_path("s3://test/train-shards"), rows)
    cfg = small_cfg("train.max_steps=4", "train.checkpoint_every=2", "train.val_every=2", "train.keep_checkpoints=1",
                    "train.backend=ddp")
    summary = run_train(cfg, "s3://test/train-shards", "s3://test/train-out")
    hist = check_outputs(summary, "s3://test/train-out", 4, local_dir=tmp_path)
    summary = storage.read_json(summary["details"])
    assert summary["backend"] == "ddp" and summary["workers"] == 2
    assert [h["step"] for h in hist if "val_token_acc" in h] == [2, 4]
    assert summary["checkpoint"].startswith("test/train-out/ray/") and summary["checkpoint"].endswith("checkpoint_0000004")
    ckpts = [p for p in storage.list_files("s3://test/train-out/ray", (ckpt.STATE_FILE,))]
    assert len(ckpts) == 1  # keep_checkpoints=1: only the final one stays
    assert storage.exists("s3://test/train-out/model/adapter/adapter_config.json")


def test_relative_shard_paths_reach_the_workers(ray_local, shards, tmp_path, monkeypatch):
    """A manifest written from a relative run directory names its shards relative to the driver's
    directory; the workers (which run elsewhere) still read the held-out set for validation."""
    from train.trainer import run_train

    monkeypatch.chdir(Path(shards).parent)
    rows = mf.read_table(mf.manifest_path(shards))
    for r in rows:
        r["shard"] = os.path.relpath(r["shard"])
    os.makedirs("relative", exist_ok=True)
    mf.write_table(mf.manifest_path("relative"), rows)
    cfg = small_cfg("train.max_steps=2", "train.checkpoint_every=0", "train.val_every=1", "train.backend=ddp")
    summary = run_train(cfg, "relative", str(tmp_path / "out"))
    hist = storage.read_json(storage.join(str(tmp_path / "out"), "history.json"))
    assert [h["step"] for h in hist if "val_colour_acc" in h] == [1, 2], summary


def test_deepspeed_zero2_on_cpu_two_workers(ray_local, shards, tmp_path):
    from train.trainer import run_train

    cfg = small_cfg("train.max_steps=3", "train.checkpoint_every=2", "train.val_every=0", "train.backend=deepspeed",
                    "train.zero_stage=2", "train.grad_accum=2")
    summary = run_train(cfg, shards, str(tmp_path / "out"))
    check_outputs(summary, str(tmp_path / "out"), 3)
    summary = storage.read_json(summary["details"])
    assert summary["backend"] == "deepspeed"
    final = Path(summary["checkpoint"])
    parts = sorted(p.name for p in (final / ckpt.DEEPSPEED_DIR / ckpt.DS_TAG).iterdir())
    assert any("zero_pp_rank_0" in p for p in parts) and any("zero_pp_rank_1" in p for p in parts), parts
    assert sorted(p.name for p in (final / "rng").iterdir()) == ["rank_0.pt", "rank_1.pt"]


def test_killed_worker_restarts_from_the_latest_checkpoint(ray_local, shards, tmp_path):
    from tests.support.train_faults import CrashAt
    from train.trainer import run_train

    marker = tmp_path / "crashed.txt"
    restored = lambda: set(Path(tempfile.gettempdir()).glob("padcap-restore-*"))  # noqa: E731
    before = restored()
    cfg = small_cfg("train.max_steps=5", "train.checkpoint_every=2", "train.val_every=0", "train.max_failures=1",
                    "train.backend=ddp")
    summary = run_train(cfg, shards, str(tmp_path / "out"), on_step=CrashAt(step=3, marker=str(marker), rank=1))
    assert marker.read_text().startswith("rank 1 exited at step 3")  # the first attempt really died
    hist = check_outputs(summary, str(tmp_path / "out"), 5)
    summary = storage.read_json(summary["details"])
    assert summary["resumes"] == 1
    # attempt 2 resumed from the step-2 checkpoint: its steps 3.. continue the saved history
    state = torch.load(Path(summary["checkpoint"]) / ckpt.STATE_FILE, weights_only=False)
    assert state["step"] == 5
    assert json.loads((Path(summary["checkpoint"]) / "config.json").read_text())["train"]["max_steps"] == 5
    assert [h["resumes"] for h in hist] == [0, 0, 1, 1, 1]  # steps 1-2 from attempt 1, 3-5 after the restart
    assert restored() - before == set(), "the restored checkpoint copies were left behind"
