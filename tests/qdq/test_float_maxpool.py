"""float_maxpool on tiny graphs: which MaxPools become Reshape + ReduceMax, and that no number changes."""

import numpy as np
import onnx
import pytest
from onnx import helper

from graphs import make_model
from qprep.qdq import float_maxpool
from qprep.model.runtime import run_model


def _model(opset: int, shape: list[int], **attrs) -> onnx.ModelProto:
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("MaxPool", ["r"], ["y"], name="pool", **attrs)]
    return make_model(nodes, [("x", shape)], [("y", ["n", "c", "h", "w"])], opset=opset, infer_shapes=False)


def _samples(shape, count=3):
    rng = np.random.default_rng(0)
    return [{"x": rng.standard_normal(shape).astype(np.float32)} for _ in range(count)]


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("kernel", [[2, 2], [1, 3]])
def test_non_overlapping_maxpool_becomes_reshape_reducemax_with_identical_outputs(opset, kernel):
    shape = [1, 5, 4, 6]
    model = _model(opset, shape, kernel_shape=kernel, strides=kernel)
    rewritten, count = float_maxpool.rewrite(model, _samples(shape))
    assert count == 1
    assert [n.op_type for n in rewritten.graph.node] == ["Relu", "Reshape", "ReduceMax"]
    samples = _samples(shape)
    for expected, actual in zip(run_model(model, samples), run_model(rewritten, samples)):
        np.testing.assert_array_equal(actual["y"], expected["y"])
    onnx.checker.check_model(rewritten)


@pytest.mark.parametrize("attrs, shape", [
    ({"kernel_shape": [3, 3], "strides": [2, 2]}, [1, 2, 7, 7]),  # overlapping windows
    ({"kernel_shape": [2, 2], "strides": [2, 2]}, [1, 2, 5, 6]),  # 2 does not divide 5 (floor drops a row)
    ({"kernel_shape": [2, 2], "strides": [2, 2], "pads": [1, 1, 1, 1]}, [1, 2, 4, 4]),
    ({"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1}, [1, 2, 4, 4]),
])
def test_other_maxpools_are_left_alone(attrs, shape):
    model = _model(13, shape, **attrs)
    rewritten, count = float_maxpool.rewrite(model, _samples(shape))
    assert count == 0 and rewritten is model


def test_dynamic_dims_are_left_alone():
    model = _model(13, [1, 2, "h", 4], kernel_shape=[2, 2], strides=[2, 2])
    assert float_maxpool.rewrite(model, _samples([1, 2, 4, 4]))[1] == 0
