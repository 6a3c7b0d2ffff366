"""Outlier positions: sequence positions whose activations stand far above the others', computed apart.

Why: transformer encoders put "massive activations" on a fixed position, BERT's [CLS] token above all. In
all-MiniLM-L6-v2 the FFN output of token 0 reaches 194 in layer 0 where the other 127 tokens stay within 5.1 (layer
1: 90.9 vs 3.5, layer 2: 163.7 vs 6.5). A per-tensor int8 scale (RKNN has no other for activations) fits that one
token, and the other tokens' values span a few of the 256 levels. Position-wise ops (a MatMul by a weight,
element-wise ops with constants, the residual Add, LayerNorm over the features) compute each position independently,
so the chain of them that ends in a LayerNorm can run as two copies, one on the outlier positions and one on the rest
(Slice on the sequence axis before, Concat after), each copy calibrated with its own ranges. Exact in float32
(verified on samples), the same model, int8 then fits both (BENCHMARKS.md: "outlier positions computed apart").

Pattern: a LayerNormalization over the last axis of a [batch, sequence, features] tensor; walking back from it
through position-wise ops whose outputs feed only the chain, up to the tensors computed elsewhere (the
previous LayerNorm's output, an attention context) which become the chain's inputs. Check: on calibration
samples, some position's largest |value| in a tensor of the chain is RATIO × the median position's in every
sample (a fixed position, not a [SEP] that moves with the sentence length). Replacement: Slice each input per
segment of positions, one copy of the chain per segment, Concat the LayerNorm outputs.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qprep.model.info import constant_names, graph_outputs, iter_nodes, tensor_shapes, unique_name
from qprep.model.runtime import intermediate_values
from qprep.quantize import rewrites
from qprep.quantize.backend import carried_float_set

log = logging.getLogger("qprep")

RATIO = 8.0  # a position stands apart when its largest |value| is this many times the median position's (3 bits)
MAX_SEGMENTS = 3  # e.g. a first token, the middle, a last token; more runs of outliers are left as they are
SEQUENCE_AXIS = 1
UNARY = {"Relu", "Gelu", "FastGelu", "Erf", "Tanh", "Sigmoid", "HardSigmoid", "HardSwish", "LeakyRelu", "Elu",
         "Softsign", "Softplus", "Neg", "Abs", "Sqrt", "Identity", "Mish", "Clip"}
BINARY = {"Add", "Sub", "Mul", "Div", "Pow"}


@dataclass
class Split:
    """The rewritten model and what later steps need to know about it."""

    model: onnx.ModelProto
    record: dict = field(default_factory=dict)  # for the report; empty when nothing was split
    copies: dict[str, list[str]] = field(default_factory=dict)  # split node → its copies, one per segment
    added: set[str] = field(default_factory=set)  # the Slices and Concats, which compute nothing

    def carried(self, names: set[str]) -> set[str]:
        """A set of node names in the rewritten model: a split node's copies where it was."""
        return carried_float_set(names, self.copies)


def split(model: onnx.ModelProto, samples: list[dict], threads: int = 2) -> Split:
    """`model` with the chains that have outlier positions computed per segment of positions, verified on
    `samples`; the model itself where no chain has any."""
    if not samples:
        return Split(model)
    chains = _chains(model)
    if not chains:
        return Split(model)
    peaks, lengths, reference = _position_peaks(model, [t for chain in chains for t in chain.internal], samples,
                                                threads)
    planned = []
    for chain in chains:
        positions = set().union(*(peaks.get(t, set()) for t in chain.internal))
        measured = [lengths[t] for t in chain.internal if t in lengths]
        segments = _segments(positions, min(measured)) if measured else []
        if segments:
            planned.append((chain, segments))
    if not planned:
        return Split(model)
    result = Split(onnx.ModelProto())
    result.model.CopyFrom(model)
    for chain, segments in planned:
        _rewrite(result, chain, segments)
    if rewrites.exact("splitting outlier positions", model, reference, result.model, samples, threads):
        return Split(model)
    result.record = {"chains": [{"layernorm": chain.nodes[-1].name, "nodes": len(chain.nodes),
                                 "segments": [[a, b] for a, b, _ in segments],
                                 "outliers": [[a, b] for a, b, outliers in segments if outliers]}
                                for chain, segments in planned],
                     "verified_on": len(samples)}
    log.info("quantize: %d LayerNorm chains computed apart for outlier positions (%s)", len(planned),
             ", ".join(f"{c.nodes[-1].name} {[[a, b] for a, b, _ in segs]}" for c, segs in planned[:4]))
    return result


def layernorm_chains(model: onnx.ModelProto) -> list[list[str]]:
    """Node names of every LayerNorm chain (the LayerNorm last): position-wise nodes that only the chain reads,
    what the RKNN fallback may make float16 as one candidate (one of its nodes alone only moves the int8
    conversion)."""
    return [[n.name for n in chain.nodes] for chain in _chains(model)]


