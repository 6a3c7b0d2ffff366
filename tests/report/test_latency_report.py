"""Latency in the report, the batch summary and `qprep compare`: original → optimized float → result, the
float models also at ORT_ENABLE_BASIC (what optimize bought where the runtime does not fuse by itself)."""

from __future__ import annotations

import json

import pytest
from synthetic_report import report

from qprep.errors import QprepError

from qprep.report.compare import compare, metrics_of
from qprep.report.document import Table, build
from qprep.report.markdown import render_markdown
from qprep.report.summary import COLUMNS, render_summary_md, summary_row


def timing(ms: float, runs: int = 20) -> dict:
    return {"median_ms": ms, "p90_ms": ms * 1.1, "round_ms": [ms] * 3, "runs": runs, "round_runs": [runs] * 3,
            "warmup": 10, "rounds": 3, "threads": 2, "interval": 0.012, "tight": 0.02}


def timed(original=30.0, optimized=25.0, result=12.0, basic=(40.0, 28.0)) -> dict:
    """evaluation.latency as evaluate.timed_latency writes it."""
    latency = {"settings": {"batch": 1, "threads": 2, "provider": "CPUExecutionProvider",
                            "graph_optimization": "ORT_ENABLE_ALL", "basic": "ORT_ENABLE_BASIC"},
               "reference": timing(original), "seconds": 4.2}
    if optimized is not None:
        latency.update(optimized=timing(optimized), optimized_speedup=original / optimized,
                       optimized_speedup_rounds=[original / optimized] * 2)
    if result is not None:
        latency.update(result=timing(result), speedup=original / result, speedup_rounds=[original / result] * 2)
    if basic is not None:
        latency["basic"] = {"level": "ORT_ENABLE_BASIC", "reference": timing(basic[0]), "optimized": timing(basic[1]),
                            "optimized_speedup": basic[0] / basic[1]}
    return latency


def with_latency(latency: dict) -> dict:
    data = report()
    data["evaluation"]["latency"] = latency
    return data


def latency_table(data: dict) -> Table:
    return next(b for b in build(data) if isinstance(b, Table) and b.title.startswith("Latency"))


def test_the_report_shows_original_optimized_and_result_at_both_levels():
    table = latency_table(with_latency(timed()))
    rows = {row[0]: row[1:] for row in table.rows}
    assert list(rows) == ["original", "optimized float", "result"]
    assert rows["original"] == ["30.00 ms ±1.2%", "40.00 ms ±1.2%"]
    assert rows["optimized float"][0].startswith("25.00 ms ±1.2% — **1.20×**")
    assert rows["optimized float"][1].startswith("28.00 ms ±1.2% — **1.43×**")
    assert rows["result"][0].startswith("12.00 ms ±1.2% — **2.50×**") and rows["result"][1] == "–"
    assert "ORT_ENABLE_BASIC" in table.header[2]
    assert "The latency step took 4.2 s." in render_markdown(with_latency(timed()))


def test_what_was_not_timed_is_said():
    """optimize that changed nothing, and a result that runs on a simulator (RKNN): no figure, a reason."""
    latency = timed(optimized=None, basic=None, result=None)
    latency.update(optimized_status="optimize left the graph as it was",
                   status="not measured: the result's latency exists only on the board")
    text = render_markdown(with_latency(latency))
    assert "Latency: optimize left the graph as it was." in text and "exists only on the board" in text
    rows = {row[0]: row[1:] for row in latency_table(with_latency(latency)).rows}
    assert rows["result"][0] == "not timed" and rows["optimized float"] == ["–", "–"]


def test_a_report_from_before_the_float_models_were_timed_still_renders():
    latency = {"reference": timing(30.0), "result": timing(12.0), "speedup": 2.5, "speedup_rounds": [2.4, 2.6],
               "settings": {"batch": 1, "threads": 2, "provider": "CPUExecutionProvider",
                            "graph_optimization": "ORT_ENABLE_ALL"}}
    rows = {row[0]: row[1:] for row in latency_table(with_latency(latency)).rows}
    assert rows["result"][0] == "12.00 ms ±1.2% — **2.50×** (rounds 2.40–2.60×)"
    assert "Latency: not measured (no device)." in render_markdown(with_latency({"status": "not measured (no device)"}))


