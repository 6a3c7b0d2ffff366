"""Channel counts padded to a multiple of 16 where ONNX Runtime's fast int8 convolutions need it.

Why: ORT's x86 CPU runs an int8 Conv with zero-point-0 weights on its "symmetric" kernels (MLAS ConvSym, with
VNNI where the CPU has it) only when the channel counts line up: a depthwise Conv needs a multiple of 16
channels, a regular one at least 16 output channels in a multiple of 4 or 8 and input channels in a multiple of
4. Any other count runs a generic kernel. MobileNet-style models have many such counts (the PP-OCR classifier:
8, 24, 40, 88, 104, 200), and a generic kernel can run such a Conv slower than its FP32 twin: most of why that
model's INT8 build was hardly faster than FP32 (BENCHMARKS.md: "channel counts padded to multiples of 16").

What changes: a set of tensors that share one channel axis (a "channel space") between the Convs that write it and
the Convs that read it, through depthwise Convs, per-tensor Q/DQ, element-wise ops and pools, gets zero channels
at its end. The Convs writing it get zero weight rows and zero biases, depthwise Convs zero filters, and the
Convs reading it zero weight columns (each row's zero point, so they dequantize to 0). The real channels compute
exactly what they did: a padded channel's value, whatever the element-wise ops make of 0, meets only zero
weights. A space that anything else touches (a Reshape, a Concat, a graph output, a per-channel constant) is left
as it is. `apply` keeps the padded model only if its outputs are the same and it runs faster.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
from onnx import numpy_helper

from qprep.measure.latency import interleaved
from qprep.model.info import Links, tensor_shapes
from qprep.model.runtime import model_error, ort_session, session_outputs

log = logging.getLogger("qprep")

MULTIPLE = 16  # MLAS's depthwise group alignment on x86 (8 on ARM64): 16 serves both
# ops whose output has the channel axis (axis 1) of their inputs, element by element or window by window
CHANNEL_PRESERVING = frozenset({
    "Add", "Sub", "Mul", "Div", "Max", "Min", "Relu", "Clip", "Sigmoid", "HardSigmoid", "HardSwish", "LeakyRelu",
    "Tanh", "Identity", "Neg", "Abs", "Erf", "Sqrt", "Exp", "Softplus", "Elu", "Selu", "Mish",
    "GlobalAveragePool", "GlobalMaxPool", "MaxPool", "AveragePool",
    "QuantizeLinear", "DequantizeLinear",
})
# reductions that keep the channel axis when they reduce only spatial axes with keepdims (timm's squeeze-excite:
# x.mean((2, 3), keepdim=True))
SPATIAL_REDUCTIONS = frozenset({"ReduceMean", "ReduceMax"})


class _Spaces:
    """Union-find over tensor names: tensors in one set share their channel axis."""

    def __init__(self):
        self.parent: dict[str, str] = {}

    def find(self, name: str) -> str:
        self.parent.setdefault(name, name)
        while self.parent[name] != name:
            self.parent[name] = self.parent[self.parent[name]]
            name = self.parent[name]
        return name

    def union(self, a: str, b: str) -> None:
        self.parent[self.find(a)] = self.find(b)


def apply(model: onnx.ModelProto, samples: list[dict], threads: int = 2) -> tuple[onnx.ModelProto, dict]:
    """(the padded model if its outputs equal the model's on `samples` and it runs faster, else `model`; the
    record: spaces padded, the timing, kept or why not)."""
    try:
        padded, spaces = pad(model)
    except Exception as exc:  # noqa: BLE001 - a speed rewrite never fails a run; the unpadded model is right
        log.warning("channel padding failed (%s: %s); left unpadded", type(exc).__name__, exc)
        return model, {"spaces": [], "kept": False, "why": f"padding failed: {type(exc).__name__}: {exc}"}
    if not spaces:
        return model, {}
    record = {"spaces": spaces, "kept": False}
    # one session per model, for the comparison and the timing alike
    reference = ort_session(model, threads=threads, optimize=True)
    try:
        candidate = ort_session(padded, threads=threads, optimize=True)
        actual = session_outputs(candidate, samples)
    except Exception as exc:  # noqa: BLE001 - ORT's own types; a form the analysis missed fails no run
        record["why"] = f"ONNX Runtime refused the padded model ({model_error(exc)})"
        log.warning("channel padding: ONNX Runtime refused the padded model; left unpadded")
        return model, record
    expected = session_outputs(reference, samples)
    if any(not np.array_equal(e[name], a[name]) for e, a in zip(expected, actual) for name in e):
        record["why"] = "the padded model's outputs differ"
        log.warning("channel padding: the padded model's outputs differ; left unpadded")
        return model, record
    timing = interleaved({"unpadded": (reference, samples[0]), "padded": (candidate, samples[0])}, threads,
                         runs=100, warmup=20, rounds=3, seconds=4.0)
    before, after = timing["unpadded"]["median_ms"], timing["padded"]["median_ms"]
    record.update(ms_before=round(before, 4), ms_after=round(after, 4), kept=after < before)
    if not record["kept"]:
        record["why"] = "not faster on this machine"
    log.info("ort: %d channel spaces padded to multiples of %d: %.3f → %.3f ms per run (%s)", len(spaces),
             MULTIPLE, before, after, "kept" if record["kept"] else "not faster: left unpadded")
    return (padded if record["kept"] else model), record


def pad(model: onnx.ModelProto, multiple: int = MULTIPLE) -> tuple[onnx.ModelProto, list[dict]]:
    """(a padded copy, one record per padded space: its channels before and after, the Convs changed);
    `model` itself if nothing is padded. The steps: the tensors each followed op ties to one channel axis are
    joined into spaces (`_join`), a space anything else touches is blocked (`_block_outside`), the spaces whose
    count is off the multiple and that a Conv writes are planned (`_plan`), and a copy is padded (`_padded`)."""
    links = Links(model)
    shapes = tensor_shapes(model)
    spaces, blocked, writers = _join(model, links, shapes, _constants(model, links))
    members = _block_outside(model, links, spaces, blocked)
    plan = _plan(spaces, blocked, members, writers, shapes, multiple)
    if not plan:
        return model, []
    return _padded(model, links, plan)


def _channels(shapes: dict, name: str) -> int | None:
    """The tensor's channel count (axis 1 of a rank-3+ tensor), None when unknown."""
    dims = shapes.get(name, (0, None))[1]
    return dims[1] if dims and len(dims) >= 3 and dims[1] else None


