"""fuse_softmax: jax2tf's written-out softmax (keepdims dropped and restored, max(−inf, ·), axes as attribute or
input) becomes one Softmax with the same numbers; reductions over another axis, a shape that is not restored and
an intermediate read elsewhere are left alone for their reason."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import helper, numpy_helper

from qprep.model.runtime import run_model
from qprep.optimize.passes import PassSettings
from qprep.optimize.passes.softmax import PASS

SHAPE = [1, 2, 4, 4]  # square rows: a Reshape to [1, 2, 1, 4] is a valid model, only the numbers differ


def written_out(opset: int = 13, keepdims: int = 0, bound: bool = True, max_axis: int = -1,
                restore_shape=(1, 2, 4, 1), extra_output: bool = False) -> onnx.ModelProto:
    """y = softmax(x) as jax2tf writes it: ReduceMax (keepdims 0) → Max(−inf, ·) → Reshape → Sub → Exp;
    ReduceSum (keepdims 0) → Reshape → Div. Axes as attributes below opset 18 (ReduceSum: input from 13)."""
    inits = [numpy_helper.from_array(np.array(-np.inf, np.float32), "minus_inf"),
             numpy_helper.from_array(np.array(restore_shape, np.int64), "row_shape"),
             numpy_helper.from_array(np.array([-1], np.int64), "last")]
    max_attrs = {"keepdims": keepdims, **({"axes": [max_axis]} if opset < 18 else {})}
    max_inputs = ["x"] if opset < 18 else ["x", "max_axes"]
    if opset >= 18:
        inits.append(numpy_helper.from_array(np.array([max_axis], np.int64), "max_axes"))
    nodes = [helper.make_node("ReduceMax", max_inputs, ["row_max"], name="/attn/ReduceMax", **max_attrs)]
    shift = "row_max"
    if bound:
        nodes.append(helper.make_node("Max", ["minus_inf", shift], ["row_max_bounded"], name="/attn/Max"))
        shift = "row_max_bounded"
    if not keepdims:
        nodes.append(helper.make_node("Reshape", [shift, "row_shape"], ["row_max_kept"], name="/attn/Reshape"))
        shift = "row_max_kept"
    nodes += [helper.make_node("Sub", ["x", shift], ["shifted"], name="/attn/Sub"),
              helper.make_node("Exp", ["shifted"], ["numerator"], name="/attn/Exp"),
              helper.make_node("ReduceSum", ["numerator", "last"], ["row_sum"], keepdims=keepdims,
                               name="/attn/ReduceSum")]
    total = "row_sum"
    if not keepdims:
        nodes.append(helper.make_node("Reshape", [total, "row_shape"], ["row_sum_kept"], name="/attn/Reshape_1"))
        total = "row_sum_kept"
    nodes.append(helper.make_node("Div", ["numerator", total], ["y"], name="/attn/Div"))
    outputs = [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, SHAPE)]
    if extra_output:
        outputs.append(helper.make_tensor_value_info("numerator", onnx.TensorProto.FLOAT, SHAPE))
    graph = helper.make_graph(nodes, "softmax", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, SHAPE)],
                              outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def fuse(proto: onnx.ModelProto):
    model = ir.from_proto(proto)
    outcome = PASS.apply(model, PassSettings())
    return outcome, ir.to_proto(model)


def scores() -> list[dict]:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(SHAPE) * 4).astype(np.float32)
    x[..., -2:] = -1e4  # masked keys, as an additive mask leaves them
    return [{"x": x}]


@pytest.mark.parametrize("opset, keepdims, bound", [(13, 0, True), (13, 1, False), (18, 0, True), (18, 1, True)])
def test_a_written_out_softmax_becomes_one_softmax_with_the_same_numbers(opset, keepdims, bound):
    proto = written_out(opset, keepdims, bound)
    outcome, fused = fuse(proto)
    assert outcome.matches == 1 and outcome.details == {"fused": 1}
    assert [(n.op_type, n.name) for n in fused.graph.node] == [("Softmax", "/attn/Softmax")]
    assert fused.graph.output[0].name == "y"
    onnx.checker.check_model(fused, full_check=True)
    np.testing.assert_allclose(run_model(fused, scores())[0]["y"], run_model(proto, scores())[0]["y"], atol=1e-6)


@pytest.mark.parametrize("variant, reason", [
    ({"max_axis": 2}, "ReduceMax is not over the last axis alone"),
    ({"restore_shape": (1, 2, 1, 4)}, "Reshape '/attn/Reshape_1' does not restore the last axis as 1"),
    ({"extra_output": True}, "Exp '/attn/Exp' is read outside the softmax"),
])
def test_near_misses_are_left_alone_for_their_reason(variant, reason):
    proto = written_out(**variant)
    outcome, fused = fuse(proto)
    assert outcome.matches == 0 and outcome.details["refused"] == {reason: 1}
    assert fused.graph.node[-1].op_type == "Div"
