"""Residual channels: the few huge channels of a transformer's residual stream scaled down before int8 sees them.

Why: post-LN transformers grow "massive activations" in a few fixed feature channels of the residual sum that a
LayerNorm reads (all-MiniLM-L6-v2: channel 223 of the FFN output reaches 46 in layers 4–5; the residual sums
there peak 23–35× their median channel). One per-tensor int8 scale (RKNN's only one for activations) fits that
channel, and every other channel of the FFN output, the residual Add and the LayerNorm's input spans a handful
of the 256 levels. Keeping that path float16 costs 3 layers per block (BENCHMARKS.md: "residual channels scaled down").
Scaling the channels down needs the LayerNorm to know: its mean and variance are over the true values, so it is
computed from the scaled tensor z' = z / d with per-channel weights:

    mean = z' · (d/N)           MatMul [N, 1]        (per position)
    u    = z' − mean · (1/d)    MatMul [1, N], Sub   (centered, still scaled: no huge channel)
    var  = (u ⊙ u) · (d²/N)     Mul, MatMul [N, 1]
    y    = u / sqrt(var + ε) ⊙ (γ·d) + β

Every tensor then fits int8 and the result is exact in float32 (BENCHMARKS.md: "residual channels scaled
down").

Pattern: a LayerNormalization over the last axis with constant γ (and β), its input an Add (the residual sum)
that only it reads. Check: on calibration samples the sum's largest channel peak is RATIO × the median
channel's. Replacement: both Add inputs divided by d (d = peak / (HEADROOM × median peak), within [1, MAX_DIVISOR]) —
folded into the constants that compute them where this path alone reads them (a MatMul's weight columns and its
bias, a restoring Mul's constant, an embedding table's columns, through the Adds between), else one added Mul —
and the LayerNorm replaced by the computation above. Verified on the calibration samples; the model is left as
it was when the outputs change.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qprep.model.info import Links, node_index, unique_name
from qprep.quantize import rewrites
from qprep.quantize.backend import carried_float_set
from qprep.quantize.channel_spread import last_axis_peaks
from qprep.schema import Key

log = logging.getLogger("qprep")

OPTION = Key("bool", default=True, doc="scale a residual sum's huge channels down before int8 and compute the "
             "LayerNorm that reads it from the scaled sum (quantize/residual_channels.py)")

RATIO = 8.0  # rewritten when the largest channel peak is this many times the median one (3 int8 bits lost)
HEADROOM = 2.0  # a scaled channel's peak: this many times the median channel's
SAMPLES = 16  # calibration samples the channel peaks are measured on
# the largest divisor: a channel divided by ~1000 (BERT's [CLS] position computed apart, whose median channel is
# tiny) left its MatMul's weight column below what the toolkit's int8 weight grid keeps (single cosine 0.78)
MAX_DIVISOR = 32.0
MAX_DEPTH = 4  # Adds walked back through from the residual sum (BERT's embeddings: word + type + position)


@dataclass
class Rescaled:
    model: onnx.ModelProto
    record: dict = field(default_factory=dict)  # for the report; empty when nothing was rewritten
    float_nodes: dict[str, list[str]] = field(default_factory=dict)  # a float LayerNorm → the nodes computing it now

    def carried(self, float_set: set[str]) -> set[str]:
        """`float_set` with each rewritten float LayerNorm replaced by the nodes that compute it now."""
        return carried_float_set(float_set, self.float_nodes)


@dataclass(eq=False)
class _Site:
    layernorm: onnx.NodeProto
    add: onnx.NodeProto


def rescale(model: onnx.ModelProto, samples: list[dict], threads: int = 2,
            keep: set[str] = frozenset()) -> Rescaled:
    """`model` with the residual sums whose channels spread ≥ RATIO scaled down and their LayerNorms computed
    from the scaled sums, verified on `samples`; the model itself when none spreads or the outputs changed.
    A LayerNorm in `keep` (the float set) is rewritten too, and the nodes that compute it now stay float in its
    place (`float_nodes`): float16 on the LayerNorm alone leaves the int8 sum that feeds it with its huge channel
    (BENCHMARKS.md: "residual channels scaled down") — unless float16 could not hold that computation
    (`_float16_computes`)."""
    sites = _sites(model) if samples else []
    if not sites:
        return Rescaled(model)
    outputs = [o.name for o in model.graph.output]
    peaks, reference = last_axis_peaks(model, [site.add.output[0] for site in sites], samples, threads, outputs)
    spread = {name: peak for name, peak in peaks.items()
              if np.median(peak) > 0 and peak.max() >= RATIO * np.median(peak)}
    if not spread:
        return Rescaled(model)
    result = onnx.ModelProto()
    result.CopyFrom(model)
    taken = ({n.name for n in result.graph.node} | {t for n in result.graph.node for t in n.output}
             | {t.name for t in result.graph.initializer})
    record, float_nodes = [], {}
    for site in (site for site in _sites(result) if site.add.output[0] in spread):
        peak = spread[site.add.output[0]]
        median = float(np.median(peak))
        divisor = np.clip(peak / (HEADROOM * median), 1.0, MAX_DIVISOR).astype(np.float32)
        if site.layernorm.name in keep and not _float16_computes(peak, divisor):
            continue  # its float16 LayerNorm stays as it is: computed from the scaled sum it could overflow
        links = Links(result)  # each site's rewrite changes the graph the next one reads
        folded = [how for name in site.add.input for how in _divide(result, links, name, site.add, divisor, taken)]
        computing = _replace_layernorm(result, links, site.layernorm, divisor, taken)
        if site.layernorm.name in keep:
            float_nodes[site.layernorm.name] = computing
        record.append({"layernorm": site.layernorm.name, "channels": int((divisor > 1).sum()),
                       "spread_before": round(float(peak.max() / median), 1), "inputs": folded,
                       **({"float": True} if site.layernorm.name in keep else {})})
    if not record:  # every spread sum feeds a float16 LayerNorm that stays as it is
        return Rescaled(model)
    if rewrites.exact("scaling residual channels", model, reference, result, samples, threads):
        return Rescaled(model)
    log.info("quantize: %d residual sums' huge channels scaled down, their LayerNorms computed from the scaled sums",
             len(record))
    return Rescaled(result, {"layernorms": record, "verified_on": len(samples)}, float_nodes)


def _float16_computes(peak: np.ndarray, divisor: np.ndarray) -> bool:
    """Whether float16 holds a kept LayerNorm's computation from the scaled sum with 4× to spare: the centered
    scaled values' squares (centered ≤ twice the largest scaled peak) and the variance (≤ the mean of the channels'
    squared peaks). MiniLM: largest scaled peak ~6, variance bound ~100; the float16 LayerNorm layer itself
    needs no such bound."""
    limit = float(np.finfo(np.float16).max) / 4
    return float((2 * (peak / divisor).max()) ** 2) < limit and float(np.mean(peak.astype(np.float64) ** 2)) < limit


def _sites(model: onnx.ModelProto) -> list[_Site]:
    links = Links(model)
    sites = []
    for node in model.graph.node:
        if node.op_type != "LayerNormalization" or node.domain not in ("", "ai.onnx") or len(node.input) < 2:
            continue
        gamma = links.initializers.get(node.input[1])
        add = links.producers.get(node.input[0])
        if (gamma is None or len(gamma.dims) != 1 or gamma.data_type != onnx.TensorProto.FLOAT
                or any(node.output[1:]) or not links.last_axis(node)
                or not all(c in links.initializers for c in node.input[1:] if c)
                or add is None or add.op_type != "Add" or add.domain not in ("", "ai.onnx")
                or len(add.input) != 2 or add.input[0] == add.input[1]
                or all(i in links.initializers for i in add.input)
                or not links.only_reader(add.output[0], node)):
            continue
        sites.append(_Site(node, add))
    return sites


def _divide(model: onnx.ModelProto, links: Links, tensor: str, reader: onnx.NodeProto, divisor: np.ndarray,
            taken: set[str], depth: int = 0) -> list[str]:
    """`tensor`, as `reader` reads it, divided by `divisor` along its last axis: in the constants that compute it
    where they are this path's alone (a MatMul's weight columns, a Gather's table columns, a Mul's or an Add's
    constant; through Adds and Subs of computed tensors, both sides), else by one Mul added in front of
    `reader`. How each part was divided: "weights", "constant" or "added mul"."""
    if tensor in links.initializers:
        if links.own_constant(tensor, reader) and _per_channel(links.initializers[tensor], divisor):
            _divide_constant(links, tensor, divisor)
            return ["constant"]
    producer = links.producers.get(tensor)
    if (producer is not None and producer.domain in ("", "ai.onnx") and links.only_reader(tensor, reader)
            and depth < MAX_DEPTH):
        op, inputs = producer.op_type, list(producer.input)
        if op in ("MatMul", "Gather") and _own_table(links, producer, divisor):
            _divide_constant(links, inputs[1 if op == "MatMul" else 0], divisor)
            return ["weights"]
        if op == "Mul" and len(inputs) == 2 and sum(i in links.initializers for i in inputs) == 1:
            constant = next(i for i in inputs if i in links.initializers)
            if links.own_constant(constant, producer) and _per_channel(links.initializers[constant], divisor):
                _divide_constant(links, constant, divisor)
                return ["constant"]
        if op in ("Add", "Sub") and len(inputs) == 2 and inputs[0] != inputs[1]:
            return [how for name in inputs for how in _divide(model, links, name, producer, divisor, taken, depth + 1)]
    inverse = unique_name(f"{reader.name}/residual_scale", taken)
    model.graph.initializer.append(numpy_helper.from_array((1.0 / divisor).astype(np.float32), inverse))
    scaled = unique_name(f"{tensor}/scaled", taken)
    mul = helper.make_node("Mul", [tensor, inverse], [scaled], name=unique_name(f"{reader.name}/scale", taken))
    for k, name in enumerate(reader.input):
        if name == tensor:
            reader.input[k] = scaled
    model.graph.node.insert(node_index(model.graph, reader), mul)
    return ["added mul"]


def _own_table(links: Links, node: onnx.NodeProto, divisor: np.ndarray) -> bool:
    """A MatMul by a 2-D constant, or a Gather (axis 0) from a 2-D constant table, that only this node reads and
    whose columns are the channels."""
    if node.op_type == "MatMul":
        name, other = node.input[1], node.input[0]
    else:
        name, other = node.input[0], node.input[1]
        if next((a.i for a in node.attribute if a.name == "axis"), 0) != 0:
            return False
    table = links.initializers.get(name)
    return (table is not None and name != other and len(table.dims) == 2 and table.dims[1] == divisor.size
            and table.data_type == onnx.TensorProto.FLOAT and links.own_constant(name, node))


def _per_channel(tensor: onnx.TensorProto, divisor: np.ndarray) -> bool:
    """A float constant whose last axis is the channels, or broadcast over them."""
    dims = list(tensor.dims)
    return tensor.data_type == onnx.TensorProto.FLOAT and (not dims or dims[-1] in (1, divisor.size))


def _divide_constant(links: Links, name: str, divisor: np.ndarray) -> None:
    tensor = links.initializers[name]
    value = numpy_helper.to_array(tensor)
    if value.shape[-1:] != divisor.shape:  # one value for every channel: it now differs per channel
        value = np.broadcast_to(value, value.shape[:-1] + divisor.shape)
    tensor.CopyFrom(numpy_helper.from_array((value / divisor).astype(np.float32), name))


def _replace_layernorm(model: onnx.ModelProto, links: Links, layernorm: onnx.NodeProto, divisor: np.ndarray,
                       taken: set[str]) -> list[str]:
    """`layernorm` (reading the scaled sum now) replaced by its computation from the scaled sum, whose node names
    it returns. The last node writes the LayerNorm's output tensor, so its readers are unchanged; γ and β go when
    nothing else reads them."""
    size = divisor.size
    epsilon = next((a.f for a in layernorm.attribute if a.name == "epsilon"), 1e-5)
    gamma = numpy_helper.to_array(links.initializers[layernorm.input[1]])
    beta = (numpy_helper.to_array(links.initializers[layernorm.input[2]])
            if len(layernorm.input) > 2 and layernorm.input[2] else np.zeros_like(gamma))
    base = layernorm.name

    def constant(what: str, value: np.ndarray) -> str:
        name = unique_name(f"{base}/{what}", taken)
        model.graph.initializer.append(numpy_helper.from_array(np.asarray(value, np.float32), name))
        return name

    nodes = []

    def node(op: str, inputs: list[str], what: str, output: str | None = None) -> str:
        output = output or unique_name(f"{base}/{what}_output", taken)
        nodes.append(helper.make_node(op, inputs, [output], name=unique_name(f"{base}/{what}", taken)))
        return output

    scaled = layernorm.input[0]
    mean = node("MatMul", [scaled, constant("mean_weights", (divisor / size)[:, None])], "mean")
    spread_mean = node("MatMul", [mean, constant("inverse_scale", (1.0 / divisor)[None, :])], "mean_per_channel")
    centered = node("Sub", [scaled, spread_mean], "centered")
    squared = node("Mul", [centered, centered], "squared")
    variance = node("MatMul", [squared, constant("variance_weights", (divisor * divisor / size)[:, None])], "variance")
    deviation = node("Sqrt", [node("Add", [variance, constant("epsilon", np.array(epsilon))], "variance_epsilon")],
                     "deviation")
    normalized = node("Div", [centered, deviation], "normalized")
    weighted = node("Mul", [normalized, constant("gamma", gamma * divisor)], "gamma")
    node("Add", [weighted, constant("beta", beta)], "beta", output=layernorm.output[0])
    index = node_index(model.graph, layernorm)
    model.graph.node.remove(layernorm)
    for offset, new in enumerate(nodes):
        model.graph.node.insert(index + offset, new)
    for name in dict.fromkeys(i for i in layernorm.input[1:] if i):
        if links.own_constant(name, layernorm):
            model.graph.initializer.remove(links.initializers[name])
    return [new.name for new in nodes]
