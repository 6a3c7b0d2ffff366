"""The per-layer error chart of report.html: every tensor in graph order, its accumulated error as 1 − cosine on
a log scale, coloured by absolute thresholds, the worst ones numbered and named. Inline SVG: no plotting
library, no script, the page opens offline.

Why these choices: a linear cosine scale draws 0.999 and 0.93 as bars of nearly one length, and colours
relative to the best tensor paint a perfect model red. On a log scale of 1 − cosine each decade is one step
of quality, and fixed thresholds mean the same on every model: green below 1e-3 (cosine above 0.999), amber
below 1e-2 (above 0.99), red from there on.
"""

from __future__ import annotations

import math
from html import escape

GREEN_BELOW, AMBER_BELOW = 1e-3, 1e-2
FLOOR = 1e-6  # 1 − cosine is clipped here: an exact tensor still gets a (short) bar
DECADES = 6  # the axis spans FLOOR … 1
COLOURS = {"green": "#27ae60", "amber": "#e6a100", "red": "#c0392b"}
LABELLED = 10
THRESHOLDS_NOTE = (f"1 − cosine of each tensor against the float model (accumulated from the input on), log scale; "
                   f"green below {GREEN_BELOW:g} (cosine > {1 - GREEN_BELOW:g}), amber below {AMBER_BELOW:g} "
                   f"(cosine > {1 - AMBER_BELOW:g}), red above")


def left_out_note(left_out: dict[str, int] | None) -> str:
    """"; left out: 12 (7 held only as integers in the result, 5 …)": the float tensors no result tensor
    provably computes (measure/correspondence.py), so a reader knows the chart is not every tensor."""
    if not left_out:
        return ""
    reasons = ", ".join(f"{count} {reason}" for reason, count in sorted(left_out.items(), key=lambda r: -r[1]))
    return f"; left out: {sum(left_out.values())} ({reasons})"


def coverage(layers: list[dict], left_out: dict[str, int] | None) -> str:
    """"26 of 88 tensors compared", "all 88 tensors compared" (none left out), or "88 tensors compared" where no
    count of left-out tensors was recorded (a toolkit's own analysis): a red count says nothing of the tensors
    that were not compared, so it never stands without how many were."""
    missing = sum(left_out.values()) if left_out else 0
    if missing:
        return f"{len(layers)} of {len(layers) + missing} tensors compared"
    everything = left_out is not None and layers
    return f"all {len(layers)} tensors compared" if everything else f"{len(layers)} tensors compared"


def layers_line(layers: list[dict], left_out: dict[str, int] | None) -> str:
    """The sentence under the chart: how many tensors were compared, the bands they fall in, what was left out
    and why; where fewer than half were compared, that the bands speak for those alone."""
    compared = coverage(layers, left_out).capitalize()
    if not layers:
        return f"{compared}{left_out_note(left_out)}."
    counts, missing = band_counts(layers), sum(left_out.values()) if left_out else 0
    few = " — most tensors were not compared: the bands speak for the compared ones alone" if missing > len(
        layers) else ""
    return (f"{compared}: **{counts['red']} red**, {counts['amber']} amber, {counts['green']} "
            f"green ({THRESHOLDS_NOTE}){left_out_note(left_out)}{few}.")


def layer_error(row: dict) -> float:
    """1 − accumulated cosine, clipped to [FLOOR, 1]; a tensor without a cosine counts as fully wrong."""
    cosine = row.get("cosine_mean")
    if cosine is None or cosine != cosine:
        return 1.0
    return min(1.0, max(FLOOR, 1.0 - cosine))


def band(error: float) -> str:
    return "green" if error < GREEN_BELOW else "amber" if error < AMBER_BELOW else "red"


def worst_first(layers: list[dict]) -> list[dict]:
    return sorted(layers, key=lambda r: (-layer_error(r), r.get("order", 0)))


def band_counts(layers: list[dict]) -> dict[str, int]:
    counts = {name: 0 for name in COLOURS}
    for row in layers:
        counts[band(layer_error(row))] += 1
    return counts


