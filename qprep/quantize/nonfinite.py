"""Tensors no calibrator may see: values that are ±inf, NaN or beyond float16's range, and the nodes that
therefore stay float on every backend.

Why: real exports add their attention masks to the scores: HF writes `(1 - mask) * finfo(float32).min` (or
`Where(mask, 0, finfo.min)`), torch `Where(Not(mask), -inf, 0)`; padding is often −inf. An int8 grid over
[-3.4e38, 0] has a step of 1.3e36 (over [-inf, 0] an infinite one): every score rounds to the same integer,
attention goes uniform and the output collapses (BENCHMARKS.md: "non-finite values never reach a calibrator"),
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
from qprep.model.info import FLOAT_TYPES, Links, default_opset, graph_inputs
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
    added: set[str] = field(default_factory=set)  # of `nodes`, those the float set did not hold already

    def record(self) -> dict:
        """For the stage record (report.json): every tensor with its values, every node with its reason."""
        return {"limit": LIMIT, "tensors": [{"tensor": name, **stats} for name, stats in self.tensors.items()],
                "nodes": dict(self.nodes)}


def extreme(low: float, high: float, nan: bool = False, limit: float = LIMIT) -> bool:
    """True for a range no int8 or float16 grid can hold: NaN, ±inf, or beyond ±limit."""
    return bool(nan or not (np.isfinite(low) and np.isfinite(high)) or low < -limit or high > limit)


def describe(stats: dict) -> str:
    """`[-3.4e+38, 0]`, with ", NaN" when there were NaNs: how a reason shows the values."""
    return f"[{stats['min']:.3g}, {stats['max']:.3g}]" + (", NaN" if stats["nan"] else "")


def find(model: onnx.ModelProto, samples: list[dict], threads: int = 2, limit: float = LIMIT) -> Extremes:
    """The extreme constants and activations of `model` (activations over `samples`, one run of the float model)
    and the nodes that must stay float because of them; `limit` lower than float16's asks which values an int8
    grid would spread over (a mask filled with -10000)."""
    found = Extremes(tensors=extreme_constants(model, limit))
    inputs = [spec.name for spec in graph_inputs(model)]  # an additive mask may also be fed as data
    outputs = [o for node in model.graph.node if node.op_type != "Constant" for o in node.output if o]
    ranges: dict[str, dict] = {}
    for values in intermediate_values(model, inputs + outputs, samples, threads):
        for name, value in values.items():
            if isinstance(value, np.ndarray) and value.dtype.kind == "f" and value.size:  # (not ZipMap's dicts)
                ranges[name] = _merged(ranges.get(name), _stats(value))
    for name, stats in ranges.items():
        if extreme(stats["min"], stats["max"], stats["nan"], limit):
            found.tensors[name] = {"kind": "activation", **stats}
    links = Links(model)
    producers, readers = links.producers, links.readers
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


def clip_constants(model: onnx.ModelProto, extremes: Extremes, bound: float, nan: float | None = None,
                   bounds: dict[str, float] | None = None) -> tuple[onnx.ModelProto, dict]:
    """A copy of `model` whose extreme float constants are clipped to ±`bound` (`bounds`: some constants' own),
    NaN left alone or replaced by `nan` → (model, {constant: "[before] → [after]"}). For a backend whose float is
    float16, where finfo(float32).min and -1e9 become -inf and HF's `(1 - mask) * fill` then gives 0 * -inf =
    NaN. The caller verifies the numbers."""
    clipped = onnx.ModelProto()
    clipped.CopyFrom(model)
    names = {name for name, stats in extremes.tensors.items() if stats["kind"] == "constant"} | set(bounds or {})
    for node in clipped.graph.node:  # a Constant's value_float(s) becomes its `value`, which can be rewritten
        if node.op_type == "Constant" and node.output[0] in names:
            tensor = _constant_value(node)
            if tensor is not None and not any(a.name == "value" for a in node.attribute):
                node.ClearField("attribute")
                node.attribute.append(onnx.helper.make_attribute("value", tensor))
    changed = {}
    for name, tensor in _float_constant_protos(clipped):
        if name in names:
            array = numpy_helper.to_array(tensor)
            limit = (bounds or {}).get(name, bound)
            values = np.clip(array, -limit, limit).astype(array.dtype)
            if nan is not None:
                values = np.where(np.isnan(values), np.asarray(nan, values.dtype), values)
            tensor.CopyFrom(numpy_helper.from_array(values, tensor.name))
            changed[name] = f"{describe(_stats(array))} → {describe(_stats(values))}"
    return clipped, changed


# a constant this negative or lower is taken for an attention mask's fill when the mask it makes is added to
# scores a Softmax reads (HF's older exports fill with -10000)
FILL = 1000.0
# a mask's fill leaves every masked key at least this far below its row's largest unmasked score on the
# calibration samples: softmax weighs it exp(-24) = 4e-11 of that one
MASK_MARGIN = 24.0


@dataclass
class MaskBound:
    """The smallest safe fill for additive attention masks (`mask_bound`): `bound` for the `constants` that make
    the masks, `excess` how far a masked score rose above its row's largest unmasked one on calibration data.
    `own`: Add → its attention's own bound, for the Adds whose mask holds nothing but 0 and the fill (so it can
    be scaled down to that bound: `own_fills`)."""

    bound: float
    excess: float
    adds: list[str]
    constants: set[str]
    own: dict[str, float] = field(default_factory=dict)
    mask_inputs: dict[str, str] = field(default_factory=dict)  # Add → its mask input
    dtype: np.dtype = np.dtype(np.float32)  # the fill's

    def record(self) -> dict:
        return {"bound": round(self.bound, 3), "excess": round(self.excess, 3), "margin": MASK_MARGIN,
                "softmax_adds": len(self.adds),
                "constants": sorted(self.constants)}


def mask_bound(model: onnx.ModelProto, samples: list[dict], threads: int = 2) -> MaskBound | None:
    """How small the fill of the additive attention masks can be while softmax still gives masked keys nothing,
    measured on `samples`; None when the model has no such mask: an Add read by a Softmax whose one input is
    computed from a fill constant (≤ -FILL: finfo.min, -inf, -1e9, HF's older -10000) and whose other input
    (the scores) is not.

    Why: an int8 attention (RKNN fuses MatMul → Mul → Add → Softmax → MatMul into one int8 layer) spreads its
    grid over the mask's fill, so the smaller the fill the finer the scores' grid (BENCHMARKS.md: "an attention
    mask's fill clipped to the bound its scores need"). The fill needed is the highest a masked
    score rises above its row's largest unmasked one (MiniLM layer 0: 17.6 on calibration data) plus a margin;
    it is doubled for unseen samples and the clipped model is verified by the caller."""
    links = Links(model)
    producers, readers = links.producers, links.readers
    arrays = dict(_float_constants(model))
    fills = {name for name, array in arrays.items() if _stats(array)["min"] <= -FILL}
    adds, constants = [], set()  # adds: (add, scores input, mask input, softmax)
    for node in model.graph.node:
        if node.op_type != "Add" or len(node.input) != 2:
            continue
        softmaxes = [r for r in readers.get(node.output[0], []) if r.op_type == "Softmax"]
        if not softmaxes:
            continue
        # the mask side: computed from a fill and not from an earlier attention (a later layer's scores are
        # computed from the fill too, through the attention before it)
        upstream = [_upstream(name, producers) for name in node.input]
        is_mask = [bool(tensors & fills) and not any(producers[t].op_type == "Softmax"
                                                      for t in tensors if t in producers) for tensors in upstream]
        if is_mask[0] != is_mask[1]:
            mask = 0 if is_mask[0] else 1
            adds.append((node, node.input[1 - mask], node.input[mask], softmaxes[0]))
            constants |= upstream[mask] & fills
    if not adds:
        return None
    opset = default_opset(model)
    fixed = {name: arrays[name] for _, scores, mask, _ in adds for name in (scores, mask) if name in arrays}
    wanted = [name for _, scores, mask, _ in adds for name in (scores, mask) if name not in fixed]
    excess = {add.name: 0.0 for add, *_ in adds}
    pure = {add.name for add, *_ in adds}  # masks of 0 and the fill only, on every sample
    for values in intermediate_values(model, wanted, samples, threads):
        values = {**fixed, **values}
        for add, scores, mask, softmax in adds:
            if scores in values and mask in values:
                excess[add.name] = max(excess[add.name],
                                       _masked_excess(values[scores], values[mask], softmax, opset))
                if not np.all((values[mask] == 0) | (values[mask] <= -FILL / 2)):
                    pure.discard(add.name)
            else:
                pure.discard(add.name)
    bounds = {name: min(2.0 * value + MASK_MARGIN, FILL) for name, value in excess.items()}
    return MaskBound(bound=max(bounds.values()), excess=max(excess.values()), adds=[add.name for add, *_ in adds],
                     constants=constants, own={name: bounds[name] for name in pure},
                     mask_inputs={add.name: mask for add, _, mask, _ in adds},
                     dtype=arrays[next(iter(constants))].dtype)


def own_fills(model: onnx.ModelProto, mask: MaskBound) -> tuple[onnx.ModelProto, dict[str, float]]:
    """A copy of `model` (its masks' fill already clipped to `mask.bound`) in which each attention whose own
    bound is lower gets its mask scaled down to it, by a Mul before its Add → (model, {Add: its fill}).

    Why: one fill serves every attention, and the attention that needs the most sets it: all-MiniLM-L6-v2 has
    a masked score 17.6 above its row's largest unmasked one in layer 0, 1.3–7.7 in layers 1–5, so one fill of
    59 where 25–38 would do. An int8 attention spreads its grid over the fill (nonfinite.mask_bound), so every
    attention's scores lost grid steps to layer 0's. Only masks of 0 and the fill (HF's and torch's) are
    scaled: a mask that carries a position bias would be scaled with it. The caller verifies the numbers."""
    scaled = {name: own for name, own in mask.own.items() if own < mask.bound}
    if not scaled:
        return model, {}
    result = onnx.ModelProto()
    result.CopyFrom(model)
    graph = result.graph
    for index, node in reversed(list(enumerate(graph.node))):
        if node.name not in scaled:
            continue
        side = list(node.input).index(mask.mask_inputs[node.name])
        factor, tensor = f"{node.name}/own_fill_scale", f"{node.name}/own_fill_output"
        graph.initializer.append(numpy_helper.from_array(np.asarray(scaled[node.name] / mask.bound, mask.dtype),
                                                              factor))
        graph.node.insert(index, onnx.helper.make_node("Mul", [node.input[side], factor], [tensor],
                                                       name=f"{node.name}/own_fill"))
        node.input[side] = tensor
    return result, {name: round(value, 3) for name, value in scaled.items()}


def _upstream(name: str, producers: dict) -> set[str]:
    """Every tensor `name` is computed from, itself included."""
    found, todo = set(), [name]
    while todo:
        tensor = todo.pop()
        if tensor not in found:
            found.add(tensor)
            producer = producers.get(tensor)
            if producer is not None:
                todo.extend(i for i in producer.input if i)
    return found


def _masked_excess(scores: np.ndarray, mask: np.ndarray, softmax: onnx.NodeProto, opset: int) -> float:
    """The highest masked score above its softmax row's largest unmasked one (0 when none is above)."""
    shape = np.broadcast_shapes(scores.shape, mask.shape)
    scores, masked = np.broadcast_to(scores, shape), np.broadcast_to(mask <= -FILL / 2, shape)
    axis = next((a.i for a in softmax.attribute if a.name == "axis"), -1 if opset >= 13 else 1)
    axis = axis % len(shape) if shape else 0
    if opset >= 13:  # one row per position of the other axes
        scores, masked = (np.moveaxis(a, axis, -1).reshape(-1, shape[axis]) for a in (scores, masked))
    else:  # before opset 13 softmax flattens the axes from `axis` on into one row
        scores, masked = (a.reshape(int(np.prod(shape[:axis], dtype=np.int64)), -1) for a in (scores, masked))
    unmasked_max = np.where(masked, -np.inf, scores).max(axis=-1, keepdims=True)
    rise = np.where(masked & np.isfinite(unmasked_max), scores - unmasked_max, -np.inf)
    return float(max(rise.max(initial=-np.inf), 0.0))


def _float_constant_protos(model: onnx.ModelProto):
    """(name, TensorProto) of every float initializer and Constant node value of the main graph (a Constant's
    `value_float(s)` as a tensor of its own: rewriting that one rewrites a copy; clip_constants converts first)."""
    for tensor in model.graph.initializer:
        if tensor.data_type in FLOAT_TYPES:
            yield tensor.name, tensor
    for node in model.graph.node:
        if node.op_type == "Constant":
            tensor = _constant_value(node)
            if tensor is not None:
                yield node.output[0], tensor


def _constant_value(node: onnx.NodeProto) -> onnx.TensorProto | None:
    """A float Constant node's value: its `value` tensor, or its `value_float(s)` made one; else None."""
    for attribute in node.attribute:
        if attribute.name == "value" and attribute.t.data_type in FLOAT_TYPES:
            return attribute.t
        if attribute.name in ("value_float", "value_floats"):
            values = attribute.f if attribute.name == "value_float" else list(attribute.floats)
            return numpy_helper.from_array(np.asarray(values, np.float32), node.output[0])
    return None


def extreme_constants(model: onnx.ModelProto, limit: float = LIMIT) -> dict[str, dict]:
    """constant → its stats ({"kind": "constant", min, max, nan}), for the float constants beyond ±`limit`,
    ±inf or NaN (what `find` starts from; also for a model converted after `find` ran)."""
    found = {}
    for name, array in _float_constants(model):
        stats = _stats(array)
        if extreme(stats["min"], stats["max"], stats["nan"], limit):
            found[name] = {"kind": "constant", **stats}
    return found


def _float_constants(model: onnx.ModelProto):
    for name, tensor in _float_constant_protos(model):
        yield name, numpy_helper.to_array(tensor)


def _stats(array: np.ndarray) -> dict:
    values = np.asarray(array)
    if not values.size:
        return {"min": 0.0, "max": 0.0, "nan": False}
    low, high = values.min(), values.max()  # NaN if any value is NaN: one pass each, no mask in the usual case
    if not (np.isnan(low) or np.isnan(high)):
        return {"min": float(low), "max": float(high), "nan": False}
    values = values[~np.isnan(values)]
    if not values.size:
        return {"min": 0.0, "max": 0.0, "nan": True}
    return {"min": float(values.min()), "max": float(values.max()), "nan": True}


def _merged(old: dict | None, new: dict) -> dict:
    if old is None:
        return new
    return {"min": min(old["min"], new["min"]), "max": max(old["max"], new["max"]), "nan": old["nan"] or new["nan"]}
