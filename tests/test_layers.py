"""The import contracts of pyproject.toml ([tool.importlinter]) hold: the layering, no import of tests,
no cycles. Runs import-linter in-process (requirements.lock pins it); skipped where it is not installed."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_hold(monkeypatch):
    pytest.importorskip("importlinter")
    from importlinter.cli import lint_imports

    monkeypatch.chdir(ROOT)
    assert lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True) == 0, "lint-imports: a contract is broken"
