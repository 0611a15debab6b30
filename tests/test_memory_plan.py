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
    # off the pool, each video keeps its prompt embeddings and two layers' states: 12 KiB a token in bf16
    assert p.retained_gb_per_video["10000"] == pytest.approx(10000 * (3 * 2048 * 2 + 2 + 48) / 1e9, abs=1e-4)
    assert p.headroom_needed_gb() == pytest.approx(p.working_gb + p.videos_in_flight["10000"] * p.retained_gb_per_video["10000"])
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


def _retained(obj, seen: set[int], found: dict[int, int]) -> None:
    """Sum into `found` (storage address -> bytes) every tensor reachable from `obj` through attributes,
    dataclass fields, lists, tuples and dicts, skipping modules and the tokenizer (shared by all videos)."""
    import torch

    if id(obj) in seen or isinstance(obj, (torch.nn.Module, str, bytes, int, float, bool, type(None))):
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        found[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
    elif isinstance(obj, dict):
        for v in obj.values():
            _retained(v, seen, found)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _retained(v, seen, found)
    elif hasattr(obj, "__dict__") and "tokeniz" not in type(obj).__name__.lower():
        for v in vars(obj).values():
            _retained(v, seen, found)


def test_what_a_release_video_retains_is_what_the_plan_counts():
    """Midway through its branches, the tensors a video in flight holds (its program's prompt embeddings,
    grounding and aggregation states, segment keys, ids; its media tokens, the raw inputs dropped once
    encoded) add up to the plan's `retained_bytes` within 10 %, with and without its media tokens."""
    import torch

    from bench.release_models import fixture_video, load
    from infer.engine.memory_plan import VideoDims, checkpoint_shape_and_weights, retained_bytes
    from infer.engine.requests import Request

    model = load()
    eng = CaptionEngine(model, InferConfig(device="cpu", max_events=3, max_branch_tokens=6))
    video = fixture_video()
    pending, seen = [Request(video, DecodeControl(num_events=2, lengths=[5]))], {}

    def feed():
        live = [v for v in eng._in_flight if v.phase.value == "branch" and v.steps >= 2]
        if live and not seen:
            without_inputs: dict[int, int] = {}
            _retained(live[0], {id(live[0].request.sample), id(live[0].prog.video)}, without_inputs)
            everything: dict[int, int] = {}
            _retained(live[0], set(), everything)
            seen.update(state=sum(without_inputs.values()), total=sum(everything.values()), prefix=live[0].prog.length)
        return pending.pop() if pending else None

    eng.run(feed, lambda req, res: None)
    shape, _ = checkpoint_shape_and_weights(FIXTURE, 4)
    t, h, w = video.grid_thw
    bare = VideoDims(prefix=seen["prefix"], timesteps=t)
    dims = dataclasses.replace(bare, patches=t * h * w, audio_chunks=int(video.mel.shape[0]))
    assert model.dtype == torch.float32
    assert retained_bytes(shape, bare, 4, 3) == pytest.approx(seen["state"], rel=0.10)
    assert retained_bytes(shape, dims, 4, 3) == pytest.approx(seen["total"], rel=0.10)