def _join(model: onnx.ModelProto, links: Links, shapes: dict, constant: dict[str, np.ndarray]
          ) -> tuple[_Spaces, set[str], dict[str, list]]:
    """(the spaces: tensors joined where an op keeps their channel axis; the roots of spaces blocked so far;
    tensor → [(conv, "write" | "depthwise" | "read")], the Convs that write or read it)."""
    spaces, blocked = _Spaces(), set()
    writers: dict[str, list] = {}
    for node in model.graph.node:
        if node.op_type == "Conv":
            _join_conv(node, links, constant, spaces, blocked, writers)
        elif node.op_type in SPATIAL_REDUCTIONS:
            if _spatial_reduction(node, constant, shapes.get(node.input[0], (0, None))[1]):
                spaces.union(node.input[0], node.output[0])
            else:
                blocked.update({spaces.find(node.input[0]), spaces.find(node.output[0])})
        elif node.op_type in CHANNEL_PRESERVING and node.output and node.output[0]:
            if node.op_type in ("QuantizeLinear", "DequantizeLinear") and constant.get(node.input[0]) is not None:
                continue  # a weight's or a constant's DequantizeLinear: read through `constant`
            out = node.output[0]
            if len(node.output) > 1 and any(node.output[1:]):
                blocked.add(spaces.find(out))
                continue
            if node.op_type in ("QuantizeLinear", "DequantizeLinear"):
                scale = constant.get(node.input[1]) if len(node.input) > 1 else None
                if scale is None or scale.size != 1:
                    blocked.add(spaces.find(out))
                spaces.union(node.input[0], out)
                continue
            for position, name in enumerate(node.input):
                if not name:
                    continue
                value = constant.get(name)
                if value is not None:
                    if _per_channel(value, shapes.get(out, (0, None))[1]):
                        blocked.add(spaces.find(out))  # a per-channel constant: would need padding too
                    continue
                if (_channels(shapes, name) is None or _channels(shapes, name) != _channels(shapes, out)
                        or (node.op_type == "Div" and position == 1)):  # a padded divisor would divide by 0
                    blocked.update({spaces.find(name), spaces.find(out)})
                spaces.union(name, out)
    return spaces, blocked, writers


