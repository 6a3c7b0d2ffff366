"""What a graph's constants say, read without running it (correspondence.py's proofs rest on them): a stored
or dequantized constant's value and the rounding step it may carry, a Q/DQ node's grid, whether a
QuantizeLinear's range clamps where a Relu/Clip does, two constants equal within rounding, attributes up to
their defaults.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from qprep.model.info import attribute

INTEGER_RANGES = {onnx.TensorProto.UINT8: (0, 255), onnx.TensorProto.INT8: (-128, 127),
                  onnx.TensorProto.UINT16: (0, 65535), onnx.TensorProto.INT16: (-32768, 32767)}
SMALL = 4096  # constants compared by value for a structural twin up to this many elements, else by name
LARGE = 1 << 20  # a twin's constants are read up to this many elements (a LayerNorm's gamma, a bias)


def constant_value(values: dict, producer: dict, name: str) -> tuple[np.ndarray, np.ndarray] | None:
    """(value, grid step) of a stored constant (step 0) or a DequantizeLinear of stored constants (its scale:
    the rounding moved each value by at most half of it); None otherwise."""
    if name in values:
        value = read_array(values, name, LARGE)
        return None if value is None else (value, np.zeros(()))
    node = producer.get(name)
    if node is None or node.op_type != "DequantizeLinear" or len(node.input) < 2:
        return None
    parts = [read_array(values, i, LARGE) for i in node.input[:3]]
    if any(p is None for p in parts):
        return None
    q, scale = parts[0].astype(np.float64), parts[1].astype(np.float64)
    zero = parts[2].astype(np.float64) if len(parts) > 2 else np.zeros_like(scale)
    if scale.size > 1:  # per axis
        axis = attribute(node, "axis", 1) % q.ndim
        shape = [1] * q.ndim
        shape[axis] = scale.size
        scale, zero = scale.reshape(shape), zero.reshape(shape)
    return (q - zero) * scale, np.broadcast_to(scale, q.shape)


def q_grid(values: dict, node: onnx.NodeProto) -> tuple | None:
    """A Q/DQ node's (scale, zero point) as comparable bytes, None if either is not a stored constant."""
    arrays = [read_array(values, node.input[i]) if len(node.input) > i else np.zeros((), np.uint8) for i in (1, 2)]
    if any(a is None for a in arrays):
        return None
    return tuple((a.dtype.str, a.shape, a.tobytes()) for a in arrays)


def clamps_like(q: onnx.NodeProto, activation: onnx.NodeProto, values: dict, float_values: dict) -> bool:
    """The QuantizeLinear's representable range clamps at or inside each bound the activation has (within one
    step of the grid): clamping tighter is the calibrated range's choice, an error the comparison should see;
    a range reaching past the bound would let through values the activation cuts off."""
    scale, zero = (read_array(values, q.input[i]) if len(q.input) > i else None for i in (1, 2))
    if scale is None or scale.size != 1 or (zero is not None and zero.size != 1):
        return False
    dtype = (values[q.input[2]].data_type if zero is not None else onnx.TensorProto.UINT8)
    if dtype not in INTEGER_RANGES:
        return False
    step, z = float(scale.reshape(-1)[0]), int(zero.reshape(-1)[0]) if zero is not None else 0
    low, high = ((q_end - z) * step for q_end in INTEGER_RANGES[dtype])
    bounds = activation_bounds(activation, float_values)
    if bounds is None:
        return False
    lo, hi = bounds
    return (lo is None or low >= lo - step) and (hi is None or high <= hi + step)


def activation_bounds(activation: onnx.NodeProto, values: dict) -> tuple[float | None, float | None] | None:
    """(lower, upper) clamp of a Relu/Clip, None for an open side; None if a bound is not a constant."""
    if activation.op_type == "Relu":
        return 0.0, None
    found: list[float | None] = [None, None]
    for item in activation.attribute:  # opset < 11
        if item.name in ("min", "max"):
            found[item.name == "max"] = item.f
    for index in (1, 2):
        if len(activation.input) > index and activation.input[index]:
            array = read_array(values, activation.input[index])
            if array is None or array.size != 1:
                return None
            found[index - 1] = float(array.reshape(-1)[0])
    return found[0], found[1]


def within_rounding(ours: np.ndarray, theirs: np.ndarray, tolerance: np.ndarray | float = 0.0) -> bool:
    """Equal within `tolerance` (the rounding a grid allows) and float error. An infinity on both sides (a mask's
    -inf) gives NaN, which compares unequal as before; numpy's warning about it is no news to a user."""
    with np.errstate(invalid="ignore"):
        return bool(np.all(np.abs(ours - theirs) <= np.asarray(tolerance) * 1.001
                           + 1e-5 * np.max(np.abs(theirs), initial=0.0) + 1e-12))


def read_array(values: dict, name: str, limit: int = SMALL) -> np.ndarray | None:
    tensor = values.get(name) if name else None
    return None if tensor is None or element_count(tensor) > limit else numpy_helper.to_array(tensor)


def element_count(tensor: onnx.TensorProto) -> int:
    return int(np.prod(tensor.dims)) if tensor.dims else 1


def op_attributes(node: onnx.NodeProto) -> dict[str, bytes]:
    """The node's attributes, those set to the op's default left out (an exporter writes allowzero=0)."""
    try:
        defaults = onnx.defs.get_schema(node.op_type, domain=node.domain).attributes
    except onnx.defs.SchemaError:
        defaults = {}
    found = {}
    for a in node.attribute:
        default = defaults.get(a.name)
        if default is not None and default.default_value.type and value_bytes(default.default_value) == value_bytes(a):
            continue
        found[a.name] = value_bytes(a)
    return found


def value_bytes(a: onnx.AttributeProto) -> bytes:
    copy = onnx.AttributeProto()
    copy.CopyFrom(a)
    copy.name, copy.doc_string = "", ""
    return copy.SerializeToString()
