"""The per-layer chart: every tensor, 1 − cosine on a log scale, absolute colours, the worst named."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from synthetic_report import layers, report

from qprep.report.layer_chart import COLOURS, LABELLED, layer_chart_svg
from qprep.report.markdown import render_markdown

SVG = "{http://www.w3.org/2000/svg}"


def bars(svg: str) -> list[ET.Element]:
    """The tensor bars: the rects that carry a tooltip."""
    return [r for r in ET.fromstring(svg).iter(f"{SVG}rect") if r.find(f"{SVG}title") is not None]


def test_every_tensor_gets_a_bar_not_the_first_80():
    svg = layer_chart_svg(layers([0.999] * 300))
    assert len(bars(svg)) == 300


def test_a_perfect_model_is_all_green():
    # SQNR 48 dB is 1 − cosine ≈ 1e-5; an exact tensor is 1 − cosine 0
    fills = {r.get("fill") for r in bars(layer_chart_svg(layers([1 - 1e-5] * 40 + [1.0] * 5)))}
    assert fills == {COLOURS["green"]}


def test_colours_are_absolute_and_bars_follow_a_log_scale():
    rows = bars(layer_chart_svg(layers([0.9999, 0.999, 0.995, 0.93])))
    assert [r.get("fill") for r in rows] == [COLOURS[c] for c in ("green", "amber", "amber", "red")]
    heights = [float(r.get("height")) for r in rows]
    decade = heights[1] - heights[0]  # 1e-4 → 1e-3
    assert decade > 20 and abs((heights[3] - heights[1]) - decade * 1.845) < 1  # 1e-3 → 0.07: 1.845 decades


def test_the_worst_tensors_are_named_worst_first():
    cosines = [0.9999] * 50
    cosines[7], cosines[30], cosines[42] = 0.93, 0.95, 0.999
    texts = ["".join(t.itertext()) for t in ET.fromstring(layer_chart_svg(layers(cosines))).iter(f"{SVG}text")]
    named = [t for t in texts if t[:1].isdigit() and ". layer" in t]
    assert len(named) == LABELLED
    assert named[:3] == ["1. layer7_out (Conv): cosine 0.93000", "2. layer30_out (Conv): cosine 0.95000",
                         "3. layer42_out (Conv): cosine 0.99900"]


def test_markdown_lists_the_worst_tensors_sorted_with_their_colour():
    markdown = render_markdown(report(layer_cosines=[0.99999, 0.93, 0.9995, 0.995]))
    assert "4 tensors compared: **1 red**, 1 amber, 2 green" in markdown
    table = markdown[markdown.index("Worst 4 tensors"):]
    order = [table.index(f"`layer{i}_out`") for i in (1, 3, 2, 0)]
    assert order == sorted(order) and "| red 0.07 |" in table


def test_a_view_whose_every_tensor_was_left_out_says_so_instead_of_vanishing():
    """No tensor provably matched: the section stays, with the count of what was left out and why."""
    data = report(layer_cosines=[])
    data["evaluation"]["layers_left_out"] = {"held only as integers in the result": 5, "no twin": 2}
    text = render_markdown(data)
    assert "Per-layer error" in text
    assert "0 of 7 tensors compared; left out: 7 (5 held only as integers in the result, 2 no twin)." in text
    data["evaluation"]["layers_left_out"] = {}
    assert "Per-layer error" not in render_markdown(data)
