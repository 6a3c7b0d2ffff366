"""uint8 weights that ONNX Runtime's integer kernels accept: symmetric, one zero point (128) for every channel.

Why: ORT's quantizer makes uint8 weights asymmetric by default, one zero point per output channel, and its CPU
QLinearConv (what a QDQ Conv runs as) refuses those ("zero point of per-channel filter must be same"):
`weight_type: uint8` failed on EfficientNet-Lite0's first Conv. Symmetric (WeightSymmetric) gives 128 to every
channel but one whose weights are all zero, which ORT gives zero point 0 and scale 1; such a channel is written
as 128s with zero point 128, the same zeros. uint8 weights are what a CPU without VNNI runs exactly: its u8s8
kernels saturate (saturation.py), its u8u8 kernels widen to 16 bits first.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

ZERO_POINT = 128  # the middle of uint8: symmetric weights around it
# where a per-channel weight and its zero points are read: op type → (weight input, zero point input)
WEIGHT_READERS = {"DequantizeLinear": (0, 2), "QLinearConv": (3, 5)}


def quantizer_options(extra_options: dict) -> dict:
    """ORT's extra_options with symmetric weights, unless the config sets WeightSymmetric itself."""
    return {"WeightSymmetric": True, **extra_options}


def equal_zero_points(model: onnx.ModelProto) -> int:
    """Give all-zero channels of per-channel uint8 weights the zero point of the others (ZERO_POINT), in place;
    returns how many channels moved. Their dequantized values stay zero."""
    inits = {t.name: t for t in model.graph.initializer}
    moved = 0
    for node in model.graph.node:
        if node.op_type not in WEIGHT_READERS or len(node.input) <= WEIGHT_READERS[node.op_type][1]:
            continue
        weight_at, zero_at = WEIGHT_READERS[node.op_type]
        weight, zero = inits.get(node.input[weight_at]), inits.get(node.input[zero_at])
        if weight is None or zero is None or weight.data_type != onnx.TensorProto.UINT8:
            continue
        points = numpy_helper.to_array(zero)
        if points.ndim != 1 or len(set(points.tolist())) < 2:
            continue
        axis = 0 if node.op_type == "QLinearConv" else next((a.i for a in node.attribute if a.name == "axis"), 1)
        integers = np.moveaxis(numpy_helper.to_array(weight), axis, 0).copy()
        empty = [c for c in range(points.size) if points[c] != ZERO_POINT and np.all(integers[c] == points[c])]
        if not empty:
            continue
        integers[empty], points = ZERO_POINT, points.copy()
        points[empty] = ZERO_POINT
        weight.CopyFrom(numpy_helper.from_array(np.moveaxis(integers, 0, axis), weight.name))
        zero.CopyFrom(numpy_helper.from_array(points, zero.name))
        moved += len(empty)
    return moved
