"""`padcap` (pipeline/cli.py): one command, one-line errors with exit status 2, examples in every help."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from pipeline import __version__
from pipeline.cli import VERBS, main

ROOT = Path(__file__).resolve().parents[1]


def test_version_is_the_packages(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"padcap {__version__}"
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"] == __version__


def test_overview_lists_every_verb(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("run", "preprocess", "train", "caption", "serve", "evaluate", "plan", "parity", "config"):
        assert f"  {name} " in out
    assert main([]) == 2
    assert main(["captoin"]) == 2
    assert capsys.readouterr().err.strip() == ("padcap: error: unknown verb 'captoin'; one of: " + ", ".join(VERBS))


@pytest.mark.parametrize("verb", sorted(VERBS))
def test_every_verb_has_help_with_an_example(verb, capsys):
    assert main([verb, "--help"]) == 0
    out = capsys.readouterr().out
    assert f"usage: padcap {verb}" in out or "usage: python -m" in out
    assert out.rstrip().endswith(VERBS[verb].example) and VERBS[verb].example.startswith(f"padcap {verb}")


def test_config_prints_the_resolved_yaml(capsys):
    import yaml

    assert main(["config", "--set", "train.max_steps=3"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["train"]["max_steps"] == 3


def test_a_bad_key_is_one_line_naming_it(capsys):
    assert main(["config", "--set", "no.such=1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("padcap config: error: unknown config key no ")


def test_caption_without_a_model_is_one_line(tmp_path, capsys):
    (tmp_path / "videos").mkdir()
    assert main(["caption", "--videos", str(tmp_path / "videos"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--model" in err and "--random-model" in err
    assert not (tmp_path / "out").exists()


def test_plan_runs(capsys):
    assert main(["plan", "--shape", "release-3b", "--device-memory-gb", "24", "--prefix-tokens", "2000"]) == 0
    assert "videos@2000" in capsys.readouterr().out
