"""Tiny hand-built graphs for the tests: build one, apply a pass, compare with ONNX Runtime."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper, numpy_helper

from qprep.optimize.passes import PassSettings
from qprep.model.runtime import run_model


def make_model(nodes, inputs, outputs, initializers=(), opset=13) -> onnx.ModelProto:
    """inputs/outputs: (name, shape) pairs of float32 tensors; initializers: name → array."""
    graph = helper.make_graph(
        nodes, "t", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in dict(initializers).items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    return onnx.shape_inference.infer_shapes(model)


def apply_pass(graph_pass, model: onnx.ModelProto, settings: PassSettings | None = None):
    """(rewritten proto, outcome); the input proto is left untouched."""
    ir_model = ir.from_proto(model)
    outcome = graph_pass.apply(ir_model, settings or PassSettings())
    return ir.to_proto(ir_model), outcome


def ops(model: onnx.ModelProto) -> Counter:
    return Counter(n.op_type for n in model.graph.node)


def max_diff(a: onnx.ModelProto, b: onnx.ModelProto, feeds: dict) -> float:
    ra, rb = run_model(a, [feeds])[0], run_model(b, [feeds])[0]
    return max(float(np.abs(ra[k].astype(np.float64) - rb[k]).max()) for k in ra)


def rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
