"""The quantize stage's decisions and the deployable files are in report.md and report.html, not only in JSON."""

from __future__ import annotations

from types import SimpleNamespace

from synthetic_report import report

from qprep.model.info import TensorSpec
from qprep.quantize.rknn.contract import input_contract
from qprep.report.decisions import decision_lines, files_lines
from qprep.report.html import render_html
from qprep.report.markdown import render_markdown


def fallback_record(skipped: list[str]) -> dict:
    base = {"score": 0.95, "metrics": {"cosine_mean": 0.95}}
    return {"target": {"cosine_mean": 0.99}, "passed": True, "stopped": "target met", "seconds": 42.0,
            "float_nodes": [{"node": "conv3", "what": "Conv", "gain": 0.03}], "base": base,
            "best": {"score": 0.991, "metrics": {"cosine_mean": 0.991}}, "rounds": 1, "rank_trials": 4, "ranked": 4,
            "candidates": 9, "trials": [], "ranking": [], "budget": {"seconds": 60, "skipped": skipped}}


def _as_markdown(html: str) -> str:
    """report.html's inline markup written back as Markdown, so one expected line checks both renderings."""
    for tag, mark in (("b", "**"), ("code", "`")):
        html = html.replace(f"<{tag}>", mark).replace(f"</{tag}>", mark)
    return html


def test_gptq_and_bias_correction_show_the_figure_that_decided_them_in_both_renderings():
    data = report()
    for text in (render_markdown(data), _as_markdown(render_html(data))):
        assert ("GPTQ weight rounding on 3 layers: calibration output SQNR 30.10 dB (nearest) → 33.40 dB (GPTQ) — "
                "**kept**") in text
        assert "bias correction on 3 layers: calibration output SQNR 33.40 dB → 33.20 dB — **left out** (no gain)" in text
        assert "ranges: `minmax` calibration on 8 calibration samples" in text


def test_fallback_line_has_target_float_nodes_seconds_and_budget_skips():
    stage = {**report()["stages"][0], "fallback": fallback_record(["bias wave (~30 s, 5 s left)"]),
             "excluded_nodes": ["conv3"]}
    lines = decision_lines(stage)
    fallback = next(line for line in lines if line.startswith("accuracy-driven fallback"))
    assert "cosine_mean ≥ 0.99: **met** with 1 float node(s)" in fallback and "42 s" in fallback
    assert "Skipped for lack of time (time_budget_s): bias wave (~30 s, 5 s left)" in fallback
    assert "float nodes: 1 node(s) kept float" in lines


def test_fallback_line_names_the_spread_sets_left_untried_over_the_float_node_cap():
    record = {**fallback_record([]), "spread_tensors": {
        "setting": "spread tensors float16", "chosen": "3 tensors under 4 levels", "as": "float16", "nodes": 4,
        "scores": {"none": 0.5, "3 tensors under 4 levels": 0.6}, "over_max_float_nodes": ["85 tensors under 64 levels"],
        "tensors": [{"tensor": "t", "levels": 1.5}]}}
    stage = {**report()["stages"][0], "fallback": record, "excluded_nodes": ["conv3"]}
    fallback = next(line for line in decision_lines(stage) if line.startswith("accuracy-driven fallback"))
    assert "3 tensors under 4 levels kept (none 0.50000, 3 tensors under 4 levels 0.60000)" in fallback
    assert "Not tried, over max_float_nodes: 85 tensors under 64 levels" in fallback


def test_float_nodes_name_nonfinite_and_unquantizable_reasons():
    stage = {**report()["stages"][0], "excluded_nodes": ["mask_add", "odd"],
             "nonfinite": {"nodes": {"mask_add": "reads 'mask' (constant, values [-inf, -inf])"}},
             "unquantizable": [{"node": "odd", "reason": "KeyError: 'x'"}]}
    line = next(line for line in decision_lines(stage) if line.startswith("float nodes"))
    assert "2 node(s) kept float" in line and "1 of them for NaN/Inf" in line and "`mask_add`" in line
    assert "1 that ONNX Runtime's quantizer fails on (e.g. `odd`: KeyError: 'x')" in line


def test_a_clipped_attention_mask_says_its_bound_and_why():
    clip = {"bound": 10000.0, "clipped": True, "constants": {"fill": "…", "pad": "…"},
            "mask_bound": {"bound": 59.2, "excess": 17.6, "margin": 24.0, "softmax_adds": 6, "constants": ["fill"],
                           "own_fills": {"add_2": 32.1, "add_3": 24.7}}}
    stage = {**report()["stages"][0], "nonfinite": {"nodes": {}, "float16_clip": clip,
                                                    "int8_not_float16": {"add": "int8: its values are finite …"}}}
    lines = decision_lines(stage)
    assert any(line.startswith("attention-mask fill clipped to ±59.2 for int8 attention (a masked score rose 17.6 "
                               "above its row's largest on calibration data; twice that + 24), 2 attention(s) masked "
                               "with their own lower fill (24.7–32.1); 1 other constant(s) "
                               "beyond float16 to ±10000") for line in lines), lines
    assert "1 node(s) kept float for their values are int8 again once clipped" in lines


