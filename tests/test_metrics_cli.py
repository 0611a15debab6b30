"""The metrics command line: one JSON object on stdout, report files, clear errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "pipeline.metrics", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _files(tmp_path: Path) -> tuple[Path, Path]:
    ref = {
        "a": {"duration": 40.0, "timestamps": [[0, 10], [10, 25], [25, 40]],
              "sentences": ["A man opens the door.", "He walks into a bright kitchen.", "He pours a glass of water."]},
        "b": {"duration": 20.0, "timestamps": [[0, 20]], "sentences": ["A dog sleeps on the sofa."]},
    }
    pred = {
        "a": {"events": [{"start": 0.5, "end": 11, "caption": "A man opens a door."},
                         {"start": 12, "end": 24, "caption": "A man walks into the kitchen."},
                         {"start": 30, "end": 20, "caption": "reversed"}]},
        "b": {"error": "decode failed"},
    }
    (tmp_path / "ref.json").write_text(json.dumps(ref))
    (tmp_path / "pred.json").write_text(json.dumps(pred))
    return tmp_path / "pred.json", tmp_path / "ref.json"


@pytest.mark.slow  # a fresh process: METEOR JVM start-up, PTB and MiniLM load
def test_cli_json_and_report(tmp_path):
    pred, ref = _files(tmp_path)
    out = _run("--pred", str(pred), "--ref", str(ref), "--protocol", "padcaptioner", "--ref-format", "longvale", "--json", "--report", str(tmp_path / "rep"))
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)  # exactly one JSON object on stdout
    assert result["protocol"] == "padcaptioner"
    assert set(result["metrics"]) == {"F1", "Sim", "SODA_c", "CIDEr", "METEOR"}
    assert all(0.0 <= v for v in result["metrics"].values())
    assert set(result["per_threshold"]["etbench"]) == {"0.1", "0.3", "0.5", "0.7"}
    assert set(result["per_threshold"]["densevid"]) == {"0.3", "0.5", "0.7", "0.9"}
    assert result["counts"]["videos"] == 2 and result["counts"]["videos_with_predictions"] == 1
    assert result["counts"]["predicted_events_dropped"] == 1
    assert result["components"]["etbench"]["counts"]["parsed_scale"] == 0.5
    assert result["scorer_calls"]["meteor_jvms"] == 1 and result["scorer_calls"]["ptb_calls"] == 1
    problems = {(p["video_id"], p["problem"]) for p in result["problems"]}
    assert ("b", "output is an error: 'decode failed'") in problems
    assert any(v == "a" and "reversed" in m for v, m in problems)
    assert "per_video" not in result["components"]["soda"]  # only with --per-video
    rep = tmp_path / "rep"
    assert (rep / "index.html").exists() and (rep / "metrics.png").exists()
    assert len(list((rep / "videos").glob("*.png"))) == 2


def test_cli_rejects_zero_policy_for_padcaptioner(tmp_path):
    pred, ref = _files(tmp_path)
    out = _run("--pred", str(pred), "--ref", str(ref), "--protocol", "padcaptioner", "--missing-as-zero", "--json")
    assert out.returncode == 2 and "LongVALE variant" in out.stderr and out.stdout == ""


def test_cli_unreadable_input(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{oops")
    out = _run("--pred", str(bad), "--ref", str(bad), "--protocol", "soda", "--json")
    assert out.returncode == 2 and "not valid JSON" in out.stderr
