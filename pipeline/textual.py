"""Events written as text: the format the sequential baselines are trained on, and its parser.

    text = format_sequential(events)        # "3.0-7.5 seconds: caption" per event, one a line
    text = format_textual_planning(events)  # "events: 3.0-7.5, 9.0-12.0 seconds" then "event 1: caption" ...
    events, problems = parse_events_text(text)
    failures = parse_failures(texts)        # how a run's text outputs failed to parse: parse_* numbers

The sequential baseline (`model.layout=sequential`, video-SALMONN 2+ / LongVALE-LLM
style) writes every event in one causal chain with textual timestamps; the textual
planning variant (`model.layout=textual_planning`) first writes all boundaries, then
the captions by number. Both are parsed back by `parse_events_text`, which the metrics'
prediction reader (pipeline/metrics/io.py) applies to a video's raw `{"text": ...}`
output, so a decoded chain is scored exactly as the metrics score any other output:
a text without one valid event is an unparsable video (left out of the averages,
P and R scaled by parsed / total under E.T.Bench), and every line that is dropped is
recorded as a problem with the reason. Times are seconds with one decimal.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence

NUMBER = r"(\d+(?:\.\d+)?)"
SPAN = NUMBER + r"\s*-\s*" + NUMBER
CAPTIONED = re.compile(r"^\s*" + SPAN + r"\s*seconds?\s*:\s*(.*?)\s*$", re.IGNORECASE)
PLAN = re.compile(r"^\s*events?\s*:\s*(.*?)\s*$", re.IGNORECASE)
PLAN_SPAN = re.compile(SPAN)
NUMBERED = re.compile(r"^\s*event\s+(\d+)\s*:\s*(.*?)\s*$", re.IGNORECASE)


def _t(x: float) -> str:
    return f"{float(x):.1f}"


def format_sequential(events: Sequence) -> str:
    """Events (objects with start / end / caption, time order) -> one line per event."""
    return "\n".join(f"{_t(e.start)}-{_t(e.end)} seconds: {e.caption.strip()}" for e in events)


def format_textual_planning(events: Sequence) -> str:
    """The boundaries first ("events: s-e, s-e seconds"), then "event i: caption" lines."""
    plan = "events: " + ", ".join(f"{_t(e.start)}-{_t(e.end)}" for e in events) + " seconds"
    return "\n".join([plan] + [f"event {i + 1}: {e.caption.strip()}" for i, e in enumerate(events)])


def _interval(a: str, b: str) -> tuple[float, float] | str:
    s, e = float(a), float(b)
    if not (math.isfinite(s) and math.isfinite(e)):
        return f"non-finite time {a}-{b}"
    if e <= s:
        return f"end {b} is not after start {a}"
    return s, e


def parse_events_text(text: str) -> tuple[list[tuple[float, float, str]], list[str]]:
    """Text -> ([(start, end, caption)] in output order, problems). Never raises.

    Lines "s-e seconds: caption" are events; a line "events: s-e, s-e ..." is a plan whose
    i-th interval takes the caption of a later line "event i: caption". Empty lines are
    skipped; anything else, a reversed interval, an empty caption, a plan interval without
    a caption and a numbered caption without a plan interval are dropped as problems.
    """
    events: list[tuple[float, float, str]] = []
    problems: list[str] = []
    plan: list[tuple[float, float] | None] = []
    numbered: dict[int, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        m = CAPTIONED.match(line)
        if m:
            iv = _interval(m.group(1), m.group(2))
            if isinstance(iv, str):
                problems.append(f"line {n}: {iv}; dropped")
            elif not m.group(3):
                problems.append(f"line {n}: empty caption; dropped")
            else:
                events.append((*iv, m.group(3)))
            continue
        m = PLAN.match(line)
        if m:
            for span in PLAN_SPAN.finditer(m.group(1)):
                iv = _interval(span.group(1), span.group(2))
                if isinstance(iv, str):
                    problems.append(f"line {n}: plan interval {len(plan) + 1}: {iv}; dropped")
                plan.append(None if isinstance(iv, str) else iv)
            if not PLAN_SPAN.search(m.group(1)):
                problems.append(f"line {n}: a plan without an interval")
            continue
        m = NUMBERED.match(line)
        if m:
            i = int(m.group(1))
            if not m.group(2):
                problems.append(f"line {n}: event {i}: empty caption; dropped")
            elif i in numbered:
                problems.append(f"line {n}: event {i} captioned twice; kept the first")
            else:
                numbered[i] = m.group(2)
            continue
        problems.append(f"line {n}: not an event line: {line.strip()[:60]!r}; dropped")
    for i, iv in enumerate(plan, 1):
        if iv is None:
            continue
        if i in numbered:
            events.append((*iv, numbered.pop(i)))
        else:
            problems.append(f"plan interval {i} has no caption; dropped")
    for i in sorted(numbered):
        problems.append(f"event {i} has a caption but no planned interval; dropped")
    return events, problems


def parse_failures(texts: Iterable[str]) -> dict[str, float]:
    """How a sequential baseline's text outputs (a run's raw outputs) failed to parse, counted over
    `parse_events_text`'s results (the metrics parse them the same way): the held-out cost of
    writing timestamps as text, which the latent layouts cannot pay. -> the flat `parse_*` numbers
    a held-out summary reports: videos without a valid event (an empty text included; such a video
    scores nothing), parse problems (each dropped line, interval or caption, or a caption given
    twice) and the unparsable share of the outputs (0 without outputs)."""
    videos = unparsable = problems = 0
    for text in texts:
        parsed, found = parse_events_text(text)
        videos += 1
        unparsable += int(not parsed)
        problems += len(found)
    return {"parse_unparsable_videos": unparsable, "parse_problems": problems,
            "parse_unparsable_share": unparsable / videos if videos else 0.0}
