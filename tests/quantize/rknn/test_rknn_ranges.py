"""Reusing one RKNN build's ranges in later hybrid builds (qprep/quantize/rknn/ranges.py): the file edits on tiny inputs, and
for real, an mmse build's table rebuilt by a `normal` step2 that searches nothing."""

import argparse
import pickle

import numpy as np
import pytest
import yaml

from qprep.quantize.rknn import ranges as rknn_ranges
from conftest import rknn_job

CFG = """custom_quantize_layers: {}
quantize_parameters:
    x:
        qtype: asym
        qmethod: layer
        dtype: float32
        min:
        -   -1.0
        max:
        -   1.0
        scale: []
        zero_point: []
    'conv.out':
        qtype: asym
        qmethod: layer
        dtype: int8
        min:
        -   -20.5
        max:
        -   20.25
        scale:
        -   0.16
        zero_point:
        -   -1
        ori_min:
        -   -20.5
        ori_max:
        -   20.25
    conv.weight:
        qtype: asym
        qmethod: channel
        dtype: int8
        min:
        -   -1.0
        -   -2.0
        max:
        -   1.0
        -   2.0
        scale:
        -   0.01
        -   0.02
        zero_point:
        -   0
        -   0
"""


def _entry(qmethod, low, high, dtype="int8"):
    scale = [(h - l) / 255 for l, h in zip(low, high)]
    return {"name": "", "qmethod": qmethod, "qtype": "asym", "dtype": dtype, "min": str(low), "max": str(high),
            "scale": str(scale), "zero_point": str([-128] * len(low)), "ori_min": str(low), "ori_max": str(high)}


def test_cfg_entries_replaced_line_by_line_and_nothing_else():
    table = {"conv.out": _entry("layer", [-3.0], [0.00001]), "conv.weight": _entry("channel", [-5.0, -5.0], [5.0, 5.0])}
    text, changed = rknn_ranges.with_entries(CFG, table)
    assert changed == 1
    parsed = yaml.safe_load(text)["quantize_parameters"]
    out = parsed["conv.out"]
    assert out["min"] == [-3.0] and out["max"] == [0.00001] and out["ori_min"] == [-3.0]  # 1e-05 would be a string
    assert out["scale"] == [3.00001 / 255] and out["zero_point"] == [-128]
    assert parsed["x"] == yaml.safe_load(CFG)["quantize_parameters"]["x"]  # not in the table
    assert parsed["conv.weight"]["min"] == [-1.0, -2.0]  # weights go through the data file, not the cfg
    changed_lines = [b for a, b in zip(CFG.splitlines(), text.splitlines()) if a != b]
    assert len(text.splitlines()) == len(CFG.splitlines()) and len(changed_lines) == 6  # min max scale zp ori ×2


def _step1(tmp_path, quant_tab):
    stem = tmp_path / "model"
    with open(f"{stem}.data", "wb") as f:
        pickle.dump({"quant_tab": quant_tab, "quantizer.param": {"qalgorithm": "mmse"},
                     "args": argparse.Namespace(quantized_algorithm="mmse")}, f)
    return stem


def test_step1_data_file_gets_the_entries_and_the_normal_algorithm(tmp_path):
    stem = _step1(tmp_path, {"conv.weight": _entry("channel", [-1.0, -2.0], [1.0, 2.0]),
                             "other.weight": _entry("channel", [-1.0], [1.0]),
                             "conv.out": _entry("layer", [-20.5], [20.25])})
    table = {"conv.out": _entry("layer", [-3.0], [3.0]), "conv.weight": _entry("channel", [-5.0, -5.0], [5.0, 5.0]),
             "other.weight": _entry("channel", [-7.0], [7.0], dtype="float16")}  # float16 there: no grid to take
    text, counts = rknn_ranges.apply(stem, CFG, table)
    assert counts == {"activations": 1, "weights": 1}
    with open(f"{stem}.data", "rb") as f:
        written = pickle.load(f)
    entries = written["quant_tab"]
    assert entries["conv.weight"]["min"] == "[-5.0, -5.0]" and entries["conv.out"]["min"] == "[-3.0]"
    assert entries["other.weight"]["min"] == "[-1.0]"
    assert written["quantizer.param"]["qalgorithm"] == "normal" and written["args"].quantized_algorithm == "normal"
    assert yaml.safe_load(text)["quantize_parameters"]["conv.out"]["ori_max"] == [3.0]  # cfg and data agree


def test_a_table_that_matches_nothing_is_refused_and_the_file_left_alone(tmp_path):
    stem = _step1(tmp_path, {"conv.out": _entry("layer", [-20.5], [20.25])})
    before = (tmp_path / "model.data").read_bytes()
    with pytest.raises(ValueError, match="matches 0 activations"):
        rknn_ranges.apply(stem, CFG, {"other": _entry("layer", [0.0], [1.0])})
    assert (tmp_path / "model.data").read_bytes() == before
    with pytest.raises(ValueError, match="no quantization table"):
        rknn_ranges.table_of(object())