def test_the_rknn_float16_layer_count_is_the_toolkits_not_the_onnx_nodes():
    layers = {"requested_nodes": 4, "mapped": {"mm": {}, "tp": {}, "ln": {}}, "unmapped": ["sq"],
              "ir_tensors": ["mm_tp_sw", "ln#1"]}
    lines = decision_lines({**report()["stages"][0], "float16_layers": layers})
    assert ("2 layer(s) of the RKNN model float16, the rest int8 (from the 3 float node(s) under Kept float; 1 more "
            "float-set node(s) have no layer of their own in the toolkit's graph: `sq`)") in lines


def test_files_explain_the_board_files_and_the_one_command():
    data = report()
    normalization = {"input": "image", "mean": [0, 0, 0], "std": [1, 1, 1], "channel_order": "rgb", "layout": "nchw"}
    contract = input_contract([TensorSpec("image", "float32", [1, 3, 8, 8])], normalization,
                              SimpleNamespace(target_platform="rk3588"))
    data["result"].update(artifacts=["input_contract.json", "model.rknn", "run_on_board.py"],
                          deployable={"path": "model.rknn", "bytes": 1000, "note": "x"}, input_contract=contract)
    lines = files_lines(data)
    assert lines[0].startswith("`model.rknn`: the NPU model")
    assert any("`input_contract.json`" in line for line in lines)
    assert any("`python3 run_on_board.py image.png`" in line for line in lines)
    markdown = render_markdown(data)
    assert markdown.index("## Decisions") < markdown.index("## Files") < markdown.index("## Stages")
    assert "onnxruntime.InferenceSession('model.onnx')" in files_lines(report())[0]  # an ORT result


def test_other_stages_and_failed_ones_decide_nothing():
    assert decision_lines({"name": "optimize", "status": "ok"}) == []
    assert decision_lines({**report()["stages"][0], "status": "failed"}) == []


def test_fallback_line_gives_the_range_algorithm_measured_again_after_the_spread_set():
    record = {**fallback_record([]), "ranges_with_spread": {
        "setting": "quantized_algorithm with the spread set float16", "configured": "normal",
        "chosen": "kl_divergence", "scores": {"normal": 0.98544, "kl_divergence": 0.99638}}}
    stage = {**report()["stages"][0], "fallback": record, "excluded_nodes": ["conv3"]}
    fallback = next(line for line in decision_lines(stage) if line.startswith("accuracy-driven fallback"))
    assert ("quantized_algorithm with the spread set float16 measured after them: kl_divergence kept "
            "(normal 0.98544, kl_divergence 0.99638)") in fallback


def test_mmse_weight_ranges_chosen_by_the_fallback_are_named_with_their_scores():
    record = {**fallback_record([]), "weight_rounding": {
        "setting": "weight_rounding", "configured": "gptq", "chosen": "mmse", "scores": {"gptq": 0.99723, "mmse": 0.99826}}}
    stage = {**report()["stages"][0], "fallback": record,
             "weight_rounding": {"method": "mmse", "calibration_samples": 8, "weights": 51, "seconds": 39.4}}
    lines = decision_lines(stage)
    assert any("weight ranges: those of an RKNN `mmse` build on 8 calibration samples (39 s), nearest rounding "
               "(chosen by the fallback)" in line for line in lines)
    fallback = next(line for line in lines if line.startswith("accuracy-driven fallback"))
    assert "weight_rounding measured after the ranges: mmse kept (gptq 0.99723, mmse 0.99826)" in fallback


def test_outlier_positions_computed_apart_are_named_with_their_positions():
    split = {"chains": [{"layernorm": "a", "nodes": 7, "segments": [[0, 1], [1, 128]], "outliers": [[0, 1]]},
                        {"layernorm": "b", "nodes": 4, "segments": [[0, 126], [126, 128]], "outliers": [[126, 128]]}],
             "verified_on": 8}
    lines = decision_lines({**report()["stages"][0], "outlier_positions": split})
    assert any("2 LayerNorm chain(s) computed apart for sequence position(s) 0, 126-127" in line and "8 samples" in line
               for line in lines)


def test_smoothed_layernorms_name_the_widest_spread_and_what_it_became():
    smoothed = {"alpha": 0.75, "verified_on": 16, "layernorms": [
        {"layernorm": "ln_a", "matmuls": 3, "spread_before": 5.0, "spread_after": 1.7, "largest_scale": 3.1},
        {"layernorm": "ln_b", "matmuls": 1, "spread_before": 19.6, "spread_after": 2.6, "largest_scale": 7.8}]}
    lines = decision_lines({**report()["stages"][0], "smoothed_layernorms": smoothed})
    assert any(line.startswith("2 LayerNorm output(s) smoothed") and "19.6 → 2.6 at ln_b" in line for line in lines)


def test_rescaled_residual_sums_name_the_widest_spread():
    rescaled = {"verified_on": 16, "layernorms": [
        {"layernorm": "ln_4", "channels": 12, "spread_before": 35.0, "inputs": ["weights", "mul"]},
        {"layernorm": "ln_5", "channels": 9, "spread_before": 25.0, "inputs": ["weights", "added mul"]}]}
    lines = decision_lines({**report()["stages"][0], "residual_channels": rescaled})
    assert any(line.startswith("2 residual sum(s) with huge channels scaled down") and "35 at ln_4" in line
               for line in lines)
