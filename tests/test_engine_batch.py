"""Many videos per step (infer/engine/core.py, infer/engine/scheduler.py, infer/engine/step.py) against each video alone.

The same randomised tiny PadCaptioner as tests/test_engine.py (fp32, CPU). A mix of videos
with different prefix lengths, event counts and forced caption lengths is decoded (a) one
video at a time, (b) all together, (c) with a small token budget, so that prefill chunks
and planning rows of newcomers ride in the same forwards as other videos' branch rows,
arriving in several orders, (d) with a KV pool so small that admission waits for pages and
later videos reuse pages earlier ones freed, (e) with every attention kernel. Tokens must be
identical and logits within 1e-5: a token's arithmetic may never depend on what else shares
its step or who held its pages before.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from infer.engine.core import CaptionEngine
from infer.engine.paged import pages_for
from infer.engine.requests import Request
from infer.engine.sampling import DecodeControl
from infer.oracles.decoders import branch_sequential, full_recompute
from pipeline.config import InferConfig
from pipeline.model import PadCaptioner
from tests.support.padcap import decoding_model, sample, tiny_cfg

CPU = InferConfig(device="cpu", max_branch_tokens=16, max_events=8, max_batch_rows=64, max_batch_videos=8)
MIX = [  # (segments, forced K, forced lengths): prefixes 5..14 segments, K 1..5, lengths 1..13
    (5, 1, [1]),  # a video that ends at its first token
    (9, 4, [2, 6, 1, 3]),
    (12, 2, [5, 2]),
    (7, 5, [2, 13, 1, 7, 3]),
    (14, 3, [4, 9, 2]),
    (6, 1, [11]),
]


@pytest.fixture(scope="module")
def model():
    return decoding_model()


@pytest.fixture(scope="module")
def videos():
    return [sample(num_segments=t, seed=t, video_id=f"v{t}") for t, _, _ in MIX]


@pytest.fixture(scope="module")
def controls():
    return [DecodeControl(num_events=k, lengths=lens, trace=True) for _, k, lens in MIX]


@pytest.fixture(scope="module")
def alone(model, videos, controls):
    eng = CaptionEngine(model, CPU)
    return [eng.decode(v, c) for v, c in zip(videos, controls)]


def decode_all(model, cfg, videos, controls, order=None):
    """Run the engine over the requests in `order`; -> (Decoded per video in input order,
    [(tag, steps taken when it arrived)], the engine's step log, the engine)."""
    order = list(range(len(videos))) if order is None else order
    eng = CaptionEngine(model, cfg)
    got, admitted = {}, []
    reqs = iter([Request(videos[i], controls[i], tag=i) for i in order])

    def feed():
        req = next(reqs, None)
        if req is not None:
            admitted.append((req.tag, eng.stats["steps"]))
        return req

    eng.run(feed, lambda req, res: got.__setitem__(req.tag, res))
    return [got[i] for i in range(len(videos))], admitted, eng.stats["step_log"], eng


def assert_same(a, b, atol=1e-5):
    assert a.tokens == b.tokens and a.intervals == b.intervals
    for x, y in zip(a.branch_logits, b.branch_logits):
        torch.testing.assert_close(x, y, atol=atol, rtol=0)
    torch.testing.assert_close(a.planning_logits, b.planning_logits, atol=atol, rtol=0)
    torch.testing.assert_close(a.grounding_logits, b.grounding_logits, atol=atol, rtol=0)


def assert_pool_empty(eng):
    assert eng.pool.allocated == 0 and eng.pool.free_pages == eng.pool.usable


def test_all_videos_in_one_batch_equal_each_alone(model, videos, controls, alone, monkeypatch):
    from infer.engine.programs import PadProgram

    groups, finish_all = [], PadProgram.finish_all
    monkeypatch.setattr(PadProgram, "finish_all", staticmethod(lambda progs: groups.append(len(progs)) or finish_all(progs)))
    got, _, log, eng = decode_all(model, CPU, videos, controls)
    assert sum(groups) == len(MIX) and max(groups) >= 2  # videos whose planning ended in one step, grounded together
    for a, b in zip(got, alone):
        assert_same(a, b)
    assert log[0].videos == len(MIX) and log[0].prefill_tokens == sum(  # one step prefilled them all
        len(CaptionEngine(model, CPU).model.make_example(v, with_targets=False).layout) for v in videos)
    assert max(r.branch_rows for r in log) > max(k for _, k, _ in MIX)  # several videos' branches per step
    assert_pool_empty(eng)


@pytest.mark.parametrize("order", [[0, 1, 2, 3, 4, 5], [5, 3, 1, 0, 2, 4], [3, 4, 0, 5, 2, 1]])
def test_chunked_prefill_and_planning_ride_with_decoding_in_any_order(model, videos, controls, alone, order):
    """A budget of 24 tokens per step: newcomers' prefill arrives in chunks (their bidirectional
    AV blocks, 20-56 tokens, one layer per step) and their planning rows one per step, in the same
    forwards as the branch rows of videos already decoding."""
    cfg = dataclasses.replace(CPU, step_tokens=24, max_batch_rows=8, max_batch_videos=3)
    got, admitted, log, eng = decode_all(model, cfg, videos, controls, order)
    for a, b in zip(got, alone):
        assert_same(a, b)
    assert max(r.branch_rows for r in log) <= 8 and max(r.videos for r in log) <= 3
    assert any(step > 0 for _, step in admitted)  # some videos joined a running batch
    assert any(r.branch_rows and r.prefill_tokens for r in log)  # prefill beside decoding
    assert any(r.branch_rows and r.layer_tokens for r in log)  # AV blocks over the budget: by layer
    assert any(r.branch_rows and r.plan_rows for r in log)  # planning beside decoding
    assert all(r.prefill_tokens == 0 or r.tokens <= 24 or r.prefill_tokens == r.tokens - r.branch_rows - r.plan_rows
               for r in log)
    assert_pool_empty(eng)


@pytest.mark.parametrize("order", [[0, 1, 2, 3, 4, 5], [4, 2, 5, 0, 3, 1]])
def test_layered_blocks_of_several_videos_move_together_beside_decoding(model, videos, controls, alone, order,
                                                                         monkeypatch):
    """A budget of 10 tokens: every AV block (20-56 tokens, 2-6x the budget) is prefilled by layer, charged
    what its parts cost, so it moves through several layers a step; several videos' blocks share steps;
    videos arrive while another's block is between layers; every running branch row is in every step."""
    from infer.engine.scheduler import Phase, Scheduler

    cfg = dataclasses.replace(CPU, step_tokens=10, q_block=4, max_batch_rows=8, max_batch_videos=4)
    steps, plan = [], Scheduler.plan

    def recording(self, vids):
        decoding = [(v, v.rows) for v in vids if v.phase is Phase.BRANCH]
        out = plan(self, vids)
        steps.append(([(v, k) for v, _, k in out.branch], decoding, [(job.span, job.parts) for _, job in out.jobs],
                      any(v.job is not None and v.job.layer > 0 for v in vids)))
        return out

    monkeypatch.setattr(Scheduler, "plan", recording)
    eng = CaptionEngine(model, cfg)
    reqs, admitted_mid_block = iter([Request(videos[i], controls[i], tag=i) for i in order]), []

    def feed():  # the next video only while nothing is in flight or a block is between layers
        mid = bool(steps) and steps[-1][3]
        req = next(reqs, None) if mid or not eng._in_flight else None
        admitted_mid_block.append(mid and req is not None)
        return req

    got = {}
    eng.run(feed, lambda req, res: got.__setitem__(req.tag, res))
    for i, b in enumerate(alone):
        assert_same(got[i], b)
    spans = {hi - lo for _, _, jobs, _ in steps for (lo, hi), _ in jobs}
    assert min(spans) >= 2 * 10 and max(spans) <= 8 * 10
    assert any(admitted_mid_block)
    assert any(len(jobs) >= 2 for _, _, jobs, _ in steps)  # several videos' blocks in one step
    assert any(len({li for li, _, _ in parts}) >= 2 for _, _, jobs, _ in steps for _, parts in jobs)
    assert any(branch and jobs for branch, _, jobs, _ in steps)
    assert all(branch == decoding for branch, decoding, _, _ in steps)  # every running branch row, every step
    assert_pool_empty(eng)


def test_admission_waits_for_pages_and_reused_pages_do_not_leak(model, videos, controls, alone):
    """A pool with room for about two videos' worst case: the others wait for pages, then take
    pages earlier videos freed (with those videos' keys still in them); decode is unchanged."""
    probe = CaptionEngine(model, CPU)
    S = 4
    worst = max(pages_for(len(model.make_example(v, with_targets=False).layout) + CPU.max_events, S)
                + CPU.max_events * pages_for(CPU.max_branch_tokens, S) for v in videos)
    per_page = probe.pool.bytes_per_page // probe.pool.page_size * S
    cfg = dataclasses.replace(CPU, page_size=S, kv_memory_gb=(2 * worst + 3) * per_page / 1e9, step_tokens=40)
    got, _, log, eng = decode_all(model, cfg, videos, controls, [4, 0, 3, 1, 5, 2])
    for a, b in zip(got, alone):
        assert_same(a, b)
    assert max(r.videos for r in log) < len(videos)  # admission was gated by free pages (8 slots)
    total = sum(pages_for(len(model.make_example(v, with_targets=False).layout) + k, S) + sum(
        pages_for(min(n, CPU.max_branch_tokens), S) for n in lens) for v, (_, k, lens) in zip(videos, MIX))
    assert eng.pool.peak_pages <= eng.pool.usable < total  # pages were freed and handed to later videos
    assert_pool_empty(eng)


@pytest.mark.parametrize("kernel", ["reference", "sdpa", "flex"])
def test_every_kernel_decodes_the_same(model, videos, controls, alone, kernel):
    """The kernels behind infer.kernel through the whole engine (flex: eager on the CPU, on a small pool)."""
    cfg = dataclasses.replace(CPU, kernel=kernel, kv_memory_gb=0.004, max_batch_videos=3, step_tokens=64)
    got, _, _, eng = decode_all(model, cfg, videos[:4], controls[:4])
    assert eng.describe()["kernel"] == kernel
    for a, b in zip(got, alone[:4]):
        assert_same(a, b, atol=1e-5)


def test_one_attention_call_per_block_decodes_the_same(model, videos, controls, alone):
    """infer.attention_calls=0 (a call per query block, no padding) through the whole engine, chunked prefill
    and planning riding with decoding: the same tokens and logits as each video alone, and reported."""
    cfg = dataclasses.replace(CPU, attention_calls=0, max_batch_videos=3, step_tokens=64)
    got, _, _, eng = decode_all(model, cfg, videos, controls)
    assert "one call per query block" in eng.describe()["kernel_reason"]
    for a, b in zip(got, alone):
        assert_same(a, b, atol=1e-5)


def test_batched_equals_the_reference_decoders(model, videos, controls, alone):
    for v, c, a in zip(videos[:3], controls[:3], alone[:3]):
        for ref in (full_recompute, branch_sequential):
            r = ref(model, v, CPU, c)
            assert a.tokens == r.tokens
            for x, y in zip(a.branch_logits, r.branch_logits):
                torch.testing.assert_close(x, y, atol=1e-4, rtol=0)


def test_caption_keeps_input_order_and_errors_in_place(model, videos):
    bad = dataclasses.replace(videos[1], video_id="nan", duration=float("nan"))
    eng = CaptionEngine(model, dataclasses.replace(CPU, max_events=3, max_branch_tokens=4))
    results = eng.caption([videos[0], bad, videos[2]])
    assert [r.video_id for r in results] == ["v5", "nan", "v12"]
    assert results[1].error and "duration" in results[1].error and results[1].events == []
    assert results[0].error is None and results[2].error is None


def test_cancelled_request_leaves_the_batch(model, videos, controls, alone):
    eng = CaptionEngine(model, CPU)
    flag = {"cancel": False}
    steps = {"n": 0}
    forward = eng.runner.forward

    def counting(batch):
        steps["n"] += 1
        if steps["n"] == 3:
            flag["cancel"] = True
        return forward(batch)

    eng.runner.forward = counting
    reqs = [Request(videos[3], controls[3], tag=3), Request(videos[1], controls[1], cancelled=lambda: flag["cancel"], tag=1)]
    got = {}
    eng.run(iter(reqs), lambda req, res: got.__setitem__(req.tag, res))
    assert set(got) == {3}  # the cancelled one never reports
    assert_same(got[3], alone[3])
    assert_pool_empty(eng)


def test_capped_branches_are_marked(model, videos):
    eng = CaptionEngine(model, dataclasses.replace(CPU, max_branch_tokens=5))
    res = eng.caption([videos[3]], controls=[DecodeControl(num_events=3, lengths=[2, 9, 5])])[0]
    assert sorted(res.capped) == [False, False, True]  # only the 9-token branch hit the cap of 5
    assert all(e.caption for e, c in zip(res.events, res.capped) if c)  # a capped caption is still returned
    auto = CaptionEngine(model, dataclasses.replace(CPU, max_branch_tokens=0, max_events=0)).cfg
    assert auto.max_branch_tokens == model.cfg.max_caption_tokens + 1 and auto.max_events == 30  # the model's own


def test_long_video_is_fitted_like_training_and_says_so(model):
    small = decoding_model(max_seq_len=120)
    long = sample(num_segments=40, seed=4, video_id="long")  # 40 x 4 tokens: far over 120
    cfg = dataclasses.replace(CPU, max_events=4, max_branch_tokens=6)
    ctl = DecodeControl(num_events=2, lengths=[3, 5], trace=True)
    res = CaptionEngine(small, cfg).caption([long], controls=[ctl])[0]
    assert res.error is None and res.segments_total == 40 and 0 < res.segments_kept < 40
    prefix = len(small.prompt[0]) + len(small.prompt[1]) + 4 * res.segments_kept
    assert prefix + cfg.max_events + cfg.max_branch_tokens <= 120 < prefix + 4 + cfg.max_events + cfg.max_branch_tokens
    for e in res.events:
        assert 0.0 <= e.start < e.end <= 40.0
    ref = full_recompute(small, long, cfg, ctl)
    eng = CaptionEngine(small, cfg).decode(long, ctl)
    assert eng.tokens == ref.tokens and ref.timings["segments_kept"] == res.segments_kept


def test_flex_with_layered_prefill_and_steps_of_blocks_only(model, videos, controls, alone):
    """flex (eager here) when a bidirectional block is prefilled layer by layer, including steps whose
    only work is such a block (one scratch token in the main batch); sizes it cannot take are refused
    at start-up."""
    cfg = dataclasses.replace(CPU, kernel="flex", kv_memory_gb=0.004, step_tokens=8, max_batch_videos=2)
    got, _, log, _ = decode_all(model, cfg, videos[:3], controls[:3])
    assert any(r.layer_tokens and not r.tokens for r in log)
    for a, b in zip(got, alone[:3]):
        assert_same(a, b)
    with pytest.raises(ValueError, match="multiples of 16"):
        CaptionEngine(model, dataclasses.replace(cfg, q_block=3))


def test_kernel_is_chosen_explicitly_and_reported(model):
    d = CaptionEngine(model, CPU).describe()
    assert d["kernel"] == "sdpa" and "auto on CPU" in d["kernel_reason"] and d["resolved_dtype"] == "torch.float32"
    assert d["kv_pages"] > 1 and d["resolved_step_tokens"] == 512
    assert CaptionEngine(model, dataclasses.replace(CPU, kernel="reference")).describe()["kernel"] == "reference"
    with pytest.raises(ValueError, match="max_batch_rows"):
        CaptionEngine(model, dataclasses.replace(CPU, max_batch_rows=4, max_events=8))


def test_a_video_over_the_kv_pool_is_refused_alone(model, videos, controls, alone):
    """A video whose worst case needs more pages than the whole pool: a DecodeError row for it,
    the others in the same batch decode as alone."""
    big = sample(num_segments=60, seed=60, video_id="big")
    probe = CaptionEngine(model, dataclasses.replace(CPU, page_size=4))
    S = 4
    need = lambda v: pages_for(len(model.make_example(v, with_targets=False).layout) + CPU.max_events, S) \
        + CPU.max_events * pages_for(CPU.max_branch_tokens, S)  # noqa: E731
    pages = (need(big) + max(need(v) for v in videos[:2])) // 2
    cfg = dataclasses.replace(CPU, page_size=S, kv_memory_gb=(pages + 1) * probe.pool.bytes_per_page / 1e9)
    res = CaptionEngine(model, cfg).caption([videos[0], big, videos[1]], controls=[controls[0], controls[0], controls[1]])
    assert res[1].error and "KV pages" in res[1].error and res[1].events == []
    assert res[0].error is None and res[2].error is None
    assert [len(e.caption) > 0 for e in res[2].events] and len(res[2].events) == len(alone[1].tokens)


# ------------------------------------------------------------------------ bf16


def _parting(a, ref) -> list[int | None]:
    """Per branch, the first position where `a` chose another token than `ref` (None: never)."""
    return [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), None) for p, q in zip(a.tokens, ref.tokens)]


