"""The decoding engine (infer/engine/core.py) against the reference decoders (infer/oracles/decoders.py).

Tiny random-init PadCaptioner, fp32, CPU. The backbone weights are re-drawn with a larger
spread (and grounding keeps only near-max segments) so that a random model grounds
events to different intervals and its branches emit different, varied tokens: a mix-up
between branches, or a wrong mask or position, changes the tokens. K and the branch
lengths are forced through DecodeControl, the hook the benchmark uses; termination
still runs through a real <eos>.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch

from infer.engine.core import CaptionEngine
from infer.engine.sampling import DecodeControl
from infer.oracles.ablation import caption_engine
from infer.oracles.decoders import branch_sequential, full_recompute, monolithic, parallel_copy
from pipeline.config import InferConfig
from pipeline.model import PadCaptioner
from tests.support.padcap import decoding_model, sample, tiny_cfg

LOGIT_ATOL = 1e-4
CPU = InferConfig(device="cpu", max_branch_tokens=16, max_events=30)


@pytest.fixture(scope="module")
def model():
    return decoding_model()


@pytest.fixture(scope="module")
def video():
    return sample(num_segments=8, seed=0, video_id="v8")


def engine(model, **over) -> CaptionEngine:
    return caption_engine(model, dataclasses.replace(CPU, **over))


def assert_same(fast, ref, *, logits=True):
    """Token for token, same intervals, and (traced) logits within LOGIT_ATOL."""
    assert fast.tokens == ref.tokens
    assert fast.intervals == ref.intervals  # segment boundaries chosen by the readout
    if logits:
        assert len(fast.branch_logits) == len(ref.branch_logits)
        for a, b in zip(fast.branch_logits, ref.branch_logits):
            torch.testing.assert_close(a, b, atol=LOGIT_ATOL, rtol=0)
        torch.testing.assert_close(fast.planning_logits, ref.planning_logits, atol=LOGIT_ATOL, rtol=0)
        torch.testing.assert_close(fast.grounding_logits, ref.grounding_logits, atol=LOGIT_ATOL, rtol=0)


def check_against_references(model, video, control, cfg=CPU):
    eng = CaptionEngine(model, cfg)
    got = eng.decode(video, control)
    for ref in (full_recompute, branch_sequential, parallel_copy):
        assert_same(got, ref(model, video, cfg, control))
    return got


# ------------------------------------------------------------------------ named cases


def test_k1_all_decoders_agree(model, video):
    """K = 1: the engine, every reference and even the single chain are the same decode."""
    ctl = DecodeControl(num_events=1, trace=True)
    got = check_against_references(model, video, ctl)
    assert got.num_events == 1 and got.steps == len(got.tokens[0])
    assert_same(got, monolithic(model, video, CPU, ctl))


def test_k5_very_unequal_lengths(model, video):
    lengths = [2, 13, 1, 7, 3]
    ctl = DecodeControl(num_events=5, lengths=lengths, trace=True)
    got = check_against_references(model, video, ctl)
    assert [len(t) for t in got.tokens] == lengths
    assert all(t[-1] == model.eos_id and model.eos_id not in t[:-1] for t in got.tokens)
    assert got.steps == max(lengths)  # lock-step: max(len) decoder steps, not sum(len)
    assert branch_sequential(model, video, CPU, ctl).steps == sum(lengths)
    assert len({tuple(t[:2]) for t in got.tokens if len(t) > 2}) > 1  # branches really differ
    assert len(set(got.intervals)) > 1  # and are grounded differently


@pytest.mark.parametrize("over", [dict(step_tokens=7, page_size=4, q_block=3), dict(page_size=1, q_block=1),
                                  dict(kernel="reference")])
def test_chunked_prefill_and_small_pages_equal_references(model, video, over):
    """Prefill in chunks under a tiny token budget (cut only where the AV block allows; the block
    itself one layer per step), pages of 1-4 keys, odd query blocks and the reference kernel:
    still the references' decode."""
    ctl = DecodeControl(num_events=3, lengths=[4, 9, 2], trace=True)
    got = check_against_references(model, video, ctl, cfg=dataclasses.replace(CPU, **over))
    assert got.num_events == 3
    with pytest.raises(ValueError, match="step_tokens"):
        CaptionEngine(model, dataclasses.replace(CPU, step_tokens=-1))


def test_branch_that_ends_at_its_first_token(model, video):
    """Two branches emit <eos> from their anchor: they leave right after the anchor forward."""
    ctl = DecodeControl(num_events=3, lengths=[1, 5, 1], trace=True)
    got = check_against_references(model, video, ctl)
    assert got.tokens[0] == [model.eos_id] and got.tokens[2] == [model.eos_id] and len(got.tokens[1]) == 5


