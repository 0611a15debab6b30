"""Docs that cannot drift: the generated references equal the code, every config field is described,
the site builds with broken links as errors, the README's and docs' runnable blocks run, and the
documented output columns are the real ones."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import reference_docs

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
FENCE = re.compile(r"^```(\w+)([^\n]*)\n(.*?)^```", re.S | re.M)


def runnable_blocks() -> list[tuple[str, str, str]]:
    """(id, language, code) of every fenced block whose info string says `runnable`."""
    out = []
    for page in PAGES:
        for n, m in enumerate(FENCE.finditer(page.read_text())):
            lang, info, code = m.group(1), m.group(2), m.group(3)
            if "runnable" in info.split():
                out.append((f"{page.relative_to(ROOT)}#{n}", lang, code))
    return out


def test_every_config_field_is_described():
    fields = reference_docs.config_fields()
    assert len(fields) > 100
    assert [f.key for f in fields if not f.description] == []


@pytest.mark.parametrize("name", sorted(reference_docs.PAGES))
def test_generated_references_are_current(name):
    page = DOCS / "reference" / name
    assert page.read_text() == reference_docs.PAGES[name]() + "\n", (
        f"{page.relative_to(ROOT)} is stale: python -m pipeline.reference_docs docs/reference")


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 220


@pytest.mark.slow
def test_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs")
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "site" / "index.html").exists()


def test_there_are_runnable_blocks():
    langs = {lang for _, lang, _ in runnable_blocks()}
    assert {"bash", "python"} <= langs


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("block", runnable_blocks(), ids=lambda b: b[0])
def test_runnable_block_runs(block, tmp_path):
    """Each block runs as a user would paste it, in a scratch directory, with the venv's commands first on
    PATH (`padcap` is its console script). A block may use $EXAMPLE_VIDEOS: a folder of two short
    synthetic mp4 files made for it."""
    name, lang, code = block
    from bench.serve_engine import synthetic_videos

    videos = tmp_path / "videos"
    videos.mkdir()
    for path in synthetic_videos(tmp_path / "corpus")[:2]:
        shutil.copy(path, videos / path.name)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               EXAMPLE_VIDEOS=str(videos), PADCAP_ROOT=str(ROOT), HF_HUB_OFFLINE="1")
    cmd = ["bash", "-euo", "pipefail", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"{name}:\n{code}\n--- stdout\n{out.stdout[-3000:]}\n--- stderr\n{out.stderr[-3000:]}"


def test_output_page_documents_every_column():
    from infer.results import RESULT_COLUMNS

    page = (DOCS / "guide" / "output.md").read_text()
    documented = re.findall(r"^\| `(\w+)` \|", page, re.M)
    assert set(documented) >= set(RESULT_COLUMNS), set(RESULT_COLUMNS) - set(documented)
