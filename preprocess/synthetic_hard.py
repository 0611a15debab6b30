"""The `hard` synthetic regime's planner: many, overlapping, look-alike events and distractor sounds.

    script = script_hard_video(cfg, index, split)   # cfg.regime == "hard"; cfg.hard: HardOptions
    validate_hard(cfg)                          # ValueError naming the first impossible setting

Why: in the default regime every event of a video has its own colour and its own sound and
none overlap, so a model can caption by listing attributes and ground by finding each
colour. Here (pipeline/config_synthetic.py `HardOptions`):
  layout       8-16 events in 48-96 s; after the first, each event partly overlaps the
               previous one, starts where it ends (back to back), or follows a background gap
               of >= min_gap_seconds; an overlap is 20-50 % of the shorter event, so at most
               two events are active at once; they are drawn in two lanes (top-left and
               bottom-right quadrant, half size, preprocess/synthetic_media.py LANE_CENTRES).
  attributes   colour, shape, motion and sound drawn independently per event, so with 8+
               events colours and sounds repeat within a video; two events of a video never
               share all four, and two overlapping events never share their sound (their mix
               would be one sound) nor both colour and shape. So events are told apart by
               time, motion, shape or the other modality only.
  distractors  2-4 audio-only sounds per video (never silence) that belong to no event: in
               the audio track, in no annotation. A distractor never overlaps another, never
               plays the sound of an event it overlaps, never overlaps a silent event, and
               never starts or ends on an event's boundary, so an event's own sound is the
               one that starts and ends with its picture.
  captions     the default grammar ("Visual: ... Audio: ..."): half of every caption's words
               are read from the picture and half from the sound, and with repeats and
               distractors neither stream alone says which words belong to which event.
Deterministic: numpy generators seeded by (seed, video index, stream).
"""

from __future__ import annotations

import math

import numpy as np

from pipeline.caption_grammar import COLOURS, MOTIONS, SHAPES, SOUNDS
from pipeline.config_synthetic import HardOptions, SyntheticConfig
from preprocess.synthetic_media import EventSpec, SoundSpec, VideoScript

HARD_MAX_EVENTS = 32
GAP, BACK_TO_BACK, OVERLAP = 0, 1, 2
_TRIES = 200  # rejection-sampling attempts per event / distractor (constraints are loose)


def min_frames(cfg: SyntheticConfig) -> tuple[int, int]:
    """(minimum event frames, minimum gap frames)."""
    return max(1, math.ceil(cfg.min_event_seconds * cfg.fps)), max(1, math.ceil(cfg.min_gap_seconds * cfg.fps))


def validate_hard(cfg: SyntheticConfig) -> None:
    """Raise ValueError naming the first impossible `data.synthetic.hard` setting."""
    h: HardOptions = cfg.hard
    if not 1 <= h.min_events <= h.max_events <= HARD_MAX_EVENTS:
        raise ValueError(f"synthetic.hard events must satisfy 1 <= min_events <= max_events <= {HARD_MAX_EVENTS}, "
                         f"got {h.min_events}..{h.max_events}")
    if not 0 < h.min_duration <= h.max_duration:
        raise ValueError(f"synthetic.hard durations must satisfy 0 < min <= max, got {h.min_duration}..{h.max_duration}")
    if not (0 <= h.overlap_prob <= 1 and 0 <= h.back_to_back_prob <= 1 and h.overlap_prob + h.back_to_back_prob <= 1):
        raise ValueError(f"synthetic.hard overlap_prob + back_to_back_prob must be probabilities summing to <= 1, "
                         f"got {h.overlap_prob} + {h.back_to_back_prob}")
    if not 0 < h.min_overlap <= h.max_overlap <= 0.5:
        raise ValueError(f"synthetic.hard overlaps must satisfy 0 < min_overlap <= max_overlap <= 0.5 (at most two "
                         f"events at once), got {h.min_overlap}..{h.max_overlap}")
    if not 0 <= h.min_distractors <= h.max_distractors:
        raise ValueError(f"synthetic.hard distractors must satisfy 0 <= min <= max, got {h.min_distractors}..{h.max_distractors}")
    if not 0 < h.min_distractor_seconds <= h.max_distractor_seconds:
        raise ValueError(f"synthetic.hard distractor seconds must satisfy 0 < min <= max, "
                         f"got {h.min_distractor_seconds}..{h.max_distractor_seconds}")
    min_ev, min_gap = min_frames(cfg)
    if min_ev * h.min_overlap < 1:
        raise ValueError(f"synthetic.hard.min_overlap {h.min_overlap} of a {min_ev}-frame event is under one frame")
    shortest = int(round(h.min_duration * cfg.fps))
    if shortest < h.min_events * (min_ev + min_gap) + min_gap:
        raise ValueError(f"synthetic.hard.min_duration {h.min_duration}s cannot hold {h.min_events} events of "
                         f">= {cfg.min_event_seconds}s with gaps of >= {cfg.min_gap_seconds}s")
    if int(round(h.max_distractor_seconds * cfg.fps)) > shortest:
        raise ValueError(f"synthetic.hard.max_distractor_seconds {h.max_distractor_seconds}s is longer than the "
                         f"shortest video ({h.min_duration}s)")


