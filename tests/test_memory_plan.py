"""The memory plan (infer/engine/memory_plan.py) against what the engine really admits, and its command line.

Run: .venv/bin/python -m pytest tests/test_memory_plan.py -q
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from infer.engine.core import CaptionEngine
from infer.engine.memory_plan import Shape, main, plan, videos_that_fit, worst_pages
from infer.engine.paged import page_bytes
from infer.engine.sampling import DecodeControl
from pipeline.config import InferConfig
from tests.support.padcap import decoding_model, sample

FIXTURE = Path(__file__).parent / "data" / "release_golden" / "checkpoint"


@pytest.fixture(scope="module")
def model():
    return decoding_model()


@pytest.mark.parametrize("fit", [1, 3])
def test_the_plan_is_the_engines_admission_rule(model, fit):
    """A pool sized for `fit` worst cases of one prefix length: the engine keeps exactly that many
    videos in flight, and describe() (what /v1/model shows) says so."""
    videos = [sample(num_segments=9, seed=i, video_id=f"p{i}") for i in range(fit + 2)]
    prefix = len(model.make_example(videos[0], with_targets=False).layout)
    base = InferConfig(device="cpu", max_events=4, max_branch_tokens=8, page_size=4, max_batch_videos=16)
    w = CaptionEngine(model, base).weights
    per_page = page_bytes(w.num_layers, w.kv_heads, w.head_dim, 4, w.dtype)
    pages = fit * worst_pages(prefix, 4, 8, 4) + 1  # + the scratch page
    cfg = dataclasses.replace(base, kv_memory_gb=pages * per_page / 1e9)
    eng = CaptionEngine(model, cfg)
    assert eng.pool.pages == pages and videos_that_fit(pages, prefix, 4, 8, 4) == fit
    ctl = DecodeControl(num_events=4, lengths=[8])
    res = eng.caption(videos, controls=[ctl] * len(videos))
    assert all(r.error is None for r in res)
    assert max(r.videos for r in eng.stats["step_log"]) == fit
    assert eng.describe()["kv_pages"] == pages


def test_plan_figures_add_up():
    shape = Shape(layers=36, hidden=2048, heads=16, kv_heads=2, head_dim=128, intermediate=11008, vocab=151936)
    p = plan(shape, int(9.4e9), 24.0, [10000], max_events=30, max_branch_tokens=321)
    assert p.kv_bytes_per_token == 2 * 36 * 2 * 128 * 2  # 36 KiB: keys and values, every layer, bf16
    assert p.weights_gb + p.kv_pool_gb + p.headroom_gb <= 24.0 and p.headroom_gb >= p.working_gb
    assert p.videos_in_flight["10000"] == (p.pages - 1) // worst_pages(10000, 30, 321, 128)  # pages of 128 (CUDA)
    bigger = plan(shape, int(9.4e9), 80.0, [10000])
    assert bigger.videos_in_flight["10000"] > p.videos_in_flight["10000"]
    nothing = plan(shape, int(9.4e9), 8.0, [10000])  # the weights alone do not leave room
    assert nothing.pages == 0 and nothing.videos_in_flight["10000"] == 0


def test_command_line_on_a_checkpoint_and_a_shape(capsys):
    out = main(["--model", str(FIXTURE), "--device-memory-gb", "2", "--prefix-tokens", "500,1000", "--dtype", "float32",
                "--json"])
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(json.dumps(out))
    cfg = json.loads((FIXTURE / "config.json").read_text())
    assert out["shape"]["layers"] == cfg["num_hidden_layers"] and out["shape"]["kv_heads"] == cfg["num_key_value_heads"]
    assert out["plans"][0]["weights_gb"] > 0
    table = main(["--shape", "release-3b", "--device-memory-gb", "24", "80", "--prefix-tokens", "10000"])
    text = capsys.readouterr().out
    assert "videos@10000" in text and len(table["plans"]) == 2


def test_a_pool_layer_stays_within_the_cuda_kernels_int32_offsets(caplog):
    """Compiled flex addresses a pool layer with int32 offsets: a small model on a large GPU would pass 2**31
    elements a layer and read wrong keys silently, so the plan and the pool stop short of it, and the
    contract refuses a layer over it."""
    import torch

    from infer.engine.kernels import FLEX_CUDA_CONTRACT, INT32_ELEMENTS
    from infer.engine.paged import PagePool, max_pages

    small = Shape(layers=24, hidden=896, heads=14, kv_heads=2, head_dim=64, intermediate=4864, vocab=151936)  # 0.5B
    p = plan(small, int(1e9), 139.0, [10000])
    assert p.pages == max_pages(2, 64, 128, INT32_ELEMENTS) == INT32_ELEMENTS // (2 * 128 * 2 * 64)  # capped
    assert p.pages * 128 * 2 * 2 * 64 <= INT32_ELEMENTS < (p.pages + 1) * 128 * 2 * 2 * 64
    assert p.kv_pool_gb < 0.85 * (139.0 - 1.0 - 1.0)  # what the fraction alone would have given
    assert plan(small, int(1e9), 24.0, [10000]).pages < p.pages  # a smaller card: the budget decides

    import logging

    # read through the logger's own handler, with logging enabled: earlier tests in the suite (third-party
    # code) may have stopped its propagation, disabled it, or called logging.disable
    logger = logging.getLogger("padcap.infer")
    was_disabled, global_disable = logger.disabled, logging.root.manager.disable
    logger.disabled = False
    logging.disable(logging.NOTSET)
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level("WARNING", logger="padcap.infer"):
            pool = PagePool.for_budget(2, 2, 4, torch.float32, torch.device("cpu"), 4, 1 << 30,
                                       max_layer_elements=2 * 4 * 2 * 4 * 10)
    finally:
        logger.removeHandler(caplog.handler)
        logger.disabled = was_disabled
        logging.disable(global_disable)
    assert pool.pages == 10 and pool.layer[0].numel() == 2 * 4 * 2 * 4 * 10
    assert "KV pool capped at 10 pages" in caplog.text  # said, not silent
    assert PagePool.for_budget(2, 2, 4, torch.float32, torch.device("cpu"), 4, 1 << 20).pages == (1 << 20) // page_bytes(
        2, 2, 4, 4, torch.float32)  # no limit: the budget alone

    tight = dataclasses.replace(FLEX_CUDA_CONTRACT, page_multiple=1, q_block_multiple=1, max_layer_elements=100)
    from infer.engine.kernels import choose_kernel
    from tests.test_kernels import _layout

    kernel = choose_kernel("reference", torch.float32, torch.device("cpu"))
    pool, q, meta, _ = _layout(0, 4, 2, kernel)
    with pytest.raises(ValueError, match="int32 offsets"):
        tight.check(q, pool.layer[0], meta)
