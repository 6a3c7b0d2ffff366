"""What a model is: its kind (float / QDQ / integer), inputs and outputs, op histogram, opsets, size.

Shared by `qprep inspect`, the stage records and the report, so every place counts ops the same way.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qprep.model.io import inferred_shapes, subgraphs, weights_bytes
from qprep.model.specs import (  # noqa: F401 - named here too: every caller reads them from the model's facts
    TensorSpec,
    cast_to,
    cast_to_inputs,
    graph_inputs,
    graph_outputs,
    input_types,
    tensor_spec,
)

QDQ_OPS = {"QuantizeLinear", "DequantizeLinear"}
INTEGER_OPS = {
    "QLinearConv", "QLinearMatMul", "QLinearAdd", "QLinearMul", "QLinearSigmoid", "QLinearLeakyRelu",
    "QLinearConcat", "QLinearAveragePool", "QLinearGlobalAveragePool", "QLinearSoftmax", "QLinearReduceMean",
    "QLinearWhere", "QGemm", "QAttention", "ConvInteger", "MatMulInteger", "MatMulIntegerToFloat",
    "DynamicQuantizeLinear", "DynamicQuantizeMatMul", "DynamicQuantizeLSTM",
}
CONTROL_FLOW_OPS = {"If", "Loop", "Scan", "SequenceMap"}

FLOAT = "float"
QDQ = "qdq"
INTEGER = "integer"


def constant_tensors(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    """Initializers and Constant nodes' values of `graph`, by name (read with numpy_helper.to_array when needed)."""
    tensors = {t.name: t for t in graph.initializer}
    tensors.update({n.output[0]: n.attribute[0].t for n in graph.node
                    if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"})
    return tensors


def constant_names(graph: onnx.GraphProto) -> set[str]:
    """Initializers and Constant outputs of `graph`: the values known before it runs."""
    return {t.name for t in graph.initializer} | {o for n in graph.node if n.op_type == "Constant" for o in n.output}


def unique_name(wanted: str, taken: set[str], separator: str = "_") -> str:
    """`wanted`, or `wanted_2`, `wanted_3`, … — the first one not in `taken`, which it joins."""
    name, count = wanted, 1
    while name in taken:
        count += 1
        name = f"{wanted}{separator}{count}"
    taken.add(name)
    return name


def node_index(graph: onnx.GraphProto, node: onnx.NodeProto) -> int:
    """Where `node` (this very proto) stands in `graph.node`: a rewrite inserts its replacement there."""
    return next(i for i, other in enumerate(graph.node) if other is node)


LAYERS = {"Conv", "ConvTranspose", "MatMul", "Gemm", "LSTM", "GRU", "RNN", "Einsum", "Attention"}


def layers_in_bodies(model: onnx.ModelProto) -> dict[str, int]:
    """{main-graph If/Loop/Scan node: how many layers (LAYERS) its bodies hold}, for those that hold any: what a
    quantizer that never enters bodies (ONNX Runtime's) leaves float, and what `integer_share` cannot count."""
    held = {}
    for node in model.graph.node:
        count = sum(n.op_type in LAYERS for n in _body_nodes(node))
        if count:
            held[node.name] = count
    return held


def iter_nodes(graph: onnx.GraphProto):
    """Every node, including those inside If/Loop/Scan bodies."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            for sub in subgraphs(attr):
                yield from iter_nodes(sub)


RANDOM_OPS = frozenset({"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Bernoulli",
                        "Multinomial"})


def random_nodes(model: onnx.ModelProto) -> list[tuple[onnx.NodeProto, str]]:
    """(node, what makes it random) for each node whose output is drawn at random and reaches a graph output: a
    random op, or a Dropout in training mode (its training_mode input a constant true and its ratio not 0:
    torch's dynamo exporter writes one for a model left in train mode). Such outputs differ run to run, so no
    comparison with the float model can judge a quantized one. Inside an If/Loop/Scan body a node counts when it
    reaches its body's outputs and the node holding the body reaches the outputs in turn; of an If whose
    condition is a constant, only the branch it takes."""
    constants = {name: t for g in _graphs(model.graph) for name, t in constant_tensors(g).items()}

    def value(name: str):
        tensor = constants.get(name)
        return None if tensor is None else numpy_helper.to_array(tensor)

    return _random_reaching(model.graph, [o.name for o in model.graph.output], value)


def _random_reaching(graph: onnx.GraphProto, outputs: list[str], value) -> list[tuple[onnx.NodeProto, str]]:
    """random_nodes within one graph whose values reach `outputs` (its own outputs, for a body)."""
    found = []  # (node of this graph, [(random node, why)])
    for node in graph.node:
        why = _random(node, value)
        inner = [(node, why)] if why else []
        for body in _bodies_run(node, value):
            inner += _random_reaching(body, [o.name for o in body.output], value)
        if inner:
            found.append((node, inner))
    if not found:
        return []
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:  # a node reads its inputs and whatever its bodies read from outside them
        for name in {*node.input, *(i for inner in _body_nodes(node) for i in inner.input)}:
            readers.setdefault(name, []).append(node)
    wanted = set(outputs)

    def reaches_output(start: onnx.NodeProto) -> bool:
        seen, todo = set(), list(start.output)
        while todo:
            name = todo.pop()
            if name in wanted:
                return True
            for reader in readers.get(name, ()):
                if id(reader) not in seen:
                    seen.add(id(reader))
                    todo.extend(reader.output)
        return False

    return [pair for node, inner in found if reaches_output(node) for pair in inner]


def _bodies_run(node: onnx.NodeProto, value) -> list[onnx.GraphProto]:
    """The bodies `node` may run: an If with a constant condition runs one branch, other nodes all theirs."""
    branches = {a.name: a.g for a in node.attribute if a.type == onnx.AttributeProto.GRAPH}
    if node.op_type == "If" and node.domain in ("", "ai.onnx") and node.input:
        condition = value(node.input[0])
        if condition is not None and condition.size == 1:
            taken = branches.get("then_branch" if bool(condition.ravel()[0]) else "else_branch")
            return [taken] if taken is not None else []
    return [sub for a in node.attribute for sub in subgraphs(a)]


def _random(node: onnx.NodeProto, value) -> str | None:
    """What makes `node` draw random values, or None."""
    if node.domain not in ("", "ai.onnx"):
        return None
    if node.op_type in RANDOM_OPS:
        return node.op_type
    if node.op_type == "Dropout" and len(node.input) > 2 and node.input[2]:
        training, ratio = value(node.input[2]), value(node.input[1]) if node.input[1] else np.float32(0.5)
        if training is not None and bool(training) and (ratio is None or float(ratio) != 0):
            return "Dropout in training mode"
    return None


def _body_nodes(node: onnx.NodeProto):
    """Every node inside `node`'s If/Loop/Scan bodies."""
    for attr in node.attribute:
        for sub in subgraphs(attr):
            yield from iter_nodes(sub)


def _graphs(graph: onnx.GraphProto):
    """The graph and every body inside it."""
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            for sub in subgraphs(attr):
                yield from _graphs(sub)


def op_counts(model: onnx.ModelProto) -> dict[str, int]:
    """Histogram of op types over the whole model (subgraphs included), sorted by count then name."""
    counts = Counter(node.op_type for node in iter_nodes(model.graph))
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def node_count(model: onnx.ModelProto) -> int:
    return sum(1 for _ in iter_nodes(model.graph))


def model_kind(model: onnx.ModelProto) -> str:
    """float, qdq (QuantizeLinear/DequantizeLinear present: QAT or QDQ-quantized) or integer (QLinear* etc.)."""
    ops = set(op_counts(model))
    if ops & INTEGER_OPS:
        return INTEGER
    if ops & QDQ_OPS:
        return QDQ
    return FLOAT


FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE, onnx.TensorProto.BFLOAT16}


def map_valued(model: onnx.ModelProto) -> list[str]:
    """Values of the main graph typed as a map or a sequence of maps (sklearn's ZipMap output): onnx-ir 1.1,
    which the rewrites and the Q/DQ clean-up run on, cannot read such a model ("Map types are not supported
    yet")."""
    def holds_map(value_type: onnx.TypeProto) -> bool:
        if value_type.HasField("map_type"):
            return True
        return value_type.HasField("sequence_type") and holds_map(value_type.sequence_type.elem_type)

    graph = model.graph
    return [v.name for v in [*graph.input, *graph.output, *graph.value_info] if holds_map(v.type)]


def computes_float(model: onnx.ModelProto) -> bool:
    """Whether any node outputs a float tensor (or one whose type shape inference cannot tell, to be safe).
    A model that computes none (e.g. an index or token graph, all int64) has nothing to quantize whatever
    its kind says: model_kind() calls it "float" because it holds no Q/DQ or QLinear ops."""
    try:
        inferred = inferred_shapes(model, shapes_only=True)
    except Exception:  # noqa: BLE001 - an inference failure: unknown types count as float
        inferred = model
    types = {v.name: v.type.tensor_type.elem_type
             for v in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]}
    return any(types.get(output, onnx.TensorProto.UNDEFINED) in FLOAT_TYPES | {onnx.TensorProto.UNDEFINED}
               for node in iter_nodes(model.graph) for output in node.output if output)


def attribute(node: onnx.NodeProto, name: str, default=None):
    """The value of `node`'s attribute `name`, or `default` when the node does not set it."""
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def opsets(model: onnx.ModelProto) -> dict[str, int]:
    return {(o.domain or "ai.onnx"): o.version for o in model.opset_import}


def default_opset(model: onnx.ModelProto) -> int:
    return opsets(model).get("ai.onnx", 0)


def has_control_flow(model: onnx.ModelProto) -> bool:
    return any(op in CONTROL_FLOW_OPS for op in op_counts(model))


def summary(model: onnx.ModelProto) -> dict:
    """The facts a report or `qprep inspect` shows about a model."""
    return {
        "kind": model_kind(model),
        "opsets": opsets(model),
        "producer": " ".join(p for p in (model.producer_name, model.producer_version) if p),
        "inputs": [s.as_dict() for s in graph_inputs(model)],
        "outputs": [s.as_dict() for s in graph_outputs(model)],
        "nodes": node_count(model),
        "op_counts": op_counts(model),
        "initializers": len(model.graph.initializer),
        "parameter_bytes": weights_bytes(model),
        "control_flow": has_control_flow(model),
    }


MULTIPLY_ADD_OPS = ("Conv", "ConvTranspose", "MatMul", "Gemm")


def multiply_adds(model: onnx.ModelProto) -> dict[str, int]:
    """Multiply-adds per Conv/ConvTranspose/MatMul/Gemm node at batch 1 (symbolic dims count as 1), from
    `layer_shapes`; nodes whose shapes stay unknown count 0. What keeping a node float costs, roughly."""
    shapes = {name: [1 if d is None else d for d in dims] for name, dims in layer_shapes(model).items()}
    counts = {}
    for node in model.graph.node:
        out, inputs = shapes.get(node.output[0]), [shapes.get(i) for i in node.input]
        if not out or not inputs or any(s is None for s in inputs[:2]):
            continue
        if node.op_type in ("Conv", "ConvTranspose") and len(inputs[1]) >= 3:
            # Conv weight [M, C/group, k...]: each output element takes prod(weight[1:]) products;
            # ConvTranspose weight [C, M/group, k...]: each input element gives prod(weight[1:]) products
            elements = out if node.op_type == "Conv" else inputs[0]
            counts[node.name] = int(np.prod(elements) * np.prod(inputs[1][1:]))
        elif node.op_type in ("MatMul", "Gemm") and inputs[0]:
            transposed = node.op_type == "Gemm" and any(a.name == "transA" and a.i for a in node.attribute)
            counts[node.name] = int(np.prod(out) * inputs[0][-2 if transposed else -1])
    return counts


def integer_share(float_model: onnx.ModelProto, result: onnx.ModelProto,
                  macs: dict[str, int] | None = None) -> float | None:
    """The share of `float_model`'s multiply-adds (Conv/MatMul/Gemm) that `result` runs on integers: a node whose
    input and weight both come from DequantizeLinear (QDQ: ONNX Runtime fuses it into an integer kernel; a node
    kept float reads a dequantized input with its float weight) or replaced by an integer op
    (QOperator, MatMulInteger). What the float set, the fallback, spread tensors and op types left float cost,
    in one number; None when the model has no multiply-adds of known shape. `macs`: multiply_adds(float_model)
    when the caller has it (shape inference of a large model takes seconds)."""
    macs = multiply_adds(float_model) if macs is None else macs
    total = sum(macs.values())
    if not total:
        return None
    return (total - sum(macs[name] for name in float_multiply_adds(macs, result))) / total


def float_multiply_adds(macs: dict[str, int], result: onnx.ModelProto) -> list[str]:
    """The nodes of `macs` (multiply_adds of the float model) that `result` runs float: present with an input or
    weight not from DequantizeLinear. One rule for integer_share and the report's list of float nodes."""
    dequantized = {o for n in result.graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    nodes = {n.name: n for n in result.graph.node}
    return sorted(name for name in macs if name in nodes and not set(nodes[name].input[:2]) <= dequantized)


def layer_shapes(model: onnx.ModelProto) -> dict[str, list[int | None]]:
    """{tensor: dims} as `tensor_shapes` knows them, and for the inputs and outputs of the multiply-add layers it
    leaves unknown, the shapes observed when ONNX Runtime runs the model once (`observed_shapes`). Why: ONNX
    shape inference stops at an op it has no rule for (sklearn's ai.onnx.ml Scaler, a contrib op), and every
    layer after it counted 0: an all-MatMul model read "integer share not measured" and its activations were
    decided as if it had no MatMul. The one source of shapes for every reader of multiply-adds."""
    shapes = {name: dims for name, (_, dims) in tensor_shapes(model).items()}
    unknown = [name for node in model.graph.node if node.op_type in MULTIPLY_ADD_OPS
               for name in [*node.input[:2], node.output[0]] if name and not _known(shapes.get(name))]
    if unknown:
        shapes.update(observed_shapes(model, unknown))
    return shapes


def _known(dims) -> bool:
    return dims is not None and None not in dims


def observed_shapes(model: onnx.ModelProto, names: list[str]) -> dict[str, list[int]]:
    """{tensor: dims} of `names` as ONNX Runtime computes them on one sample of zeros, when every graph input
    has fixed dims (as the run fixes them before its stages); {} when one is symbolic or the model does not run
    on zeros (never fatal: the shapes are for estimates)."""
    from qprep.model.runtime import intermediate_values

    sample = {}
    for spec in graph_inputs(model):
        if spec.shape is None or not all(isinstance(d, int) for d in spec.shape):
            return {}
        try:
            sample[spec.name] = np.zeros(spec.shape, spec.numpy_dtype)
        except TypeError:  # an element type numpy has no name for
            return {}
    try:
        values = next(intermediate_values(model, names, [sample], threads=1))
    except Exception:  # noqa: BLE001 - ORT's own errors: the shapes stay unknown
        return {}
    return {name: list(value.shape) for name, value in values.items() if isinstance(value, np.ndarray)}


def tensor_shapes(model: onnx.ModelProto) -> dict[str, tuple[int, list[int | None]]]:
    """{tensor: (element type, dims with None where unknown)} from ONNX shape inference and the initializers;
    {} for the inferred part when inference fails (never fatal: callers only use what is known)."""
    try:
        inferred = inferred_shapes(model, shapes_only=True)
    except Exception:  # noqa: BLE001 - an inference failure; the initializers are still known
        inferred = model
    shapes = {}
    for value in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]:
        tensor_type = value.type.tensor_type
        if tensor_type.HasField("shape"):
            shapes[value.name] = (tensor_type.elem_type,
                                  [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None
                                   for d in tensor_type.shape.dim])
    shapes.update({t.name: (t.data_type, list(t.dims)) for t in model.graph.initializer})
    return shapes


class Links:
    """Who computes and who reads each tensor of a model's main graph, and whether a rewrite may edit a constant
    or a tensor in place: another reader, a subgraph or a graph output would see the change."""

    def __init__(self, model: onnx.ModelProto):
        graph = model.graph
        self._model = model
        self.initializers = {t.name: t for t in graph.initializer}
        self.producers = {o: node for node in graph.node for o in node.output}
        self.readers: dict[str, list[onnx.NodeProto]] = {}
        for node in graph.node:
            for name in dict.fromkeys(node.input):
                if name:
                    self.readers.setdefault(name, []).append(node)
        self.in_subgraphs = {name for node in graph.node for attr in node.attribute
                             for sub in subgraphs(attr)
                             for inner in iter_nodes(sub) for name in inner.input}
        self.outputs = {o.name for o in graph.output}
        self._ranks: dict[str, int] | None = None

    def only_reader(self, name: str, reader: onnx.NodeProto) -> bool:
        """`reader` is the one node that reads `name` (no subgraph, not a graph output)."""
        readers = self.readers.get(name, [])
        return (name not in self.outputs and name not in self.in_subgraphs
                and len(readers) == 1 and readers[0] is reader)

    def own_constant(self, name: str, reader: onnx.NodeProto) -> bool:
        """`name` is an initializer that `reader` alone reads."""
        return name in self.initializers and self.only_reader(name, reader)

    def last_axis(self, node: onnx.NodeProto) -> bool:
        """`node`'s `axis` attribute (default -1) names its output's last axis."""
        axis = next((a.i for a in node.attribute if a.name == "axis"), -1)
        if axis == -1:
            return True
        if self._ranks is None:
            self._ranks = {name: len(dims) for name, (_, dims) in tensor_shapes(self._model).items()
                           if dims is not None}
        return axis == self._ranks.get(node.output[0], 0) - 1
