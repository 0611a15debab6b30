"""The sequential baselines' text: format -> parse round trip, malformed outputs, the metrics' reading of it."""

from __future__ import annotations

import numpy as np

from pipeline.metrics.io import EMPTY, OK, UNPARSABLE, read_predictions
from pipeline.schema import Event
from pipeline.textual import format_sequential, format_textual_planning, parse_events_text

EVENTS = [Event(0.5, 4.25, "Visual: a red circle moves up. Audio: a high beep."),
          Event(6.0, 11.0, "Visual: a blue square grows. Audio: silence."),
          Event(12.3, 20.0, "Visual: a green triangle blinks. Audio: a low beep.")]


def test_sequential_round_trip():
    text = format_sequential(EVENTS)
    assert text.splitlines()[0] == "0.5-4.2 seconds: Visual: a red circle moves up. Audio: a high beep."
    events, problems = parse_events_text(text)
    assert problems == []
    assert [c for _, _, c in events] == [e.caption for e in EVENTS]
    np.testing.assert_allclose([[s, e] for s, e, _ in events], [[0.5, 4.2], [6.0, 11.0], [12.3, 20.0]])


def test_textual_planning_round_trip():
    text = format_textual_planning(EVENTS)
    assert text.splitlines()[0] == "events: 0.5-4.2, 6.0-11.0, 12.3-20.0 seconds"
    assert text.splitlines()[2] == "event 2: Visual: a blue square grows. Audio: silence."
    events, problems = parse_events_text(text)
    assert problems == []
    assert events == [(0.5, 4.2, EVENTS[0].caption), (6.0, 11.0, EVENTS[1].caption), (12.3, 20.0, EVENTS[2].caption)]


def test_malformed_lines_are_dropped_with_reasons():
    text = "\n".join([
        "3.0-1.0 seconds: reversed",            # end before start
        "2.0-3.0 seconds:",                     # empty caption
        "Visual: no timestamp at all",           # not an event line
        "4.0 - 6.5 second: spaced and singular",  # still an event
        "events: 1.0-2.0, 9-8, 3.0-4.0 seconds",  # plan with a bad interval
        "event 1: first planned",
        "event 1: twice",
        "event 7: nowhere in the plan",
    ])
    events, problems = parse_events_text(text)
    assert events == [(4.0, 6.5, "spaced and singular"), (1.0, 2.0, "first planned")]
    joined = "\n".join(problems)
    for reason in ("line 1: end 1.0 is not after start 3.0", "line 2: empty caption", "line 3: not an event line",
                   "plan interval 2: end 8 is not after start 9", "event 1 captioned twice",
                   "plan interval 3 has no caption", "event 7 has a caption but no planned interval"):
        assert reason in joined, reason


def test_metrics_read_text_outputs():
    preds, _, fmt = read_predictions({
        "good": {"text": format_sequential(EVENTS[:2]) + "\ngarbage line"},
        "junk": {"text": "Visual: a red circle moves up."},  # no event: unparsable (E.T.Bench: not parsed)
        "blank": {"text": "  "},
    })
    assert fmt == "engine"
    assert preds["good"].status == OK and preds["good"].captions == [EVENTS[0].caption, EVENTS[1].caption]
    assert any("not an event line" in p for p in preds["good"].problems)
    assert preds["junk"].status == UNPARSABLE and "no valid event in the text output" in preds["junk"].problems[-1]
    assert preds["blank"].status == EMPTY