def _max_err(a, ref) -> float:
    """Max |logit difference| of `a` against `ref` over the positions both computed from the same tokens:
    every position up to and excluding where the branch parts from `ref`."""
    err = 0.0
    for x, y, at in zip(a.branch_logits, ref.branch_logits, _parting(a, ref)):
        n = min(len(x), len(y)) if at is None else at
        if n:
            err = max(err, float((x[:n].float() - y[:n].float()).abs().max()))
    return err


def _bf16(model):
    m16 = PadCaptioner(tiny_cfg(grounding_threshold=0.99, dtype="bfloat16"))
    m16.load_state_dict({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()})
    return m16.eval()


def test_an_engine_that_casts_to_bf16_keeps_the_rotary_frequencies_in_fp32(model):
    """A float32 model decoded in bf16 (the CUDA default) is cast by the engine: its weights, not RoPE's
    frequencies, which stay the float32 ones HF computes (and from_pretrained in bf16 keeps), so the
    angles at long positions are the float32 angles rounded once, not angles of rounded frequencies."""
    import copy

    from pipeline.backbone import ROPE_BUFFERS

    eng = CaptionEngine(copy.deepcopy(model), dataclasses.replace(CPU, dtype="bfloat16"))
    assert eng.model.dtype == torch.bfloat16
    ref = dict(model.named_buffers())
    kept = {n: b for n, b in eng.model.named_buffers() if n.endswith(ROPE_BUFFERS)}
    assert kept and all(b.dtype == torch.float32 and torch.equal(b, ref[n]) for n, b in kept.items())
    positions = torch.arange(0, 8000, 7)[None].expand(3, -1)
    cos, sin = eng.runner.rope(positions, torch.bfloat16)
    cos32, sin32 = CaptionEngine(copy.deepcopy(model), CPU).runner.rope(positions, torch.float32)
    assert torch.equal(cos, cos32.to(torch.bfloat16)) and torch.equal(sin, sin32.to(torch.bfloat16))


