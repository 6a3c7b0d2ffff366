"""The fallback's part of the report: a heading only over tables (issue #59: a fallback that met its target with
everything quantized left an empty "accuracy-driven fallback" heading and a pointer to trials that were none)."""

from __future__ import annotations

from synthetic_report import report

from qprep.report.html import render_html
from qprep.report.markdown import render_markdown


def fallback(float_nodes: list, trials: list) -> dict:
    metrics = {"cosine_mean": 0.9999}
    return {"target": {"cosine_mean": 0.99}, "passed": True, "float_nodes": float_nodes, "stopped": "target met",
            "rank_trials": 0, "ranked": 0, "candidates": 0, "seconds": 1.0, "trials": trials, "ranking": [],
            "best": {"metrics": metrics}, "base": {"metrics": metrics}}


def test_a_fallback_that_kept_nothing_float_has_its_verdict_and_no_empty_heading():
    data = report()
    data["stages"][0]["fallback"] = fallback([], [{"phase": "base", "score": 0.9999, "metrics": {}}])
    for text in (render_markdown(data), render_html(data)):
        assert "Target cosine_mean ≥ 0.99" in text  # the verdict, under Decisions
        assert "quantize: accuracy-driven fallback" not in text and "trials: the Stages section" not in text


def test_a_fallback_that_kept_nodes_float_shows_them_under_its_heading():
    data = report()
    data["stages"][0]["fallback"] = fallback([{"node": "conv1", "what": "Conv", "gain": 0.01}], [])
    markdown = render_markdown(data)
    assert "### quantize: accuracy-driven fallback" in markdown and "conv1" in markdown
    assert "trials: the Stages section" in markdown
