"""What a benchmark does with its result: print it, save it as JSON, name the command that made it."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def command(script: str, argv: list[str] | None) -> str:
    """The command line of a run (argv None: this process's own arguments)."""
    return f"python -m bench.{script.removesuffix('.py')} " + " ".join(argv if argv is not None else sys.argv[1:])


def emit(result: dict, out: Path | None) -> dict:
    """Print `result` as JSON and write it to `out` when given; returns it."""
    print(json.dumps(result, indent=2))
    if out:
        out.write_text(json.dumps(result, indent=2) + "\n")
    return result
