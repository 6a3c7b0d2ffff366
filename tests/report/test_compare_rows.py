"""`compare`, batch summaries and `qprep evaluate` show the figure that decided the verdict (the held-out one when
given) with its samples named, and compare says each run's status, backend and the model it deploys: a run judged
on held-out samples once showed its evaluation figures, and an RKNN run its float ONNX's nodes as the deployed ones."""

from __future__ import annotations

import json
import math

import pytest

from synthetic_report import judged, report, rows_of, write_run

from qprep.report.compare import (compare, facts_of, load_record, metrics_of, render_html, render_markdown,
                                  render_text)
from qprep.report.summary import render_summary_html, render_summary_md, summary_row
from qprep.report.verdict import check_text, decided_by, deciding_check, sample_set, verdict


def rknn(data: dict) -> dict:
    """The same report as an RKNN run records it: model.onnx is the float model the .rknn was built from."""
    data["stages"][0]["backend"] = "rknn"
    data["result"].update(kind="float", nodes=272, deployable={"path": "model.rknn", "bytes": 4_210_502,
                                                             "note": "model.onnx is the prepared float model"},
                          input_contract={"target_platform": "rk3588", "inputs": []})
    data["float_set"] = ["ln0", "ln1"]
    return data


def test_decided_by_is_the_verdicts_figure_on_the_verdicts_samples():
    for heldout in (False, True):
        data = judged({"cosine_mean": 0.99, "top1_agreement": 0.5}, heldout=heldout)
        evaluation = data["evaluation"]
        figure = decided_by(evaluation)
        check = deciding_check(evaluation["gate"]["checks"])
        assert check_text(check) in verdict(data).text and check_text(check) in figure["text"]
        # the set named is the verdict's: "16 held-out samples (`data/heldout`)"
        assert sample_set(evaluation) == f"{figure['samples']} {figure['split']} samples (`{figure['source']}`)"
        assert figure["text"].endswith(f"({'held-out' if heldout else 'evaluation'}, 16 samples)")
    assert decided_by(report()["evaluation"]) is None  # no gate, no floor: nothing decided


def test_compare_shows_the_held_out_figures_that_decided_not_the_evaluation_ones(tmp_path):
    data = judged({"cosine_mean": 0.5}, heldout=True)
    held = data["evaluation"]["heldout"]["outputs"]["logits"]
    assert held["cosine_mean"] != data["evaluation"]["outputs"]["logits"]["cosine_mean"]
    assert metrics_of("report", data)["logits.cosine_mean"] == held["cosine_mean"]
    single = rows_of(compare([write_run(tmp_path, "a", data)], {}))
    assert single["logits.top1_agreement"]["others"][0]["value"] == held["top1_agreement"]
    assert single["decided by"]["others"][0]["value"] == decided_by(data["evaluation"])["text"]
    assert single["judged on"]["others"][0]["value"] == "held-out, 16 samples (`data/heldout`)"


def test_compare_has_status_verdict_backend_and_deployed_model_rows(tmp_path):
    met = judged({"cosine_mean": 0.5})
    missed = rknn(judged({"cosine_mean": 0.99999}))
    missed["status"] = "gate missed"
    result = compare([write_run(tmp_path, "a", met), write_run(tmp_path, "b", missed)], {})
    rows = rows_of(result)
    assert (rows["status"]["base"], rows["status"]["others"][0]["value"]) == ("ok", "gate missed")
    assert rows["status"]["others"][0]["worse"]
    assert (rows["verdict"]["base"], rows["verdict"]["others"][0]["value"]) == ("met", "missed")
    assert (rows["backend"]["base"], rows["backend"]["others"][0]["value"]) == ("ort", "rknn")
    assert rows["deployed model"]["base"] == "model.onnx, 2.00 MB (qdq ONNX, 20 nodes)"
    deployed = rows["deployed model"]["others"][0]["value"]
    assert deployed.startswith("model.rknn for rk3588, 4.21 MB") and "not recorded" in deployed
    # model.onnx's 272 nodes are not the .rknn's: no node count, no delta against the ONNX result's
    assert rows["result.nodes"]["base"] == 20 and rows["result.nodes"]["others"][0]["value"] is None
    assert rows["result.kept_float"]["others"][0]["value"] == 2
    text = render_text(result)
    assert "gate missed ▼" in text and "`" not in text  # the terminal gets plain text
    assert "| status | ok | **gate missed** |" in render_markdown(result)
    assert "gate missed</td>" in render_html(result) and "`" not in render_html(result)
    assert not result["notes"]  # the same samples


def test_compare_says_when_runs_were_judged_on_different_samples(tmp_path):
    result = compare([write_run(tmp_path, "a", judged({"cosine_mean": 0.5})),
                      write_run(tmp_path, "b", judged({"cosine_mean": 0.5}, heldout=True))], {})
    assert "judged on different samples" in result["notes"][0]
    assert "judged on different samples" in render_text(result)


def test_a_summary_row_shows_the_deciding_figure_and_the_judged_set(tmp_path):
    data = rknn(judged({"cosine_mean": 0.5}, heldout=True))
    run = tmp_path / "run"
    run.mkdir()
    (run / "report.json").write_text(json.dumps(data))
    row = summary_row("m.onnx", run, 1.0)
    held = data["evaluation"]["heldout"]["outputs"]["logits"]
    assert (row["cosine_mean"], row["agreement"]) == (held["cosine_mean"], held["top1_agreement"])
    assert row["decided_by"] == decided_by(data["evaluation"])["text"]
    assert row["decided_by"].endswith("(held-out, 16 samples)") and row["judged_on"] == "held-out, 16 samples"
    assert row["nodes_after"] is None  # model.onnx's nodes are not the .rknn's
    assert "(held-out, 16 samples)" in render_summary_md([row]) and "`" not in render_summary_html([row])
    rows = rows_of(compare([str(_summary(tmp_path, row))], {}))
    assert rows["m.onnx.decided_by"]["base"] == row["decided_by"]
    assert rows["m.onnx.status"]["base"] == "ok" and rows["m.onnx.judged_on"]["base"] == "held-out, 16 samples"


def _summary(tmp_path, row: dict):
    (tmp_path / "batch").mkdir()
    (tmp_path / "batch" / "summary.json").write_text(json.dumps({"models": [row]}))
    return tmp_path / "batch"


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_a_record_read_back_from_disk_computes_as_the_run_did_on_non_finite_figures(tmp_path, value):
    """report.json writes a non-finite figure as a string ("Infinity": an exact result's SQNR); every view that
    reads the record from disk (compare, batch summaries) turns it back into the float before it computes, so an
    exact result compares instead of failing as 'not a qprep report'."""
    from qprep import jsonfile
    data = report(gate={"passed": True, "checks": [
        {"metric": "cosine_mean", "threshold": 0.99, "value": 1.0, "passed": True, "kind": "minimum"},
        {"metric": "mean_sqnr_db", "threshold": 17.0, "value": value, "passed": value > 17, "kind": "minimum"}]})
    data["evaluation"]["outputs"]["logits"]["sqnr_db"] = value
    run = tmp_path / "run"
    run.mkdir()
    (run / "report.json").write_text(jsonfile.dumps(data))
    kind, loaded = load_record(str(run))
    assert facts_of(kind, loaded)["decided by"]
    assert summary_row("net", run, 1.0)["decided_by"]
