"""report.html in headless Chromium: it loads without a console message and shows the verdict and the chart.

Skipped only where no Chromium can be found (.ci/run installs the Debian package `chromium`)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
from synthetic_report import report

from qprep.report.html import render_html

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.fixture(scope="module")
def browser():
    sys.path.insert(0, str(SCRIPTS))
    try:
        module = importlib.import_module("report_browser")
    finally:
        sys.path.remove(str(SCRIPTS))
    if module.find_chromium() is None:
        pytest.skip("no chromium on PATH (apt-get install -y chromium; .ci/run does): report.html not checked in a browser")
    return module


@pytest.mark.slow
def test_report_html_renders_in_chromium_with_verdict_and_chart(browser, tmp_path):
    page = tmp_path / "report.html"
    page.write_text(render_html(report(layer_cosines=[0.99999] * 150 + [0.93])))
    assert browser.check_report(page) == []
    png = tmp_path / "report.png"
    browser.screenshot(page, png, 900, 700)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_the_browser_check_fails_on_console_errors_and_a_missing_verdict(browser, tmp_path):
    page = tmp_path / "broken.html"
    page.write_text("<!doctype html><html><body><p>no verdict</p><script>console.error('boom');</script></body></html>")
    problems = browser.check_report(page)
    assert any("boom" in p for p in problems)
    assert "no verdict element (id=verdict)" in problems and any("layer chart" in p for p in problems)