class Chain:
    """Position-wise nodes in graph order, the LayerNorm last; `inputs` are the activations they read from
    outside the chain."""

    def __init__(self, nodes: list[onnx.NodeProto], inputs: list[str]):
        self.nodes, self.inputs = nodes, inputs
        self.internal = [t for node in nodes[:-1] for t in node.output if t]  # the tensors whose ranges it fixes


def _chains(model: onnx.ModelProto) -> list[Chain]:
    """Every LayerNorm's chain of position-wise nodes (two nodes at least: a chain of the LayerNorm alone has
    no range to fix). Dims must be known (RKNN fixes them): a chain of unknown sequence length is left whole."""
    graph = model.graph
    constants = constant_names(graph)
    names = Counter(n.name for n in iter_nodes(graph))
    shapes = {name: dims for name, (_, dims) in tensor_shapes(model).items()}
    producer = {o: n for n in graph.node for o in n.output}
    consumers: dict[str, list[str]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node.name)
    outputs = {o.name for o in graph.output}
    order = {id(n): i for i, n in enumerate(graph.node)}
    chains = []
    for node in graph.node:
        if not _is_layernorm(node, shapes) or not node.name or names[node.name] > 1:
            continue
        members = {node.name: node}
        stack = [node.input[0]]
        while stack:
            tensor = stack.pop()
            source = producer.get(tensor)
            if (source is None or source.name in members or not source.name or names[source.name] > 1
                    or not _rank3(tensor, shapes)
                    or not _position_wise(source, constants, shapes)):
                continue
            members[source.name] = source
            stack.extend(i for i in source.input if i and i not in constants)
        # nodes whose outputs are read outside the chain (or are graph outputs) cannot be copied away
        changed = True
        while changed:
            changed = False
            for name, member in list(members.items()):
                if member is node:
                    continue
                if any(o in outputs or any(c not in members for c in consumers.get(o, [])) for o in member.output):
                    del members[name]
                    changed = True
            reachable = _reaching(node, members, producer)
            if len(reachable) != len(members):
                members = reachable
                changed = True
        if len(members) < 2:
            continue
        nodes = sorted(members.values(), key=lambda n: order[id(n)])
        produced = {o for n in nodes for o in n.output}
        inputs = list(dict.fromkeys(i for n in nodes for i in n.input if i and i not in constants and i not in produced))
        # one sequence length throughout (a [batch, 1, features] input would broadcast, not slice)
        lengths = {shapes[t][SEQUENCE_AXIS] for t in inputs + [o for n in nodes for o in n.output] if _rank3(t, shapes)}
        if all(_rank3(i, shapes) for i in inputs) and len(lengths) == 1 and None not in lengths:
            chains.append(Chain(nodes, inputs))
    return chains


def _reaching(last: onnx.NodeProto, members: dict, producer: dict) -> dict:
    """The members the LayerNorm still reads from through members only."""
    kept, stack = {last.name: last}, list(last.input)
    while stack:
        source = producer.get(stack.pop())
        if source is not None and source.name in members and source.name not in kept:
            kept[source.name] = source
            stack.extend(source.input)
    return kept


def _is_layernorm(node: onnx.NodeProto, shapes: dict) -> bool:
    if node.op_type != "LayerNormalization" or node.domain not in ("", "ai.onnx") or not _rank3(node.input[0], shapes):
        return False
    axis = next((a.i for a in node.attribute if a.name == "axis"), -1)
    return axis in (-1, 2) and sum(1 for o in node.output if o) == 1


def _position_wise(node: onnx.NodeProto, constants: set[str], shapes: dict) -> bool:
    """Computes each sequence position from the same position of its inputs alone."""
    op = node.op_type
    if len([o for o in node.output if o]) != 1:
        return False
    if op in UNARY:
        return all(i in constants for i in node.input[1:] if i)
    if op == "MatMul":
        weight = node.input[1]
        return weight in constants and len(shapes.get(weight) or []) == 2
    if op in BINARY:
        for name in node.input:
            if name in constants:  # broadcast from the right: its dim on the sequence axis must be 1 or absent
                shape = shapes.get(name)
                if shape is None or len(shape) > 3 or (len(shape) >= 2 and shape[len(shape) - 3 + SEQUENCE_AXIS] != 1):
                    return False
            elif not _rank3(name, shapes):
                return False
        return True
    return False


def _rank3(name: str, shapes: dict) -> bool:
    shape = shapes.get(name)
    return shape is not None and len(shape) == 3


