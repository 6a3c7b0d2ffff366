"""Weights pre-rounded onto rknn-toolkit2's own int8 grid with GPTQ, so the toolkit's rounding is exact.

Why: the toolkit rounds every weight to the nearest integer (its `mmse` algorithm searches better weight ranges
but makes every build minutes long). GPTQ (gptq.gptq) chooses integers that minimise each layer's
*output* error instead. The toolkit cannot be handed integers, but it can be handed float weights that already
sit on the grid it will derive: measured with rknn-toolkit2 2.5.0 (`quantized_algorithm: normal`,
`quantized_method: channel`, w8a8), each output channel is quantized asymmetrically over
[min(w, 0), max(w, 0)] with scale (max - min) / 255 and zero point round(-128 - min / scale). Each channel
keeps an element at -128 and at 127 (its original extremes, which nearest rounding puts there anyway), so the
toolkit derives the same scale and zero point from the new weights, and its rounding returns GPTQ's integers.

Handled: Conv, and MatMul/Gemm with a 2-D weight (the toolkit turns them into 1x1 convolutions quantized per
output column, measured the same way), each with an initializer weight of its own. The layer inputs for GPTQ
come from the float model on the calibration samples.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
from onnx import numpy_helper

from qprep.quantize import gptq
from qprep.quantize.gptq import Layer

QMIN, QMAX = -128, 127


def grid(weight: np.ndarray, axis: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The toolkit's per-output-channel (scale, zero point) for a weight whose output channels run along `axis`."""
    rows = _channels(weight, axis).astype(np.float64)
    low, high = np.minimum(rows.min(axis=1), 0.0), np.maximum(rows.max(axis=1), 0.0)
    scale = (high - low) / (QMAX - QMIN)
    scale = np.where(scale > 0, scale, 1.0)  # an all-zero channel: any grid holds it exactly
    return scale, np.round(QMIN - low / scale)


def _channels(weight: np.ndarray, axis: int) -> np.ndarray:
    """[output channels, everything else]."""
    return np.moveaxis(weight, axis, 0).reshape(weight.shape[axis], -1)


def layers(model: onnx.ModelProto) -> list[Layer]:
    """The weighted nodes with an initializer weight of their own, in the form gptq.gptq takes."""
    inits = {t.name: t for t in model.graph.initializer}
    uses = Counter(i for n in model.graph.node for i in n.input)
    found = []
    for node in model.graph.node:
        if (node.op_type not in ("Conv", "MatMul", "Gemm") or len(node.input) < 2 or node.input[1] not in inits
                or uses[node.input[1]] != 1):
            continue
        weight = numpy_helper.to_array(inits[node.input[1]])
        form = gptq.weighted_form(node, weight.ndim) if weight.dtype == np.float32 else None
        if form is None:
            continue
        kind, groups, attrs = form
        axis = 0 if kind in ("conv", "gemm_t") else 1
        scale, zero = grid(weight, axis)
        found.append(Layer(node.name, kind, node.input[0], node.input[1], weight.astype(np.float64), scale, zero,
                           axis, groups, attrs))
    return found


def on_grid(model: onnx.ModelProto, samples: list[dict], threads: int = 2) -> tuple[onnx.ModelProto, int, dict]:
    """A copy of `model` whose weights sit on the toolkit's grid (GPTQ integers); the number of layers
    re-rounded; why the others are left to the toolkit's nearest rounding (gptq.left_nearest: the calibration
    samples do not determine their input moments, or they are too wide for GPTQ here)."""
    weighted = layers(model)
    moments = gptq.input_moments(model, weighted, samples, threads) if weighted and samples else {}
    result = onnx.ModelProto()
    result.CopyFrom(model)
    inits = {t.name: t for t in result.graph.initializer}
    changed = 0
    for layer in weighted:
        if layer.node not in moments:
            continue
        integers = gptq.rounded(layer, moments[layer.node], QMIN, QMAX)
        rows, flat = _channels(integers, layer.axis).copy(), _channels(layer.float_weight, layer.axis)
        low, high = flat.argmin(axis=1), flat.argmax(axis=1)
        index = np.arange(rows.shape[0])
        # the extremes stay at the ends of the grid, so the toolkit derives this grid again from the new weights
        rows[index, low] = np.where(flat[index, low] < 0, QMIN, rows[index, low])
        rows[index, high] = np.where(flat[index, high] > 0, QMAX, rows[index, high])
        scale, zero = layer.scale.reshape(-1, 1), layer.zero_point.reshape(-1, 1)
        shape = np.moveaxis(layer.float_weight, layer.axis, 0).shape
        weight = np.moveaxis(((rows - zero) * scale).reshape(shape), 0, layer.axis).astype(np.float32)
        inits[layer.quantized].CopyFrom(numpy_helper.from_array(weight, layer.quantized))
        changed += 1
    return result, changed, gptq.left_nearest(weighted, moments)
