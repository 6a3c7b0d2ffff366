"""report.json → report.html: the blocks of report/document.py as one self-contained page (inline CSS and SVG)
that opens offline."""

from __future__ import annotations

import re
from html import escape

from qprep.report.document import Bullets, Heading, LayerChart, Table, Text, build
from qprep.report.layer_chart import layer_chart_svg
from qprep.report.verdict import Verdict

STYLE = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1100px;color:#222}
table{border-collapse:collapse;margin:.6em 0}td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px}
th{background:#f3f3f3;text-align:left}b.bad{color:#c0392b}
code{font-size:12px}.note{background:#fff6d6;padding:6px 10px;border-left:4px solid #e6b800}
.chart{overflow-x:auto}.verdict{font-size:17px;padding:10px 14px;border-left:8px solid #888;background:#f1f1f1}
.verdict.met{border-color:#27ae60;background:#e9f7ef}.verdict.missed{border-color:#c0392b;background:#fbeaea}"""


def render_html(report: dict) -> str:
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>qprep report</title>"
             f"<style>{STYLE}</style></head><body>"]
    for block in build(report):
        if isinstance(block, Verdict):
            state = block.state.replace(" ", "-")
            parts.append(f"<p id='verdict' class='verdict {state}'><b>Verdict: {block.state}</b> — "
                         f"{_inline(block.text)}</p>")
        elif isinstance(block, Heading):
            parts.append(f"<h{block.level}>{_inline(block.text)}</h{block.level}>")
        elif isinstance(block, Text):
            parts.append(f"<p{' class=note' if block.note else ''}>{_inline(block.text)}</p>")
        elif isinstance(block, Bullets):
            parts.append("<ul>" + "".join(f"<li>{_inline(item)}</li>" for item in block.items) + "</ul>")
        elif isinstance(block, Table):
            head = "".join(f"<th>{_inline(h)}</th>" for h in block.header)
            body = "".join("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in row) + "</tr>" for row in block.rows)
            title = f"<h4>{_inline(block.title)}</h4>" if block.title else ""
            parts.append(f"{title}<table><tr>{head}</tr>{body}</table>")
        elif isinstance(block, LayerChart):
            parts.append(f"<div class=chart>{layer_chart_svg(block.layers, left_out=block.left_out)}</div>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _inline(text: str) -> str:
    """Escape, then Markdown's **bold** (red when it says missed/failed) and `code`."""
    html = escape(str(text))
    html = re.sub(r"\*\*(.+?)\*\*", lambda m: f"<b{' class=bad' if _is_bad(m.group(1)) else ''}>{m.group(1)}</b>",
                  html)
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html)


def _is_bad(text: str) -> bool:
    return any(word in text for word in ("missed", "failed", "interrupted"))
