"""The published release's model: strict loading, layout and positions, parity with the release's
own inference (the copied release-golden fixture), and its decode through CaptionEngine."""

from __future__ import annotations

import io
import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from bench.release_models import CHECKPOINT, FIXTURE, fixture_video, load, perturbed, random_video
from infer.engine.core import CaptionEngine
from infer.oracles.release_loop import branch_mask, release_reference
from infer.parity import check as parity
from pipeline.config import InferConfig
from pipeline.release.checkpoint import ReleaseError, read_state_dict, weight_files
from pipeline.release.grounding import find_and_merge
from pipeline.release.layout import AVGrid, audio_counts, build_layout, index_sets, mrope_ids, prompt_visible
from pipeline.release.model import ReleaseCaptioner, ReleaseSettings

GOLDEN = json.loads((FIXTURE / "golden.json").read_text())


@pytest.fixture(scope="module")
def model():
    return load()


def engine_for(model, **over) -> CaptionEngine:
    cfg = dict(max_events=model.max_events, max_branch_tokens=model.max_branch_tokens + 1, device="cpu")
    cfg.update(over)
    return CaptionEngine(model, InferConfig(**cfg))


# ------------------------------------------------------------------ parity command


def test_parity_command_passes_every_check_on_the_fixture():
    out = io.StringIO()
    checks = parity.run(FIXTURE, out=out)
    text = out.getvalue()
    assert all(c.passed for c in checks.items), text
    assert text.strip().splitlines()[-1] == f"{len(checks.items)}/{len(checks.items)} checks passed"
    assert len(checks.items) >= 25


def test_parity_command_fails_on_a_changed_trace(tmp_path):
    case = tmp_path / "case"
    shutil.copytree(FIXTURE, case)
    golden = json.loads((case / "golden.json").read_text())
    golden["branches"][1]["tokens"][-1] += 1  # one wrong final token
    (case / "golden.json").write_text(json.dumps(golden))
    assert parity.main([str(case)]) == 1


# ------------------------------------------------------------------ loading


def _copy_with(tmp_path, state: dict, fmt: str = "bin"):
    d = tmp_path / "ckpt"
    shutil.copytree(CHECKPOINT, d, ignore=shutil.ignore_patterns("pytorch_model.bin"))
    if fmt == "bin":
        torch.save(state, d / "pytorch_model.bin")
    elif fmt == "safetensors":
        save_file({k: v.contiguous() for k, v in state.items()}, str(d / "model.safetensors"))
    else:  # sharded safetensors with its index
        keys = sorted(state)
        half = len(keys) // 2
        shards = {"model-00001-of-00002.safetensors": keys[:half], "model-00002-of-00002.safetensors": keys[half:]}
        for name, ks in shards.items():
            save_file({k: state[k].contiguous() for k in ks}, str(d / name))
        index = {"weight_map": {k: name for name, ks in shards.items() for k in ks}}
        (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return d


@pytest.mark.parametrize("fmt", ["safetensors", "sharded"])
def test_every_weight_layout_loads_the_same_model(tmp_path, fmt, model):
    state = read_state_dict(CHECKPOINT)
    d = _copy_with(tmp_path, state, fmt)
    assert len(weight_files(d)) == (2 if fmt == "sharded" else 1)
    other = ReleaseCaptioner.from_release(d)
    for k, v in model.release_state_dict().items():
        assert torch.equal(other.release_state_dict()[k], v), k


@pytest.mark.parametrize("change, message", [
    ("missing", "missing tensor"), ("unexpected", "unexpected tensor"), ("shape", "shape mismatch")])
def test_strict_load_names_the_bad_tensor(tmp_path, change, message):
    state = read_state_dict(CHECKPOINT)
    key = "model.layers.3.self_attn.k_proj.weight"
    if change == "missing":
        del state[key]
    elif change == "unexpected":
        state["model.layers.3.self_attn.extra.weight"] = torch.zeros(2, 2)
        key = "model.layers.3.self_attn.extra.weight"
    else:
        state[key] = torch.zeros(9, 16)
    with pytest.raises(ReleaseError, match=message) as err:
        ReleaseCaptioner.from_release(_copy_with(tmp_path, state))
    assert key.split(".", 1)[1] in str(err.value)


def test_token_ids_must_agree_with_the_tokenizer(tmp_path):
    d = _copy_with(tmp_path, read_state_dict(CHECKPOINT))
    cfg = json.loads((d / "config.json").read_text())
    cfg["evi_token_id"] = 151667
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ReleaseError, match="evi_token_id=151667"):
        ReleaseCaptioner.from_release(d)


