"""A fallback ranking trial's model derived from the build it adds one candidate to, instead of a new build.

Why: the fallback ranks each candidate (an activation edge) by the build with it float on top of the current
float set, the *reference*, built just before. A build runs ONNX Runtime's quantizer over the whole graph (90 of
them in a round on EfficientNet-Lite0), where a candidate changes a few nodes. Derived by those edits the
model is the one the quantizer writes: on EfficientNet-Lite0 all 90 candidates gave the same outputs as their
builds, to the last printed digit, each in a small part of a build's time (BENCHMARKS.md: "ranking trials
derived from the build they add to").

What ONNX Runtime's QDQ quantizer does, which the edits follow:
- a node left float reads the float model's weights and bias (not the DequantizeLinear of its integers);
- a tensor is rounded (QuantizeLinear → DequantizeLinear after it) while a quantized node produces or reads it:
  once none does, its readers read it unrounded;
- a Relu/Clip right after a quantized node is removed (the Q/DQ's range clips): made float, or its producer made
  float, it is put back, and when its producer stays quantized the tensor between them is rounded with the Q/DQ
  pair that a build with those activations float writes (`split`, built once per reference when first needed).
A change outside these (a node neither in the reference nor such an activation, weights in external files) gives
None: the caller builds.
"""

from __future__ import annotations

from typing import Callable

import onnx

QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")
# ORT's QDQ quantizer quantizes these only when their input is quantized, and writes their output's Q/DQ on the
# input's scale (onnxruntime.quantization.operators: QDQDirect8BitOp, QDQResize, QDQMaxPool, QDQPad, QDQSplit,
# QDQGather, QDQWhere): next to a candidate, the build decides anew (PP-OCRv4 rec: a Reshape after a float Softmax
# went float and its output got its own scale). Such a change is built, not derived.
FOLLOWS_INPUT = frozenset({"Reshape", "Transpose", "Squeeze", "Unsqueeze", "AveragePool", "Slice", "TopK", "Resize",
                           "MaxPool", "Pad", "Split", "Gather", "GatherElements", "Where"})


