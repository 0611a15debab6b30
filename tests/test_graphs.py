"""The step's CUDA graphs (infer/engine/graphs.py, pieces.py): buckets, routing, static buffers and padding,
against the eager step.

On the CPU the graphs' static path runs with the eager forward standing in for the replay
(infer.cuda_graphs=static): the same buffers, copies and padding a replay reads, so a step in
a bucket (whole or in pieces) must give the eager step's tokens and logits (1e-5, fp32), its
padding must never touch a real page, and each step must take the route `GraphPlan.route` gives
its metadata (layered prefill in pieces, steps over every bucket eagerly). The capture itself is
CUDA only (skipped here).
"""

from __future__ import annotations

import copy
import dataclasses
import logging

import pytest
import torch

from infer.engine.core import CaptionEngine
from infer.engine.graphs import Buckets, GraphPlan, StepKey, coverage, graph_buckets, piece_buckets
from infer.engine.requests import Request
from infer.oracles.ablation import caption_engine
from tests.test_engine_batch import CPU, alone, assert_pool_empty, assert_same, controls, decode_all, model, videos  # noqa: F401 - the same module fixtures

FLEX = dataclasses.replace(CPU, kernel="flex", kv_memory_gb=0.004, max_batch_videos=3, step_tokens=64)


@pytest.fixture(scope="module")
def eager(model, videos, controls):
    got, _, _, eng = decode_all(model, FLEX, videos, controls)
    assert eng.graphs is None
    return got


def test_buckets_are_powers_of_two_and_fit_the_smallest():
    b = graph_buckets(200, 20)
    assert b.tokens == (8, 16, 32, 64, 128, 256) and b.blocks == (1, 2, 4, 8, 16, 32)
    assert b.fit(1, 1) == (8, 1) and b.fit(9, 3) == (16, 4) and b.fit(256, 32) == (256, 32)
    assert b.fit(12, 16) == (16, 16)  # a step's blocks are padded to a power of two: may exceed its tokens
    assert b.fit(257, 1) is None and b.fit(8, 64) is None
    assert (8, 16) not in b.pairs() and (16, 16) in b.pairs()
    assert graph_buckets(5, 1) == Buckets((8,), (1,))
    with pytest.raises(ValueError):
        graph_buckets(0, 4)


def test_static_graph_steps_equal_the_eager_steps(model, videos, controls, eager):
    """Every step through the buckets' buffers (prefill chunks, planning rows, branch rows of three
    videos at once, pages freed and reused in a small pool) == the eager engine, token for token."""
    got, _, log, eng = decode_all(model, dataclasses.replace(FLEX, cuda_graphs="static"), videos, controls)
    g = eng.describe()["graphs"]
    assert g["replayed"] == len(log) and g["eager"] == g["pieces"] == 0 and not g["captured"]
    for a, b in zip(got, eager):
        assert_same(a, b)
    assert_pool_empty(eng)
    eng.reset_stats()  # benchmarks count after their warm-up
    assert eng.graphs.stats == {"replayed": 0, "pieces": 0, "eager": 0}


def test_routes_whole_steps_pieces_and_eager():
    plan = GraphPlan(graph_buckets(64, 8), piece_buckets(200), q_block=64, capture_layers=(1, 3))
    assert plan.pieces == (8, 16, 32, 64, 128, 256)
    assert plan.route(StepKey(12, 2, 64, False, (1,))) == ("full", (16, 2))
    assert plan.route(StepKey(12, 2, 64, True, ())) == ("pieces", 16)  # a layered block's parts: pieces
    assert plan.route(StepKey(12, 2, 16, False, ())) == ("pieces", 16)  # another query block
    assert plan.route(StepKey(12, 0, 0, False, ())) == ("pieces", 16)  # a gathering kernel's metadata
    assert plan.route(StepKey(100, 2, 64, False, ())) == ("pieces", 128)  # over the whole steps' tokens
    assert plan.route(StepKey(257, 2, 64, False, ())) == ("eager", None)
    assert GraphPlan(None, (8,)).route(StepKey(8, 1, 64, False, ())) == ("pieces", 8)
    assert coverage([]) is None and coverage(["eager", "full"]) == 0.5


def test_arrival_order_and_uncovered_steps(model, videos, controls, eager):
    """Reversed arrivals, a budget of 8 tokens (bidirectional blocks prefilled layer by layer: those steps run
    in pieces, their parts eagerly between) and whole-step buckets of at most 8 tokens: whole steps and pieces
    interleave, each step where `GraphPlan.route` sends it, and the stats count what the step log says."""
    cfg = dataclasses.replace(FLEX, cuda_graphs="static", step_tokens=8, max_batch_videos=2)
    order = list(reversed(range(len(videos))))
    eng = CaptionEngine(model, cfg)
    forward, routes = eng.graphs.forward, []

    def routed(batch):
        routes.append(eng.graphs.plan.route(StepKey.of(batch))[0])
        return forward(batch)

    eng.graphs.forward = routed
    got, log = {}, None
    eng.run(iter([Request(videos[i], controls[i], tag=i) for i in order]), lambda req, res: got.__setitem__(req.tag, res))
    log, g = eng.stats["step_log"], eng.describe()["graphs"]
    assert [r.graph for r in log] == routes
    assert g["replayed"] == routes.count("full") > 0 and g["pieces"] == routes.count("pieces") > 0
    assert g["eager"] == routes.count("eager") and g["coverage"] == coverage(routes)
    assert any(r.layer_tokens and r.graph == "pieces" for r in log)
    got = [got[i] for i in range(len(videos))]
    for a, b in zip(got, eager):
        assert_same(a, b)
    assert_pool_empty(eng)