def test_a_directory_without_weights_is_refused(tmp_path):
    d = tmp_path / "empty"
    shutil.copytree(CHECKPOINT, d, ignore=shutil.ignore_patterns("pytorch_model.bin"))
    with pytest.raises(ReleaseError, match="no weights"):
        ReleaseCaptioner.from_release(d)


# ------------------------------------------------------------------ layout, positions, grounding


def test_both_position_modes_equal_the_fixture(model):
    video = fixture_video()
    instruction = GOLDEN["prompt_text"].split("<|vision_end|>\n")[1].split("<|im_end|>")[0]
    lay = build_layout(model.tokenizer, model.ids, video.grid(120), instruction)
    assert lay.input_ids.tolist() == GOLDEN["input_ids"]
    pos, delta = mrope_ids(lay, "release")
    assert pos.tolist() == GOLDEN["positions_infer"] and delta == GOLDEN["rope_delta_infer"] == 16
    pos, delta = mrope_ids(lay, "training")
    assert pos.tolist() == GOLDEN["positions_train"] and delta == GOLDEN["rope_delta_train"] == -36


def test_interleave_counts_and_index_sets():
    # docs/design/release.md 2: a 12 s video at 64 frames (fps 64/12, d = 0.375 s): counts [0, 1, 1, ..., 1, 37]
    grid = AVGrid(timesteps=32, rows=1, cols=1, seconds_per_step=2 / (64 / 12), audio_tokens=60)
    counts = audio_counts(grid)
    assert counts[0] == 0 and counts[-1] == 37 and sum(counts) == 60
    # the fixture: overlapping audio sets, audio 62..119 in no timestep
    video, audio = index_sets(AVGrid(6, 2, 3, 31 / 6, 120))
    assert [(a[0], a[-1] + 1) for a in audio] == [(0, 11), (10, 21), (20, 31), (31, 42), (41, 52), (51, 62)]
    assert [(v[0], v[-1] + 1) for v in video] == [(6 * t, 6 * t + 6) for t in range(6)]


def test_without_audio_the_two_position_modes_coincide(model):
    grid = AVGrid(timesteps=5, rows=2, cols=3, seconds_per_step=3.0, audio_tokens=0)
    lay = build_layout(model.tokenizer, model.ids, grid, "Describe.")
    assert lay.audio_slots.numel() == 0 and all(not a for a in lay.audio_sets)
    assert torch.equal(mrope_ids(lay, "release")[0], mrope_ids(lay, "training")[0])


def test_find_and_merge_bridges_gaps_and_picks_the_heaviest_span():
    sims = GOLDEN["grounding_calls"]
    for call in sims:
        assert list(find_and_merge(torch.tensor(call["sim"]), 0.7, 2)) == call["interval"][0]
        assert list(find_and_merge(torch.tensor(call["sim"]), 0.5, 2)) == call["interval_at_threshold_0.5"][0]
    # a tie goes to the first span
    assert find_and_merge(torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0]), 0.9, 1) == (0, 0)


def test_branch_mask_literal():
    assert branch_mask(2, 2, 2).int().tolist() == [[1, 1, 1, 0, 1, 0], [1, 1, 0, 1, 0, 1]]


def test_the_prompt_mask_is_causal_with_the_av_block_bidirectional(model):
    # pipeline/layout.py's rule over the release prompt gives the release's prefill mask
    lay = build_layout(model.tokenizer, model.ids, fixture_video().grid(120), "Describe.")
    want = torch.ones(lay.length, lay.length, dtype=torch.bool).tril()
    want[lay.p0:lay.p0 + lay.block_len, lay.p0:lay.p0 + lay.block_len] = True
    assert torch.equal(prompt_visible(lay), want)


# ------------------------------------------------------------------ decoding


def test_engine_reproduces_the_fixture_and_marks_the_capped_branch(model):
    res = engine_for(model).caption([fixture_video()])[0]
    assert res.error is None
    by_start = sorted(GOLDEN["events"], key=lambda e: e["interval_seconds"][0])
    assert [e.caption for e in res.events] == [e["caption_text"].strip() for e in by_start]
    assert res.capped == [not e["ended_with_im_end"] for e in by_start]
    assert all(0 <= e.start < e.end <= 31.0 for e in res.events)


