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


# ONNX Runtime contrib ops the optimize passes write whose output has the input's shape and type. ONNX's shape
# inference does not know them and would stop there (every shape after a fused GELU unknown), so during
# inference they stand in as Identity.
MS_DOMAIN = "com.microsoft"  # ONNX Runtime's contrib ops
FLOAT_TYPES = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE})
SHAPE_KEEPING_CONTRIB_OPS = frozenset({(MS_DOMAIN, "Gelu"), (MS_DOMAIN, "FastGelu"), (MS_DOMAIN, "QuickGelu")})


def infer_shapes(model: ir.Model) -> bool:
    """Recompute shapes from the inputs after rewrites; never fatal. Returns success.

    Stale shapes are cleared first: a shape inferred before a rewrite (e.g. `unk__` dims behind a Pad whose
    pads were computed) would otherwise survive and hide what inference can now prove.
    """
    from onnx_ir.passes.common import ShapeInferencePass

    stand_ins = []
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        for output in node.outputs:
            if not output.is_graph_output():
                output.shape = None
        if (node.domain, node.op_type) in SHAPE_KEEPING_CONTRIB_OPS and len(node.inputs) == 1:
            stand_ins.append((node, node.domain, node.op_type, node.version, dict(node.attributes)))
            node.domain, node.op_type, node.version = "", "Identity", None
            node.attributes.clear()
    try:
        ShapeInferencePass(check_type=False, strict_mode=False, data_prop=True)(model)
        return True
    except Exception:  # noqa: BLE001 - inference failure only means fewer rules can prove their checks
        return False
    finally:
        for node, domain, op_type, version, attributes in stand_ins:
            node.domain, node.op_type, node.version = domain, op_type, version
            node.attributes.update(attributes)