def test_summary_columns_hold_original_optimized_and_result_latency(tmp_path):
    (tmp_path / "net").mkdir()
    (tmp_path / "net" / "report.json").write_text(json.dumps(with_latency(timed())))
    row = summary_row("net", tmp_path / "net", seconds=10.0)
    assert (row["original_ms"], row["optimized_ms"], row["result_ms"]) == (30.0, 25.0, 12.0)
    assert COLUMNS.index("original_ms") < COLUMNS.index("optimized_ms") < COLUMNS.index("result_ms")
    header = render_summary_md([row]).splitlines()[2]
    assert "| original_ms | optimized_ms | result_ms |" in header
    assert "| 30.00 | 25.00 | 12.00 |" in render_summary_md([row])


def test_compare_lists_the_three_latencies_of_runs_and_summaries(tmp_path):
    flat = metrics_of("report", with_latency(timed()))
    assert (flat["latency.original_ms"], flat["latency.optimized_ms"], flat["latency.result_ms"]) == (30.0, 25.0, 12.0)
    summary = {"models": [{"model": "net", "original_ms": 30.0, "optimized_ms": 25.0, "result_ms": 12.0}]}
    assert metrics_of("summary", summary)["net.optimized_ms"] == 25.0
    for name, latency in (("a", timed()), ("b", timed(optimized=27.0))):
        (tmp_path / name).mkdir()
        (tmp_path / name / "report.json").write_text(json.dumps(with_latency(latency)))
    rows = {r["metric"]: r for r in compare([str(tmp_path / "a"), str(tmp_path / "b")], {})["rows"]}
    assert rows["latency.optimized_ms"]["others"][0]["worse"]  # slower is worse
    single = {r["metric"]: r for r in compare([str(tmp_path / "a")], {})["rows"]}
    assert single["latency.optimized_float_ms"]["base"] == 30.0
    assert single["latency.optimized_float_ms"]["others"][0]["value"] == 25.0
    assert single["latency.optimized_float_ms (ORT_ENABLE_BASIC)"]["others"][0]["value"] == 28.0


def noisy(ms: float, rounds: list[float]) -> dict:
    return {**timing(ms), "round_ms": rounds, "interval": 0.03}


def test_compare_marks_a_latency_worse_only_beyond_both_runs_timing_spreads(tmp_path):
    """Two runs of the same model: the original's latency moved by timing noise and compare called it a
    regression. Within the runs' round spreads and intervals a delta is not worse; the original model's latency
    never is a result's regression; a delta beyond both spreads still is."""
    def run(name: str, original: float, result: float, spread: float) -> str:
        latency = timed(optimized=None, basic=None, result=None)
        latency.update(reference=noisy(original, [original * (1 - spread), original, original * (1 + spread)]),
                       result=noisy(result, [result * (1 - spread), result, result * (1 + spread)]),
                       speedup=original / result, speedup_rounds=[original / result * (1 - spread),
                                                                  original / result * (1 + spread)])
        (tmp_path / name).mkdir()
        (tmp_path / name / "report.json").write_text(json.dumps(with_latency(latency)))
        return str(tmp_path / name)

    a, same, slower = run("a", 30.0, 12.0, 0.05), run("same", 31.0, 12.5, 0.05), run("slower", 90.0, 40.0, 0.05)
    with pytest.raises(QprepError, match="--fail-on-regression original_ms: the original model's latency is the "
                                         "input model timed again, never a result's regression; use result_ms"):
        compare([a, same], {"original_ms": 0.0})
    fail_on = {"result_ms": 0.0, "speedup": 0.0}
    within = compare([a, same], fail_on)
    rows = {r["metric"]: r["others"][0] for r in within["rows"]}
    assert rows["latency.original_ms"]["delta"] == 1.0 and not rows["latency.original_ms"]["worse"]
    assert rows["latency.result_ms"]["delta"] == 0.5 and not rows["latency.result_ms"]["worse"]
    assert rows["latency.speedup"]["delta"] < 0 and not rows["latency.speedup"]["worse"]
    assert within["regressions"] == []
    beyond = compare([a, slower], fail_on)
    rows = {r["metric"]: r["others"][0] for r in beyond["rows"]}
    assert rows["latency.result_ms"]["worse"] and rows["latency.speedup"]["worse"]
    assert not rows["latency.original_ms"]["worse"]  # the same input model, timed again: never the result's
    assert {r["metric"] for r in beyond["regressions"]} == {"latency.result_ms", "latency.speedup"}
