"""Tensors no calibrator may see: values that are ±inf, NaN or beyond float16's range, and the nodes that
therefore stay float on every backend.

Why: real exports add their attention masks to the scores: HF writes `(1 - mask) * finfo(float32).min` (or
`Where(mask, 0, finfo.min)`), torch `Where(Not(mask), -inf, 0)`; padding is often −inf. An int8 grid over
[-3.4e38, 0] has a step of 1.3e36 (over [-inf, 0] an infinite one): every score rounds to the same integer,
attention goes uniform and the output collapses (all-MiniLM-L6-v2, ORT static: calibration SQNR -0.8 dB),
while a histogram over such a range is refused outright ("supplied range of [-inf, 0.0] is not finite").
float16 (RKNN's float) cannot hold finfo(float32).min either.

Found from the graph and the calibration data, never by name: a float constant holding such a value, and
every tensor the float model computes whose calibration values include one. Each such tensor keeps its
producer and all its readers float (an edge is float only when every node on it is), which is exactly the
chain that carries a mask until it is added to the scores, and the Softmax that reads the sum.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import numpy_helper

from qprep.errors import EXIT_INTERNAL, QprepError
from qprep.model.info import FLOAT_TYPES, graph_inputs
from qprep.model.runtime import intermediate_values

LIMIT = float(np.finfo(np.float16).max)  # 65504: beyond it float16 overflows and no int8 grid keeps the rest


class NonFiniteRange(QprepError):
    """A range or scale came out non-finite although its tensor was not kept float: qprep's miss, not the
    user's (exit 3)."""

    exit_code = EXIT_INTERNAL


@dataclass
class Extremes:
    """What `find` saw: tensor → {"kind", "min", "max", "nan"} and node → why it stays float."""

    tensors: dict[str, dict] = field(default_factory=dict)
    nodes: dict[str, str] = field(default_factory=dict)

    def record(self) -> dict:
        """For the stage record (report.json): every tensor with its values, every node with its reason."""
        return {"limit": LIMIT, "tensors": [{"tensor": name, **stats} for name, stats in self.tensors.items()],
                "nodes": dict(self.nodes)}


def extreme(low: float, high: float, nan: bool = False) -> bool:
    """True for a range no int8 or float16 grid can hold: NaN, ±inf, or beyond ±LIMIT."""
    return bool(nan or not (np.isfinite(low) and np.isfinite(high)) or low < -LIMIT or high > LIMIT)


def describe(stats: dict) -> str:
    """`[-3.4e+38, 0]`, with ", NaN" when there were NaNs: how a reason shows the values."""
    return f"[{stats['min']:.3g}, {stats['max']:.3g}]" + (", NaN" if stats["nan"] else "")


def find(model: onnx.ModelProto, samples: list[dict], threads: int = 2) -> Extremes:
    """The extreme constants and activations of `model` (activations over `samples`, one run of the float model)
    and the nodes that must stay float because of them."""
    found = Extremes()
    for name, array in _float_constants(model):
        stats = _stats(array)
        if extreme(stats["min"], stats["max"], stats["nan"]):
            found.tensors[name] = {"kind": "constant", **stats}
    inputs = [spec.name for spec in graph_inputs(model)]  # an additive mask may also be fed as data
    outputs = [o for node in model.graph.node if node.op_type != "Constant" for o in node.output if o]
    ranges: dict[str, dict] = {}
    for values in intermediate_values(model, inputs + outputs, samples, threads):
        for name, value in values.items():
            if value.dtype.kind == "f" and value.size:
                ranges[name] = _merged(ranges.get(name), _stats(value))
    for name, stats in ranges.items():
        if extreme(stats["min"], stats["max"], stats["nan"]):
            found.tensors[name] = {"kind": "activation", **stats}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    producers = {o: node for node in model.graph.node for o in node.output}
    for name, stats in found.tensors.items():
        values = describe(stats)
        producer = producers.get(name)
        if producer is not None and producer.op_type != "Constant" and stats["kind"] == "activation":
            found.nodes.setdefault(producer.name, f"computes '{name}' with values {values} on calibration data")
        for reader in readers.get(name, []):
            found.nodes.setdefault(reader.name, f"reads '{name}' ({stats['kind']}, values {values})")
    return found


def check_scales(model: onnx.ModelProto) -> None:
    """Stop with the tensor's name when a Q/DQ scale of the quantized model is not finite (exit 3)."""
    quantizers = [node for node in model.graph.node
                  if node.op_type in ("QuantizeLinear", "DequantizeLinear") and len(node.input) > 1]
    wanted = {node.input[1] for node in quantizers}
    scales = {name: numpy_helper.to_array(tensor) for name, tensor in _float_constant_protos(model) if name in wanted}
    for node in quantizers:
        scale = scales.get(node.input[1])
        if scale is not None and not np.isfinite(scale).all():
            raise NonFiniteRange(f"quantize: the scale of tensor '{node.input[0]}' ({node.name}) is not finite "
                                 f"({np.asarray(scale).ravel()[:4].tolist()}): its values reached the calibrator; "
                                 "please report it, and keep its producer float meanwhile (keep_float.nodes)")


def clip_constants(model: onnx.ModelProto, extremes: Extremes, bound: float,
                   nan: float | None = None) -> tuple[onnx.ModelProto, dict]:
    """A copy of `model` whose extreme float constants are clipped to ±`bound` (NaN left alone, or replaced by
    `nan`) → (model, {constant: "[before] → [after]"}). For a backend whose float is float16, where
    finfo(float32).min and -1e9 become -inf and HF's `(1 - mask) * fill` then gives 0 * -inf = NaN. The caller
    verifies the numbers."""
    clipped = onnx.ModelProto()
    clipped.CopyFrom(model)
    names = {name for name, stats in extremes.tensors.items() if stats["kind"] == "constant"}
    changed = {}
    for name, tensor in _float_constant_protos(clipped):
        if name in names:
            array = numpy_helper.to_array(tensor)
            values = np.clip(array, -bound, bound).astype(array.dtype)
            if nan is not None:
                values = np.where(np.isnan(values), np.asarray(nan, values.dtype), values)
            tensor.CopyFrom(numpy_helper.from_array(values, tensor.name))
            changed[name] = f"{describe(_stats(array))} → {describe(_stats(values))}"
    return clipped, changed


def _float_constant_protos(model: onnx.ModelProto):
    """(name, TensorProto) of every float initializer and Constant node value of the main graph."""
    for tensor in model.graph.initializer:
        if tensor.data_type in FLOAT_TYPES:
            yield tensor.name, tensor
    for node in model.graph.node:
        if node.op_type == "Constant":
            for attribute in node.attribute:
                if attribute.name == "value" and attribute.t.data_type in FLOAT_TYPES:
                    yield node.output[0], attribute.t


def _float_constants(model: onnx.ModelProto):
    for name, tensor in _float_constant_protos(model):
        yield name, numpy_helper.to_array(tensor)


def _stats(array: np.ndarray) -> dict:
    values = np.asarray(array)
    nan = bool(np.isnan(values).any())
    if nan:
        values = values[~np.isnan(values)]
    if not values.size:
        return {"min": 0.0, "max": 0.0, "nan": nan}
    return {"min": float(values.min()), "max": float(values.max()), "nan": nan}


def _merged(old: dict | None, new: dict) -> dict:
    if old is None:
        return new
    return {"min": min(old["min"], new["min"]), "max": max(old["max"], new["max"]), "nan": old["nan"] or new["nan"]}