class Derivation:
    """Builds with more nodes float, derived from `reference` (a static QDQ build of `float_model`, the model
    ORT's quantizer was given: node names match). `split(removed)`: a build of the same float set with the
    `removed` activations (those the quantizer took out) float as well, for the Q/DQ pairs it writes before them.
    `quantizable`: the nodes the reference's build may quantize (its op types, not its float set); a node outside
    it that reads a DequantizeLinear is a float node reading a rounded tensor (PP-OCRv4 rec's Adds, left float as
    an op type), and keeps nothing rounded once its neighbours are float."""

    def __init__(self, float_model: onnx.ModelProto, reference: onnx.ModelProto,
                 split: Callable[[set[str]], onnx.ModelProto], quantizable: set[str] | None = None):
        self.reference, self._build_split = reference, split
        self._split: dict[str, tuple[onnx.NodeProto, onnx.NodeProto, list[onnx.TensorProto]]] | None = None
        self.float_nodes = {n.name: n for n in float_model.graph.node}
        self.float_weights = {t.name: t for t in float_model.graph.initializer}
        self.external = any(t.data_location == onnx.TensorProto.EXTERNAL for t in float_model.graph.initializer)
        self.touchers: dict[str, set[str]] = {}  # float-model tensor → nodes that round it when quantized
        for node in float_model.graph.node:
            for name in [*node.input, *node.output]:
                if name:
                    self.touchers.setdefault(name, set()).add(node.name)
        self.float_producer = {o: n.name for n in float_model.graph.node for o in n.output}
        self.readers: dict[str, list[str]] = {}
        for node in float_model.graph.node:
            for name in node.input:
                self.readers.setdefault(name, []).append(node.name)
        # a FOLLOWS_INPUT node does not round its output by itself: its readers decide (mediapipe face detection:
        # a MaxPool's output went unrounded once the Pad reading it was float)
        for node in float_model.graph.node:
            if node.op_type in FOLLOWS_INPUT:
                for name in node.output:
                    self.touchers.get(name, set()).discard(node.name)
        present = {n.name for n in reference.graph.node}
        dequantized = {o for n in reference.graph.node if n.op_type == "DequantizeLinear" for o in n.output}
        # quantized in the reference: a node reading a DequantizeLinear, or one the quantizer removed (absorbed)
        self.removed = set(self.float_nodes) - present
        reading = {n.name for n in reference.graph.node if n.op_type not in QDQ_OPS and set(n.input) & dequantized}
        self.quantized_weights = {original for n in reference.graph.node if n.name in self.float_nodes
                                  for original, name in zip(self.float_nodes[n.name].input, n.input)
                                  if original in self.float_weights and name in dequantized}
        self.quantized = (reading if quantizable is None else reading & quantizable) | self.removed

    def derive(self, nodes: set[str]) -> onnx.ModelProto | None:
        """The reference with `nodes` float as well (nodes the reference quantizes), or None if the edits above
        do not cover it."""
        if self.external or not nodes <= set(self.float_nodes):
            return None
        nodes = self._with_freed_activations(nodes)
        still_quantized = self.quantized - nodes
        if not self._decided_alike(nodes, still_quantized):
            return None
        edit = _Edit(self.reference)
        for name in sorted(nodes):  # weights back to float; removed activations put back
            original, node = self.float_nodes[name], edit.by_name.get(name)
            if node is None:
                node = self._put_back(original, nodes, edit)
                if node is None:
                    return None
                edit.by_name[name] = edit.producer[original.output[0]] = node
                continue
            for index, tensor in enumerate(original.input):
                if tensor in self.float_weights and index < len(node.input):
                    node.input[index] = edit.float_weight(self.float_weights[tensor])
        touched = {t for name in nodes for t in [*self.float_nodes[name].input, *self.float_nodes[name].output]
                   if t and t not in self.float_weights}
        for tensor in sorted(touched):  # unrounded where no quantized node produces or reads it any more
            if not self.touchers.get(tensor, set()) & still_quantized:
                self._unround(tensor, edit)
        return edit.result()

    def _unround(self, tensor: str, edit: "_Edit") -> None:
        """Its readers read `tensor` itself, not its DequantizeLinear; a graph output is written by its producer
        again."""
        for reader in self.touchers.get(tensor, set()) - {self.float_producer.get(tensor)}:
            node = edit.by_name.get(reader)
            for index, name in enumerate(node.input if node is not None else []):
                if index < len(self.float_nodes[reader].input) and self.float_nodes[reader].input[index] == tensor:
                    node.input[index] = _rounded_from(name, edit.producer) or name
        if tensor in edit.outputs:
            source = _rounded_from(tensor, edit.producer)
            if source is not None:
                edit.dropped.add(id(edit.producer[tensor]))
                edit.renamed[source] = tensor

    def _decided_alike(self, nodes: set[str], still_quantized: set[str]) -> bool:
        """No weight of `nodes` shared with another node, and no FOLLOWS_INPUT node whose quantization the change decides anew: one left quantized whose input only
        it would still round (the build leaves it float: mediapipe face detection's MaxPool after a Relu once the
        depthwise Conv beside it was float), or one made float whose output stays rounded (the build rounds it on
        a scale of its own)."""
        for name in nodes:
            node = self.float_nodes[name]
            if any(len(self.readers.get(t, ())) > 1 for t in node.input if t in self.quantized_weights):
                return False  # a weight shared with another node: ORT names and scales its copies in build order
            for tensor in [*node.input, *node.output]:
                rounding = self.touchers.get(tensor, set()) & still_quantized
                followers = {n for n in rounding if self.float_nodes[n].op_type in FOLLOWS_INPUT}
                if followers and not rounding - followers:
                    return False
            if node.op_type in FOLLOWS_INPUT and any(self.touchers.get(o, set()) & still_quantized
                                                     for o in node.output):
                return False
        return True

    def _with_freed_activations(self, nodes: set[str]) -> set[str]:
        """`nodes` and the removed activations whose producer is among them: the quantizer removes an activation
        only after a quantized node, so after a float one it stays, unquantized."""
        nodes = set(nodes)
        while True:
            freed = {name for name in self.removed - nodes if self.float_nodes[name].input
                     and self.float_producer.get(self.float_nodes[name].input[0]) in nodes}
            if not freed:
                return nodes
            nodes |= freed

    def _put_back(self, original: onnx.NodeProto, nodes: set[str], edit: "_Edit") -> onnx.NodeProto | None:
        """A removed activation restored after the node that took over its output (None if there is none), its
        input rounded as a build with it float rounds it when that producer stays quantized."""
        if not original.input or not original.output:
            return None
        absorbing = edit.producer.get(original.output[0])
        if absorbing is None or absorbing.name != self.float_producer.get(original.input[0]):
            return None
        absorbing.output[list(absorbing.output).index(original.output[0])] = original.input[0]
        node = onnx.NodeProto()
        node.CopyFrom(original)
        for index, tensor in enumerate(original.input):
            if tensor in self.float_weights:
                node.input[index] = edit.float_weight(self.float_weights[tensor])
        inserted = []
        if absorbing.name not in nodes:
            pair = self.split_pair(original.input[0])
            if pair is None:
                return None
            quantize, dequantize, constants = pair
            if any(name in edit.names for name in [*quantize.output, *dequantize.output]):
                return None
            if not all(edit.constant(tensor) for tensor in constants):
                return None
            inserted = [quantize, dequantize]
            node.input[0] = dequantize.output[0]
        edit.after.setdefault(absorbing.name, []).extend([*inserted, node])
        return node

    def split_pair(self, tensor: str):
        """(QuantizeLinear, DequantizeLinear, their constants) that the split build writes after `tensor`."""
        if self._split is None:
            split = self._build_split(self.removed)
            constants = {t.name: t for t in split.graph.initializer}
            readers: dict[str, list[onnx.NodeProto]] = {}
            for node in split.graph.node:
                for name in node.input:
                    readers.setdefault(name, []).append(node)
            self._split = {}
            for node in split.graph.node:
                if node.op_type != "QuantizeLinear":
                    continue
                dequantize = [r for r in readers.get(node.output[0], []) if r.op_type == "DequantizeLinear"]
                if dequantize:
                    self._split[node.input[0]] = (node, dequantize[0],
                                                  [constants[n] for n in dict.fromkeys([*node.input[1:],
                                                                                        *dequantize[0].input[1:]])
                                                   if n in constants])
        return self._split.get(tensor)