def layer_chart_svg(layers: list[dict], min_width: int = 1000, left_out: dict[str, int] | None = None) -> str:
    """The chart (see the module doc): one bar per tensor, a dot for the error the layer adds alone where the
    backend measures it (RKNN), the worst LABELLED numbered above their bars and named in a list below; its
    heading says how many of the float model's tensors it holds (`coverage`)."""
    rows = sorted(layers, key=lambda r: r.get("order", 0))
    left, top, plot_h, right = 58, 50, 220, 12
    bar_w = max(2.0, (min_width - left - right) / max(len(rows), 1))
    plot_w = bar_w * len(rows)
    worst = {id(r): rank for rank, r in enumerate(worst_first(rows)[:LABELLED], 1)}
    list_h = 16 * math.ceil(len(worst) / 2) + 28
    width, height = left + plot_w + right, top + plot_h + 22 + list_h

    def y(error: float) -> float:
        return top + plot_h * -math.log10(error) / DECADES

    parts = [f'<svg id="layer-chart" xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height}" '
             f'font-family="system-ui,sans-serif" role="img" aria-label="per-layer error, 1 − cosine, log scale">',
             f'<text x="0" y="14" font-size="13" font-weight="bold">Per-layer error: 1 − cosine per tensor, '
             f'{escape(coverage(rows, left_out))}, in graph order (log scale)</text>']
    parts += _legend(left, 32, any(r.get("single_cosine") is not None for r in rows))
    for exponent in range(0, DECADES + 1):
        level = 10.0 ** -exponent
        parts.append(f'<line x1="{left}" x2="{left + plot_w:.1f}" y1="{y(level):.1f}" y2="{y(level):.1f}" '
                     f'stroke="#e3e3e3"/><text x="{left - 4}" y="{y(level) + 4:.1f}" font-size="10" '
                     f'text-anchor="end">{"1" if exponent == 0 else f"1e-{exponent}"}</text>')
    for level, name in ((GREEN_BELOW, "amber"), (AMBER_BELOW, "red")):
        parts.append(f'<line x1="{left}" x2="{left + plot_w:.1f}" y1="{y(level):.1f}" y2="{y(level):.1f}" '
                     f'stroke="{COLOURS[name]}" stroke-dasharray="4 3"/>')
    placed: list[tuple[float, float]] = []  # (x, y) of the rank numbers drawn so far: neighbours stack up
    for i, row in enumerate(rows):
        error, x = layer_error(row), left + i * bar_w
        tip = (f"{row['tensor']} ({row.get('op_type', '?')}): cosine {_cosine(row.get('cosine_mean'))}, "
               f"1 − cosine {error:.2g}")
        bar_top = min(y(error), top + plot_h - 2)  # an exact tensor still shows as a thin green line
        parts.append(f'<rect x="{x:.2f}" y="{bar_top:.1f}" width="{max(bar_w - 0.6, 0.8):.2f}" '
                     f'height="{top + plot_h - bar_top:.1f}" fill="{COLOURS[band(error)]}">'
                     f'<title>{escape(tip)}</title></rect>')
        single = row.get("single_cosine")
        if single is not None:
            parts.append(f'<circle cx="{x + bar_w / 2:.2f}" cy="{y(layer_error({"cosine_mean": single})):.1f}" '
                         f'r="1.6" fill="#222"/>')
        if id(row) in worst:
            label_y = bar_top - 3
            while any(abs(px - x) < 14 and abs(py - label_y) < 11 for px, py in placed):
                label_y -= 11
            placed.append((x, label_y))
            parts.append(f'<text x="{x + bar_w / 2:.2f}" y="{label_y:.1f}" font-size="10" '
                         f'text-anchor="middle" font-weight="bold">{worst[id(row)]}</text>')
    parts.append(f'<line x1="{left}" x2="{left + plot_w:.1f}" y1="{top + plot_h}" y2="{top + plot_h}" stroke="#888"/>'
                 f'<text x="{left}" y="{top + plot_h + 14}" font-size="10">input side</text>'
                 f'<text x="{left + plot_w:.1f}" y="{top + plot_h + 14}" font-size="10" text-anchor="end">'
                 f'output side</text>')
    base = top + plot_h + 40
    parts.append(f'<text x="0" y="{base}" font-size="12" font-weight="bold">Worst {len(worst)} tensors</text>')
    for row in worst_first(rows)[:LABELLED]:
        rank = worst[id(row)]
        column, line = (rank - 1) % 2, (rank - 1) // 2
        label = f"{rank}. {row['tensor']} ({row.get('op_type', '?')}): cosine {_cosine(row.get('cosine_mean'))}"
        parts.append(f'<text x="{column * max(width / 2, 480):.0f}" y="{base + 18 + 16 * line}" font-size="11" '
                     f'fill="{COLOURS[band(layer_error(row))]}">{escape(label[:90])}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _legend(x: float, y: float, with_single: bool) -> list[str]:
    items = [("green", f"< {GREEN_BELOW:g}"), ("amber", f"< {AMBER_BELOW:g}"), ("red", f"≥ {AMBER_BELOW:g}")]
    parts = []
    for name, text in items:
        parts.append(f'<rect x="{x:.0f}" y="{y - 9}" width="10" height="10" fill="{COLOURS[name]}"/>'
                     f'<text x="{x + 14:.0f}" y="{y}" font-size="11">{name} {escape(text)}</text>')
        x += 110
    if with_single:
        parts.append(f'<circle cx="{x + 5:.0f}" cy="{y - 4}" r="2.5" fill="#222"/>'
                     f'<text x="{x + 14:.0f}" y="{y}" font-size="11">this layer alone (inputs from the float '
                     f'model)</text>')
    return parts


def _cosine(value) -> str:
    return "not measured" if value is None else f"{value:.5f}"
