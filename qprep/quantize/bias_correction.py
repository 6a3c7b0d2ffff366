"""Empirical bias correction of a QDQ model (Nagel et al., "Data-Free Quantization", 2019, section 4.2).

Why: the rounding errors of weights and activations do not average out per output channel. A depthwise
convolution sums only 9 products per output, so its channels' means drift, and the drift of one layer feeds
every layer after it. Moving each layer's integer bias by the drift measured on calibration data removes it
at no inference cost, and can spare the fallback the float nodes it would otherwise need (BENCHMARKS.md:
"empirical bias correction").

How: layers are corrected in waves, a wave being the layers whose upstream layers are all corrected; per wave,
the QDQ model as written runs over the samples up to the wave's layers (runtime.Stepwise: only the nodes no
earlier wave ran, from the tensors earlier waves left, with their layers' corrections added; past
MAX_HELD_BYTES, or where parts cannot go on, the whole corrected model per wave), giving each layer's
per-channel output mean, compared with the float model's. Only int32 bias initializers change; the caller
keeps the result only if the model's output error goes down.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from qprep.model.io import reads
from qprep.model.runtime import Stepwise, intermediate_values

LAYER_OPS = {"Conv": 1, "ConvTranspose": 1, "Gemm": -1}  # op type → channel axis of its output
# A smaller rise of the calibration SQNR is no evidence the correction helps: held-out figures can move the other
# way (BENCHMARKS.md: "a correction kept only above 0.1 dB")
MIN_GAIN_DB = 0.1
INT32 = np.iinfo(np.int32)
# Beyond this the tensors later waves read are let go and each remaining wave runs the corrected model again: they
# grow with samples × resolution, one 64-channel U-Net skip at 1024² is 256 MiB a sample (BENCHMARKS.md: "bias
# correction's held tensors")
MAX_HELD_BYTES = 2 << 30


@dataclass
class BiasLayer:
    node: str
    output: str  # the node's output in the QDQ model
    float_output: str  # the same node's output in the float model
    bias: str  # int32 initializer read by the bias DequantizeLinear
    scale: np.ndarray  # that DequantizeLinear's scale (zero point 0)
    axis: int
    upstream: set[str]  # bias layers this one depends on


def find_layers(qdq_model: onnx.ModelProto, float_model: onnx.ModelProto) -> list[BiasLayer]:
    """Conv/ConvTranspose/Gemm nodes whose bias is a DequantizeLinear of an int32 initializer read by nothing
    else, matched by name to the float model, in graph order (a Gemm only with beta 1: its bias adds as it is).
    What a node depends on includes the tensors its If/Loop/Scan bodies read."""
    inits = {t.name: t for t in qdq_model.graph.initializer}
    float_nodes = {n.name: n for n in float_model.graph.node}
    producer = {o: n for n in qdq_model.graph.node for o in n.output if o}
    readers = Counter(name for node in qdq_model.graph.node for name in reads(node))
    layers: dict[str, BiasLayer] = {}
    feeds: dict[str, set[str]] = {}  # tensor → bias layers it depends on
    for node in qdq_model.graph.node:
        upstream = set().union(*(feeds.get(i, set()) for i in reads(node)))
        original = float_nodes.get(node.name)
        dq = producer.get(node.input[2]) if node.op_type in LAYER_OPS and len(node.input) > 2 else None
        beta = next((a.f for a in node.attribute if a.name == "beta"), 1.0)
        if (dq is not None and dq.op_type == "DequantizeLinear" and original is not None and beta == 1.0
                and original.op_type == node.op_type and dq.input[0] in inits and dq.input[1] in inits
                and inits[dq.input[0]].data_type == onnx.TensorProto.INT32 and readers[dq.input[0]] == 1
                and readers[node.input[2]] == 1):
            layers[node.name] = BiasLayer(node.name, node.output[0], original.output[0], dq.input[0],
                                          numpy_helper.to_array(inits[dq.input[1]]).astype(np.float64),
                                          LAYER_OPS[node.op_type], upstream)
            upstream = upstream | {node.name}
        for output in node.output:
            feeds[output] = upstream
    return list(layers.values())


class FloatMeans:
    """The float model's per-channel output means on the samples, measured once per tensor: every bias
    correction of a search (one per float set) compares its layers with the same float model."""

    def __init__(self, float_model: onnx.ModelProto, samples: list[dict], threads: int = 2):
        self.float_model, self.samples, self.threads = float_model, samples, threads
        self.means: dict[str, np.ndarray] = {}

    def of(self, layers: list[BiasLayer]) -> dict[str, np.ndarray]:
        axes = {layer.float_output: layer.axis for layer in layers if layer.float_output not in self.means}
        if axes:
            self.means.update(_channel_means(intermediate_values(self.float_model, list(axes), self.samples,
                                                                 self.threads), axes))
        return {layer.float_output: self.means[layer.float_output] for layer in layers
                if layer.float_output in self.means}


def corrections(qdq_model: onnx.ModelProto, float_means: FloatMeans, layers: list[BiasLayer],
                samples: list[dict], threads: int = 2, budget=None) -> dict[str, np.ndarray]:
    """{node: bias shift in float units} that brings each layer's per-channel output mean on `samples` to the
    float model's (`float_means`, on the same samples), with every upstream correction applied before a layer is
    measured. With a `budget` (quantize/budget.py), a wave is started only if it and the caller's check (two
    more runs of the whole model: kind "bias check", which the caller records) fit: the layers corrected so far
    are a valid correction on their own (their upstream layers are all among them)."""
    expected = float_means.of(layers)
    biases = {t.name: numpy_helper.to_array(t).astype(np.int64) for t in qdq_model.graph.initializer
              if t.name in {layer.bias for layer in layers}}
    stepwise = Stepwise(qdq_model, samples, threads)
    shifts: dict[str, np.ndarray] = {}
    for index, wave in enumerate(waves(layers)):
        if budget is not None:
            check = budget.predict("bias check")
            wave_cost = budget.predict("bias wave") if stepwise is not None else max(budget.predict("bias wave"), check)
            if not budget.allows(f"bias correction waves {index + 1}+", wave_cost + 2 * check):
                break
        start = time.perf_counter()
        axes = {layer.output: layer.axis for layer in wave}
        values = stepwise.advance(list(axes)) if stepwise is not None else None
        if values is None:  # too much held, or parts that cannot go on: the whole model, as corrected so far
            stepwise = None
            values = intermediate_values(apply(qdq_model, layers, shifts), list(axes), samples, threads)
        measured = _channel_means(values, axes)
        if stepwise is not None and stepwise.held_bytes() > MAX_HELD_BYTES:
            stepwise = None
        if budget is not None:
            budget.record("bias wave", time.perf_counter() - start)
        for layer in wave:
            bias = biases.get(layer.bias)
            if layer.output not in measured or layer.float_output not in expected or bias is None:
                continue
            shift = expected[layer.float_output] - measured[layer.output]
            if shift.shape != bias.shape:
                continue
            shifts[layer.node] = shift
            if stepwise is not None:  # what the moved bias adds to the layer's output, for the waves after it
                stepwise.add(layer.output, (_moved(bias, shift, layer.scale) - bias) * layer.scale, layer.axis)
    return shifts


def waves(layers: list[BiasLayer]) -> list[list[BiasLayer]]:
    """Layers grouped in measuring order: a layer joins the first wave after every layer upstream of it (each
    wave runs the nodes no earlier wave ran, so the cost is about one model run per sample)."""
    done: set[str] = set()
    groups = []
    while len(done) < len(layers):
        wave = [layer for layer in layers if layer.node not in done and layer.upstream <= done]
        groups.append(wave)
        done |= {layer.node for layer in wave}
    return groups


def prefixes(layers: list[BiasLayer], shifts: dict[str, np.ndarray]) -> list[tuple[int, dict[str, np.ndarray]]]:
    """(wave count, the shifts of the first that many waves) for 1, 2, 4, … and all the measured waves, the
    shortest first: each is a valid correction on its own (a wave's upstream layers are in earlier waves). Why:
    on HardSwish CNNs the first waves help and the later ones undo it, while on other models all of them together
    help most (BENCHMARKS.md: "Bias correction keeps the best prefix")."""
    measured = [wave for wave in waves(layers) if any(layer.node in shifts for layer in wave)]
    counts = sorted({min(1 << k, len(measured)) for k in range(len(measured).bit_length() + 1)} - {0})
    return [(count, {layer.node: shifts[layer.node] for wave in measured[:count] for layer in wave
                     if layer.node in shifts}) for count in counts]


def apply(qdq_model: onnx.ModelProto, layers: list[BiasLayer], shifts: dict[str, np.ndarray]) -> onnx.ModelProto:
    """A copy of `qdq_model` with each layer's int32 bias moved by its shift (rounded to its grid)."""
    model = onnx.ModelProto()
    model.CopyFrom(qdq_model)
    inits = {t.name: t for t in model.graph.initializer}
    for layer in layers:
        shift = shifts.get(layer.node)
        tensor = inits.get(layer.bias)
        if shift is None or tensor is None:
            continue
        bias = numpy_helper.to_array(tensor).astype(np.int64)
        if bias.shape != shift.shape:
            continue
        tensor.CopyFrom(numpy_helper.from_array(_moved(bias, shift, layer.scale).astype(np.int32), tensor.name))
    return model


def _moved(bias: np.ndarray, shift: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """An int32 bias (as int64) moved by `shift` float units, rounded to its grid and kept within int32."""
    steps = np.nan_to_num(np.round(shift / scale), nan=0.0)  # on a ~0 scale a shift is ±inf steps
    return np.clip(bias + steps, INT32.min, INT32.max).astype(np.int64)  # in float64: clipped before it is cast


def _channel_means(values, axes: dict[str, int]) -> dict[str, np.ndarray]:
    """{tensor: its mean per channel (along its axis in `axes`)} over the samples' `values` ({tensor: value})."""
    sums: dict[str, np.ndarray] = {}
    count = 0
    for sample in values:
        count += 1
        for name, value in sample.items():
            if name in axes:
                axis = axes[name] % value.ndim
                sums[name] = sums.get(name, 0) + value.mean(  # summed in float64 without a float64 copy
                    axis=tuple(i for i in range(value.ndim) if i != axis), dtype=np.float64)
    return {name: total / count for name, total in sums.items()}
