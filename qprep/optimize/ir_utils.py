"""Small helpers over onnx_ir shared by the rules: constants, opset, shape inference (rule infrastructure: rules.py)."""

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

