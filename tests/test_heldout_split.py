"""Held-out metrics for the hard regime: attribute accuracy split by unique / repeated values,
grounding F1 of overlapping events, and the text baselines' parse failures (hand-computed).

    .venv/bin/python -m pytest tests/test_heldout_split.py -q
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from bench.ablation import FULL, HARD, bench_config
from pipeline.config import SyntheticConfig
from pipeline.schema import Event
from pipeline.textual import parse_failures
from preprocess.synthetic import parse_caption
from train.evaluate import EvalCounts, engine_counts, overlapping_references, summary


def _video(*events: tuple[float, float, str]) -> SimpleNamespace:
    return SimpleNamespace(events=[Event(s, e, c) for s, e, c in events])


def test_attribute_accuracy_is_split_by_whether_the_value_is_unique_in_its_video():
    # colour: red twice (repeated), blue once; sound: high beep twice, low beep once;
    # shape: circle once, square twice; motions all different
    video = _video((0, 4, "Visual: a red circle moves up. Audio: a high beep."),
                   (5, 9, "Visual: a red square grows. Audio: a low beep."),
                   (10, 14, "Visual: a blue square shrinks. Audio: a high beep."))
    pred = [(0, 4, "Visual: a green circle moves up. Audio: a low beep."),     # colour x, sound x
            (5, 9, "Visual: a blue square grows. Audio: a low beep."),        # colour x
            (10, 14, "Visual: a blue circle shrinks. Audio: a high beep.")]   # shape x
    out = summary(engine_counts([video], [pred], parse_caption))
    assert out["colour_acc"] == pytest.approx(1 / 3)
    assert (out["colour_acc_unique"], out["colour_acc_repeated"]) == (1.0, 0.0)
    assert (out["sound_acc_unique"], out["sound_acc_repeated"]) == (1.0, 0.5)
    assert (out["shape_acc_unique"], out["shape_acc_repeated"]) == (1.0, 0.5)
    assert out["motion_acc_unique"] == 1.0 and "motion_acc_repeated" not in out  # no motion repeats
    assert out["attr_acc_unique"] == 1.0  # 3 of 3 unique (colour, sound, shape) values right
    assert out["attr_acc_repeated"] == pytest.approx(2 / 6)  # colour 0/2 + sound 1/2 + shape 1/2
    assert "overlap_grounding_f1@0.5" not in out  # no two references overlap


def test_overlapping_references_touching_is_not_overlapping():
    ref = np.array([[0, 10], [6, 16], [20, 30], [30, 40]], dtype=np.float64)
    assert overlapping_references(ref).tolist() == [True, True, False, False]
    assert overlapping_references(ref[:1]).tolist() == [False]


def test_overlap_grounding_f1_by_hand():
    v1 = _video((0, 10, "a"), (6, 16, "b"), (20, 30, "c"), (30, 40, "d"))  # a, b overlap; c, d back to back
    p1 = [(0, 10, "x"),    # = a: hit, its best reference overlaps
          (12, 20, "x"),   # best b (tIoU 4/14), no hit
          (20, 30, "x"),   # = c: an isolated reference, not counted in the overlap numbers
          (50, 55, "x"),   # touches nothing: in no overlap count
          (6, 16, "x")]    # = b: hit
    v2 = _video((0, 5, "e"), (3, 8, "f"))  # overlapping, nothing predicted
    v3 = _video((0, 5, "g"))  # no overlap: not an overlap video
    out = summary(engine_counts([v1, v2, v3], [p1, [], [(0, 5, "x")]]))
    # v1: recall over {a, b} = 2/2, precision over the predictions owned by a or b = 2/3; v2: 0 and 0
    assert out["overlap_videos"] == 2 and out["overlap_events"] == 4
    assert out["overlap_grounding_recall@0.5"] == pytest.approx(0.5)
    assert out["overlap_grounding_precision@0.5"] == pytest.approx(1 / 3)
    assert out["overlap_grounding_f1@0.5"] == pytest.approx(0.4)  # 2 * (1/3 * 1/2) / (1/3 + 1/2)
    # the all-event numbers are unchanged by the split: v1 P 3/5 R 3/4, v2 0 / 0, v3 1 / 1
    assert out["grounding_precision@0.5"] == pytest.approx((3 / 5 + 0 + 1) / 3)
    assert out["grounding_recall@0.5"] == pytest.approx((3 / 4 + 0 + 1) / 3)


def test_teacher_forced_counts_report_no_split():
    out = summary(EvalCounts(videos=1.0, events=2.0, colour=1.0))
    assert not any(k.endswith(("_unique", "_repeated")) or k.startswith("overlap_") for k in out)
    assert out["colour_acc"] == 0.5


def test_parse_failures_by_hand():
    texts = ["0.0-2.0 seconds: a\n5.0-3.0 seconds: b\nhello\n",  # 1 event; reversed + not an event line
             "",  # empty: unparsable, no problem line
             "events: 1.0-2.0, 3.0-4.0 seconds\nevent 1: x\nevent 3: y",  # 1 event; plan 2 uncaptioned, event 3 unplanned
             "garbage"]  # unparsable: 1 problem
    assert parse_failures(texts) == {"parse_unparsable_videos": 2, "parse_problems": 5, "parse_unparsable_share": 0.5}
    assert parse_failures([])["parse_unparsable_share"] == 0.0


def test_ablation_budget_hard_selects_the_regime_and_full_stays_default():
    hard = bench_config(HARD, "sequential", 1)
    syn = hard.data.synthetic
    assert syn.regime == "hard" and (syn.hard.min_events, syn.hard.max_events) == (8, 16)
    assert (syn.hard.min_duration, syn.hard.max_duration) == (48.0, 96.0) and hard.infer.max_events == 16
    assert hard.model.layout == "sequential" and HARD.seeds == 3
    full = bench_config(FULL, "full", 0).data.synthetic
    assert full == SyntheticConfig(num_videos=128, min_duration=14.0, max_duration=24.0, max_events=4, seed=0,
                                   num_workers=2)
    assert bench_config(FULL, "full", 0).infer.max_events == 8


def test_ablation_set_overrides_reach_every_variant_and_the_variant_keeps_its_own():
    from dataclasses import replace

    budget = replace(HARD, overrides=("train.lr=0.001", "model.aggregation=mean"))
    assert bench_config(budget, "full", 0).train.lr == 0.001
    assert bench_config(budget, "sequential", 2).train.lr == 0.001
    assert bench_config(budget, "agg_none", 0).model.aggregation == "none"  # the variant's setting wins
    assert bench_config(HARD, "full", 0).train.lr != 0.001


def test_teacher_forced_scoring_finds_every_attribute_of_every_generated_caption():
    """Teacher-forced attribute accuracy scores the tokens that spell each attribute in the reference
    (train/evaluate.py `attribute_token_spans`): every value the generator writes must be found there,
    spelled as the caption spells it (stripes as 'striped square'), or its events count as misses."""
    import itertools

    from pipeline.config import ModelConfig
    from pipeline.tokens import build_tokenizer
    from preprocess.synthetic import ATTRIBUTES, COLOURS, MOTIONS, SHAPES, SOUNDS, dense_caption
    from train.evaluate import attribute_token_spans

    tok = build_tokenizer(ModelConfig())
    for combo in itertools.product(COLOURS, SHAPES, MOTIONS[:3], SOUNDS):
        texts = [tok.decode([i]) for i in tok(dense_caption(*combo))["input_ids"]]
        spans = attribute_token_spans(texts, parse_caption)
        spelled = {a: "".join(texts[j] for j in spans.get(a, [])).strip() for a in ATTRIBUTES}
        assert spelled == {a: "striped square" if v == "stripes" else v for a, v in zip(ATTRIBUTES, combo)}, combo


def test_colour_by_caption_form_counts_each_form_and_the_former_one():
    """bench/colour_forms.py: each reference matched to its best prediction at tIoU >= 0.5, the colour
    scored under the form its caption is written in and the form the former template gave it."""
    from bench.colour_forms import caption_form, colour_by_form

    assert [caption_form(c) for c in ("Visual: the red circle moves to the left.", "Visual: an orange square grows.",
                                      "Visual: a set of red stripes moves up.", "Visual: a red circle blinks.")] \
        == ["the", "an", "set of", "a"]
    refs = {"v": {"timestamps": [[0, 4], [5, 9], [10, 14], [15, 19]],
                  "sentences": ["Visual: an orange square grows. Audio: silence.",
                                "Visual: a set of red stripes moves up. Audio: a high beep.",
                                "Visual: a blue circle blinks. Audio: a low beep.",
                                "Visual: the green triangle shrinks. Audio: a low beep."]}}
    outputs = {"v": {"events": [{"start": 0, "end": 4, "caption": "Visual: a red square grows."},      # orange -> red
                                {"start": 5, "end": 9, "caption": "Visual: a set of red stripes."},    # right
                                {"start": 10, "end": 12.5, "caption": "Visual: a blue circle."},       # tIoU 0.625: right
                                {"start": 15, "end": 16, "caption": "Visual: the green triangle."}]}}  # tIoU 0.25: unmatched
    t = colour_by_form(refs, outputs)
    assert (t["matched"], t["unmatched"]) == (3, 1)
    assert t["forms"] == {"a": {"events": 1, "accuracy": 1.0}, "an": {"events": 1, "accuracy": 0.0},
                          "set of": {"events": 1, "accuracy": 1.0}}
    assert t["former_forms"] == t["forms"]
    assert t["confusion"] == {"blue": {"blue": 1}, "orange": {"red": 1}, "red": {"red": 1}}
    # generator 2's captions: one form as written, the former one still told apart
    refs["v"]["sentences"][:3] = ["Visual: the orange square grows.", "Visual: the red striped square moves up.",
                                  "Visual: the blue circle blinks."]
    t = colour_by_form(refs, outputs)
    assert t["forms"] == {"the": {"events": 3, "accuracy": round(2 / 3, 4)}}
    assert set(t["former_forms"]) == {"a", "an", "set of"}