@pytest.mark.slow
def test_mmse_build_rebuilt_from_its_ranges_without_searching(tmp_path):
    """cls with mmse: the builder reuses the first build's table; the next build (a hybrid step2 with the
    `normal` algorithm) has the same ranges, gives the same outputs and runs no mmse search."""
    pytest.importorskip("rknn.api", reason="rknn-toolkit2 is not installed (scripts/setup.sh or `qprep setup rknn` installs it)")
    from qprep.quantize import rknn

    builder = rknn.RknnBuilder(rknn_job(tmp_path, "ppocr_cls", quantized_algorithm="mmse", weight_rounding="gptq"))
    calibration = builder.job.calibration
    samples = calibration.samples[:4]
    searched = builder.session(set())
    expected = searched(samples)
    table = searched.quantization_table()
    assert builder.reuse_ranges(set())
    builder.release()
    log_start = builder.toolkit.log_path.stat().st_size
    rebuilt = builder.session(set())
    assert builder.details["ranges_reused"]["weights"] >= 50 and builder.details["ranges_reused"]["activations"] >= 50
    with open(builder.toolkit.log_path, errors="replace") as f:
        f.seek(log_start)
        assert "Mmse" not in f.read()  # the mmse search ran once, in the first build
    again = rebuilt.quantization_table()
    int8 = [name for name, entry in table.items() if entry["dtype"] == "int8"]
    assert len(int8) > 100
    for name in int8:
        for field in ("min", "max", "scale", "zero_point"):
            assert np.allclose(rknn_ranges.numbers(again[name][field]), rknn_ranges.numbers(table[name][field]))
    for old, new in zip(expected, rebuilt(samples)):
        for key in old:
            np.testing.assert_allclose(new[key], old[key], atol=1e-6)


@pytest.mark.parametrize("algorithm, elapsed, reused", [("mmse", 230.0, True), ("mmse", 0.0, False),
                                                         ("normal", 230.0, False)])
def test_after_a_slow_range_build_late_in_the_budget_the_phases_before_the_search_reuse_its_ranges(
        algorithm, elapsed, reused):
    """PP-OCRv4 rec: mmse kept after 230 of 300 s; its spread phase predicted each trial as slow as that build and
    was skipped. Late in the budget, the builds reuse the mmse build's ranges and the slow timings are forgotten."""
    import time

    from qprep.quantize.budget import Budget
    from qprep.quantize.rknn.phases import faster_if_late

    class Builder:
        def __init__(self):
            self.algorithm, self.asked = algorithm, []

        def reuse_ranges(self, float_set):
            self.asked.append(set(float_set))
            return True

    budget = Budget(300.0, started=time.perf_counter() - elapsed)
    budget.durations["trial"] = [220.0]
    builder = Builder()
    assert faster_if_late(builder, {"ln"}, budget) is reused
    assert ("trial" not in budget.durations) is reused and (builder.asked == [{"ln"}]) is reused


@pytest.mark.parametrize("first", ["nearest", "gptq"])
def test_mmse_weight_ranges_are_given_to_normal_builds(tmp_path, first):
    """weight_rounding mmse: an mmse build on a few calibration samples gives the weight ranges (mmse's gain lies
    there), and the builds after it are normal ones — no mmse search in them — whose int8 weights carry exactly
    those ranges and whose activation ranges stay normal's. Switching there and back runs hybrid step1 once per
    model file the toolkit loads (nearest and mmse weights load the model as prepared, GPTQ its own): its
    outputs are copied back as they came out (the build after the mmse one has the first one's weights)."""
    pytest.importorskip("rknn.api", reason="rknn-toolkit2 is not installed (scripts/setup.sh or `qprep setup rknn` installs it)")
    from qprep.quantize import rknn

    builder = rknn.RknnBuilder(rknn_job(tmp_path, "ppocr_cls", weight_rounding=first))
    calls, call = [], builder.toolkit.call
    builder.toolkit.call = lambda what, *args, **kwargs: (calls.append(what), call(what, *args, **kwargs))[1]
    last = {builder.job.model.graph.node[-1].name}  # a float16 layer: every build a hybrid one
    files = 1 if first == "nearest" else 2
    try:
        assert builder.weights_in_use() == first
        normal = builder.session(last).quantization_table()
        builder.use_weight_rounding("mmse")
        harvested = builder.model_file.weight_table(builder.algorithm)
        assert builder.details["weight_rounding"]["method"] == "mmse"
        assert builder.details["weight_rounding"]["calibration_samples"] == 8
        log_start = builder.toolkit.log_path.stat().st_size
        table = builder.session(last).quantization_table()
        with open(builder.toolkit.log_path, errors="replace") as f:
            f.seek(log_start)
            assert "Mmse" not in f.read()
        builder.use_weight_rounding(first)
        back = builder.session(last).quantization_table()
        assert len(list(builder.toolkit.work_dir.glob("step1_*"))) == files
    finally:
        builder.close()
    assert not list(builder.toolkit.work_dir.glob("step1_*"))  # kept copies deleted with the builder
    assert calls.count("hybrid_quantization_step1") == files and calls.count("hybrid_quantization_step2") == 3
    assert len(harvested) > 40
    moved = 0
    for name, entry in harvested.items():
        scale = rknn_ranges.numbers(table[name]["scale"])
        np.testing.assert_allclose(scale, rknn_ranges.numbers(entry["scale"]), rtol=1e-6)
        np.testing.assert_allclose(rknn_ranges.numbers(back[name]["scale"]),
                                   rknn_ranges.numbers(normal[name]["scale"]), rtol=1e-6)
        moved += not np.allclose(scale, rknn_ranges.numbers(normal[name]["scale"]), rtol=1e-3)
    assert moved > 10  # mmse chose other weight ranges than the extremes for many weights
    activations = [name for name, entry in normal.items() if entry["qmethod"] == "layer" and entry["dtype"] == "int8"]
    assert len(activations) > 40
    if first == "gptq":  # its file holds GPTQ's weights, which the toolkit calibrates with: activations move (0.1%)
        return
    for name in activations:
        for field in ("min", "max"):
            np.testing.assert_allclose(rknn_ranges.numbers(table[name][field]), rknn_ranges.numbers(normal[name][field]),
                                       rtol=1e-6)
