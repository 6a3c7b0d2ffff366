"""A 2016 export (IR version 3, opset 8) that ONNX Runtime runs: onnx's checker wants IR 3's initializers listed
as graph inputs, a rule IR 4 dropped; qprep takes it as IR 4 (its opset kept) and says so, instead of refusing."""

import logging

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from qprep.errors import ModelError
from qprep.model.load import load_model
from conftest import run_on_samples


def ir3_model() -> onnx.ModelProto:
    """x[1,3,6,6] → Conv(w) → Relu → y, opset 8, IR 3, `w` an initializer and not a graph input."""
    weight = np.random.default_rng(0).standard_normal((4, 3, 3, 3)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name="conv"),
                               helper.make_node("Relu", ["c"], ["y"], name="relu")], "ir3",
                              [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 3, 6, 6])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4, 6, 6])],
                              [numpy_helper.from_array(weight, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 8)])
    model.ir_version = 3
    return model


def test_an_ir3_model_whose_initializers_are_not_inputs_loads_as_ir4_with_its_opset(tmp_path, caplog):
    onnx.save(ir3_model(), str(tmp_path / "old.onnx"))
    with caplog.at_level(logging.WARNING, logger="qprep"):
        model = load_model(tmp_path / "old.onnx")
    assert model.ir_version == 4 and [(o.domain, o.version) for o in model.opset_import] == [("", 8)]
    assert "IR version 3" in caplog.text and "taken as IR version 4 (opset 8 kept)" in caplog.text


def test_another_checker_complaint_is_still_refused_in_one_line(tmp_path):
    model = ir3_model()
    model.graph.node[1].input[0] = "nowhere"  # read before anything computes it
    onnx.save(model, str(tmp_path / "old.onnx"))
    with pytest.raises(ModelError, match=r"old.onnx is not a valid ONNX model \(IR version 3, checked as IR 4\): "
                                         r".*input 'nowhere' of node"):
        load_model(tmp_path / "old.onnx")


def test_an_ir3_model_runs_on_the_ort_backend(tmp_path):
    samples = [{"x": np.random.default_rng(i).standard_normal((1, 3, 6, 6)).astype(np.float32)} for i in range(4)]
    report = run_on_samples(tmp_path, ir3_model(), samples, [{"quantize": {"backend": "ort"}}])
    assert report["status"] == "ok"
    assert report["evaluation"]["outputs"]["y"]["cosine_mean"] > 0.99