def _position_peaks(model: onnx.ModelProto, tensors: list[str], samples: list[dict],
                    threads: int) -> tuple[dict[str, set[int]], dict[str, int], list[dict]]:
    """(tensor → the positions that stand apart in every sample, tensor → its sequence length, the model's
    outputs per sample: the reference the rewrite is verified against, from the same run)."""
    peaks, lengths, reference = {}, {}, []
    outputs = [spec.name for spec in graph_outputs(model)]
    for values in intermediate_values(model, tensors + outputs, samples, threads):
        reference.append({name: values[name] for name in outputs if name in values})
        for name, value in ((n, values[n]) for n in tensors if n in values):
            if value.dtype.kind != "f" or value.ndim != 3 or value.shape[SEQUENCE_AXIS] < 2:
                peaks[name] = set()
                continue
            magnitude = np.abs(np.nan_to_num(value, posinf=0.0, neginf=0.0)).max(axis=(0, 2))
            median = float(np.median(magnitude))
            standing = {int(p) for p in np.flatnonzero(magnitude >= RATIO * median)} if median > 0 else set()
            peaks[name] = peaks[name] & standing if name in peaks else standing
            lengths[name] = min(lengths.get(name, value.shape[SEQUENCE_AXIS]), value.shape[SEQUENCE_AXIS])
    return peaks, lengths, reference


def _segments(positions: set[int], length: int) -> list[tuple[int, int, bool]]:
    """[start, end) runs covering 0..length, each run of outlier positions a segment of its own; none when there
    is no outlier, or more segments than MAX_SEGMENTS would take. The flag says whether a segment is outliers."""
    if not positions or length < 2 or len(positions) * 2 > length:
        return []
    cuts = {0, length}
    for p in positions:
        cuts |= {p, p + 1}
    bounds = sorted(cuts)
    segments = list(zip(bounds[:-1], bounds[1:]))
    merged: list[tuple[int, int]] = []
    for start, end in segments:  # neighbouring outlier positions share one segment
        if merged and start in positions and merged[-1][0] in positions:
            merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return [(start, end, start in positions) for start, end in merged] if len(merged) <= MAX_SEGMENTS else []


def _rewrite(result: Split, chain: Chain, segments: list[tuple[int, int, bool]]) -> None:
    """Replace the chain in `result.model` by one copy per segment between Slices and a Concat; the copies and
    the added nodes go into `result`."""
    graph, last = result.model.graph, chain.nodes[-1]
    index = next(i for i, n in enumerate(graph.node) if n.name == last.name)
    members = {n.name for n in chain.nodes}
    produced = {o for n in chain.nodes for o in n.output}
    taken = ({n.name for n in iter_nodes(graph)} | {t for n in iter_nodes(graph) for t in list(n.input) + list(n.output)}
             | {v.name for v in list(graph.initializer) + list(graph.input) + list(graph.value_info)})
    weights = {i.name: i for i in graph.initializer}

    def fresh(wanted: str) -> str:  # two split chains in a row would otherwise name a Slice like a copy
        return unique_name(wanted, taken)

    new_nodes, concat_inputs = [], []
    for segment, (start, end, outliers) in enumerate(segments):
        tag = f"positions_{start}_{end}"
        bounds = {}
        last_segment = end == segments[-1][1]  # to the end of whatever length the model is run with
        for key, value in (("starts", start), ("ends", np.iinfo(np.int64).max if last_segment else end),
                           ("axes", SEQUENCE_AXIS)):
            bounds[key] = fresh(f"{last.name}/{tag}/{key}")
            graph.initializer.append(numpy_helper.from_array(np.array([value], dtype=np.int64), bounds[key]))
        renamed = {}
        for tensor in chain.inputs:
            renamed[tensor] = fresh(f"{tensor}/{tag}/sliced")
            new_nodes.append(helper.make_node("Slice", [tensor, bounds["starts"], bounds["ends"], bounds["axes"]],
                                              [renamed[tensor]], name=fresh(f"{last.name}/{tag}/slice")))
        for node in chain.nodes:
            copy = onnx.NodeProto()
            copy.CopyFrom(node)
            copy.name = fresh(f"{node.name}/{tag}")
            for o in node.output:
                if o:
                    renamed[o] = fresh(f"{o}/{tag}")
            copy.input[:] = [renamed.get(i, i) for i in node.input]
            copy.output[:] = [renamed.get(o, o) for o in node.output]
            if segment:  # each copy its own weights: GPTQ rounds a weight one MatMul reads (rknn/weights.py)
                for position, name in enumerate(node.input):
                    if name in weights:
                        clone = onnx.TensorProto()
                        clone.CopyFrom(weights[name])
                        clone.name = fresh(f"{name}/{tag}")
                        graph.initializer.append(clone)
                        copy.input[position] = clone.name
            new_nodes.append(copy)
            result.copies.setdefault(node.name, []).append(copy.name)
        concat_inputs.append(renamed[last.output[0]])
    new_nodes.append(helper.make_node("Concat", concat_inputs, [last.output[0]], name=fresh(f"{last.name}/concat"),
                                      axis=SEQUENCE_AXIS))
    result.added |= {n.name for n in new_nodes if n.op_type in ("Slice", "Concat")}
    kept = [n for n in graph.node if n.name not in members]
    position = sum(1 for n in graph.node[:index] if n.name not in members)
    del graph.node[:]
    graph.node.extend(kept[:position] + new_nodes + kept[position:])
    gone = produced - {last.output[0]}
    values = [v for v in graph.value_info if v.name not in gone]
    del graph.value_info[:]
    graph.value_info.extend(values)
