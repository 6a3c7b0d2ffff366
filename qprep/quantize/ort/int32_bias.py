"""int32 biases that hold their value: a channel whose bias does not fit the int32 grid gets a coarser weight scale.

Why: a QDQ Conv/Gemm bias is stored as int32 on the scale input scale × weight scale. A channel whose weights are
(nearly) zero — a channel switched off by its BatchNorm, folded into the Conv — has a tiny weight scale, so its
bias, often the channel's whole output, would need more than 2³¹ steps: ONNX Runtime's quantizer then clips it
("Quantized bias … exceeds the range of a int32") and the channel outputs ~0 instead of its constant. The
quantizer raises such a channel's weight scale itself, but only for int8/int16 weights; with uint8 weights
(`weight_type: auto` on CPUs without VNNI) it clips, and a switched-off channel loses the constant it outputs
(BENCHMARKS.md: "int32 biases that hold their value").

The fix is the quantizer's own rule for int8: scale the channel's weight scale (and so its bias scale) up just
enough that the bias fits, and round that channel's weights and bias again from the float model. Such a channel's
weights round to (nearly) zero either way; its bias is then exact to int32 precision.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

LAYER_OPS = ("Conv", "ConvTranspose", "Gemm")  # weight input 1, bias input 2
INT32_STEPS = float(np.iinfo(np.int32).max)
MARGIN = 1.0001  # the bias lands just inside the int32 range, as the quantizer's own adjustment does


def fit_biases(qdq_model: onnx.ModelProto, float_model: onnx.ModelProto) -> int:
    """Re-scale, in place, the channels whose int32 bias would not hold the float model's bias; returns how many.
    Layers are matched by node name to `float_model` (the model that was quantized)."""
    inits = {t.name: t for t in qdq_model.graph.initializer}
    float_inits = {t.name: t for t in float_model.graph.initializer}
    float_nodes = {n.name: n for n in float_model.graph.node}
    producer = {o: n for n in qdq_model.graph.node for o in n.output}
    readers: dict[str, int] = {}
    for node in qdq_model.graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    rescaled = 0
    for node in qdq_model.graph.node:
        original = float_nodes.get(node.name)
        if node.op_type not in LAYER_OPS or len(node.input) < 3 or original is None or len(original.input) < 3:
            continue
        dqs = [producer.get(name) for name in node.input[:3]]
        if any(dq is None or dq.op_type != "DequantizeLinear" for dq in dqs):
            continue
        parts = _parts(dqs[1], dqs[2], inits, readers)
        float_weight, float_bias = (float_inits.get(original.input[1]), float_inits.get(original.input[2]))
        if parts is None or float_weight is None or float_bias is None or dqs[0].input[1] not in inits:
            continue
        out_axis = _output_axis(node)
        if out_axis is not None:
            rescaled += _fit(parts, numpy_helper.to_array(inits[dqs[0].input[1]]), numpy_helper.to_array(float_weight),
                             numpy_helper.to_array(float_bias), out_axis)
    return rescaled


def _output_axis(node: onnx.NodeProto) -> int | None:
    """The weight axis that indexes the bias's channels (None where one does not: grouped ConvTranspose)."""
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    if node.op_type == "Conv":
        return 0
    if node.op_type == "ConvTranspose":
        return 1 if attrs.get("group", 1) == 1 else None
    return 0 if attrs.get("transB", 0) else 1


def _parts(weight_dq: onnx.NodeProto, bias_dq: onnx.NodeProto, inits: dict, readers: dict) -> dict | None:
    """The initializers a re-scale rewrites, when they belong to this layer alone."""
    names = {"weight": weight_dq.input[0], "weight_scale": weight_dq.input[1], "bias": bias_dq.input[0],
             "bias_scale": bias_dq.input[1]}
    if len(weight_dq.input) > 2 and weight_dq.input[2]:
        names["weight_zero"] = weight_dq.input[2]
    if any(name not in inits or readers.get(name) != 1 for name in names.values()):
        return None
    if inits[names["bias"]].data_type != onnx.TensorProto.INT32:
        return None
    parts = {key: inits[name] for key, name in names.items()}
    parts["axis"] = next((a.i for a in weight_dq.attribute if a.name == "axis"), 1)
    return parts


