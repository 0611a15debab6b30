"""The evaluation report (`pipeline.metrics --report`, the evaluate stage's report/index.html) opened in a
real headless browser: Debian's Chromium driven by Playwright. Its metrics table and every video's
timeline must render (images decoded, not broken links)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.test_metrics_cli import _files, _run

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# Chromium on a machine without a network or a screen (the flags the workplace's probe found necessary)
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]

pytestmark = [pytest.mark.slow]


def _playwright():
    if not Path(CHROMIUM).exists():
        pytest.skip("no chromium (apt-get install chromium; .ci/run installs it)")
    return pytest.importorskip("playwright.sync_api")


def test_report_renders_in_a_browser(tmp_path):
    sync_api = _playwright()
    pred, ref = _files(tmp_path)
    out = _run("--pred", str(pred), "--ref", str(ref), "--protocol", "padcaptioner", "--ref-format", "longvale",
               "--json", "--report", str(tmp_path / "rep"))
    assert out.returncode == 0, out.stderr
    index = tmp_path / "rep" / "index.html"
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(index.as_uri())
            tables = page.locator("table")
            assert tables.count() >= 1
            assert page.locator("table tr").count() >= 2  # a header and at least one row
            images = page.locator("img")
            alts = [images.nth(i).get_attribute("alt") for i in range(images.count())]
            assert "metrics table" in alts and sum(a.startswith("timeline of ") for a in alts) == 2
            # every image decoded: a broken <img> has naturalWidth 0
            widths = page.eval_on_selector_all("img", "imgs => imgs.map(i => i.complete ? i.naturalWidth : 0)")
            assert all(w > 0 for w in widths), widths
            shot = os.environ.get("PADCAP_REPORT_SCREENSHOT")  # docs/images/report.png is made this way
            if shot:
                page.screenshot(path=shot, full_page=False)
        finally:
            browser.close()