def test_release_steps_through_the_step_graphs_reproduce_the_fixture(model):
    """The release model with the flex kernel (eager here) and every step through the CUDA graphs'
    static buffers and padding (infer.cuda_graphs=static, infer/engine/graphs.py): the fixture's captions."""
    eng = engine_for(model, kernel="flex", cuda_graphs="static", kv_memory_gb=0.02)
    res = eng.caption([fixture_video()])[0]
    assert res.error is None
    by_start = sorted(GOLDEN["events"], key=lambda e: e["interval_seconds"][0])
    assert [e.caption for e in res.events] == [e["caption_text"].strip() for e in by_start]
    g = eng.describe()["graphs"]
    assert g["replayed"] > 0 and g["replayed"] + g["pieces"] + g["eager"] == eng.stats["steps"]


@pytest.mark.parametrize("step_tokens", [512, 8])
def test_engine_batch_equals_the_release_loop_on_random_models(step_tokens):
    """The release model through the token-budget scheduler: with a budget of 8 tokens the prompt
    is prefilled in chunks around its bidirectional AV block (which moves one layer per step),
    beside other videos' planning and branch rows; every video decodes as the release's own loop does."""
    seen = set()
    for seed in (2, 3):  # seed 2: branches run to the cap; seed 3: they end after one token
        model = perturbed(seed, eos_gain=0.75)
        videos = [random_video(10 * seed + i, timesteps=3 + i, audio=i != 1) for i in range(3)]
        # 6 rows: a video of K = 4 waits for the one before it (continuous admission)
        batched = engine_for(model, step_tokens=step_tokens, max_batch_rows=6)
        results = batched.caption(videos)
        if step_tokens == 8:
            log = batched.stats["step_log"]
            assert any(r.prefill_tokens and (r.branch_rows or r.plan_rows) for r in log)
            assert any(r.layer_tokens for r in log)  # the AV block, over the budget, one layer per step
        alone = engine_for(model)
        for video, res in zip(videos, results):
            ref = release_reference(model, video, model.max_events, model.max_branch_tokens)
            assert res.error is None
            assert [e.caption for e in res.events] == [e.caption for e in alone.caption([video])[0].events]
            decoded = alone.decode(video)
            assert decoded.tokens == ref.decoded.tokens, (seed, video.video_id)
            assert decoded.intervals == ref.decoded.intervals
            seen.add((ref.front.num_events, max(map(len, ref.decoded.tokens), default=0)))
    assert {k for k, _ in seen} >= {0, 4} and {n for _, n in seen} >= {1, 7}  # K = 0 inside a batch, both lengths


def test_k_zero_gives_no_events(model):
    video = fixture_video()
    m = load()
    pre_last = release_reference(m, video, m.max_events, 0).front.prefill.last_hidden
    with torch.no_grad():  # make <S> the first choice: its (tied) row along the last prompt state
        m.decoder.embed_tokens.weight[m.s_id] = pre_last / pre_last.norm() * 50
    ref = release_reference(m, video, m.max_events, m.max_branch_tokens)
    assert ref.front.num_events == 0 and ref.decoded.tokens == []
    res = engine_for(m).caption([video, fixture_video(video_id="again")])
    assert [r.events for r in res] == [[], []] and all(r.error is None for r in res)


def test_planning_cap_forces_the_stop(model):
    ref = release_reference(model, fixture_video(), 2, model.max_branch_tokens)
    assert ref.front.num_events == 2 and ref.front.steps == [(3, 3), (5, 5)]


def test_training_positions_change_the_prefix_but_decode_the_same_way():
    m = load(ReleaseSettings(positions="training"))
    ref = release_reference(m, fixture_video(), m.max_events, m.max_branch_tokens)
    assert ref.front.prefill.delta == -36
    assert engine_for(m).decode(fixture_video()).tokens == ref.decoded.tokens


def test_renormalised_aggregation_is_an_option(model):
    m = load(ReleaseSettings(aggregation="renormalised"))
    ref = release_reference(m, fixture_video(), m.max_events, m.max_branch_tokens)
    base = release_reference(model, fixture_video(), model.max_events, model.max_branch_tokens)
    assert not torch.allclose(ref.front.serial_inputs[:1], base.front.serial_inputs[:1])
    assert engine_for(m).decode(fixture_video()).tokens == ref.decoded.tokens


def test_plan_logits_are_the_g_and_s_columns_of_the_lm_head(model):
    """The engine reads a planning decision from plan_logits (two columns, every decision row of a step
    at once): they are lm_logits' <G> and <S> columns."""
    h = torch.randn(3, model.hf.config.get_text_config().hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model.lm_logits(h)[:, [model.g_id, model.s_id]]
        torch.testing.assert_close(model.plan_logits(h), full, atol=1e-5, rtol=1e-5)