def test_bf16_engine_is_as_exact_as_a_single_kernel(model, videos):
    """bf16 on CPU: the engine picks the tokens of HF's own bf16 forward (`branch_sequential`, one SDPA
    kernel per call) and its logits are as close to the fp32 reference as that forward's; where bf16 parts
    from fp32 at all, it is on a near-tie (fp32's margin there below what bf16 is off by elsewhere in the
    video); batched bf16 == bf16 alone, token for token."""
    m16 = _bf16(model)
    cfg = dataclasses.replace(CPU, dtype="auto")
    cases = [(videos[1], DecodeControl(num_events=4, lengths=[2, 6, 1, 3], trace=True)),
             (videos[3], DecodeControl(num_events=5, lengths=[2, 13, 1, 7, 3], trace=True))]
    eng = CaptionEngine(m16, cfg)
    assert eng.describe()["resolved_dtype"] == "torch.bfloat16"
    alone16 = []
    for v, c in cases:
        fp32 = full_recompute(model, v, CPU, c)
        base = branch_sequential(m16, v, cfg, c)  # single-kernel bf16 baseline
        got = eng.decode(v, c)
        alone16.append(got)
        assert got.tokens == base.tokens
        e_base, e_eng = _max_err(base, fp32), _max_err(got, fp32)
        assert e_base > 0
        assert e_eng <= 1.5 * e_base, (e_eng, e_base)
        for b, at in enumerate(_parting(got, fp32)):
            if at is not None:
                ref = fp32.branch_logits[b][at].float()
                margin = float(ref[fp32.tokens[b][at]] - ref[got.tokens[b][at]])
                assert 0 <= margin < 2 * e_base, (b, at, margin, e_base)
    batched, _, _, _ = decode_all(m16, dataclasses.replace(cfg, step_tokens=32), [v for v, _ in cases],
                                  [c for _, c in cases])
    for a, b in zip(batched, alone16):
        assert a.tokens == b.tokens


