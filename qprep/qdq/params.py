"""Quantization parameters of Q/DQ nodes, read from the graph; constants quantized exactly as ONNX Runtime does.

A QuantizeLinear/DequantizeLinear node is `y = saturate(round(x / scale) + zero_point)` /
`x = (y - zero_point) * scale`, per tensor (one scale) or per axis (a 1-D scale along `axis`). Two nodes are
*identical* when type, axis, every scale bit and every zero point agree; only then is DQ→Q the identity.
A 1-element 1-D scale is per-tensor here, as in ONNX Runtime (IsScalarOr1ElementVector).

Also: small onnx_ir helpers the QDQ rules share (producer of a given op, dropping an Identity a rule created,
removing the nodes a rewrite left without consumers).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from qprep.graph.ir import constant_array

QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")
# Integer types the QDQ stages handle, with their saturation range (int4/float8 are left alone).
INTEGER_RANGES = {
    ir.DataType.UINT8: (0, 255), ir.DataType.INT8: (-128, 127),
    ir.DataType.UINT16: (0, 65535), ir.DataType.INT16: (-32768, 32767),
}
EIGHT_BIT = (ir.DataType.UINT8, ir.DataType.INT8)


@dataclass(frozen=True, eq=False)
class QParams:
    """scale (float, shape () per-tensor or (C,) per-axis), zero point (same shape, the quantized dtype), axis."""

    scale: np.ndarray
    zero_point: np.ndarray
    dtype: ir.DataType
    axis: int | None  # None: per-tensor

    @property
    def per_tensor(self) -> bool:
        return self.axis is None

    @property
    def qmin(self) -> int:
        return INTEGER_RANGES[self.dtype][0]

    @property
    def qmax(self) -> int:
        return INTEGER_RANGES[self.dtype][1]

    def same_as(self, other: "QParams") -> bool:
        """Identical parameters: DQ with these followed by Q with `other` is the identity."""
        return (self.dtype == other.dtype and self.axis == other.axis
                and self.scale.dtype == other.scale.dtype and self.scale.shape == other.scale.shape
                and self.scale.tobytes() == other.scale.tobytes()
                and np.array_equal(self.zero_point, other.zero_point))

    def describe(self) -> dict:
        """For records: type, axis and the (first) scale / zero point."""
        return {"dtype": self.dtype.name.lower(), "axis": self.axis,
                "scale": float(self.scale.reshape(-1)[0]), "zero_point": int(self.zero_point.reshape(-1)[0]),
                **({"channels": int(self.scale.size)} if self.axis is not None else {})}


def qparams(node: ir.Node) -> QParams | str:
    """The parameters of a QuantizeLinear/DequantizeLinear node, or a string saying why they are unusable."""
    if node.domain not in ("", "ai.onnx") or node.op_type not in QDQ_OPS:
        return f"{node.op_type} is not a QuantizeLinear/DequantizeLinear"
    if node.attributes.get_int("block_size", 0):
        return f"{node.name}: blocked quantization (block_size) is not handled"
    scale = constant_array(node.inputs[1]) if len(node.inputs) > 1 else None
    if scale is None:
        return f"{node.name}: scale is not a constant"
    zp_value = node.inputs[2] if len(node.inputs) > 2 else None
    if zp_value is not None:
        zero_point = constant_array(zp_value)
        if zero_point is None:
            return f"{node.name}: zero point is not a constant"
        dtype = ir.DataType.from_numpy(zero_point.dtype)
    else:
        dtype = _default_type(node)
        if dtype is None:
            return f"{node.name}: no zero point and the quantized type is unknown"
        zero_point = np.zeros(scale.shape, dtype=dtype.numpy())
    if dtype not in INTEGER_RANGES:
        return f"{node.name}: quantized type {dtype.name.lower()} is not handled (8/16-bit integers only)"
    if scale.size == 1 and zero_point.size == 1:
        return QParams(scale.reshape(()), zero_point.reshape(()), dtype, None)
    if scale.ndim != 1 or zero_point.shape not in ((), (1,), scale.shape):
        return f"{node.name}: scale shape {scale.shape} / zero point shape {zero_point.shape} are not per-axis"
    axis = node.attributes.get_int("axis", 1)
    rank = _rank(node.inputs[0])
    if axis < 0 and rank is not None:
        axis += rank
    return QParams(scale, np.broadcast_to(zero_point.reshape(-1), scale.shape).copy(), dtype, axis)


def _default_type(node: ir.Node) -> ir.DataType | None:
    if node.op_type == "DequantizeLinear":
        return node.inputs[0].dtype
    if node.attributes.get_int("output_dtype", 0):
        return ir.DataType(node.attributes.get_int("output_dtype", 0))
    return ir.DataType.UINT8  # QuantizeLinear without zero point or output_dtype


def _rank(value: ir.Value | None) -> int | None:
    return value.shape.rank() if value is not None and value.shape is not None else None


def quantize_array(x: np.ndarray, p: QParams) -> np.ndarray:
    """QuantizeLinear on a constant, bit-exact with ONNX Runtime's CPU kernel: float32 x / scale, round half to
    even, + zero point, saturate."""
    x = np.asarray(x, dtype=np.float32)
    scale, zero = p.scale.astype(np.float32), p.zero_point.astype(np.float32)
    if p.axis is not None:
        shape = [1] * x.ndim
        shape[p.axis] = -1
        scale, zero = scale.reshape(shape), zero.reshape(shape)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.rint(x / scale) + zero
    return np.clip(q, p.qmin, p.qmax).astype(p.dtype.numpy())


def quantize_bias(bias: np.ndarray, bias_scale: np.ndarray) -> np.ndarray:
    """int32 bias as onnxruntime.quantization does: round(float64(b) / float64(scale)), clipped to int32."""
    q = np.round(np.asarray(bias, np.float64) / np.asarray(bias_scale, np.float64))
    info = np.iinfo(np.int32)
    return np.clip(q, info.min, info.max).astype(np.int32)


# ---------------------------------------------------------------------------------------------------------
# Graph helpers
# ---------------------------------------------------------------------------------------------------------


def producer(value: ir.Value | None, *op_types: str) -> ir.Node | None:
    """The node producing `value` when it is one of `op_types` (default ONNX domain)."""
    node = value.producer() if value is not None else None
    if node is None or node.domain not in ("", "ai.onnx") or node.op_type not in op_types:
        return None
    return node


def consumers(value: ir.Value) -> list[ir.Node]:
    return [use.node for use in value.uses()]


def constant_weight(value: ir.Value) -> tuple[np.ndarray, QParams, str] | str:
    """A weight input `DQ(w)`: its integer array, DQ parameters and how the integers were stored.

    `w` is an integer constant (quantizer output), or `QuantizeLinear(float constant)` with the same parameters
    (PyTorch QAT exports quantize the float weight in the graph): then it is quantized here as ORT would.
    Returns a string saying why not.
    """
    dq = producer(value, "DequantizeLinear")
    if dq is None:
        return "weight is not produced by DequantizeLinear"
    params = qparams(dq)
    if isinstance(params, str):
        return params
    source = dq.inputs[0]
    array = constant_array(source)
    if array is not None:
        return array, params, "integer constant"
    q = producer(source, "QuantizeLinear")
    floats = constant_array(q.inputs[0]) if q is not None else None
    if floats is None:
        return "weight is neither an integer constant nor QuantizeLinear of a constant (run optimize first)"
    q_params = qparams(q)
    if isinstance(q_params, str):
        return q_params
    if not q_params.same_as(params):
        return "weight QuantizeLinear and DequantizeLinear parameters differ"
    return quantize_array(floats, params), params, "quantized from float (QuantizeLinear on a constant)"


def drop_identity(node: ir.Node) -> bool:
    """Remove an Identity a rule created: its consumers (and a graph output) read its input instead.

    Kept when its output is a graph output and its input is a graph input or initializer (a graph output cannot
    be renamed onto those). Returns True when removed.
    """
    source, result = node.inputs[0], node.outputs[0]
    graph = node.graph
    is_output = result.is_graph_output()
    if is_output and (source.is_graph_input() or source.is_initializer() or source.is_graph_output()):
        return False
    source.shape = source.shape or result.shape
    source.type = source.type or result.type
    ir.convenience.replace_all_uses_with(result, source, replace_graph_outputs=True)
    graph.remove(node, safe=True)
    if is_output:
        source.name = result.name  # graph outputs keep their names
    return True


def remove_dead(nodes) -> list[ir.Node]:
    """Remove the given nodes if nothing reads them any more, then their producers in turn, and initializers
    only they read. Nodes elsewhere in the graph are left alone (unlike RemoveUnusedNodesPass), so a record
    counts only what a rewrite orphaned."""
    removed: list[ir.Node] = []
    pending = [n for n in nodes if n is not None]
    seen: set[int] = set()
    while pending:
        node = pending.pop()
        if id(node) in seen or node.graph is None:
            continue
        if any(out.uses() or out.is_graph_output() for out in node.outputs):
            continue
        seen.add(id(node))
        graph = node.graph
        inputs = [v for v in node.inputs if v is not None]
        graph.remove(node, safe=True)
        removed.append(node)
        for value in inputs:
            if value.producer() is not None:
                pending.append(value.producer())
            elif value.is_initializer() and not value.uses() and not value.is_graph_output() \
                    and not value.is_graph_input() and graph.initializers.get(value.name) is value:
                graph.initializers.pop(value.name)  # a weight or scale only that node read
    return removed
