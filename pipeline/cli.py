"""`padcap`: the one command of the project, one verb per tool.

    padcap run                      the whole pipeline on the embedded default (what `make run` does)
    padcap caption --model DIR --videos DIR --out OUT
    padcap serve --model DIR
    padcap config --set train.max_steps=10

Each verb is the tool's own command line (`padcap caption` is `python -m infer.offline.job`, with the
same flags), so `pipeline/run.py` keeps working for `ray job submit`. What this layer adds is the same
behaviour everywhere: a usage or config error is one line on stderr that names the flag or key, with
exit status 2; `--help` ends with an example; `padcap --version`. It is the driver layer: it may
import every stage, and nothing imports it.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass

from pipeline import __version__
from pipeline.config import ConfigError, load_config


@dataclass(frozen=True)
class Verb:
    module: str  # whose `main(argv) -> int` runs the verb ("" = defined here)
    summary: str
    example: str


VERBS: dict[str, Verb] = {
    "run": Verb("pipeline.run", "the whole pipeline: synth, preprocess, train, caption, evaluate",
                "padcap run --config cluster/configs/default.yaml --set train.max_steps=200"),
    "preprocess": Verb("preprocess.job", "videos + annotations -> WebDataset shards and a Parquet manifest (Ray Data)",
                       "padcap preprocess --videos /data/videos --annotations train=train.json --format longvale --out shards/"),
    "train": Verb("train.trainer", "LoRA fine-tuning on preprocessed shards (Ray Train)",
                  "padcap train --shards shards/ --out runs/mine/train --set train.max_steps=1000"),
    "caption": Verb("infer.offline.job", "caption a folder, glob, bucket or manifest of videos (Ray Data)",
                    "padcap caption --model runs/default/train/model --videos /data/videos --out captions/"),
    "serve": Verb("infer.serving.deployment", "the HTTP captioning endpoint (Ray Serve) on this machine or cluster",
                  "padcap serve --model runs/default/train/model --set serve.port=8000"),
    "evaluate": Verb("pipeline.metrics.__main__", "score captions against references (F1, Sim, SODA_c, CIDEr, METEOR)",
                     "padcap evaluate --pred captions/captions.jsonl --ref test.json --report report/"),
    "plan": Verb("infer.engine.memory_plan", "how many videos of a given length fit in flight on a device",
                 "padcap plan --shape release-3b --device-memory-gb 24 80"),
    "parity": Verb("infer.parity.check", "check this project against a trace of the release's own inference",
                   "padcap parity path/to/release-golden --dtype float32"),
    "config": Verb("", "print the resolved config as YAML (a preset, then --set overrides)",
                   "padcap config --config cluster/configs/release-3b.yaml --set infer.max_events=10"),
}


def _one_line_error(self: argparse.ArgumentParser, message: str):
    """argparse's `error` while a verb runs: a usage error is one line naming the flag, and exit status 2."""
    self.exit(2, f"{self.prog}: error: {message}\n")


def config_main(argv: list[str]) -> int:
    import yaml

    ap = argparse.ArgumentParser(prog="padcap config", description=VERBS["config"].summary)
    ap.add_argument("--config", default=None, help="a YAML preset (default: the embedded default)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override one key, e.g. train.max_steps=10 (repeatable)")
    args = ap.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    sys.stdout.write(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    return 0


def _overview() -> str:
    width = max(map(len, VERBS))
    lines = ["usage: padcap VERB [flags]   (padcap VERB --help for a verb's flags and an example)", "", "verbs:"]
    lines += [f"  {name:<{width}}  {verb.summary}" for name, verb in VERBS.items()]
    lines += ["", "examples:"] + [f"  {verb.example}" for verb in VERBS.values()]
    return "\n".join(lines)


def run_verb(name: str, argv: list[str]) -> int:
    """Run one verb with its own argv; usage and config errors become one line and exit status 2."""
    verb = VERBS[name]
    prog = f"padcap {name}"
    real_error, real_argv0 = argparse.ArgumentParser.error, sys.argv[0]
    argparse.ArgumentParser.error = _one_line_error  # the tools' own parsers, for this call only
    sys.argv[0] = prog  # argparse's default prog
    try:
        main = config_main if not verb.module else importlib.import_module(verb.module).main
        code = main(argv)
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # argparse's --help (0) and usage errors (2)
        if e.code == 0 and {"-h", "--help"} & set(argv):
            print(f"\nexample:\n  {verb.example}")
        return e.code if isinstance(e.code, int) else 1
    finally:
        argparse.ArgumentParser.error, sys.argv[0] = real_error, real_argv0
    return code if isinstance(code, int) else 0


def main(argv: list[str] | None = None) -> int:
    """`padcap VERB ...`: the console script.

    >>> main(["--version"])
    padcap 0.1.0
    0
    >>> main(["nosuchverb"])
    2
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_overview())
        return 0 if argv else 2
    if argv[0] == "--version":
        print(f"padcap {__version__}")
        return 0
    if argv[0] not in VERBS:
        print(f"padcap: error: unknown verb {argv[0]!r}; one of: {', '.join(VERBS)}", file=sys.stderr)
        return 2
    return run_verb(argv[0], argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
