"""The operands of a quantized Conv/MatMul as the fusion rules read them from the graph: the dequantized activation,
weight and bias, their quantization parameters, the activation between Conv and Q, and the values a rewrite adds
(constants, zero points, probes). Each reader returns the operand or the reason it cannot be used."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from qprep.graph.ir import constant_array
from qprep.graph.rules import unique_value_name
from qprep.model.saturation import u8s8_saturates
from qprep.qdq.params import (
    EIGHT_BIT,
    QParams,
    constant_weight,
    consumers,
    producer,
    qparams,
    quantize_array,
    quantize_bias,
)
from qprep.qdq.verified import Probe


@dataclass
class ActivationOperand:
    """The quantized input: DQ(q) with per-tensor parameters."""

    dq: ir.Node
    params: QParams

    @property
    def quantized(self) -> ir.Value:
        return self.dq.inputs[0]


@dataclass
class WeightOperand:
    array: np.ndarray  # integers
    params: QParams
    how: str  # "integer constant" | "quantized from float (…)"
    dq: ir.Node


@dataclass
class BiasOperand:
    values: np.ndarray | None  # float32, as the QDQ graph computes them (None: no bias)
    integers: np.ndarray | None = None  # the int32 data of a DQ'd bias
    scale: np.ndarray | None = None  # its scale
    how: str = "none"


def activation_operand(value: ir.Value, role: str) -> ActivationOperand | str:
    dq = producer(value, "DequantizeLinear")
    if dq is None:
        return f"{role} is not dequantized"
    params = qparams(dq)
    if isinstance(params, str):
        return params
    if not params.per_tensor:
        return f"{role} is quantized per axis (the integer ops need one scale)"
    if params.dtype not in EIGHT_BIT:
        return f"{role} is {params.dtype.name.lower()} (8-bit only)"
    return ActivationOperand(dq, params)


def weight_operand(value: ir.Value, channel_axis: int) -> WeightOperand | str:
    found = constant_weight(value)
    if isinstance(found, str):
        return found
    array, params, how = found
    if params.dtype not in EIGHT_BIT:
        return f"weight is {params.dtype.name.lower()} (8-bit only)"
    axis = channel_axis if channel_axis >= 0 else array.ndim + channel_axis
    if not params.per_tensor and params.axis != axis:
        return f"weight is quantized along axis {params.axis}, not the output-channel axis {axis}"
    return WeightOperand(array, params, how, value.producer())


def bias_operand(value: ir.Value | None, channels: int) -> BiasOperand | str:
    if value is None:
        return BiasOperand(None)
    array = constant_array(value)
    if array is not None:
        return BiasOperand(array.astype(np.float32).reshape(-1), how="float")
    dq = producer(value, "DequantizeLinear")
    integers = constant_array(dq.inputs[0]) if dq is not None else None
    scale = constant_array(dq.inputs[1]) if dq is not None and len(dq.inputs) > 1 else None
    zero = constant_array(dq.inputs[2]) if dq is not None and len(dq.inputs) > 2 and dq.inputs[2] is not None else 0
    if integers is None or scale is None or zero is None:
        return "bias is neither a constant nor DequantizeLinear of constants"
    if np.any(np.asarray(zero) != 0):
        return "bias zero point is not 0"
    values = (integers.astype(np.float32) * scale.astype(np.float32)).reshape(-1)  # as DQ computes it
    if values.size != channels:
        return f"bias has {values.size} values for {channels} channels"
    return BiasOperand(values, integers.reshape(-1), scale, "int32")


def bias_int32(bias: BiasOperand, scale: np.ndarray, channels: int) -> tuple[np.ndarray | None, str]:
    """The int32 bias for accumulator scale `scale` (x_scale · w_scale), and how it was obtained."""
    if bias.values is None:
        return None, "none"
    target = np.broadcast_to(scale.astype(np.float32), (channels,))
    if bias.integers is not None and bias.integers.dtype == np.int32:
        same = np.broadcast_to(bias.scale.astype(np.float32).reshape(-1), (channels,))
        if same.tobytes() == target.tobytes():
            return bias.integers.astype(np.int32), "int32 kept"
        return quantize_bias(bias.values, target), "int32 requantized to x_scale·w_scale"
    return quantize_bias(bias.values, target), "quantized from float (as onnxruntime.quantization does)"


def channel_vector(value: ir.Value, channels: int) -> np.ndarray | None:
    """A 1-D per-channel constant (BatchNormalization's parameters) as float64 [C]."""
    array = constant_array(value)
    if array is None or array.size not in (1, channels):
        return None
    return np.broadcast_to(array.reshape(-1).astype(np.float64), (channels,))


def requantization(value: ir.Value) -> tuple[ir.Node | None, ir.Node] | None:
    """(Relu/Clip or None, Q) when `value` is read only by a Q, directly or through one Relu/Clip."""
    users = consumers(value)
    if len(users) != 1 or value.is_graph_output() or users[0].domain not in ("", "ai.onnx"):
        return None
    user = users[0]
    if user.op_type == "QuantizeLinear":
        return None, user
    if user.op_type in ("Relu", "Clip"):
        after = requantization(user.outputs[0])
        if after is not None and after[0] is None:
            return user, after[1]
    return None


def add_constant(op, graph: ir.Graph, array: np.ndarray, name: str) -> ir.Value:
    name = unique_value_name(graph, name)
    return op.initializer(ir.tensor(np.ascontiguousarray(array), name=name), name=name)


def add_zero_point(op, graph: ir.Graph, node: ir.Node, params: QParams, name: str) -> ir.Value:
    """The node's zero-point input, or an explicit one (the integer ops require it)."""
    if len(node.inputs) > 2 and node.inputs[2] is not None:
        return node.inputs[2]
    return add_constant(op, graph, params.zero_point, name)


# ---------------------------------------------------------------------------------------------------------
# Rules
# ---------------------------------------------------------------------------------------------------------



def activation_bounds(node: ir.Node | None, y: QParams, opset: int) -> tuple[str, tuple | None] | str:
    """How a Relu/Clip between Conv and Q is handled: ('none'|'absorbed …'|'kept … as integer Clip', bounds)."""
    if node is None:
        return "none", None
    if node.op_type == "Relu":
        low, high = 0.0, None
    else:
        low, high = clip_limits(node)
        if isinstance(low, str):
            return low
    q_low = int(quantize_array(np.array(low), y)) if low is not None else y.qmin
    q_high = int(quantize_array(np.array(high), y)) if high is not None else y.qmax
    if q_low <= y.qmin and q_high >= y.qmax:
        return f"absorbed {node.op_type} (a no-op under the output's saturation)", None
    if opset < 12:
        return f"{node.op_type} is not a no-op under the output range and integer Clip needs opset 12 (model: {opset})"
    return f"kept {node.op_type} as integer Clip [{q_low}, {q_high}]", (q_low, q_high)


def clip_limits(node: ir.Node) -> tuple:
    if len(node.inputs) == 1 and ("min" in node.attributes or "max" in node.attributes):  # Clip before opset 11
        return node.attributes.get_float("min", None), node.attributes.get_float("max", None)
    limits = []
    for index in (1, 2):
        value = node.inputs[index] if len(node.inputs) > index else None
        if value is None:
            limits.append(None)
            continue
        array = constant_array(value)
        if array is None or array.size != 1:
            return "Clip bounds are not constants", None
        limits.append(float(array.reshape(())))
    return tuple(limits)


def weight_inputs(op, graph: ir.Graph, weight: WeightOperand, base: str,
                  x_dtype: ir.DataType) -> tuple[ir.Value, ir.Value, ir.Value]:
    """Integer weight, scale and zero point values: the DQ's own when they are stored as needed."""
    dq = weight.dq
    if widens(weight, x_dtype):
        array, zero = widened(weight)
        return (add_constant(op, graph, array, f"{base}/weight_quantized_u8"), dq.inputs[1],
                add_constant(op, graph, zero, f"{base}/w_zero_point_u8"))
    if weight.how == "integer constant" and dq.inputs[0].is_initializer():
        zero = dq.inputs[2] if len(dq.inputs) > 2 and dq.inputs[2] is not None else \
            add_constant(op, graph, weight.params.zero_point, f"{base}/w_zero_point")
        return dq.inputs[0], dq.inputs[1], zero
    return (add_constant(op, graph, weight.array, f"{base}/weight_quantized"),
            add_constant(op, graph, weight.params.scale, f"{base}/weight_scale"),
            add_constant(op, graph, weight.params.zero_point, f"{base}/w_zero_point"))


def widens(weight: WeightOperand, x_dtype: ir.DataType) -> bool:
    """Do int8 weights beside uint8 inputs go in as uint8? Where this CPU's U8S8 kernels saturate
    (model/saturation.py): the fused op would not compute what the QDQ graph does, while the same
    values as uint8 run ORT's widening U8U8 kernel, exact on every CPU."""
    return weight.params.dtype == ir.DataType.INT8 and x_dtype == ir.DataType.UINT8 and u8s8_saturates()


def weight_types(x_dtype: ir.DataType, weight: WeightOperand) -> str:
    """The integer types of a fused op as its record says them, e.g. "uint8/int8"."""
    shown = "uint8 (int8 weights + 128: this CPU's u8s8 kernels saturate)" if widens(weight, x_dtype) \
        else weight.params.dtype.name.lower()
    return f"{x_dtype.name.lower()}/{shown}"


def widened(weight: WeightOperand) -> tuple[np.ndarray, np.ndarray]:
    """int8 weights and zero points as uint8, both moved by 128: w - zero_point is unchanged."""
    shift = lambda a: (np.asarray(a).astype(np.int16) + 128).astype(np.uint8)
    return shift(weight.array), shift(weight.params.zero_point)


def matmul_operands(node: ir.Node) -> dict | str:
    a = activation_operand(node.inputs[0], "input a")
    if isinstance(a, str):
        return a
    b = activation_operand(node.inputs[1], "input b")
    if isinstance(b, str):
        weight = weight_operand(node.inputs[1], -1)
        if isinstance(weight, str):
            return f"input b: {weight}"
        if weight.array.ndim != 2 and not weight.params.per_tensor:
            return "per-column b must be 2-D"
        b = weight
    if a.params.dtype == ir.DataType.INT8 and b.params.dtype != ir.DataType.INT8:
        return "int8 input a with uint8 b (no ONNX Runtime kernel)"
    return {"a": a, "b": b}


def b_inputs(op, graph, b, base, a_dtype: ir.DataType):
    if isinstance(b, ActivationOperand):
        return b.quantized, b.dq.inputs[1], add_zero_point(op, graph, b.dq, b.params, f"{base}/b_zero_point")
    return weight_inputs(op, graph, b, base, a_dtype)


def probe_inputs(a: ActivationOperand, b) -> list[str]:
    return [a.quantized.name] + ([b.quantized.name] if isinstance(b, ActivationOperand) else [])


def float_probe(x: ActivationOperand, requantized: ir.Node | None, output: str, accumulator_step: float,
                 extra: list[str] = ()) -> Probe:
    """Check at the Q after the op when there is one (1 integer step), else at the float output: one step of
    the int32 accumulator (x_scale·w_scale), plus float32 summation noise relative to the value."""
    inputs = [x.quantized.name, *extra]
    if requantized is not None:
        params = qparams(requantized)
        return Probe(inputs, requantized.outputs[0].name, atol=1.0,
                     unit=f"1 step of the output, scale {float(params.scale):.4g}")
    return Probe(inputs, output, atol=accumulator_step, rtol=1e-5,
                 unit=f"one int32 accumulator step {accumulator_step:.3g} (x_scale·w_scale) + 1e-5 relative")


def granularity(params: QParams) -> str:
    return "per-tensor" if params.per_tensor else f"per-channel ({params.scale.size})"