def _join_conv(node: onnx.NodeProto, links: Links, constant: dict, spaces: _Spaces, blocked: set[str],
               writers: dict[str, list]) -> None:
    """A Conv: a regular one writes its output's space and reads its input's, a depthwise one joins them; a
    grouped one, or one whose weight or input is not what padding can follow, blocks both."""
    weight = _weight(node, links)
    group = next((a.i for a in node.attribute if a.name == "group"), 1)
    x, y = node.input[0], node.output[0]
    if weight is None or constant.get(x) is not None:
        blocked.update({spaces.find(x), spaces.find(y)})
        return
    out_channels, in_per_group = weight.shape[0], weight.shape[1]
    if group == 1:
        writers.setdefault(y, []).append((node, "write"))
        writers.setdefault(x, []).append((node, "read"))
        spaces.find(x), spaces.find(y)
        if node.input[1] in links.initializers:  # a float Conv: ORT's FP32 kernel for another channel
            blocked.add(spaces.find(x))          # count sums in another order (not bit-identical)
    elif in_per_group == 1 and out_channels == group:
        spaces.union(x, y)
        writers.setdefault(y, []).append((node, "depthwise"))
    else:
        blocked.update({spaces.find(x), spaces.find(y)})


def _block_outside(model: onnx.ModelProto, links: Links, spaces: _Spaces, blocked: set[str]) -> dict[str, list[str]]:
    """Blocks (in `blocked`) every space another op reads or writes, or a graph input or output is in →
    root → the space's tensors."""
    handled = {id(n) for n in model.graph.node
               if n.op_type == "Conv" or n.op_type in CHANNEL_PRESERVING or n.op_type in SPATIAL_REDUCTIONS}
    members: dict[str, list[str]] = {}
    for name in list(spaces.parent):
        members.setdefault(spaces.find(name), []).append(name)
    for root, names in members.items():
        for name in names:
            producer = links.producers.get(name)
            readers = links.readers.get(name, [])
            if (producer is None or name in links.outputs or name in links.in_subgraphs
                    or id(producer) not in handled or not all(_reads_as_data(r, name, handled) for r in readers)):
                blocked.add(spaces.find(name))
    return members


