"""infer/engine/staging.py: a step's tensors packed as bytes and viewed back exactly (any dtype, shape,
alignment), and the engine reading each step's outputs through one `to_host` call."""

from __future__ import annotations

import torch

import infer.engine.core as core
from infer.engine.core import CaptionEngine
from infer.engine.staging import Staging, _pack, _spans, _unpack, to_host
from tests.test_engine_batch import CPU, controls, model, videos  # noqa: F401 - the same module fixtures


def test_bytes_round_trip_every_dtype_exactly():
    ts = [torch.arange(5), None, torch.tensor([[1, -2, 3]], dtype=torch.int32), torch.randn(3, 2),
          torch.tensor([0.1, 3.5, -7.25], dtype=torch.bfloat16), torch.zeros(0, dtype=torch.long),
          torch.tensor([True, False])]
    spans, total = _spans(ts)
    assert all(a % 8 == 0 for a in spans) and total % 8 == 0
    buf = torch.full((total,), 255, dtype=torch.uint8)
    _pack(ts, buf, spans)
    back = _unpack(buf, ts, spans)
    assert back[1] is None
    for a, b in zip(ts, back):
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    assert Staging(torch.device("cpu")).to_device(ts[:1])[0] is ts[0]  # on the CPU: the tensor itself


def test_one_read_of_the_outputs_per_step(model, videos, controls, monkeypatch):
    """Every step's host reads (branch tokens, planning logits, the programs' readouts) go through one
    to_host call: as many calls as steps."""
    calls = []
    monkeypatch.setattr(core, "to_host", lambda ts: calls.append(len(ts)) or to_host(ts))
    eng = CaptionEngine(model, CPU)
    eng.caption(videos[:3], controls=controls[:3])
    assert len(calls) == eng.stats["steps"] > 0 and max(calls) > 2  # a step with branch tokens and decisions


def test_two_host_to_device_copies_per_step(model, videos, controls):
    """What a step sends to the device goes in two staging calls, each one pinned copy on CUDA: the scheduler's
    (positions, slots, branch token ids, the page table's changes) and the flex metadata's; a layered block's
    part adds its own metadata's (built as the part runs)."""
    import dataclasses

    eng = CaptionEngine(model, dataclasses.replace(CPU, kernel="flex", kv_memory_gb=0.004, max_batch_videos=3,
                                                   step_tokens=64))
    calls, per_step = [], []
    stage, plan = eng.pool.staging.to_device, eng.scheduler.plan
    eng.pool.staging.to_device = lambda ts: calls.append(len(ts)) or stage(ts)

    def counted(videos):
        calls.clear()
        p = plan(videos)
        per_step.append((len(calls), bool(p and p.jobs)))
        return p

    eng.scheduler.plan = counted
    eng.caption(videos[:3], controls=controls[:3])
    assert any(not jobs for _, jobs in per_step) and all(n == 2 for n, jobs in per_step if not jobs)
