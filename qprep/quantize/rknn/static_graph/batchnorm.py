"""BatchNormalization over statistics computed at run time → arithmetic.

Facts (rknn-toolkit2 2.5.0): where a BatchNormalization's mean/variance are computed at run time (tf2onnx writes
a Keras LayerNormalization as FusedBatchNormV3 over statistics it computes: magika), the build dies with SIGSEGV
after "I rknn building ..." (at optimization_level 0 too, and without quantization); with constant statistics
the same graph builds. Rewritten as (x - mean) / sqrt(var + eps) * scale + bias, the per-channel inputs reshaped
to [C, 1, ...].
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qprep.errors import ModelError
from qprep.model.info import constant_names, iter_nodes, unique_name
from qprep.model.io import inferred_shapes
from qprep.quantize.rknn.io_names import all_names
from qprep.quantize.rknn.static_graph.edit import replace_node, value_shapes


def is_runtime_batchnorm(node: onnx.NodeProto, constants: set[str]) -> bool:
    """A BatchNormalization with an input computed at run time (constant ones the toolkit folds)."""
    return (node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx")
            and not all(name in constants for name in node.input[1:5]))


def batchnorms_as_arithmetic(model: onnx.ModelProto) -> list[str]:
    graph = model.graph
    constants = constant_names(graph)
    if not any(is_runtime_batchnorm(n, constants) for n in graph.node):
        return []
    shapes = value_shapes(inferred_shapes(model, shapes_only=True))
    taken = all_names(model) | {n.name for n in iter_nodes(graph)}
    done = []
    for index in reversed(range(len(graph.node))):
        node = graph.node[index]
        if not is_runtime_batchnorm(node, constants):
            continue
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        rank = len(shapes[node.input[0]]) if shapes.get(node.input[0]) is not None else None
        if attributes.get("training_mode", 0) or len([o for o in node.output if o]) > 1 or not rank or rank < 2:
            raise ModelError(f"quantize.rknn: node '{node.name}' is a BatchNormalization over statistics computed "
                             "at run time, which crashes rknn-toolkit2, and qprep cannot rewrite this one (training "
                             "mode, running-statistics outputs or an input of unknown rank): export it in eval mode")
        replacement = _arithmetic(node, rank, attributes.get("epsilon", 1e-5), taken, graph)
        replace_node(graph, index, replacement)
        done.append(node.name)
    return done[::-1]


def _arithmetic(node: onnx.NodeProto, rank: int, epsilon: float, taken: set[str],
                graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """(x - mean) / sqrt(var + eps) * scale + bias, the [C] inputs reshaped to [C, 1, ...] against x's axis 1."""
    x, scale, bias, mean, var = node.input[:5]

    def name(what: str) -> str:
        return unique_name(f"{node.name}/{what}", taken)

    nodes = []
    if rank > 2:
        shape = name("channel_shape")
        graph.initializer.append(numpy_helper.from_array(np.array([-1] + [1] * (rank - 2), np.int64), shape))
        channels = {}
        for key, value in (("scale", scale), ("bias", bias), ("mean", mean), ("var", var)):
            channels[key] = name(f"{key}_per_channel")
            nodes.append(helper.make_node("Reshape", [value, shape], [channels[key]], name=name(f"reshape_{key}")))
        scale, bias, mean, var = channels["scale"], channels["bias"], channels["mean"], channels["var"]
    eps = name("epsilon")
    graph.initializer.append(numpy_helper.from_array(np.array(epsilon, np.float32), eps))
    centered, shifted, deviation, normalized, scaled = (name(w) for w in ("centered", "var_eps", "std", "normalized",
                                                                          "scaled"))
    nodes += [helper.make_node("Sub", [x, mean], [centered], name=name("sub_mean")),
              helper.make_node("Add", [var, eps], [shifted], name=name("add_epsilon")),
              helper.make_node("Sqrt", [shifted], [deviation], name=name("sqrt")),
              helper.make_node("Div", [centered, deviation], [normalized], name=name("div_std")),
              helper.make_node("Mul", [normalized, scale], [scaled], name=name("mul_scale")),
              helper.make_node("Add", [scaled, bias], [node.output[0]], name=name("add_bias"))]
    return nodes

