"""Every `*.md` file that the code or the docs name exists in the repository.

Scans the project's own text (Python, Markdown, YAML, shell, TOML, the Makefile; not test data) for
names ending in `.md` and resolves each against the naming file's folder, then the repository root; a
bare name (`CHANGELOG.md`) may also be any tracked file of that name. Markdown links count the same.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("pipeline", "preprocess", "train", "infer", "bench", "cluster", "tests", "docs")
SUFFIXES = {".py", ".md", ".yaml", ".yml", ".sh", ".toml", ".txt", ".cfg"}
SKIPPED = ("tests/data/",)  # fixtures: the release's own files name its repository's documents
GENERATED = {"ablation_smoke.md"}  # written by a run (tests/test_ablation.py), not a document to read
NAME = re.compile(r"(?<![\w/.-])((?:\.{1,2}/|/)?[\w./-]*[\w-]\.md)\b")


def project_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "Makefile", ROOT / "pyproject.toml"]
    for top in SCANNED:
        for p in sorted((ROOT / top).rglob("*")):
            rel = p.relative_to(ROOT).as_posix()
            if p.is_file() and p.suffix in SUFFIXES and not rel.startswith(SKIPPED) and "__pycache__" not in rel:
                files.append(p)
    return [p for p in files if p.exists()]


def md_names(text: str) -> set[str]:
    return {m.group(1) for m in NAME.finditer(text)}


def resolves(name: str, where: Path, basenames: set[str]) -> bool:
    if name in GENERATED:
        return True
    if name.startswith("/"):
        return False  # an absolute path points outside the clone
    if (where.parent / name).is_file() or (ROOT / name).is_file():
        return True
    return "/" not in name and name in basenames


def test_the_scanner_finds_names_and_links():
    assert md_names("see docs/design/release.md §2, [m](../docs/design/method.md) and CHANGELOG.md.") == {
        "docs/design/release.md", "../docs/design/method.md", "CHANGELOG.md"}
    assert md_names("x.mdx or md.py") == set()


def test_every_named_markdown_file_exists():
    basenames = {p.name for p in ROOT.rglob("*.md") if ".venv" not in p.parts and ".git" not in p.parts}
    missing = []
    for path in project_files():
        for name in sorted(md_names(path.read_text(errors="replace"))):
            if not resolves(name, path, basenames):
                missing.append(f"{path.relative_to(ROOT)}: {name}")
    assert not missing, "named but not in the repository:\n" + "\n".join(missing)
