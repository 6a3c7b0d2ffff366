"""A float16 or float64 model is quantized from a float32 copy of itself (float32_copy.py): before, ONNX Runtime's
quantizer quantized nothing in it and the run returned the model as it was under an INT8 config (and fp16 left
a float64 model's weights float64)."""

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxconverter_common import float16

from conftest import run_on_samples
from graphs import make_model, rand
from qprep.model.runtime import run_model
from qprep.quantize import float32_copy


def classifier() -> onnx.ModelProto:
    """x[1,3,8,8] → Conv → Relu → GlobalAveragePool → Flatten → MatMul → y[1,4]: float32."""
    rng = np.random.default_rng(0)
    return make_model([helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
                       helper.make_node("Relu", ["c"], ["r"]),
                       helper.make_node("GlobalAveragePool", ["r"], ["g"]),
                       helper.make_node("Flatten", ["g"], ["f"]),
                       helper.make_node("MatMul", ["f", "fc"], ["y"])],
                      [("x", [1, 3, 8, 8])], [("y", [1, 4])],
                      {"w": rng.standard_normal((8, 3, 3, 3)).astype(np.float32) * 0.3,
                       "b": rng.standard_normal(8).astype(np.float32),
                       "fc": rng.standard_normal((8, 4)).astype(np.float32)}, infer_shapes=False)


