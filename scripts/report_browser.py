"""report.html in a real browser (headless Chromium): what it logs to the console, its DOM, a screenshot.

    python scripts/report_browser.py RUN_DIR docs/report.png [--width 1100 --height 1500]

re-renders RUN_DIR/report.json with this checkout's renderer (so an older run shows the current layout),
checks the page (no console message, the verdict and the layer chart present) and writes the screenshot.
tests/report/test_browser.py uses the same functions. Needs the Debian package `chromium` (.ci/run installs it).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CANDIDATES = ("chromium", "chromium-browser", "google-chrome")
# --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start; the page is our own file
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
         "--enable-logging=stderr", "--v=0")
CONSOLE = re.compile(r":CONSOLE(?:\(\d+\)|:\d+)\] (.*)")


def find_chromium() -> str | None:
    return next((path for path in map(shutil.which, CANDIDATES) if path), None)


def open_page(page: Path, *extra: str, timeout: float = 120) -> tuple[str, list[str]]:
    """(the DOM after load, the console messages) of a local HTML file."""
    chromium = find_chromium()
    if chromium is None:
        raise RuntimeError("chromium not found: apt-get install -y chromium")
    with tempfile.TemporaryDirectory() as profile:  # a fresh profile: no state from another run
        done = subprocess.run([chromium, *FLAGS, f"--user-data-dir={profile}", *extra, page.resolve().as_uri()],
                              capture_output=True, text=True, timeout=timeout)
    return done.stdout, [m.group(1) for m in CONSOLE.finditer(done.stderr)]


def check_report(page: Path) -> list[str]:
    """What is wrong with a rendered report.html: console messages, a missing verdict or chart."""
    dom, console = open_page(page, "--dump-dom")
    problems = [f"console: {message}" for message in console]
    if 'id="verdict"' not in dom:
        problems.append("no verdict element (id=verdict)")
    if not re.search(r'<svg[^>]*id="layer-chart"', dom) or "<rect" not in dom:
        problems.append("no per-layer chart (svg#layer-chart with bars)")
    return problems


def screenshot(page: Path, png: Path, width: int, height: int) -> None:
    png.parent.mkdir(parents=True, exist_ok=True)
    open_page(page, f"--screenshot={png.resolve()}", f"--window-size={width},{height}")
    if not png.is_file():
        raise RuntimeError(f"chromium wrote no screenshot to {png}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a run directory holding report.json")
    parser.add_argument("png", type=Path, help="where to write the screenshot")
    parser.add_argument("--width", type=int, default=1100)
    parser.add_argument("--height", type=int, default=1500)
    args = parser.parse_args()
    from qprep.report.html import render_html

    report = json.loads((args.run_dir / "report.json").read_text())
    with tempfile.TemporaryDirectory() as folder:
        page = Path(folder) / "report.html"
        page.write_text(render_html(report))
        problems = check_report(page)
        if problems:
            print("report.html: " + "; ".join(problems), file=sys.stderr)
            return 1
        screenshot(page, args.png, args.width, args.height)
    print(f"{args.png}: screenshot of {args.run_dir / 'report.json'} rendered")
    return 0


if __name__ == "__main__":
    sys.exit(main())
