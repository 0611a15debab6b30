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
