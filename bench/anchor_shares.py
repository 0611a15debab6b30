"""How much of each anchor says its colour, shape, motion and sound: trained models against the untrained one.

    .venv/bin/python -m bench.anchor_shares runs/default_study/seed*/train/model --layers 0 1 2

For the untrained default model and each trained model directory given, over the events of the first
`--fit` training videos and all held-out videos of `--run-dir`'s shards: the between-class share
(`bench.attr_probe.between_class_share`) of each attribute in the anchors' aggregated features and in
their visual and audio halves, with the anchors aggregated at each of `--layers` (input states of
that decoder layer; the model's own is `aggregation_layer`). A model directory inside a train stage
(`<run>/train/model`) also gets its run's `colour_transition_step` (bench/default_study.py) and its
held-out free-running colour.

Written: `<out>/<name>.json` (default `anchor_shares`; {model: {"layer_<i>": {part: {attribute: share, "norm": mean
L2 norm}}, ...}}).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_facts(model_dir: Path) -> dict:
    """The train stage's colour transition step and held-out colour, when `model_dir` is `<run>/train/model`."""
    from bench.default_study import transition_step

    train = model_dir.parent
    facts = {}
    if (train / "history.json").exists():
        facts["colour_transition_step"] = transition_step(json.loads((train / "history.json").read_text()), "val_colour_acc")
    if (train / "summary.json").exists():
        facts["colour"] = round(json.loads((train / "summary.json").read_text())["heldout"]["free_running"]["colour_acc"], 4)
    return facts


def main(argv: list[str] | None = None) -> int:
    import torch

    from bench.attr_probe import attribute_shares
    from bench.default_seeds import default_config, load_data
    from pipeline.model import PadCaptioner
    from train.data import decode_record
    from train.evaluate import caption_parser
    from train.loop import build_model

    ap = argparse.ArgumentParser(prog="python -m bench.anchor_shares", description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*", help="trained model directories (a train stage's <run>/train/model)")
    ap.add_argument("--layers", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--fit", type=int, default=64, help="training videos whose events are scored beside the held-out ones")
    ap.add_argument("--run-dir", default=str(ROOT / "runs" / "default"), help="make run's directory (its shards)")
    ap.add_argument("--set", action="append", default=[], help="config override of the untrained model")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--name", default="anchor_shares", help="stem of the output file")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = default_config(0, overrides=args.set)
    records, test = load_data(Path(args.run_dir) / "preprocess", cfg)
    samples = [decode_record(r) for r in records[: args.fit]] + test
    parse = caption_parser(cfg)
    first = samples[0]
    models = {"untrained": (build_model(cfg, first.visual.shape[-1], first.audio.shape[-1]), {})}
    for m in args.models:
        models[m] = (PadCaptioner.from_pretrained(m), run_facts(Path(m)))
    result = {"command": "python -m bench.anchor_shares " + " ".join(argv if argv is not None else sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d"), "events": sum(len(s.events) for s in samples), "models": {}}
    for name, (model, facts) in models.items():
        model.eval()
        row = dict(facts, aggregation_layer=model.aggregation_layer)
        for layer in args.layers:
            row[f"layer_{layer}"] = attribute_shares(model, samples, parse, layer=layer)
        result["models"][name] = row
        visual = {k: row[f"layer_{k}"]["visual"]["colour"] for k in args.layers}
        print(f"{name}: {facts} visual-half colour share by layer {visual}", flush=True)
    out = Path(args.out) / f"{args.name}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
