"""Reports: report.json is the source of truth; Markdown (and later HTML) are renderings of it."""

from __future__ import annotations

from pathlib import Path

from qprep import jsonfile
from qprep.disk.atomic import atomic_write_text
from qprep.report.html import render_html
from qprep.report.markdown import render_markdown


def write_report(directory: Path, report: dict) -> list[str]:
    """Write report.json, report.md and report.html atomically; returns the file names written."""
    write_report_json(directory, report)
    atomic_write_text(directory / "report.md", render_markdown(report))
    atomic_write_text(directory / "report.html", render_html(report))
    return ["report.json", "report.md", "report.html"]


def write_report_json(directory: Path, report: dict) -> None:
    """report.json alone: also written as each stage starts, so a run killed outright (SIGKILL, out of
    memory) still leaves a report that says where it was."""
    atomic_write_text(directory / "report.json", jsonfile.dumps(report) + "\n")