class _Edit:
    """A copy of the reference being edited: its nodes by name and by output, the names taken, and what is added
    (nodes after a node, constants), dropped or renamed when the graph is written again (`result`)."""

    def __init__(self, reference: onnx.ModelProto):
        self.model = onnx.ModelProto()
        self.model.CopyFrom(reference)
        self.order = list(self.model.graph.node)
        self.by_name = {n.name: n for n in self.order}
        self.producer = {o: n for n in self.order for o in n.output}
        self.names = {t.name for t in self.model.graph.initializer} | set(self.producer)
        self.outputs = {o.name for o in self.model.graph.output}
        self.after: dict[str, list[onnx.NodeProto]] = {}  # node name → nodes put back right after it
        self.added: list[onnx.TensorProto] = []
        self.dropped: set[int] = set()  # id() of nodes left out
        self.renamed: dict[str, str] = {}

    def constant(self, tensor: onnx.TensorProto, name: str | None = None) -> bool:
        """Adds a copy of `tensor` (as `name`); False if the name is taken."""
        name = name or tensor.name
        if name in self.names:
            return False
        copy = onnx.TensorProto()
        copy.CopyFrom(tensor)
        copy.name = name
        self.added.append(copy)
        self.names.add(name)
        return True

    def float_weight(self, tensor: onnx.TensorProto) -> str:
        """The float model's constant, under a name of its own if the reference uses its name for something else
        (the DequantizeLinear of a bias writes the bias's name)."""
        own = tensor.name if tensor.name not in self.producer else f"{tensor.name}_float"
        self.constant(tensor, own)  # (added once: a weight two float nodes share)
        return own

    def result(self) -> onnx.ModelProto:
        """The edited model: nodes put back in place, graph outputs written by their producers, dead Q/DQ gone."""
        kept = []
        for node in self.order:
            if id(node) not in self.dropped:
                kept.append(node)
                kept.extend(self.after.get(node.name, []))
        for node in kept if self.renamed else []:
            for index, name in enumerate(node.input):
                node.input[index] = self.renamed.get(name, name)
            for index, name in enumerate(node.output):
                node.output[index] = self.renamed.get(name, name)
        copies = []
        for node in _without_dead_qdq(kept, self.outputs):  # copied before the repeated field is cleared
            copy = onnx.NodeProto()
            copy.CopyFrom(node)
            copies.append(copy)
        graph = self.model.graph
        del graph.node[:]
        graph.node.extend(copies)
        graph.initializer.extend(self.added)
        return self.model


def _rounded_from(name: str, producer: dict) -> str | None:
    """The unrounded tensor behind `name` when `name` is a DequantizeLinear of a QuantizeLinear."""
    dequantize = producer.get(name)
    if dequantize is None or dequantize.op_type != "DequantizeLinear":
        return None
    quantize = producer.get(dequantize.input[0])
    if quantize is None or quantize.op_type != "QuantizeLinear":
        return None
    return quantize.input[0]


def _without_dead_qdq(nodes: list[onnx.NodeProto], outputs: set[str]) -> list[onnx.NodeProto]:
    """`nodes` without the Q/DQ nodes nothing reads any more (ORT would drop them; written, they only cost)."""
    while True:
        read = {name for node in nodes for name in node.input} | outputs
        alive = [n for n in nodes if n.op_type not in QDQ_OPS or any(o in read for o in n.output)]
        if len(alive) == len(nodes):
            return nodes
        nodes = alive