def test_token_cap(model, video):
    ctl = DecodeControl(num_events=3, suppress_eos=True, trace=True)
    cfg = dataclasses.replace(CPU, max_branch_tokens=5)
    got = check_against_references(model, video, ctl, cfg)
    assert [len(t) for t in got.tokens] == [5, 5, 5]
    assert all(model.eos_id not in t for t in got.tokens)
    # the cap also binds forced lengths
    capped = CaptionEngine(model, cfg).decode(video, DecodeControl(num_events=2, lengths=[9, 3]))
    assert [len(t) for t in capped.tokens] == [5, 3]


def test_batch_of_three_videos_different_prefixes_and_k(model):
    videos = [sample(num_segments=n, seed=n, video_id=f"v{n}") for n in (5, 9, 12)]
    controls = [DecodeControl(num_events=1, lengths=[4]), DecodeControl(num_events=4, lengths=[2, 6, 1, 3]),
                DecodeControl(num_events=2, lengths=[5, 2])]
    eng = engine(model)
    prefix_lens = {len(model.make_example(v, with_targets=False).layout) for v in videos}
    assert len(prefix_lens) == 3
    results = eng.caption(videos, controls=controls)
    assert [r.video_id for r in results] == ["v5", "v9", "v12"]
    assert [len(r.events) for r in results] == [1, 4, 2]
    for v, ctl, r in zip(videos, controls, results):
        alone = full_recompute(model, v, CPU, ctl)
        assert r.timings["tokens"] == alone.num_tokens and r.timings["steps"] == max(ctl.lengths)
        assert sorted(e.caption for e in r.events) == sorted(
            model.tokenizer.decode(t[:-1], skip_special_tokens=True).strip() for t in alone.tokens)


def test_termination_leaves_other_branches_unchanged(model, video):
    """Branches ending early vs nobody ending before step 13: every branch's tokens and
    logits up to its own end are the same, i.e. dropping a branch's KV and query row
    never touches the others."""
    lengths = [6, 1, 13, 3, 9]
    early = engine(model).decode(video, DecodeControl(num_events=5, lengths=lengths, trace=True))
    late = engine(model).decode(video, DecodeControl(num_events=5, lengths=[13] * 5, trace=True))
    for i, n in enumerate(lengths):
        assert early.tokens[i][:-1] == late.tokens[i][: n - 1]
        torch.testing.assert_close(early.branch_logits[i], late.branch_logits[i][:n], atol=1e-5, rtol=0)


def test_finished_branches_are_dropped_not_padded(model, video):
    """The step at branch step j carries exactly the branches with len > j, and an ended
    branch's pages go back to the pool at once."""
    lengths = [2, 11, 1, 6, 3]
    eng = engine(model)
    eng.decode(video, DecodeControl(num_events=5, lengths=lengths))
    branch_steps = [r.branch_rows for r in eng.stats["step_log"] if r.branch_rows]
    assert branch_steps == [sum(n > j for n in lengths) for j in range(max(lengths))]
    assert eng.pool.allocated == 0 and eng.pool.free_pages == eng.pool.usable  # nothing held, nothing promised


def test_planning_respects_max_events(model, video):
    eng = engine(model, max_events=3)
    got = eng.decode(video, DecodeControl(trace=True))
    assert got.num_events == 3
    assert (got.planning_logits[:, 0] > got.planning_logits[:, 1]).all()  # the model wanted more: the cap stopped it
    assert full_recompute(model, video, dataclasses.replace(CPU, max_events=3)).tokens == got.tokens
    assert eng.decode(video, DecodeControl(num_events=10)).num_events == 3  # forced K is capped too
    assert len(eng.caption([video])[0].events) == 3


def test_at_least_one_event(model, video):
    """A model whose first planning decision is <S> still gets one event."""
    m = copy.deepcopy(model)
    with torch.no_grad():
        m.new_embed.data = m.new_embed.data.flip(0)  # swap the <G> and <S> rows: <S> now wins
    got = engine(m, max_events=5).decode(video, DecodeControl(trace=True))
    assert got.planning_logits[0, 1] > got.planning_logits[0, 0] and got.num_events == 1
    assert full_recompute(m, video, dataclasses.replace(CPU, max_events=5)).tokens == got.tokens


def test_untrained_model_returns_well_formed_events():
    torch.manual_seed(0)
    fresh = PadCaptioner(tiny_cfg()).eval()  # as initialised: LoRA no-op, heads random
    v = sample(num_segments=10, seed=3, video_id="raw")
    short = dataclasses.replace(v, video_id="short", duration=9.4)  # last segment runs past the end
    results = CaptionEngine(fresh, dataclasses.replace(CPU, max_events=6, max_branch_tokens=8)).caption([v, short])
    for r, duration in zip(results, (10.0, 9.4)):
        assert r.error is None and 1 <= len(r.events) <= 6 and r.duration == pytest.approx(duration)
        assert [e.start for e in r.events] == sorted(e.start for e in r.events)
        for e in r.events:
            assert 0.0 <= e.start < e.end <= duration and isinstance(e.caption, str)
        assert {"prefill_ms", "planning_ms", "grounding_ms", "decode_ms", "total_ms", "steps", "tokens"} <= set(r.timings)
        d = r.to_dict()
        assert set(d) == {"video_id", "duration", "events", "timings", "segments_kept", "segments_total"}
        assert set(d["events"][0]) == {"start", "end", "caption", "capped"}
        assert d["segments_kept"] == d["segments_total"] == 10 and r.capped == [e["capped"] for e in d["events"]]