def _plan(spaces: _Spaces, blocked: set[str], members: dict[str, list[str]], writers: dict[str, list],
          shapes: dict, multiple: int) -> list[tuple]:
    """[(channels, padded to, the Convs to pad with their kind, the space's tensors)] for each unblocked space
    of one known channel count, off the multiple, that a Conv writes."""
    roots = {spaces.find(r) for r in members}
    blocked = {spaces.find(b) for b in blocked}
    plan = []
    for root in sorted(roots - blocked):
        names = [n for n in members.get(root, []) if n in spaces.parent and spaces.find(n) == root]
        counts = {_channels(shapes, n) for n in names}
        if len(counts) != 1 or None in counts:
            continue
        count = counts.pop()
        convs = [pair for n in names for pair in writers.get(n, [])]
        if count % multiple == 0 or not any(kind == "write" or kind == "depthwise" for _, kind in convs):
            continue
        plan.append((count, -(-count // multiple) * multiple, convs, names))
    return plan


def _padded(model: onnx.ModelProto, links: Links, plan: list[tuple]) -> tuple[onnx.ModelProto, list[dict]]:
    """A copy of `model` with the planned spaces padded → (it, a record per space)."""
    padded = onnx.ModelProto()
    padded.CopyFrom(model)
    padded_links = Links(padded)
    nodes = {id(a): b for a, b in zip(model.graph.node, padded.graph.node)}
    records, changed = [], set()
    for count, to, convs, names in plan:
        for conv, kind in convs:
            _pad_conv(padded, padded_links, nodes[id(conv)], kind, count, to)
            changed.update(conv.input[1:3])  # its weight's and bias's DequantizeLinear outputs
        changed.update(names)
        records.append({"channels": count, "padded_to": to,
                        "convs": sorted({c.name or c.output[0] for c, _ in convs})})
    after = Links(padded)
    unread = [t for t in padded.graph.initializer if t.name in links.readers and not after.readers.get(t.name)
              and t.name not in after.in_subgraphs and t.name not in after.outputs]
    for tensor in unread:  # every reader now has its own padded copy
        padded.graph.initializer.remove(tensor)
    dims = {t.name: list(t.dims) for t in padded.graph.initializer}
    for value in padded.graph.input:  # a weight also declared as a graph input (IR < 4 exports) keeps up
        if value.name in dims and value.type.tensor_type.HasField("shape"):
            del value.type.tensor_type.shape.dim[:]
            for size in dims[value.name]:
                value.type.tensor_type.shape.dim.add().dim_value = size
    # shapes of the padded tensors (and of the weights' DequantizeLinear outputs) are stale: ORT infers them again
    keep = [v for v in padded.graph.value_info if v.name not in changed]
    del padded.graph.value_info[:]
    padded.graph.value_info.extend(keep)
    return padded, records


def _spatial_reduction(node: onnx.NodeProto, constant: dict, dims: list | None) -> bool:
    """A reduction over axes that exclude the channel axis, keeping the reduced dims (so axis 1 stays axis 1)."""
    keepdims = next((a.i for a in node.attribute if a.name == "keepdims"), 1)
    axes = next((list(a.ints) for a in node.attribute if a.name == "axes"), None)
    if axes is None and len(node.input) > 1 and node.input[1]:
        value = constant.get(node.input[1])
        axes = None if value is None else [int(v) for v in np.asarray(value).ravel()]
    if not keepdims or not axes or not dims:
        return False
    return all((axis % len(dims)) != 1 for axis in axes)


def _per_channel(value: np.ndarray, out_dims: list | None) -> bool:
    """A constant operand whose broadcast reaches the output's channel axis (1) with more than one value; True
    when the output's rank is unknown."""
    if value.size == 1:
        return False
    if not out_dims:
        return True
    axis = value.ndim - len(out_dims) + 1  # the constant's axis that lines up with the output's axis 1
    return axis >= 0 and value.shape[axis] != 1


def _reads_as_data(reader: onnx.NodeProto, name: str, handled: set[int]) -> bool:
    """`reader` is one of the ops the analysis follows, and reads `name` as data, not as a Conv's weight or a
    Q/DQ's scale (whose shapes padding would break)."""
    if id(reader) not in handled:
        return False
    if reader.op_type in ("Conv", "QuantizeLinear", "DequantizeLinear", *SPATIAL_REDUCTIONS):
        return name not in reader.input[1:]
    return True


def _constants(model: onnx.ModelProto, links: Links) -> dict[str, np.ndarray]:
    """Initializers, and Q/DQ outputs of constants (a quantized constant, same shape), by tensor name."""
    values = {name: numpy_helper.to_array(t) for name, t in links.initializers.items()}
    for node in model.graph.node:  # in order: a QuantizeLinear → DequantizeLinear of a constant is one too
        if node.op_type in ("QuantizeLinear", "DequantizeLinear") and node.input[0] in values:
            values[node.output[0]] = values[node.input[0]]
    return values


def _weight(conv: onnx.NodeProto, links: Links) -> np.ndarray | None:
    """The Conv's weight values (integers behind a DequantizeLinear, or floats); None if not a constant."""
    name = conv.input[1]
    if name in links.initializers:
        return numpy_helper.to_array(links.initializers[name]) if _own_bias(conv, links) else None
    producer = links.producers.get(name)
    if (producer is not None and producer.op_type == "DequantizeLinear" and producer.input[0] in links.initializers
            and links.only_reader(name, conv) and _own_bias(conv, links) and _per_output_channel(producer, links)):
        return numpy_helper.to_array(links.initializers[producer.input[0]])
    return None


def _per_output_channel(dequantize: onnx.NodeProto, links: Links) -> bool:
    """A weight's DequantizeLinear with one scale, or one per output channel (axis 0), from initializers."""
    scale = links.initializers.get(dequantize.input[1])
    if scale is None:
        return False
    axis = next((a.i for a in dequantize.attribute if a.name == "axis"), 1)
    return int(np.prod(scale.dims)) == 1 or axis == 0


def _own_bias(conv: onnx.NodeProto, links: Links) -> bool:
    """The Conv has no bias, a constant one, or one behind a DequantizeLinear that only it reads."""
    if len(conv.input) < 3 or not conv.input[2] or conv.input[2] in links.initializers:
        return True
    producer = links.producers.get(conv.input[2])
    return (producer is not None and producer.op_type == "DequantizeLinear"
            and producer.input[0] in links.initializers and links.only_reader(conv.input[2], conv))


def _pad_conv(model: onnx.ModelProto, links: Links, conv: onnx.NodeProto, kind: str, count: int, to: int) -> None:
    """Zero channels for one Conv: output rows (+ bias) for write/depthwise, input columns for read."""
    extra = to - count
    weight_name = conv.input[1]
    dequantize = links.producers.get(weight_name)
    if dequantize is not None and dequantize.op_type == "DequantizeLinear":
        zero = _initializer(model, links, dequantize, 2) if len(dequantize.input) > 2 else None
        points = numpy_helper.to_array(zero).reshape(-1) if zero is not None else np.zeros(1)
        weight = _initializer(model, links, dequantize, 0)
    else:
        dequantize, points = None, np.zeros(1)
        weight = _initializer(model, links, conv, 1)
    values = numpy_helper.to_array(weight)
    if kind == "read":
        rows = points if points.size == values.shape[0] else np.full(values.shape[0], points[0])
        fill = np.broadcast_to(rows.reshape(-1, 1, *([1] * (values.ndim - 2))),
                               (values.shape[0], extra, *values.shape[2:])).astype(values.dtype)
        _set(weight, np.concatenate([values, fill], axis=1))
        return
    # new rows hold the zero point they get (uint8 weights: 128), so they dequantize to 0
    fill = np.broadcast_to(np.asarray(points[0], values.dtype), (extra, *values.shape[1:]))
    _set(weight, np.concatenate([values, fill], axis=0))
    if dequantize is not None:
        scale = _initializer(model, links, dequantize, 1)
        if numpy_helper.to_array(scale).size > 1:
            _extend(scale, extra, 1.0)
            if zero is not None:
                _extend(zero, extra, points[0])
    if kind == "depthwise":
        for attribute in conv.attribute:
            if attribute.name == "group":
                attribute.i = to
    if len(conv.input) > 2 and conv.input[2]:
        bias_dq = links.producers.get(conv.input[2])
        if bias_dq is not None and bias_dq.op_type == "DequantizeLinear":
            _extend(_initializer(model, links, bias_dq, 0), extra, 0)
            for index, fill_value in ((1, 1.0), (2, 0)):
                if len(bias_dq.input) > index and bias_dq.input[index]:
                    tensor = _initializer(model, links, bias_dq, index)
                    if numpy_helper.to_array(tensor).size > 1:
                        _extend(tensor, extra, fill_value)
        else:
            _extend(_initializer(model, links, conv, 2), extra, 0)


def _initializer(model: onnx.ModelProto, links: Links, node: onnx.NodeProto, index: int) -> onnx.TensorProto:
    """The initializer `node` reads at `index`, its own copy if other nodes read it too (edited in place)."""
    name = node.input[index]
    tensor = links.initializers[name]
    if links.own_constant(name, node):
        return tensor
    copy = model.graph.initializer.add()  # (append would store a copy of the message, not this one)
    copy.CopyFrom(tensor)
    copy.name = _unique(links, f"{name}/padded")
    links.initializers[copy.name] = copy
    links.readers.setdefault(copy.name, []).append(node)
    node.input[index] = copy.name
    return copy


def _unique(links: Links, name: str) -> str:
    candidate, n = name, 1
    while candidate in links.initializers or candidate in links.producers or candidate in links.readers:
        candidate, n = f"{name}_{n}", n + 1
    return candidate


def _set(tensor: onnx.TensorProto, values: np.ndarray) -> None:
    tensor.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(values), tensor.name))


def _extend(tensor: onnx.TensorProto, extra: int, fill) -> None:
    values = numpy_helper.to_array(tensor)
    _set(tensor, np.concatenate([values.reshape(-1), np.full(extra, fill, values.dtype)]).reshape(-1))
