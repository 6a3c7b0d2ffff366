"""Small helpers over onnx_ir shared by the passes: constants, opset, ranks."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from qprep.third_party import numpy_value


def constant_array(value: ir.Value | None) -> np.ndarray | None:
    """The value's array when it is a constant (initializer or Constant node) and not a graph input."""
    if value is None or value.is_graph_input():
        return None
    return numpy_value(value)


def default_opset(model: ir.Model) -> int:
    return model.opset_imports.get("", 0)


def infer_shapes(model: ir.Model) -> bool:
    """Recompute shapes from the inputs after rewrites; never fatal. Returns success.

    Stale shapes are cleared first: a shape inferred before a rewrite (e.g. `unk__` dims behind a Pad whose
    pads were computed) would otherwise survive and hide what inference can now prove.
    """
    from onnx_ir.passes.common import ShapeInferencePass

    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        for output in node.outputs:
            if not output.is_graph_output():
                output.shape = None
    try:
        ShapeInferencePass(check_type=False, strict_mode=False, data_prop=True)(model)
        return True
    except Exception:  # noqa: BLE001 - inference failure only means fewer rules can prove their checks
        return False


def first_free(wanted: str, taken: set[str]) -> str:
    """`wanted`, or `wanted_1`, `wanted_2`, … — the first one not in `taken`."""
    name, i = wanted, 1
    while name in taken:
        name, i = f"{wanted}_{i}", i + 1
    return name


def unique_node_name(graph: ir.Graph, wanted: str) -> str:
    """The first name like `wanted` that no node of the graph has."""
    return first_free(wanted, {n.name for n in graph})


def unique_value_name(graph: ir.Graph, wanted: str) -> str:
    """The first name like `wanted` that no value of the graph has (inputs, initializers, node outputs)."""
    return first_free(wanted, set(graph.initializers) | {v.name for n in graph for v in n.outputs}
                      | {v.name for v in graph.inputs})
