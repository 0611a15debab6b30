"""The synthetic corpus's caption grammar: its words, how an event's caption is spelled, and how a caption
(the model's output or a reference) is read back into attributes.

    dense_caption("red", "circle", "moves to the left", "high beep")
        # -> 'Visual: the red circle moves to the left. Audio: a high beep.'
    parse_caption("Visual: the red circle moves up. Audio: silence.")
        # -> {'colour': 'red', 'shape': 'circle', 'motion': 'moves up', 'sound': 'silence'}

Part of the core: the corpus generator (preprocess/synthetic.py) spells its captions with it, the small
BPE tokenizer (pipeline/tokens.py) trains on it, and evaluation (pipeline/evaluate.py, train/evaluate.py)
scores attributes with it. Pure Python; no torch.
"""

from __future__ import annotations

import re

COLOURS: tuple[str, ...] = ("red", "green", "blue", "yellow", "purple", "orange", "white", "cyan")
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "stripes")
MOTIONS: tuple[str, ...] = (
    "moves to the left",
    "moves to the right",
    "moves up",
    "moves down",
    "stays still",
    "grows",
    "shrinks",
    "blinks",
)
SOUNDS: tuple[str, ...] = (
    "low beep",
    "mid beep",
    "high beep",
    "white noise",
    "rising chirp",
    "falling chirp",
    "pulsing beeps",
    "silence",
)
ATTRIBUTES = ("colour", "shape", "motion", "sound")

_SOUND_PHRASE = {s: (s if s in ("white noise", "silence", "pulsing beeps") else f"a {s}") for s in SOUNDS}


def visual_caption(colour: str, shape: str, motion: str) -> str:
    """'the red circle moves to the left.' / 'the orange square grows.' / 'the red striped square moves up.'

    Every colour word follows the same word ('the') and comes before the shape, so the model decides the
    colour on the same row in every caption (why: docs/benchmarks.md, "Learning the attribute words")."""
    noun = "striped square" if shape == "stripes" else shape
    return f"the {colour} {noun} {motion}."


def audio_caption(sound: str) -> str:
    """'a high beep.' / 'white noise.' / 'silence.'"""
    return f"{_SOUND_PHRASE[sound]}."


def dense_caption(colour: str, shape: str, motion: str, sound: str) -> str:
    """The full event caption, in the ChronusAV 'Visual: ... Audio: ...' form."""
    return f"Visual: {visual_caption(colour, shape, motion)} Audio: {audio_caption(sound)}"


def _first_match(words: tuple[str, ...], text: str) -> str | None:
    """The word of `words` that occurs earliest in `text` as whole words (longest wins ties)."""
    best: tuple[int, int, str] | None = None
    for w in words:
        m = re.search(r"\b" + re.escape(w) + r"\b", text)
        if m and (best is None or (m.start(), -len(w)) < (best[0], best[1])):
            best = (m.start(), -len(w), w)
    return best[2] if best else None


def parse_caption(text: str) -> dict[str, str | None]:
    """Caption -> {colour, shape, motion, sound}; an attribute not found is None.

    Tolerant of model output: case-insensitive, any word order; colour/shape/motion
    are read from the part before 'Audio:' and the sound from the part after it (with
    no 'Audio:' marker, the whole text, sound phrases removed before reading colours,
    so 'white noise' is never read as the colour white).
    """
    low = " ".join(text.lower().split())
    visual, audio = low.split("audio:", 1) if "audio:" in low else (low, low)
    sound = _first_match(SOUNDS, audio)
    if sound is None and re.search(r"\bsilent\b", audio):
        sound = "silence"
    for s in SOUNDS:
        visual = re.sub(r"\b" + re.escape(s) + r"\b", " ", visual)
    # 'striped square' (or 'stripes') before any other shape word: the striped square is not a square
    shape = "stripes" if re.search(r"\bstripe", visual) else _first_match(SHAPES, visual)
    return {
        "colour": _first_match(COLOURS, visual),
        "shape": shape,
        "motion": _first_match(MOTIONS, visual),
        "sound": sound,
    }


# How a value is spelled in the generated captions where that is not the value itself (regular
# expressions): what train/evaluate.py's attribute_token_spans looks for in a reference.
parse_caption.surface = {"stripes": r"striped square|stripes"}


def attribute_token_ids(encode) -> list[int]:
    """The token ids that spell attribute values in the generated captions: the ids of every caption
    the grammar can spell, less those every caption has (the template: 'Visual: the', 'Audio:', ...).

    encode: text -> token ids (a tokenizer's `encode` without special tokens). What the training
    aid `model.attribute_token_weight` up-weights in the caption-branch loss (train/losses.py).

    >>> ids = attribute_token_ids(lambda text: [sum(map(ord, w)) for w in text.split()])
    >>> sum(map(ord, "red")) in ids, sum(map(ord, "Visual:")) in ids
    (True, False)
    """
    seen: set[int] = set()
    common: set[int] | None = None
    for c in COLOURS:
        for s in SHAPES:
            for m in MOTIONS:
                for snd in SOUNDS:
                    ids = set(encode(dense_caption(c, s, m, snd)))
                    seen |= ids
                    common = ids if common is None else common & ids
    return sorted(seen - (common or set()))