# ------------------------------------------------------------------------ CUDA (skipped without it)
# Every CUDA engine of the suite gets the same 1 GB pool: the pool's width is part of compiled flex's shapes,
# so each shape (one per CUDA-graph block bucket) compiles once per process, not once per engine.


@pytest.mark.gpu
def test_cuda_flex_kernel_equals_the_reference_kernel(model, videos, controls):
    """On CUDA (fp32): FlexAttention compiled through Triton gives the reference kernel's tokens
    and logits (1e-4: fp32 tensor-core sums in another order), batched as alone."""
    import copy

    cfg = dataclasses.replace(CPU, device="cuda", dtype="float32", step_tokens=64, kv_memory_gb=1.0)
    ref, _, _, _ = decode_all(copy.deepcopy(model), dataclasses.replace(cfg, kernel="reference"), videos, controls)
    got, _, _, eng = decode_all(copy.deepcopy(model), cfg, videos, controls)
    assert eng.describe()["kernel"] == "flex"
    for x, y in zip(got, ref):
        assert x.tokens == y.tokens
        for p, q in zip(x.branch_logits, y.branch_logits):
            torch.testing.assert_close(p, q, atol=1e-4, rtol=0)


@pytest.mark.gpu
def test_bf16_is_the_cuda_default_and_batched_equals_alone(model, videos, controls):
    """bf16 on CUDA against a bf16 baseline (the same engine, one video at a time), not fp32 at 1e-3."""
    import copy

    eng = CaptionEngine(copy.deepcopy(model), dataclasses.replace(CPU, device="cuda", kv_memory_gb=1.0))
    assert eng.describe()["resolved_dtype"] == "torch.bfloat16"
    alone = [eng.decode(v, c) for v, c in zip(videos, controls)]
    got, _, _, _ = decode_all(eng.model, eng.cfg, videos, controls)
    for a, b in zip(got, alone):
        assert a.tokens == b.tokens