def test_bad_sample_is_an_explained_error_and_the_rest_goes_on(model, video):
    wrong_dims = dataclasses.replace(video, video_id="bad", visual=np.zeros((8, 2, 5), dtype=np.float16))
    bad_duration = dataclasses.replace(video, video_id="nan", duration=float("nan"))
    results = engine(model, max_events=2, max_branch_tokens=3).caption([wrong_dims, video, bad_duration])
    assert results[0].error and "feature dims" in results[0].error and results[0].events == []
    assert results[1].error is None and len(results[1].events) == 2
    assert results[2].error and "duration" in results[2].error


def test_sampling_is_seeded_and_well_formed(model, video):
    kw = dict(temperature=0.9, top_p=0.8, max_events=3, max_branch_tokens=6)
    a = engine(model, seed=7, **kw).decode(video)
    b = engine(model, seed=7, **kw).decode(video)
    c = engine(model, seed=8, **kw).decode(video)
    greedy = engine(model, max_events=3, max_branch_tokens=6).decode(video)
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens or a.tokens != greedy.tokens
    assert all(1 <= len(t) <= 6 for t in a.tokens)


def test_monolithic_decoder_option(model, video):
    ctl = DecodeControl(num_events=3, lengths=[3, 2, 4])
    got = engine(model, decoder="monolithic").decode(video, ctl)
    assert got.tokens == monolithic(model, video, CPU, ctl).tokens and got.steps == 9


@pytest.mark.gpu
def test_engine_on_cuda_matches_cpu_reference(model, video):
    """fp32 on CUDA (compiled flex, pages and blocks of 128) against the fp32 CPU reference; bf16 is
    compared with a bf16 baseline in tests/test_engine_batch.py, never with fp32 at an fp32 tolerance."""
    cuda_model = copy.deepcopy(model).to("cuda")
    ctl = DecodeControl(num_events=5, lengths=[2, 13, 1, 7, 3], trace=True)
    got = CaptionEngine(cuda_model, dataclasses.replace(CPU, device="cuda", dtype="float32", kv_memory_gb=1.0)).decode(video, ctl)
    ref = full_recompute(model, video, CPU, ctl)
    assert got.tokens == ref.tokens
    for a, b in zip(got.branch_logits, ref.branch_logits):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=0)


def load_decode_bench():
    """bench/decode.py (the benchmarks are the `bench` package)."""
    import importlib

    return importlib.import_module("bench.decode")


def test_decode_benchmark_smoke(capsys):
    """bench/decode.py end to end on a short prefix: every mode generates the same tokens,
    the step counts are sum(len) / max(len), and the JSON has what the GPU run reports."""
    import json

    bench = load_decode_bench()
    out = bench.main(["--prefix", "96", "--lengths", "3,1,2", "--repeats", "1"])
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(out))
    modes = out["modes"]
    assert {m: modes[m]["steps"] for m in modes} == {"monolithic": 6, "branch_sequential": 6, "parallel_copy": 3, "engine": 3}
    assert all(modes[m]["tokens"] == 6 and modes[m].get("tokens_equal_engine", True) for m in modes)
    assert out["targets"]["ideal_step_ratio"] == 2.0 and "engine_speedup_met" in out["targets"]
    assert out["floor"]["floor_ms_per_step"] > 0 and out["floor"]["weight_bytes"] > 0
    roof = out["roofline"]
    assert roof["peak_gflops"] > 0 and roof["engine_ms_per_step"] > 0 and roof["monolithic_ms_per_step"] > 0
    assert 0 < roof["speedup_bound"] <= out["targets"]["ideal_step_ratio"] + 1e-9


def test_roofline_bound_follows_machine_balance(model):
    """The roofline speedup bound is the ideal step ratio where FLOPs are cheap against bytes,
    and falls below it where the K rows' arithmetic costs more than reading the weights."""
    bench = load_decode_bench()
    lengths, shared = [32] * 8, 2048
    gpu_like = bench.roofline(model, lengths, shared, bandwidth_gbs=4000.0, peak_gflops=1e6)
    cpu_like = bench.roofline(model, lengths, shared, bandwidth_gbs=10.0, peak_gflops=10.0)
    assert gpu_like["speedup_bound"] == pytest.approx(8.0, rel=0.02)  # bandwidth-bound: K rows ride free
    assert cpu_like["speedup_bound"] < 0.8 * 8.0  # 8 rows of FLOPs at 1 FLOP/byte: the K rows cost