def test_pieces_replay_mixed_and_layered_steps_equal_alone(model, videos, controls, alone):
    """The CPU's kernel (sdpa) in pieces only: every step (prefill chunks, planning and branch rows of the
    videos in flight, layered blocks at a budget of 32) through the pieces' padded buffers, attention between
    them, == each video decoded alone eagerly."""
    cfg = dataclasses.replace(CPU, cuda_graphs="static", step_tokens=32, max_batch_videos=3)
    got, _, log, eng = decode_all(model, cfg, videos, controls)
    assert {r.graph for r in log} == {"pieces"} and any(r.layer_tokens for r in log) and any(
        r.branch_rows and r.prefill_tokens for r in log)
    assert eng.describe()["graphs"]["coverage"] == 1.0
    for a, b in zip(got, alone):
        assert_same(a, b)
    assert_pool_empty(eng)


def test_padding_writes_only_the_scratch_page(model, videos, controls):
    """A covered step's padding tokens write their KV to the scratch page and nowhere else: every pool slot
    that changes is one of the step's own slots or on page 0."""
    eng = CaptionEngine(copy.deepcopy(model), dataclasses.replace(FLEX, cuda_graphs="static"))
    S = eng.pool.page_size
    seen = {"steps": 0}
    forward = eng.graphs.forward

    def checked(batch):
        before = eng.pool.kv.clone()
        out = forward(batch)
        changed = (eng.pool.kv != before).flatten(2).any(-1).any(0).nonzero().flatten()  # slots, all layers
        allowed = set(batch.slots.tolist()) | set(range(S))
        assert set(changed.tolist()) <= allowed
        how, key = eng.graphs.route(batch)
        if how != "eager" and (key if how == "pieces" else key[0]) > batch.attn.tokens:
            seen["steps"] += 1
        return out

    eng.graphs.forward = checked
    reqs = [Request(videos[i], controls[i], tag=i) for i in (1, 3)]
    eng.run(iter(reqs), lambda req, res: None)
    assert seen["steps"] > 0  # steps that were padded were checked


def test_graphs_say_what_runs(model):
    s = CaptionEngine(model, dataclasses.replace(CPU, cuda_graphs="static")).describe()["graphs"]  # sdpa: pieces only
    assert s["token_buckets"] == [] and s["piece_buckets"] == [8, 16, 32, 64, 128, 256, 512, 1024]
    d = CaptionEngine(model, CPU).describe()["graphs"]
    assert d == {"captured": False, "reason": "infer.cuda_graphs=auto (captured on CUDA with the parallel decoder only)"}
    assert CaptionEngine(model, dataclasses.replace(FLEX, cuda_graphs="off")).graphs is None
    # the single-chain baseline takes no steps: nothing to record
    assert caption_engine(model, dataclasses.replace(FLEX, cuda_graphs="static", decoder="monolithic")).graphs is None
    s = CaptionEngine(model, dataclasses.replace(FLEX, cuda_graphs="static", graph_tokens=32)).describe()["graphs"]
    assert s["token_buckets"] == [8, 16, 32] and s["block_buckets"] == [1, 2, 4, 8] and not s["captured"]
    with pytest.raises(ValueError, match="graph_tokens"):
        CaptionEngine(model, dataclasses.replace(FLEX, graph_tokens=0))


def test_a_start_up_failure_in_building_the_graphs_runs_eagerly(model, videos, controls, eager, monkeypatch, caplog):
    """A check made while the static buffers are built fails (a torch whose BlockMask copies its block table,
    forced by handing it a copy of the static table): the engine is still built and captions every video eagerly,
    equal to the eager engine, and describe() and the log say why."""
    from infer.engine import graphs as graphs_module

    real = graphs_module.flex_block_mask
    monkeypatch.setattr(graphs_module, "flex_block_mask",
                        lambda meta, pool, indices: real(meta, pool, indices=indices.clone()))
    with caplog.at_level(logging.WARNING, logger="padcap.infer"):
        got, _, log, eng = decode_all(model, dataclasses.replace(FLEX, cuda_graphs="static"), videos, controls)
    g = eng.describe()["graphs"]
    assert not g["enabled"] and not g["captured"]
    assert g["reason"].startswith("building the graphs' static buffers failed, running eagerly: RuntimeError:")
    assert "copies its block table" in g["reason"] and g["reason"] in caplog.text
    assert g["eager"] == len(log) > 0 and g["replayed"] == g["pieces"] == 0 and {r.graph for r in log} == {"eager"}
    for a, b in zip(got, eager):
        assert_same(a, b)
    assert_pool_empty(eng)


@pytest.mark.gpu
def test_cuda_graphs_are_captured_and_replay_the_eager_step(model, videos, controls):
    """On CUDA (fp32): graphs captured at start-up for every bucket; the replayed steps give the eager
    engine's tokens and logits (1e-4: the padded GEMMs may sum in another order)."""
    cfg = dataclasses.replace(CPU, device="cuda", dtype="float32", step_tokens=64, graph_tokens=64,
                              kv_memory_gb=1.0)
    ref, _, _, _ = decode_all(copy.deepcopy(model), dataclasses.replace(cfg, cuda_graphs="off"), videos, controls)
    got, _, log, eng = decode_all(copy.deepcopy(model), cfg, videos, controls)
    g = eng.describe()["graphs"]
    assert g["captured"], g["reason"]
    assert g["replayed"] > 0 and g["replayed"] + g["eager"] == len(log)
    for x, y in zip(got, ref):
        assert x.tokens == y.tokens
        for p, q in zip(x.branch_logits, y.branch_logits):
            torch.testing.assert_close(p, q, atol=1e-4, rtol=0)