# ------------------------------------------------------------------------ the benchmark


def test_per_request_options_share_one_batch(model, videos):
    """Requests with their own max_events / max_branch_tokens / sampling in one batch get what an
    engine configured with those options gives each alone; out-of-range options are refused."""
    from infer.engine.requests import VideoOptions

    opts = [VideoOptions(max_events=2, max_branch_tokens=4), VideoOptions(),
            VideoOptions(temperature=0.8, top_p=0.9, seed=3, max_branch_tokens=6), VideoOptions(max_events=1)]
    eng = CaptionEngine(model, CPU)
    got = {}
    reqs = [Request(v, tag=i, options=o) for i, (v, o) in enumerate(zip(videos[:4], opts))]
    eng.run(iter(reqs), lambda req, res: got.__setitem__(req.tag, res))
    assert max(r.videos for r in eng.stats["step_log"]) == 4
    for i, (v, o) in enumerate(zip(videos[:4], opts)):
        alone = CaptionEngine(model, o.resolve(CPU)).decode(v)
        assert got[i].tokens == alone.tokens and got[i].intervals == alone.intervals
    assert got[0].num_events <= 2 and got[3].num_events == 1 and all(len(t) <= 4 for t in got[0].tokens)
    bad = []
    eng.run(iter([Request(videos[0], options=VideoOptions(max_events=99))]), lambda req, res: bad.append(res))
    assert isinstance(bad[0], ValueError) and "max_events" in str(bad[0])


def test_engine_recovers_after_a_run_that_raised(model, videos, controls, alone):
    """A step that raises (a server bug on some input) ends that run with the exception; the next
    run on the same engine gets every page back and decodes as if nothing had happened."""
    eng = CaptionEngine(model, CPU)
    forward, calls = eng.runner.forward, {"n": 0}

    def flaky(batch):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return forward(batch)

    eng.runner.forward = flaky
    with pytest.raises(RuntimeError, match="boom"):
        eng.caption(videos[:3], controls=controls[:3])
    got = eng.decode(videos[3], controls[3])
    assert_same(got, alone[3])
    assert_pool_empty(eng)
