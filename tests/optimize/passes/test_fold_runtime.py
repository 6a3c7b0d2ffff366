"""fold_constants' ONNX Runtime half: a bicubic position-embedding Resize (the ViT `interpolate_pos_encoding`
export) folds through ONNX Runtime once the input dims are fixed; a node over the cost budget, a random op and a
custom-domain op are left, counted with their reason."""

import json

import numpy as np
import onnx
from onnx import helper

from qprep.graph import fold_cost
from qprep.model.runtime import run_model
from qprep.optimize.passes import fold_constants
from graphs import apply_pass, make_model, ops, rand

PATCH = 16


def interpolated_pos_model(size: int = 64, channels: int = 64) -> onnx.ModelProto:
    """x[1,3,S,S] → patch Conv → + Resize(pos[1,C,14,14], cubic, sizes = [1, C, H/16, W/16] from Shape(x))."""
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["patches"], kernel_shape=[PATCH, PATCH], strides=[PATCH, PATCH]),
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "two"], ["h"], axis=0),
        helper.make_node("Gather", ["shape", "three"], ["w_"], axis=0),
        helper.make_node("Div", ["h", "patch"], ["gh"]),
        helper.make_node("Div", ["w_", "patch"], ["gw"]),
        helper.make_node("Unsqueeze", ["gh", "axis0"], ["gh1"]),
        helper.make_node("Unsqueeze", ["gw", "axis0"], ["gw1"]),
        helper.make_node("Concat", ["lead", "gh1", "gw1"], ["sizes"], axis=0),
        helper.make_node("Resize", ["pos", "", "", "sizes"], ["pos_resized"], mode="cubic",
                         coordinate_transformation_mode="half_pixel", cubic_coeff_a=-0.75),
        helper.make_node("Add", ["patches", "pos_resized"], ["y"]),
    ]
    initializers = {"w": rand(channels, 3, PATCH, PATCH, seed=1) * 0.05, "pos": rand(1, channels, 14, 14, seed=2),
                    "two": np.array(2, np.int64), "three": np.array(3, np.int64), "patch": np.array(PATCH, np.int64),
                    "axis0": np.array([0], np.int64), "lead": np.array([1, channels], np.int64)}
    grid = size // PATCH
    return make_model(nodes, [("x", [1, 3, size, size])], [("y", [1, channels, grid, grid])], initializers,
                      opset=13, infer_shapes=False)


def test_a_bicubic_pos_embedding_resize_folds_through_onnxruntime(tmp_path, save, cli):
    model = interpolated_pos_model()
    path = save(model)
    config = tmp_path / "c.yaml"
    config.write_text(f"model: {path}\noutput_dir: {tmp_path / 'run'}\npipeline: [{{optimize: {{}}}}]\n")
    code, _, err = cli("run", config, "--quiet")
    assert code == 0, err
    stage = json.loads((tmp_path / "run" / "report.json").read_text())["stages"][0]
    details = {p["pass"]: p for p in stage["passes"]}["fold_constants"]["details"]
    assert details["evaluated_by_onnxruntime"] >= 1 and details["onnxruntime_sessions"] >= 1, details
    assert "left" not in details, details
    folded = onnx.load(str(tmp_path / "run" / "model.onnx"))
    assert "Resize" not in ops(folded) and "Shape" not in ops(folded), ops(folded)
    feeds = {"x": rand(1, 3, 64, 64, seed=3)}
    before, after = run_model(model, [feeds])[0]["y"], run_model(folded, [feeds])[0]["y"]
    np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-6)


def test_a_node_over_the_cost_budget_is_left_and_counted(monkeypatch):
    monkeypatch.setattr(fold_cost, "BUDGET", 100)  # the 64×4×4 bicubic Resize costs 16 × 1024
    out, outcome = apply_pass(fold_constants.PASS, interpolated_pos_model())
    assert ops(out)["Resize"] == 1
    assert outcome.details["left"] == {"cost": 1}, outcome.details
    assert "Shape" not in ops(out)  # the shape arithmetic before it still folds (onnxscript's partial evaluation)


