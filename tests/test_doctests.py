"""The `>>>` examples in the product's docstrings run and give what they show.

Every module of pipeline/, infer/, preprocess/, train/ and bench/ whose source holds a `>>> ` line is imported
and run through `doctest.testmod`; the modules with examples must stay light (no Ray), which the last
test checks in a fresh interpreter.
"""

from __future__ import annotations

import doctest
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pipeline", "infer", "preprocess", "train", "bench")
EXAMPLE = re.compile(r"^\s*>>> ", re.M)


def modules_with_examples() -> list[str]:
    names = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if EXAMPLE.search(path.read_text()):
                rel = path.relative_to(ROOT).with_suffix("")
                parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
                names.append(".".join(parts))
    return names


MODULES = modules_with_examples()


def test_some_modules_have_examples():
    assert {"pipeline.config_retired", "pipeline.metrics.tiou", "infer.engine.kernels"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, report=True)
    assert result.attempted > 0
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed (printed above)"


def test_modules_with_examples_do_not_import_ray():
    code = f"import sys; import {', '.join(MODULES)}; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
