"""A model whose outputs are drawn at random (a Dropout left in training mode, as torch's dynamo exporter writes
a model not put in eval mode; a random op) is refused before any work: its float outputs differ run to run, and
a T5 encoder exported that way came out `ok` at cosine 0.90 against itself."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from graphs import make_model, rand
from qprep.errors import ModelError
from qprep.model.info import random_nodes


def _dropout_model(training, ratio=0.1, dead=False):
    """x → MatMul → Dropout(ratio, training_mode) → y (or the Dropout's output read by nobody: y = the MatMul)."""
    dropout = helper.make_node("Dropout", ["h", "ratio", "training"], ["d"], name="dropout")
    out = "h" if dead else "d"
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="matmul"), dropout,
             helper.make_node("Relu", [out], ["y"], name="relu")]
    return make_model(nodes, [("x", [2, 8])], [("y", [2, 8])],
                      {"w": rand(8, 8), "ratio": np.float32(ratio), "training": np.array(training)}, opset=13)


@pytest.mark.parametrize("training, ratio, dead, found", [
    (True, 0.1, False, ["Dropout in training mode"]),
    (False, 0.1, False, []),  # inference: the identity
    (True, 0.0, False, []),  # nothing dropped
    (True, 0.1, True, []),  # random, but no output reads it
])
def test_a_dropout_in_training_mode_that_reaches_an_output_is_random(training, ratio, dead, found):
    assert [why for _, why in random_nodes(_dropout_model(training, ratio, dead))] == found


def test_a_random_op_feeding_an_output_is_found():
    nodes = [helper.make_node("RandomNormalLike", ["x"], ["noise"], name="noise"),
             helper.make_node("Add", ["x", "noise"], ["y"], name="add")]
    model = make_model(nodes, [("x", [2, 8])], [("y", [2, 8])], opset=13)
    assert [(n.name, why) for n, why in random_nodes(model)] == [("noise", "RandomNormalLike")]


def test_a_run_on_a_model_left_in_training_mode_is_refused_before_any_work(tmp_path):
    import onnx

    import qprep

    onnx.save(_dropout_model(True), str(tmp_path / "m.onnx"))
    (tmp_path / "calib").mkdir()
    np.save(tmp_path / "calib" / "0.npy", rand(2, 8))
    with pytest.raises(ModelError, match=r"node 'dropout' \(Dropout in training mode\) draws random values that "
                                         r"reach the outputs.*export the model in eval mode"):
        qprep.run({"model": str(tmp_path / "m.onnx"), "calibration": {"source": str(tmp_path / "calib")},
                   "pipeline": [{"optimize": {}}, {"quantize": {}}]}, output_dir=str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def _branch(name: str, nodes, output: str):
    from graphs import make_graph
    return make_graph(nodes, [], [(output, [2, 8])], name=name)


def test_a_random_op_inside_an_if_branch_that_feeds_an_output_is_found():
    noisy = _branch("then", [helper.make_node("RandomUniformLike", ["x"], ["u"], name="draw"),
                             helper.make_node("Add", ["x", "u"], ["t"], name="noisy")], "t")
    clean = _branch("else", [helper.make_node("Identity", ["x"], ["e"], name="clean")], "e")
    nodes = [helper.make_node("If", ["flag"], ["y"], name="if", then_branch=noisy, else_branch=clean)]
    model = make_model(nodes, [("x", [2, 8]), ("flag", [], np.bool_)], [("y", [2, 8])], opset=13)
    assert [(n.name, why) for n, why in random_nodes(model)] == [("draw", "RandomUniformLike")]


def test_a_random_value_read_only_inside_a_branch_reaches_the_output_through_it():
    reads = _branch("then", [helper.make_node("Add", ["x", "noise"], ["t"], name="add")], "t")
    clean = _branch("else", [helper.make_node("Identity", ["x"], ["e"], name="clean")], "e")
    nodes = [helper.make_node("RandomNormalLike", ["x"], ["noise"], name="noise"),
             helper.make_node("If", ["flag"], ["y"], name="if", then_branch=reads, else_branch=clean)]
    model = make_model(nodes, [("x", [2, 8]), ("flag", [], np.bool_)], [("y", [2, 8])], opset=13)
    assert [(n.name, why) for n, why in random_nodes(model)] == [("noise", "RandomNormalLike")]


def test_random_ops_that_cannot_reach_an_output_are_not_found():
    """A branch a constant condition never takes (a converted graph's train/eval switch), and a random value
    a Loop body computes for nobody: both models give the same outputs on every run."""
    from graphs import make_graph

    noisy = _branch("then", [helper.make_node("RandomUniformLike", ["x"], ["u"], name="draw"),
                             helper.make_node("Add", ["x", "u"], ["t"], name="noisy")], "t")
    clean = _branch("else", [helper.make_node("Identity", ["x"], ["e"], name="clean")], "e")
    switch = make_model([helper.make_node("If", ["training"], ["y"], name="if", then_branch=noisy,
                                          else_branch=clean)],
                        [("x", [2, 8])], [("y", [2, 8])], {"training": np.array(False)}, opset=13)
    assert random_nodes(switch) == []
    body = make_graph([helper.make_node("Identity", ["cond_in"], ["cond_out"]),
                       helper.make_node("RandomNormalLike", ["h_in"], ["unused"], name="dead_draw"),
                       helper.make_node("Relu", ["h_in"], ["h_out"])],
                      [("i", [], np.int64), ("cond_in", [], np.bool_), ("h_in", [2, 8])],
                      [("cond_out", [], np.bool_), ("h_out", [2, 8])], name="body")
    loop = make_model([helper.make_node("Loop", ["trips", "", "x"], ["y"], name="loop", body=body)],
                      [("x", [2, 8])], [("y", [2, 8])], {"trips": np.int64(3)}, opset=13, infer_shapes=False)
    assert random_nodes(loop) == []