def _fit(parts: dict, input_scale: np.ndarray, weight: np.ndarray, bias: np.ndarray, out_axis: int) -> int:
    stored_shape = tuple(parts["weight_scale"].dims)  # () for a per-tensor scale
    weight_scale = numpy_helper.to_array(parts["weight_scale"]).astype(np.float32).reshape(-1)
    integers = numpy_helper.to_array(parts["weight"])
    channels = bias.size
    if (input_scale.size != 1 or integers.shape != weight.shape or bias.ndim != 1
            or weight.shape[out_axis] != channels):
        return 0
    if weight_scale.size not in (1, channels) or (weight_scale.size > 1 and parts["axis"] % weight.ndim != out_axis):
        return 0
    if numpy_helper.to_array(parts["bias_scale"]).size != weight_scale.size:  # not input scale × weight scale
        return 0
    needed = MARGIN * np.abs(bias.astype(np.float64)) / INT32_STEPS  # the finest bias scale that holds the bias
    bias_scale = input_scale.astype(np.float64).item() * weight_scale.astype(np.float64)
    ratio = np.where(bias_scale > 0, needed / np.maximum(bias_scale, np.finfo(np.float64).tiny), 1.0)
    if weight_scale.size == 1:
        ratio = np.array([ratio.max()])
    low = np.flatnonzero(ratio > 1)
    if low.size == 0:
        return 0
    weight_scale = weight_scale.copy()
    weight_scale[low] = (weight_scale[low].astype(np.float64) * ratio[low]).astype(np.float32)
    _requantize_weight(parts, weight, integers, weight_scale, out_axis, low if weight_scale.size > 1 else None)
    new_bias_scale = (input_scale.astype(np.float32).reshape(()) * weight_scale).astype(np.float32)
    old_scale = numpy_helper.to_array(parts["bias_scale"])
    integers_bias = np.clip(np.round(bias.astype(np.float64) / new_bias_scale.astype(np.float64)),
                            -INT32_STEPS - 1, INT32_STEPS).astype(np.int32)
    parts["bias"].CopyFrom(numpy_helper.from_array(integers_bias, parts["bias"].name))
    parts["bias_scale"].CopyFrom(numpy_helper.from_array(new_bias_scale.reshape(old_scale.shape),
                                                         parts["bias_scale"].name))
    parts["weight_scale"].CopyFrom(numpy_helper.from_array(weight_scale.reshape(stored_shape),
                                                           parts["weight_scale"].name))
    return int(low.size) if weight_scale.size > 1 else channels


def _requantize_weight(parts: dict, weight: np.ndarray, integers: np.ndarray, scale: np.ndarray, out_axis: int,
                       channels: np.ndarray | None) -> None:
    """Round the float weight of `channels` (all: None) again on the new scale; zero points unchanged."""
    zero = (numpy_helper.to_array(parts["weight_zero"]).astype(np.float64) if "weight_zero" in parts
            else np.zeros(scale.shape))
    shape = [1] * weight.ndim
    if scale.size > 1:
        shape[out_axis] = -1
    info = np.iinfo(integers.dtype)
    values = np.round(weight.astype(np.float64) / scale.astype(np.float64).reshape(shape)) + zero.reshape(
        shape if zero.size > 1 else [1] * weight.ndim)
    requantized = np.clip(values, info.min, info.max).astype(integers.dtype)
    if channels is not None:
        kept = np.moveaxis(integers.copy(), out_axis, 0)
        kept[channels] = np.moveaxis(requantized, out_axis, 0)[channels]
        requantized = np.moveaxis(kept, 0, out_axis)
    parts["weight"].CopyFrom(numpy_helper.from_array(requantized, parts["weight"].name))
