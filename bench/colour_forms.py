"""Held-out colour accuracy by the form of the reference caption, and the colour confusions.

    .venv/bin/python -m bench.colour_forms runs/default/synth/longvale_test.json runs/default_seeds/seed*/run.json

Each reference event of the synthetic grammar is matched to the predicted event with the highest
tIoU (at least `--min-iou`, 0.5) and its colour read with preprocess.synthetic.parse_caption from
both captions. The form of a reference says on which row the colour is decided: `a` (`a <colour>
<shape>`), `an` (`an orange ...`: decided by the article, one row earlier), `set of` (`a set of
<colour> stripes`: the row of `of`), both former templates, and `the` (`the <colour> <shape>`,
generator 2: one row for every colour). docs/benchmarks.md's "Why colour stayed a coin flip" is this table
over the runs of bench/default_seeds.py. Reads run.json files as bench/ablation_run.py writes them
(`outputs`: {video id: {"events": [{start, end, caption}]}}).
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path

from pipeline.metrics.tiou import tiou
from preprocess.synthetic import parse_caption

ROOT = Path(__file__).resolve().parents[1]

def caption_form(caption: str) -> str:
    """The words before the colour in a reference's visual part: 'the', 'an', 'set of' or 'a'."""
    visual = re.sub(r"^\s*visual:\s*", "", caption.lower().split("audio:")[0])
    for form in ("the ", "a set of ", "an "):
        if visual.startswith(form):
            return form.removeprefix("a ").strip()
    return "a"


def former_form(colour: str | None, shape: str | None) -> str:
    """The form the event's caption had under the former template (generator 1), from its attributes:
    so runs on generator 2's captions can be split the same way as runs on the former ones."""
    return "set of" if shape == "stripes" else ("an" if colour == "orange" else "a")


def colour_by_form(references: dict, outputs: dict, min_iou: float = 0.5) -> dict:
    """references: {video: {"timestamps": [[s, e]], "sentences": [...]}} (the synthetic stage's
    <dataset>_test.json); outputs: {video: {"events": [{start, end, caption}]}} ->
    {"forms": {form: {"events", "accuracy"}}, "former_forms": the same by `former_form`,
    "confusion": {true colour: {predicted: count}}, "matched", "unmatched"}; a reference with no
    prediction at min_iou is unmatched (not scored)."""
    hits, seen, confusion = Counter(), Counter(), {}
    former_hits, former_seen = Counter(), Counter()
    unmatched = 0
    for video, pred in outputs.items():
        ref = references[video]
        events = pred.get("events", [])
        for (s, e), sentence in zip(ref["timestamps"], ref["sentences"]):
            overlap, best = max(((tiou((s, e), (p["start"], p["end"])), i) for i, p in enumerate(events)),
                                default=(0.0, None))
            if best is None or overlap < min_iou:
                unmatched += 1
                continue
            best = events[best]
            ref_attrs = parse_caption(sentence)
            truth, said = ref_attrs["colour"], parse_caption(best["caption"])["colour"]
            form, former = caption_form(sentence), former_form(truth, ref_attrs["shape"])
            seen[form] += 1
            hits[form] += int(said == truth)
            former_seen[former] += 1
            former_hits[former] += int(said == truth)
            row = confusion.setdefault(truth, Counter())
            row[said or "none"] += 1
    table = lambda h, n: {f: {"events": k, "accuracy": round(h[f] / k, 4)} for f, k in sorted(n.items())}  # noqa: E731
    return {"forms": table(hits, seen), "former_forms": table(former_hits, former_seen),
            "confusion": {c: dict(row) for c, row in sorted(confusion.items())},
            "matched": sum(seen.values()), "unmatched": unmatched}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("references", help="the synthetic stage's <dataset>_test.json")
    ap.add_argument("runs", nargs="+", help="run.json files (bench/default_seeds.py, bench/ablation.py)")
    ap.add_argument("--min-iou", type=float, default=0.5)
    args = ap.parse_args(argv)
    references = json.loads(Path(args.references).read_text())
    out = {}
    for path in args.runs:
        table = colour_by_form(references, json.loads(Path(path).read_text())["outputs"], args.min_iou)
        out[path] = table
        for key in ("forms", "former_forms"):
            forms = "  ".join(f"{f} {v['accuracy']:.2f} ({v['events']})" for f, v in table[key].items())
            print(f"{path}: {key} {forms}")
        for colour, row in table["confusion"].items():
            wrong = {k: v for k, v in row.items() if k != colour}
            if wrong:
                print(f"    {colour:7s} right {row.get(colour, 0)}, read as {wrong}")
    return out


if __name__ == "__main__":
    main()