def test_the_cost_estimate_reads_the_resize_mode_and_matmul_depth():
    out = (1, 64, 28, 28)
    cubic = fold_cost.node_cost("Resize", {"mode": "cubic"}, [(1, 64, 14, 14)], [out])
    nearest = fold_cost.node_cost("Resize", {"mode": "nearest"}, [(1, 64, 14, 14)], [out])
    assert cubic == 16 * nearest == 16 * 64 * 28 * 28
    assert fold_cost.node_cost("MatMul", {}, [(8, 300), (300, 5)], [(8, 5)]) == 8 * 5 * 300


def test_random_and_custom_domain_ops_are_left_untouched():
    """Bernoulli (onnxscript's reference evaluator would draw it once and freeze it) and an op of a domain ONNX
    Runtime has no kernel for stay in the graph; the custom one is counted not_runnable."""
    nodes = [helper.make_node("Bernoulli", ["probs"], ["coin"], seed=1.0),
             helper.make_node("Add", ["x", "coin"], ["a"]),
             helper.make_node("Scale", ["big"], ["scaled"], domain="example.custom"),
             helper.make_node("Add", ["a", "scaled"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 3])],
                              [onnx.numpy_helper.from_array(np.full((2, 3), 0.5, np.float32), "probs"),
                               onnx.numpy_helper.from_array(rand(2, 3), "big")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15),
                                                    helper.make_opsetid("example.custom", 1)])
    out, outcome = apply_pass(fold_constants.PASS, model)
    assert ops(out)["Bernoulli"] == 1 and ops(out)["Scale"] == 1, ops(out)
    assert outcome.details["left"] == {"not_runnable": 1}, outcome.details


def test_a_node_onnxruntime_refuses_is_left_and_the_rest_of_the_closure_still_folds():
    """ONNX Runtime has no uint16 Add kernel: that node is left (not_runnable), the weight Transpose in the same
    closure still folds, to the transposed weight."""
    weight = rand(80, 60)
    nodes = [helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),
             helper.make_node("MatMul", ["x", "wt"], ["mm"]),
             helper.make_node("Add", ["a", "b"], ["count"]),
             helper.make_node("Cast", ["count"], ["count_f"], to=onnx.TensorProto.FLOAT),
             helper.make_node("ReduceSum", ["count_f"], ["total"], keepdims=0),
             helper.make_node("Add", ["mm", "total"], ["y"])]
    counts = np.arange(5000, dtype=np.uint16)
    model = make_model(nodes, [("x", [2, 60])], [("y", [2, 80])],
                       {"w": weight, "a": counts, "b": counts}, opset=13, infer_shapes=False)
    out, outcome = apply_pass(fold_constants.PASS, model)
    assert "Transpose" not in ops(out) and ops(out)["Add"] == 2, ops(out)
    assert outcome.details["left"] == {"not_runnable": 1}, outcome.details
    matmul = next(node for node in out.graph.node if node.op_type == "MatMul")
    folded = {t.name: onnx.numpy_helper.to_array(t) for t in out.graph.initializer}[matmul.input[1]]
    np.testing.assert_array_equal(folded, weight.T)


def test_what_folding_left_is_in_the_report_with_its_reason(tmp_path, save, cli, monkeypatch):
    monkeypatch.setattr(fold_cost, "BUDGET", 100)
    config = tmp_path / "c.yaml"
    config.write_text(f"model: {save(interpolated_pos_model())}\noutput_dir: {tmp_path / 'run'}\n"
                      "pipeline: [{optimize: {}}]\n")
    code, _, err = cli("run", config, "--quiet")
    assert code == 0, err
    text = (tmp_path / "run" / "report.md").read_text()
    assert "Left unfolded by **fold_constants**: 1× over the folding cost bound" in text
