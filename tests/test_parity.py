"""infer.parity.check can fail: it passes on both copies of release-golden (fp32 and bf16) and exits non-zero
on a corrupted copy, one test per kind of corruption; its weights table catches a wrong loader mapping;
an exception is a FAIL line and the run goes on."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
import torch

from bench.release_models import CHECKPOINT, FIXTURE
from infer.parity import check as parity
from infer.parity.weights import weight_problems
from pipeline.release.checkpoint import read_state_dict
from pipeline.release.model import ReleaseCaptioner

SHARED = Path(__file__).resolve().parents[2] / "shared" / "release-golden"
CASES = [FIXTURE] + ([SHARED] if SHARED.is_dir() else [])


def outcome(case: Path, dtype: str = "float32") -> tuple[int, dict[str, parity.Check], str]:
    out = io.StringIO()
    checks = parity.run(case, dtype, out=out)
    code = 0 if all(c.passed for c in checks.items) else 1  # what main() returns
    return code, {c.name: c for c in checks.items}, out.getvalue()


def failed(checks: dict[str, parity.Check]) -> set[str]:
    return {n for n, c in checks.items() if not c.passed}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", CASES, ids=lambda p: p.parent.name + "/" + p.name)
def test_every_check_passes_on_the_golden_case(case, dtype):
    code, checks, text = outcome(case, dtype)
    assert code == 0, text
    assert len(checks) >= 30 and "weights: file vs model (own table)" in checks
    assert checks["video index sets (every index)"].passed and checks["anchor/branch logits"].tolerance == \
        parity.TOL[dtype]["logits"]


@pytest.fixture
def case(tmp_path) -> Path:
    dst = tmp_path / "case"
    shutil.copytree(FIXTURE, dst)
    return dst


def test_a_swapped_weight_fails(case):
    state = torch.load(case / "checkpoint" / "pytorch_model.bin", weights_only=True)
    a, b = "model.layers.2.mlp.up_proj.weight", "model.layers.5.mlp.up_proj.weight"
    state[a], state[b] = state[b], state[a]
    torch.save(state, case / "checkpoint" / "pytorch_model.bin")
    assert parity.main([str(case)]) == 1
    _, checks, _ = outcome(case)
    assert {"grounding-layer states hs[-2]", "prefill logits (last row)"} <= failed(checks)
    assert checks["vision tower + merger"].passed  # the LLM swap leaves the towers alone


def test_a_shifted_index_set_fails(case):
    inputs = torch.load(case / "inputs.pt", weights_only=True)
    (a, b), = inputs["video_token_indices_per_timestep"][3]
    inputs["video_token_indices_per_timestep"][3] = [(a + 1, b + 1)]
    torch.save(inputs, case / "inputs.pt")
    assert parity.main([str(case)]) == 1
    _, checks, _ = outcome(case)
    assert failed(checks) == {"video index sets (every index)"}


def test_an_index_set_with_a_hole_fails(case):
    """The same first and last index, one index missing: only an element-by-element comparison sees it."""
    inputs = torch.load(case / "inputs.pt", weights_only=True)
    (a, b), = inputs["audio_token_indices_per_timestep"][2]
    inputs["audio_token_indices_per_timestep"][2] = [(a, a + 2), (a + 3, b)]
    torch.save(inputs, case / "inputs.pt")
    _, checks, _ = outcome(case)
    assert failed(checks) == {"audio index sets (every index)"}


def test_a_changed_threshold_fails(case):
    inputs = torch.load(case / "inputs.pt", weights_only=True)
    inputs["test_time_config"]["grounding_threshold"] = 0.5  # the first event's interval grows (3,3) -> (1,3)
    torch.save(inputs, case / "inputs.pt")
    assert parity.main([str(case)]) == 1
    _, checks, _ = outcome(case)
    assert "grounded intervals (timesteps)" in failed(checks)


def test_an_exception_is_a_fail_line_and_the_run_goes_on(case):
    tensors = torch.load(case / "golden_tensors.pt", weights_only=True)
    del tensors["visual"]
    torch.save(tensors, case / "golden_tensors.pt")
    code, checks, text = outcome(case)
    assert code == 1 and failed(checks) == {"vision tower + merger"}
    assert "KeyError" in checks["vision tower + merger"].detail
    assert "PASS  final text with seconds" in text


def test_the_weights_table_catches_a_wrong_loader_mapping(monkeypatch):
    """A loader that puts frm_head's tensors into evi_head and back (same shapes) loads without complaint;
    the table, written from the release's names, sees both heads hold the other's weights."""
    rules = ReleaseCaptioner.release_rules

    def swapped(self):
        swap = {"frm_head.net.": "evi_head.net.", "evi_head.net.": "frm_head.net."}
        return [(src, swap.get(dst, dst)) for src, dst in rules(self)]

    monkeypatch.setattr(ReleaseCaptioner, "release_rules", swapped)
    model = ReleaseCaptioner.from_release(CHECKPOINT)
    problems = weight_problems(model, read_state_dict(CHECKPOINT))
    assert len(problems) == 1 and problems[0].startswith("12 tensors that differ from the file"), problems


def test_bf16_judges_each_planning_row_on_the_release_history_and_fails_a_far_decision(case):
    """The release stops after 2 events with a wide <S> margin where this model (on the same history)
    says <G>: not a near tie, so "events K" fails in bf16 as in fp32."""
    golden = json.loads((case / "golden.json").read_text())
    golden["K"], golden["serial_intervals"] = 2, golden["serial_intervals"][:2]
    golden["planning"] = golden["planning"][:2] + [{**golden["planning"][2], "logit_G": -5.0, "logit_S": 5.0,
                                                    "chosen": "<S>"}]
    (case / "golden.json").write_text(json.dumps(golden))
    for dtype in ("float32", "bfloat16"):
        _, checks, _ = outcome(case, dtype)
        assert "events K" in failed(checks), dtype
    assert "row 2 (the release's <G>/<S> gap 10" in checks["events K"].detail


def test_forced_steps_keep_the_model_s_own_rows_on_another_history():
    """The front's teacher forcing: K and the intervals are the forced ones; row 0 (before any
    forced choice) is the free run's, row 1 follows the forced interval instead of the model's."""
    from transformers.cache_utils import DynamicCache

    from infer.oracles.front import run_front
    from pipeline.config import InferConfig

    inputs, golden, _, _ = parity.load_case(FIXTURE)
    sample, settings = parity.case_settings(FIXTURE, inputs, "float32")
    model = ReleaseCaptioner.from_release(CHECKPOINT, settings).eval()
    video = parity.case_video(inputs, sample, settings.instruction)
    opts = InferConfig(max_events=model.max_events)
    fronts = [run_front(model, video, DynamicCache(config=model.hf_config), opts, forced_steps=f)
              for f in (None, [(0, 1)])]
    free, forced = fronts
    assert free.steps == parity.release_steps(golden) and free.num_events == 3
    assert forced.steps == [(0, 1)] and forced.num_events == 1 and len(forced.planning_logits) == 2
    torch.testing.assert_close(forced.planning_logits[0], free.planning_logits[0], rtol=0, atol=0)
    assert not torch.allclose(forced.planning_logits[1], free.planning_logits[1])


def test_front_verdict_passes_only_near_ties_between_the_engine_and_the_reference():
    """bf16, engine vs the free-running reference: the first differing event must be a near tie in the
    reference's own row (its <G>/<S> gap, or its flipped timesteps' distance from the threshold)."""
    from types import SimpleNamespace

    front = SimpleNamespace(steps=[(2, 2), (0, 0)],  # the reference's two events, in timesteps
                            planning_logits=torch.tensor([[1.0, 0.0], [2.0, 1.5], [0.0, 3.0]]),
                            grounding_logits=torch.tensor([[0.1, 0.4, 1.0, 0.2], [0.9, 0.62, 0.1, 0.65],
                                                           [0.5, 0.5, 0.5, 0.5]]))

    def verdict(seconds):  # 2 s per timestep, threshold 0.7 (row 1: 0.63), tolerances 1 (logits), 0.1 (sims)
        return parity.front_verdict(seconds, front, 2.0, 0.7, 1.0, 0.1)

    assert verdict([(4.0, 6.0), (0.0, 2.0)]) == (True, "")
    assert verdict([(4.0, 6.0)])[0]  # stopped at row 1, where the reference's gap is 0.5
    ok, detail = verdict([(4.0, 6.0), (0.0, 2.0), (2.0, 4.0)])  # went on at row 2, gap 3
    assert not ok and "row 2 is 3" in detail
    assert verdict([(4.0, 6.0), (0.0, 4.0)])[0]  # timestep 1 (0.62) flipped in: 0.01 from 0.63
    ok, detail = verdict([(4.0, 6.0), (0.0, 6.0)])  # and timestep 2 (0.1): 0.53 from it
    assert not ok and "row 1" in detail and "0.53" in detail
