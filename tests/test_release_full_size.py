"""bench/release_full_size.py on its scaled-down copy of the published configuration (no Ray, about a minute).

The full-size run (about 10 GB of disk and RAM) is not for CI: docs/benchmarks.md has its command and figures.
"""

from __future__ import annotations

import json

import pytest
import torch

from bench.release_full_size import BIN, FIXTURE, build_checkpoint, main, release_config

KEYS = FIXTURE.parent / "keys.txt"


def _structure(keys) -> set[str]:
    """Keys with their layer numbers blanked: the checkpoint's structure, whatever the depths."""
    return {".".join("N" if p.isdigit() and i > 1 else p for i, p in enumerate(k.split("."))) for k in keys}


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    root = tmp_path_factory.mktemp("release_full_size")
    out = root / "result.json"
    result = main(["--scale", "ci", "--cache", str(root), "--seconds", "4", "--size", "64", "--threads", "1",
                   "--max-events", "2", "--max-branch-tokens", "4", "--out", str(out)])
    return root, result, json.loads(out.read_text())


def test_the_scaled_down_checkpoint_is_the_releases_format_and_structure(measured):
    root, result, _ = measured
    ckpt, built = build_checkpoint(root, "ci")  # cached: the same directory, not rebuilt
    assert not built["built_now"] and str(ckpt) in {str(p) for p in root.iterdir()}
    state = torch.load(ckpt / BIN, weights_only=True, mmap=True)
    release = [line.split("\t")[0] for line in KEYS.read_text().splitlines()]
    assert _structure(state) == _structure(release) and "lm_head.weight" not in state  # tied head popped
    assert {t.dtype for k, t in state.items() if not k.endswith("position_ids")} == {torch.bfloat16}
    assert state["audio.qformer.bert.embeddings.position_ids"].dtype == torch.int64
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg == release_config("ci") and state["model.embed_tokens.weight"].shape == (151936, cfg["hidden_size"])
    assert len({k.split(".")[2] for k in state if k.startswith("model.layers.")}) == cfg["num_hidden_layers"]
    assert result["parameters"] == sum(t.numel() for t in state.values() if t.is_floating_point())


def test_the_offline_stages_caption_a_real_mp4_and_the_plan_is_compared(measured):
    _, result, written = measured
    assert written == json.loads(json.dumps(result))
    assert result["captioned"] and result["error"] == "" and result["dtype"] == "torch.bfloat16"
    assert result["caps"] == {"max_events": 2, "max_branch_tokens": 4} and result["events"] <= 2
    assert result["tokens"] <= 4 * result["events"]
    t, h, w = result["grid_thw"]
    assert result["av_tokens"] == t * (h // 2) * (w // 2) + 60  # 4 s of audio: one 30 s chunk, 60 tokens
    assert result["prefix_tokens"] > result["av_tokens"]
    assert set(result["stage_s"]) >= {"vision_tower", "audio_tower", "prefill", "planning", "decoding"}
    assert result["stage_s"]["vision_tower"] > 0 and result["stage_s"]["audio_tower"] > 0
    parts = result["plan_parts"]
    assert result["plan_predicted_bytes"] == parts["total"] == (parts["weights"] + parts["kv"] + parts["retained"]
                                                                + max(parts["encoders"], parts["working"]))
    assert parts["weights"] == result["checkpoint_bytes"]  # a bf16 file, planned in bf16: its size
    assert result["measured_peak_bytes"] > result["checkpoint_bytes"] and result["load_s"] > 0
