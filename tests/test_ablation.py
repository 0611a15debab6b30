"""bench/ablation.py --smoke: every variant trained, decoded in its own layout, scored, tabled, plotted."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from bench.ablation import DEFAULT, FULL, HARD, ROWS, VARIANTS, bench_config, main

DECODERS = {"sequential": "text_chain", "textual_planning": "text_chain", "latent_sequential": "monolithic",
            "causal_mask": "layout_ordered", "own_g": "layout_ordered"}


def test_every_variant_trains_with_the_papers_losses():
    """The embedded default's training aid (model.attribute_token_weight) is off in every variant of every
    budget, and only a --set asks for it."""
    for budget in (FULL, DEFAULT, HARD):
        for variant in VARIANTS:
            assert bench_config(budget, variant, 0).model.attribute_token_weight == 1.0
    aided = replace(FULL, overrides=("model.attribute_token_weight=3",))
    assert bench_config(aided, "full", 0).model.attribute_token_weight == 3.0


@pytest.mark.slow
def test_smoke_run_writes_the_table(tmp_path):
    assert main(["--smoke", "--inline", "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out")]) == 0
    result = json.loads((tmp_path / "out" / "ablation_smoke.json").read_text())
    assert result["budget"]["name"] == "smoke" and result["corpus"]["heldout_videos"] == 2
    assert set(result["runs"]) == set(VARIANTS)
    for variant, runs in result["runs"].items():
        assert [r["seed"] for r in runs] == [0, 1]
        for r in runs:
            assert r["decoder"] == DECODERS.get(variant, "parallel engine")
            assert r["videos"] == 2 and 0 <= r["videos_parsed"] <= 2
            for key in ("F1", "Sim", "SODA_c", "CIDEr", "METEOR", "ms_per_video", "ms_per_token", "attr_acc"):
                assert math.isfinite(r[key]), (variant, key)
            assert r["ms_per_video"] > 0
    rows = result["rows"]
    assert [r["label"] for r in rows] == [r["label"] for r in ROWS]
    assert all(r["stats"]["F1"]["n"] == 2 for r in rows)
    table = (tmp_path / "out" / "ablation_smoke.md").read_text()
    assert "1 run(s) at a time" in table.splitlines()[0]  # how the decode ms were measured
    assert "| ++ parallel decoding (full) | 61.8 / 38.8 |" in table and table.count("\n| ") == len(ROWS) + 1
    assert (tmp_path / "out" / "ablation_smoke.png").stat().st_size > 10_000
    assert all(r["stats"]["sound_acc"]["n"] == 2 for r in rows)  # each attribute's accuracy: the plot's last panel
    # redraw: the rows re-summarized from the JSON's own runs, the table kept, nothing retrained
    from bench.ablation_report import redraw

    (tmp_path / "out" / "ablation_smoke.png").unlink()
    redraw(tmp_path / "out" / "ablation_smoke.json")
    again = json.loads((tmp_path / "out" / "ablation_smoke.json").read_text())
    assert again == result and (tmp_path / "out" / "ablation_smoke.md").read_text() == table
    assert (tmp_path / "out" / "ablation_smoke.png").stat().st_size > 10_000