def layout(cfg: SyntheticConfig, rng: np.random.Generator) -> tuple[int, list[tuple[int, int]], list[int]]:
    """(frames n, event intervals [start, end) in start order, relation of each event to the previous)."""
    h = cfg.hard
    n = int(round(rng.uniform(h.min_duration, h.max_duration) * cfg.fps))
    min_ev, min_gap = min_frames(cfg)
    fit = (n - min_gap) // (min_ev + min_gap)
    k = int(min(rng.integers(h.min_events, h.max_events + 1), fit))
    p_gap = 1.0 - h.overlap_prob - h.back_to_back_prob
    rel = [int(r) for r in rng.choice(3, size=k - 1, p=[p_gap, h.back_to_back_prob, h.overlap_prob])]
    slots = rel.count(GAP) + 2  # background before the first, after the last, and between GAP pairs
    free = n - k * min_ev - slots * min_gap
    free_ev = int(round(free * rng.uniform(0.6, 0.85)))
    lengths = min_ev + rng.multinomial(free_ev, rng.dirichlet(np.full(k, 3.0)))
    overlap = [0] + [int(math.floor(rng.uniform(h.min_overlap, h.max_overlap) * min(lengths[i], lengths[i + 1])))
                     if r == OVERLAP else 0 for i, r in enumerate(rel)]
    gap_free = free - free_ev + sum(overlap)
    gaps = min_gap + rng.multinomial(gap_free, rng.dirichlet(np.full(slots, 3.0)))
    spans, g, cursor = [], 1, int(gaps[0])
    for i in range(k):
        if i > 0:
            r = rel[i - 1]
            cursor = spans[-1][1] + (int(gaps[g]) if r == GAP else -overlap[i] if r == OVERLAP else 0)
            g += int(r == GAP)
        spans.append((cursor, cursor + int(lengths[i])))
    assert spans[-1][1] + int(gaps[-1]) == n and g == slots - 1, (spans, n)
    return n, spans, rel


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return min(a[1], b[1]) > max(a[0], b[0])


def _lanes(spans: list[tuple[int, int]], rng: np.random.Generator) -> list[int]:
    """Lane 0 or 1 per event: concurrent events in different lanes, a free choice drawn at random."""
    lanes: list[int] = []
    busy_until = [0, 0]
    for s, e in spans:
        free = [lane for lane in (0, 1) if busy_until[lane] <= s]
        lane = free[0] if len(free) == 1 else int(rng.integers(2))
        busy_until[lane] = e
        lanes.append(lane)
    return lanes


def _attributes(spans: list[tuple[int, int]], rng: np.random.Generator) -> list[tuple[str, str, str, str]]:
    """(colour, shape, motion, sound) per event, independent draws under the module doc's constraints."""
    chosen: list[tuple[str, str, str, str]] = []
    for i, span in enumerate(spans):
        for _ in range(_TRIES):
            a = (COLOURS[rng.integers(len(COLOURS))], SHAPES[rng.integers(len(SHAPES))],
                 MOTIONS[rng.integers(len(MOTIONS))], SOUNDS[rng.integers(len(SOUNDS))])
            clash = any(a == b or (_overlaps(span, spans[j]) and (a[3] == b[3] or a[:2] == b[:2]))
                        for j, b in enumerate(chosen))
            if not clash:
                break
        else:
            raise RuntimeError(f"no attributes for event {i} after {_TRIES} draws")
        chosen.append(a)
    return chosen


def _distractors(cfg: SyntheticConfig, n: int, events: list[EventSpec], rng: np.random.Generator) -> list[SoundSpec]:
    """Audio-only sounds that belong to no event (module doc); a draw that fits nowhere is left out."""
    h = cfg.hard
    lo, hi = int(round(h.min_distractor_seconds * cfg.fps)), int(round(h.max_distractor_seconds * cfg.fps))
    edges = {f for ev in events for f in (ev.start_frame, ev.end_frame)}
    sounds = [s for s in SOUNDS if s != "silence"]
    placed: list[SoundSpec] = []
    for _ in range(int(rng.integers(h.min_distractors, h.max_distractors + 1))):
        for _ in range(_TRIES):
            length = int(rng.integers(lo, hi + 1))
            start = int(rng.integers(0, n - length + 1))
            span, sound = (start, start + length), sounds[rng.integers(len(sounds))]
            under = [ev for ev in events if _overlaps(span, (ev.start_frame, ev.end_frame))]
            if (start in edges or span[1] in edges or any(_overlaps(span, (d.start_frame, d.end_frame)) for d in placed)
                    or any(ev.sound in (sound, "silence") for ev in under)):
                continue
            placed.append(SoundSpec(span[0], span[1], sound))
            break
    return sorted(placed, key=lambda d: d.start_frame)


def script_hard_video(cfg: SyntheticConfig, index: int, split: str) -> VideoScript:
    """The deterministic hard-regime script of video `index` (module doc)."""
    rng = np.random.default_rng([cfg.seed, index, 0])
    n, spans, _ = layout(cfg, rng)
    lanes = _lanes(spans, rng)
    events = [EventSpec(s, e, *attrs, lane=lane) for (s, e), attrs, lane in zip(spans, _attributes(spans, rng), lanes)]
    return VideoScript.of(cfg, index, split, n, events, _distractors(cfg, n, events, rng))
