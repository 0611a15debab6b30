"""The generated reference pages: every config field and every `padcap` verb's flags, from the code.

    python -m pipeline.reference_docs docs/reference     # writes config.md and cli.md there

The config reference reads each field's description from the comment that documents it in the source
(the comment on the field's line, else the comment lines just above it), so the one place a knob is
explained is next to its definition; a field without one is an error here, and tests/test_docs.py
fails on it. The CLI reference is each verb's own `--help`. The pages are committed; the test checks
they equal what this module generates now.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import sys
import tokenize
import typing
from contextlib import redirect_stdout
from pathlib import Path

from pipeline.config import Config
from pipeline.config_build import type_name


@dataclasses.dataclass(frozen=True)
class FieldDoc:
    key: str  # dotted, e.g. "train.max_steps"
    type: str
    default: str
    description: str


def _comments(cls: type) -> dict[str, str]:
    """field name -> its documenting comment in `cls`'s source (same line, else the block just above)."""
    lines, _ = inspect.getsourcelines(cls)
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO("".join(lines)).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    out: dict[str, str] = {}
    for number, line in enumerate(lines, start=1):
        stripped = line.strip()
        name = stripped.split(":", 1)[0]
        if not (line.startswith("    ") and not line.startswith("     ") and name.isidentifier() and ":" in stripped):
            continue
        if number in comments and not stripped.startswith("#"):
            out[name] = comments[number]
            continue
        above, k = [], number - 1
        while k >= 1 and k in comments and lines[k - 1].strip().startswith("#"):
            above.insert(0, comments[k])
            k -= 1
        if above:
            out[name] = " ".join(above)
    return out


def _default(f: dataclasses.Field) -> str:
    """Every config field has a default (`Config()` builds them all): a value or a factory."""
    if f.default is not dataclasses.MISSING:
        return repr(f.default)
    value = f.default_factory()  # type: ignore[misc]
    return "(section)" if dataclasses.is_dataclass(value) else repr(value)


def _sections(cls: type = Config, prefix: str = "") -> list[tuple[str, str, list[FieldDoc]]]:
    """(dotted section ("" = the root), its docstring's first line, its leaf fields with their
    descriptions ("" when the source has none)), depth first."""
    hints = typing.get_type_hints(cls)
    comments = _comments(cls)
    leaves, below = [], []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            below += _sections(tp, f"{prefix}{f.name}.")
        else:
            leaves.append(FieldDoc(f"{prefix}{f.name}", type_name(tp), _default(f), comments.get(f.name, "")))
    return [(prefix.rstrip("."), (inspect.getdoc(cls) or "").split("\n")[0], leaves)] + below


def config_fields() -> list[FieldDoc]:
    """Every leaf field of the config, section by section."""
    return [f for _, _, leaves in _sections() for f in leaves]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def config_reference() -> str:
    fields = config_fields()
    missing = [f.key for f in fields if not f.description]
    if missing:
        raise ValueError(f"config fields without a description (a comment on or above the field): {missing}")
    parts = ["# Config reference", "",
             "Every key of the one configuration (`pipeline/config.py`), generated from the code by",
             "`python -m pipeline.reference_docs docs/reference`. Set a key in a YAML preset (`--config FILE`)",
             "or on the command line with `--set KEY=VALUE` (repeatable); `padcap config` prints the result.",
             "Unknown keys and values of the wrong type are errors that name the key.", ""]
    for section, doc, rows in _sections():  # the root's own keys first (run_dir)
        parts += [f"## `{section}`", "", doc, ""] if section else ["## (root)", ""]
        parts += ["| key | type | default | meaning |", "|---|---|---|---|"]
        parts += [f"| `{f.key}` | `{_cell(f.type)}` | `{_cell(f.default)}` | {_cell(f.description)} |" for f in rows]
        parts.append("")
    return "\n".join(parts)


def cli_reference() -> str:
    from pipeline.cli import VERBS, main

    parts = ["# CLI reference", "",
             "`padcap VERB [flags]`, generated from the parsers by `python -m pipeline.reference_docs docs/reference`.",
             "A usage or config error prints one line naming the flag or key and exits with status 2.", ""]
    for name, verb in VERBS.items():
        buf = io.StringIO()
        with redirect_stdout(buf):
            code = main([name, "--help"])
        if code != 0:
            raise RuntimeError(f"padcap {name} --help exited {code}")
        parts += [f"## `padcap {name}`", "", verb.summary, "", "```text", buf.getvalue().rstrip(), "```", ""]
    return "\n".join(parts)


PAGES = {"config.md": config_reference, "cli.md": cli_reference}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0] if argv else "docs/reference")
    out.mkdir(parents=True, exist_ok=True)
    for name, make in PAGES.items():
        (out / name).write_text(make() + "\n")
        print(out / name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
