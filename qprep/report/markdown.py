"""report.json → report.md: the blocks of report/document.py as GitHub-flavoured Markdown."""

from __future__ import annotations

from qprep.report.document import Bullets, Heading, LayerChart, Table, Text, build
from qprep.report.verdict import Verdict


def render_markdown(report: dict) -> str:
    lines: list[str] = []
    for block in build(report):
        if isinstance(block, Verdict):
            lines += [f"**Verdict: {block.state}** — {block.text}", ""]
        elif isinstance(block, Heading):
            lines += ["#" * block.level + " " + block.text, ""]
        elif isinstance(block, Text):
            lines += [("> " if block.note else "") + block.text, ""]
        elif isinstance(block, Bullets):
            lines += [f"- {item}" for item in block.items] + [""]
        elif isinstance(block, Table):
            if block.title:
                lines += [f"{block.title}:", ""]
            lines += ["| " + " | ".join(block.header) + " |", "|" + "---|" * len(block.header)]
            lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in block.rows] + [""]
        elif isinstance(block, LayerChart):
            lines += ["(every tensor is plotted in report.html)", ""]
    return "\n".join(lines)


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")
