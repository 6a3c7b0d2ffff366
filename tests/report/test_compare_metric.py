"""`compare` shows the user's own metric (evaluation.metric) whether or not the gate reads it, in its own
direction, and says when the same input model timed differently in two runs (the machine changed speed)."""

from __future__ import annotations


import pytest

from synthetic_report import judged, rows_of, write_run

from qprep.errors import QprepError
from qprep.report.compare import compare, render_text


def with_metric(result: float, reference: float = 0.5, direction: str = "higher") -> dict:
    data = judged({"cosine_mean": 0.5}, heldout=True)
    figures = {"function": "readrate.py:read_rate", "direction": direction, "samples": 16,
               "reference_metric": reference, "metric": result,
               "metric_drop": (reference - result) if direction == "higher" else (result - reference)}
    data["evaluation"]["metric"] = {**figures, "metric": 0.9, "reference_metric": 0.9, "metric_drop": 0.0}
    data["evaluation"]["heldout"]["metric"] = figures  # the held-out figures decided: those are shown
    return data


def test_a_dropped_metric_outside_the_gate_is_a_worse_row_and_a_regression(tmp_path):
    runs = [write_run(tmp_path, "ort", with_metric(0.5)), write_run(tmp_path, "rknn", with_metric(0.484375))]
    result = compare(runs, {"metric": 0.01})
    rows = rows_of(result)
    cell = rows["evaluation.metric"]["others"][0]
    assert rows["evaluation.metric"]["base"] == 0.5 and cell["value"] == 0.484375 and cell["worse"]
    assert rows["evaluation.metric_drop"]["others"][0]["worse"]
    assert not rows["evaluation.reference_metric"]["others"][0]["worse"]
    assert [r["metric"] for r in result["regressions"]] == ["evaluation.metric"]
    assert "evaluation.metric  " in render_text(result)
    with pytest.raises(QprepError, match="FP32's own evaluation.metric"):
        compare(runs, {"reference_metric": 0.01})


def test_a_lower_is_better_metric_is_worse_when_it_rises(tmp_path):
    runs = [write_run(tmp_path, "a", with_metric(0.10, 0.10, "lower")), write_run(tmp_path, "b", with_metric(0.12, 0.10, "lower"))]
    assert rows_of(compare(runs, {}))["evaluation.metric"]["others"][0]["worse"]


def test_one_run_shows_its_metric_against_fp32s(tmp_path):
    row = rows_of(compare([write_run(tmp_path, "a", with_metric(0.484375))], {}))["evaluation.metric (readrate.py:read_rate)"]
    assert row["base"] == 0.5 and row["others"][0]["value"] == 0.484375 and row["others"][0]["delta"] == -0.015625


def timed(original_ms: float, digest: str = "abc") -> dict:
    data = judged({"cosine_mean": 0.5})
    data["model"]["sha256"] = digest
    timing = {"median_ms": original_ms, "round_ms": [original_ms * 0.99, original_ms * 1.01], "interval": 0.02}
    data["evaluation"]["latency"] = {"reference": timing, "result": {**timing, "median_ms": original_ms / 2},
                                     "speedup": 2.0, "speedup_rounds": [1.9, 2.1]}
    return data


def test_the_same_input_model_timed_apart_says_the_machine_changed(tmp_path):
    result = compare([write_run(tmp_path, "a", timed(62.0)), write_run(tmp_path, "b", timed(24.0))], {})
    assert any("the machine's speed changed" in note for note in result["notes"])
    steady = compare([write_run(tmp_path, "c", timed(62.0)), write_run(tmp_path, "d", timed(62.5))], {})
    other = compare([write_run(tmp_path, "e", timed(62.0)), write_run(tmp_path, "f", timed(24.0, "def"))], {})
    assert not steady["notes"] and not other["notes"]  # within the spreads; another input model
