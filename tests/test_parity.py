"""infer.parity can fail: it passes on both copies of release-golden (fp32 and bf16) and exits non-zero
on a corrupted copy, one test per kind of corruption; its weights table catches a wrong loader mapping;
an exception is a FAIL line and the run goes on."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest
import torch

from infer import parity
from infer.parity_weights import weight_problems
from pipeline.release.checkpoint import read_state_dict
from pipeline.release.model import ReleaseCaptioner
from tests.support.release import CHECKPOINT, FIXTURE

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
        swap = {"frm_head.": "evi_head.", "evi_head.": "frm_head."}
        return [(src, swap.get(dst, dst)) for src, dst in rules(self)]

    monkeypatch.setattr(ReleaseCaptioner, "release_rules", swapped)
    model = ReleaseCaptioner.from_release(CHECKPOINT)
    problems = weight_problems(model, read_state_dict(CHECKPOINT))
    assert len(problems) == 1 and problems[0].startswith("12 tensors that differ from the file"), problems