def float64(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with float64 weights and interface (as skl2onnx writes a model of doubles)."""
    double = onnx.ModelProto()
    double.CopyFrom(model)
    for index, tensor in enumerate(double.graph.initializer):
        double.graph.initializer[index].CopyFrom(
            numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float64), tensor.name))
    for value in [*double.graph.input, *double.graph.output]:
        value.type.tensor_type.elem_type = TensorProto.DOUBLE
    return double


def mlp() -> onnx.ModelProto:
    """x[1,16] → MatMul → Relu → MatMul → y[1,4]: ONNX Runtime has float64 kernels for these (not for Conv)."""
    rng = np.random.default_rng(1)
    return make_model([helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
                       helper.make_node("MatMul", ["r", "w2"], ["y"])], [("x", [1, 16])], [("y", [1, 4])],
                      {"w1": rng.standard_normal((16, 32)).astype(np.float32),
                       "w2": rng.standard_normal((32, 4)).astype(np.float32)}, opset=17, infer_shapes=False)


def samples(dtype, count=8):
    return [{"x": rand(1, 3, 8, 8, seed=i).astype(dtype)} for i in range(count)]


@pytest.mark.parametrize("keep_io_types", [False, True])
def test_a_float16_model_is_quantized_with_its_interface_kept(tmp_path, keep_io_types):
    model = float16.convert_float_to_float16(classifier(), keep_io_types=keep_io_types)
    io_type = np.float32 if keep_io_types else np.float16
    report = run_on_samples(tmp_path, model, samples(io_type), [{"quantize": {"backend": "ort"}}])
    stage = next(s for s in report["stages"] if s["name"] == "quantize")
    assert stage["float32_copy"]["applied"] and stage["float32_copy"]["weights"] == 3
    assert stage["op_counts_after"].get("QuantizeLinear", 0) >= 2  # before: none (the model came back float16)
    result = onnx.load(str(tmp_path / "out" / "model.onnx"))
    expected = TensorProto.FLOAT if keep_io_types else TensorProto.FLOAT16
    assert [v.type.tensor_type.elem_type for v in [*result.graph.input, *result.graph.output]] == [expected] * 2
    assert report["evaluation"]["gate"]["passed"]
    assert report["evaluation"]["outputs"]["y"]["cosine_mean"] > 0.99
    assert not any("quantized nothing" in w for w in report["warnings"])
    assert "quantized from its float32 copy (3 float16 weights" in (tmp_path / "out" / "report.md").read_text()
    json.dumps(report)


def test_the_float32_copy_keeps_what_the_float16_model_computes():
    """Initializers listed as inputs (IR 3), an internal Cast to float16, a ConstantOfShape's value, a float16
    output that is also read inside: all float32 inside, the same outputs, and float16 at the interface."""
    half = np.float16
    w = numpy_helper.from_array(np.linspace(-1, 1, 8).astype(half).reshape(2, 4), "w")
    shape = numpy_helper.from_array(np.array([1, 4], np.int64), "shape")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]),
             helper.make_node("ConstantOfShape", ["shape"], ["one"],
                              value=numpy_helper.from_array(np.array([1.5], half))),
             helper.make_node("Add", ["h", "one"], ["y"]),
             helper.make_node("Cast", ["y"], ["y32"], to=TensorProto.FLOAT),
             helper.make_node("Cast", ["y32"], ["y16"], to=TensorProto.FLOAT16),
             helper.make_node("Mul", ["y16", "y"], ["z"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [1, 2]),
                                           helper.make_tensor_value_info("w", TensorProto.FLOAT16, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [1, 4]),
                               helper.make_tensor_value_info("z", TensorProto.FLOAT16, [1, 4])], [w, shape])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 7
    data = [{"x": np.array([[0.5, -2.0]], half)}, {"x": np.array([[3.0, 1.0]], half)}]
    upcast, record = float32_copy.to_float32(model, data, threads=1)
    assert record["applied"] and record["interface_casts"] == 3 and record["cosine_min"] > 0.999
    assert {t.data_type for t in upcast.graph.initializer} == {TensorProto.FLOAT, TensorProto.INT64}
    inside = [n for n in upcast.graph.node if not n.name.endswith("/to_float16")]
    assert not any(float32_copy._type_of(a) == TensorProto.FLOAT16 for n in inside for a in n.attribute)
    assert len(upcast.graph.node) - len(inside) == 2  # y and z
    for before, after in zip(run_model(model, data), run_model(upcast, data)):
        for name in ("y", "z"):
            assert after[name].dtype == np.float16
            np.testing.assert_allclose(after[name], before[name], rtol=2e-3)


def test_a_float16_control_flow_body_is_left_as_it_is_with_the_reason():
    then = helper.make_graph([helper.make_node("Identity", ["c16"], ["out"])], "then", [],
                             [helper.make_tensor_value_info("out", TensorProto.FLOAT16, [1])],
                             [numpy_helper.from_array(np.array([1.0], np.float16), "c16")])
    other = helper.make_graph([helper.make_node("Identity", ["c16b"], ["out2"])], "else", [],
                              [helper.make_tensor_value_info("out2", TensorProto.FLOAT16, [1])],
                              [numpy_helper.from_array(np.array([2.0], np.float16), "c16b")])
    graph = helper.make_graph([helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other)], "g",
                              [helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    upcast, record = float32_copy.to_float32(model, [], threads=1)
    assert upcast is model and not record["applied"] and "control-flow" in record["why"]


def test_a_float32_model_holds_no_float16():
    assert float32_copy.other_floats(classifier()) == []
    assert float32_copy.other_floats(float16.convert_float_to_float16(classifier(), keep_io_types=True)) == ["float16"]
    assert float32_copy.other_floats(float64(classifier())) == ["float64"]


def test_the_fp16_backend_passes_a_float16_model_through_with_the_reason(tmp_path):
    """onnxconverter-common refuses to convert a model that holds float16 ("already converted"): it was an
    internal error (exit 3)."""
    model = float16.convert_float_to_float16(classifier(), keep_io_types=True)
    report = run_on_samples(tmp_path, model, samples(np.float32, 4), [{"quantize": {"backend": "fp16"}}])
    stage = next(s for s in report["stages"] if s["name"] == "quantize")
    assert stage["status"] == "skipped" and "already holds float16" in stage["reason"]
    assert report["status"] == "ok"


def test_a_copy_that_computes_something_else_is_not_used(monkeypatch):
    """The check behind the rewrite: a copy whose outputs differ from the float16 model's (here a rewrite that
    lost a weight's sign) is left unused, with the figure. (ONNX Runtime's CPU runs float16 ops in float32 and
    drops the casts between them, so float16 rounding alone does not move the outputs there.)"""
    rewrite = float32_copy._rewritten

    def sign_lost(model):
        copy = rewrite(model)
        weight = next(t for t in copy.graph.initializer if t.name == "fc")
        weight.CopyFrom(numpy_helper.from_array(-numpy_helper.to_array(weight), "fc"))
        return copy

    monkeypatch.setattr(float32_copy, "_rewritten", sign_lost)
    model = float16.convert_float_to_float16(classifier(), keep_io_types=False)
    kept, record = float32_copy.to_float32(model, samples(np.float16, 2), threads=1)
    assert kept is model and not record["applied"]
    assert record["cosine_min"] < 0.99 and "differ from the float16 model" in record["why"]


def mlp_samples(count=8):
    return [{"x": rand(1, 16, seed=i).astype(np.float64)} for i in range(count)]


def test_a_float64_model_is_quantized_with_its_interface_kept(tmp_path):
    report = run_on_samples(tmp_path, float64(mlp()), mlp_samples(), [{"quantize": {"backend": "ort"}}])
    stage = next(s for s in report["stages"] if s["name"] == "quantize")
    assert stage["float32_copy"]["applied"] and stage["float32_copy"]["from"] == "float64"
    assert stage["op_counts_after"].get("QuantizeLinear", 0) >= 2  # before: none, and the run said ok
    result = onnx.load(str(tmp_path / "out" / "model.onnx"))
    assert [v.type.tensor_type.elem_type for v in [*result.graph.input, *result.graph.output]] == [TensorProto.DOUBLE] * 2
    assert not any("quantized nothing" in w for w in report["warnings"])
    assert report["evaluation"]["outputs"]["y"]["cosine_mean"] > 0.99
    assert "float64 model: quantized from its float32 copy (2 float64 weights, rounded" in \
        (tmp_path / "out" / "report.md").read_text()


def test_the_fp16_backend_passes_a_float64_model_through_with_the_reason(tmp_path):
    """onnxconverter-common converts float32 only: the run said ok over float64 weights left as they were."""
    report = run_on_samples(tmp_path, float64(mlp()), mlp_samples(4), [{"quantize": {"backend": "fp16"}}])
    stage = next(s for s in report["stages"] if s["name"] == "quantize")
    assert stage["status"] == "skipped" and "computes in float64" in stage["reason"]


def test_a_float32_model_that_casts_to_float64_inside_is_not_copied():
    model = mlp()
    model.graph.node.extend([helper.make_node("Cast", ["y"], ["y64"], to=TensorProto.DOUBLE),
                             helper.make_node("Cast", ["y64"], ["y32"], to=TensorProto.FLOAT)])
    assert float32_copy.other_floats(model) == []
