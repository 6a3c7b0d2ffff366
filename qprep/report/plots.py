"""Tiny inline-SVG charts for report.html: no plotting dependency, and the HTML stays one offline file."""

from __future__ import annotations

from html import escape


def bar_chart(rows: list[tuple[str, float]], title: str, unit: str = "", width: int = 720) -> str:
    """Horizontal bars, one per (label, value), in the given order; values may be inf (drawn full length)."""
    if not rows:
        return ""
    finite = [v for _, v in rows if v == v and abs(v) != float("inf")]
    top = max(finite + [1e-9])
    bar_h, label_w, gap = 16, 330, 4
    height = len(rows) * (bar_h + gap) + 30
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
             f'aria-label="{escape(title)}">', f'<text x="0" y="14" font-size="13" font-weight="bold">'
             f'{escape(title)}</text>']
    for i, (label, value) in enumerate(rows):
        y = 24 + i * (bar_h + gap)
        shown = top if value != value or abs(value) == float("inf") else max(value, 0)
        length = (width - label_w - 80) * shown / top
        colour = "#c0392b" if shown < 0.5 * top else "#e67e22" if shown < 0.8 * top else "#27ae60"
        parts.append(f'<text x="{label_w - 6}" y="{y + 12}" font-size="11" text-anchor="end">'
                     f'{escape(label[-48:])}</text>')
        parts.append(f'<rect x="{label_w}" y="{y}" width="{length:.1f}" height="{bar_h}" fill="{colour}"/>')
        parts.append(f'<text x="{label_w + length + 4:.1f}" y="{y + 12}" font-size="11">{value:.1f}{unit}</text>')
    parts.append("</svg>")
    return "".join(parts)
