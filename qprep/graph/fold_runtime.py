"""Constant folding's heavy half: every node computable from constants, evaluated by ONNX Runtime in one session.

Why: onnxscript's folder evaluates a node with onnx's pure-Python reference ops, which are fine for shape
arithmetic and fatal for real work (a bicubic Resize of a ViT's position embeddings ran for over ten minutes).
Here the constant closure (the nodes whose inputs are constants or other closure outputs, in graph order) runs
as one ONNX Runtime session with graph optimizations off (ORT must compute what the graph says, not rewrite it);
only its frontier (values that something outside the closure reads) becomes initializers, so intermediate
tensors are never stored in the model.

Never evaluated: Q/DQ (a QAT model's scales must stay visible), random ops, control flow and nodes with
subgraphs, sequences and optionals, and domains ONNX Runtime has no kernels for (counted "not_runnable").
A node whose estimated cost (qprep/graph/fold_cost.py) is over the budget is left with everything after it
(counted "cost"); a result over the size cap stays computed in the graph (counted "size").
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx_ir as ir
from onnx import numpy_helper
from onnx_ir.passes.common import NameFixPass

from qprep.graph import fold_cost
from qprep.model.runtime import ort_session
from qprep.third_party import numpy_value

log = logging.getLogger("qprep")

NEVER_FOLD = frozenset({"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear",
                        "RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Bernoulli",
                        "Multinomial", "If", "Loop", "Scan"})
RUNNABLE_DOMAINS = frozenset({"", "ai.onnx", "ai.onnx.ml", "com.microsoft"})
INTERMEDIATE_MAX = 1 << 26  # elements: no closure tensor may need more memory than this (256 MB of float32)
SHAPE_DATA_MAX = 1024  # constants this small go into shape inference with their values (Reshape/Resize sizes)


@dataclass
class ClosureResult:
    evaluated: int = 0  # nodes ONNX Runtime computed
    materialized: int = 0  # values that became initializers
    sessions: int = 0
    left: Counter = field(default_factory=Counter)  # reason → nodes or values left as they are


def is_constant(value: ir.Value | None) -> bool:
    """An initializer or a Constant node's output, never a graph input (a graph input can be fed another value)."""
    if value is None or value.is_graph_input():
        return False
    producer = value.producer()
    return value.const_value is not None or (producer is not None and producer.op_type == "Constant"
                                             and producer.domain in ("", "ai.onnx"))


def refusal(node: ir.Node, functions) -> str | None:
    """Why `node` must not be evaluated here: "policy" (never folded) or "not_runnable", else None."""
    if node.op_type in NEVER_FOLD or "Sequence" in node.op_type or "Optional" in node.op_type:
        return "policy"
    if any(attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for attr in node.attributes.values()):
        return "policy"
    if node.domain not in RUNNABLE_DOMAINS or (node.domain, node.op_type, node.overload) in functions:
        return "not_runnable"
    return None


def fold_closure(model: ir.Model, max_elements: int, threads: int, budget: int | None = None) -> ClosureResult:
    """Evaluate the main graph's constant closure with ONNX Runtime and replace its frontier by initializers."""
    result = ClosureResult()
    closure = _closure(model, result)
    if not closure:
        return result
    if any(not v.name for node in closure for v in [*node.inputs, *node.outputs] if v is not None):
        NameFixPass()(model)  # the session names what it reads and computes
    shapes = _shapes(model, closure)
    kept = _within_budget(closure, shapes, fold_cost.BUDGET if budget is None else budget, result)
    frontier = _frontier(model, kept)
    if not frontier:
        return result
    try:
        feeds = _feeds(kept)
        session = ort_session(_closure_model(model, kept, feeds, [v.name for v in frontier]), threads=threads,
                              log_severity=4)
        arrays = session.run([v.name for v in frontier], {name: array for name, (_, array) in feeds.items()})
        result.sessions, result.evaluated = 1, len(kept)
    except Exception as exc:  # noqa: BLE001 - one node ORT cannot run: find it, keep the rest
        log.info("fold_constants: ONNX Runtime could not evaluate the %d constant nodes at once (%s); "
                 "evaluating them one by one", len(kept), str(exc).splitlines()[0][:200] if str(exc) else "")
        arrays = _one_by_one(model, kept, frontier, threads, result)
    for value, array in zip(frontier, arrays):
        if array is None:
            continue  # its node, or one before it, failed (counted)
        if not isinstance(array, np.ndarray) or array.dtype == object:
            result.left["not_runnable"] += 1
        elif array.size > max_elements and not _shrinks(value, array.size, kept, shapes):
            result.left["size"] += 1
        else:
            _materialize(model.graph, value, array)
            result.materialized += 1
    return result


def _one_by_one(model: ir.Model, kept: list[ir.Node], frontier: list[ir.Value], threads: int,
                result: ClosureResult) -> list[np.ndarray | None]:
    """The closure a node per session, so that a node ONNX Runtime refuses is left alone (counted
    "not_runnable") with what depends on it, and the rest still folds. Returns the frontier's arrays (None for
    a value not computed)."""
    computed: dict[int, np.ndarray] = {}
    for node in kept:
        inputs = [v for v in node.inputs if v is not None]
        if any(id(v) not in computed and not is_constant(v) for v in inputs):
            continue  # after a refused node
        try:
            feeds = {v.name: (v, computed[id(v)] if id(v) in computed else np.asarray(numpy_value(v)))
                     for v in inputs}
            session = ort_session(_closure_model(model, [node], feeds, [v.name for v in node.outputs if v.name]),
                                  threads=threads, log_severity=4)
            arrays = session.run(None, {name: array for name, (_, array) in feeds.items()})
        except Exception:  # noqa: BLE001 - this node is the one ONNX Runtime cannot run here
            result.left["not_runnable"] += 1
            continue
        computed.update(zip((id(v) for v in node.outputs if v.name), arrays))
        result.sessions += 1
        result.evaluated += 1
    return [computed.get(id(v)) for v in frontier]


def _closure(model: ir.Model, result: ClosureResult) -> list[ir.Node]:
    """Main-graph nodes computable from constants, in graph (topological) order; refused ones are counted."""
    functions = set(model.functions)
    computed: set[int] = set()  # ids of closure outputs
    closure = []
    for node in model.graph:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            continue
        inputs = [v for v in node.inputs if v is not None]
        if not inputs or not all(id(v) in computed or is_constant(v) for v in inputs):
            continue
        reason = refusal(node, functions)
        if reason is not None:
            if reason != "policy":
                result.left[reason] += 1
            continue
        closure.append(node)
        computed.update(id(v) for v in node.outputs)
    return closure


def _within_budget(closure: list[ir.Node], shapes: dict, budget: int, result: ClosureResult) -> list[ir.Node]:
    """The closure less every node over the cost budget or the intermediate size, and whatever depends on one."""
    dropped: set[int] = set()
    kept = []
    for node in closure:
        if any(v is not None and id(v) in dropped for v in node.inputs):
            dropped.update(id(v) for v in node.outputs)
            continue
        ins = [shapes.get(v.name) if v is not None else None for v in node.inputs]
        outs = [shapes.get(v.name) for v in node.outputs]
        attributes = {name: attr.value for name, attr in node.attributes.items()
                      if attr.type in (ir.AttributeType.STRING, ir.AttributeType.INT)}
        reason = None
        if any(fold_cost.elements(s) > INTERMEDIATE_MAX for s in outs):
            reason = "size"
        elif fold_cost.node_cost(node.op_type, attributes, ins, outs) > budget:
            reason = "cost"
        if reason:
            result.left[reason] += 1
            dropped.update(id(v) for v in node.outputs)
            continue
        kept.append(node)
    return kept


def _frontier(model: ir.Model, kept: list[ir.Node]) -> list[ir.Value]:
    """Closure outputs read outside the closure (by a later node, a subgraph), graph outputs excepted."""
    inside = {id(node) for node in kept}
    frontier = []
    for node in kept:
        for value in node.outputs:
            if value.is_graph_output():
                continue
            if any(id(use.node) not in inside for use in value.uses()):
                frontier.append(value)
    return frontier


def _feeds(kept: list[ir.Node]) -> dict[str, tuple[ir.Value, np.ndarray]]:
    """The constants the closure reads, by name, with their arrays (fed to the session as inputs: no copy of
    the weights into a serialized model)."""
    produced = {id(v) for node in kept for v in node.outputs}
    feeds = {}
    for node in kept:
        for value in node.inputs:
            if value is not None and id(value) not in produced and value.name not in feeds:
                feeds[value.name] = (value, np.asarray(numpy_value(value)))
    return feeds


def _closure_model(model: ir.Model, kept: list[ir.Node], feeds: dict, outputs: list[str],
                   values_for: int | None = None) -> onnx.ModelProto:
    """The closure as a model: constants as inputs (those of at most `values_for` elements as initializers,
    for shape inference), the given outputs (dtype and shape left to inference)."""
    inputs, initializers = [], []
    for name, (_, array) in feeds.items():
        if values_for is not None and array.size <= values_for:
            initializers.append(numpy_helper.from_array(array, name))
        else:
            elem = onnx.helper.np_dtype_to_tensor_dtype(array.dtype)
            inputs.append(onnx.helper.make_tensor_value_info(name, elem, list(array.shape)))
    graph = onnx.helper.make_graph([ir.serde.serialize_node(node) for node in kept], "constant_closure", inputs,
                                   [onnx.helper.make_empty_tensor_value_info(name) for name in outputs],
                                   initializers)
    opsets = [onnx.helper.make_opsetid(domain, version) for domain, version in model.opset_imports.items()]
    return onnx.helper.make_model(graph, opset_imports=opsets, ir_version=max(model.ir_version or 8, 4))


def _shapes(model: ir.Model, closure: list[ir.Node]) -> dict[str, tuple]:
    """Static shapes of the closure's values by ONNX shape inference (with small constants' values, so Resize
    sizes and Reshape shapes resolve); a value it cannot resolve is absent."""
    feeds = _feeds(closure)
    shapes = {name: tuple(array.shape) for name, (_, array) in feeds.items()}
    names = [v.name for node in closure for v in node.outputs if v.name]
    try:
        inferred = onnx.shape_inference.infer_shapes(_closure_model(model, closure, feeds, names, SHAPE_DATA_MAX),
                                                     data_prop=True)
    except Exception:  # noqa: BLE001 - unknown shapes only make the cost estimate coarser
        return shapes
    for info in [*inferred.graph.value_info, *inferred.graph.output]:
        dims = info.type.tensor_type.shape.dim if info.type.HasField("tensor_type") else None
        if dims is not None and info.type.tensor_type.HasField("shape") and all(d.HasField("dim_value") for d in dims):
            shapes[info.name] = tuple(d.dim_value for d in dims)
    return shapes


def _shrinks(value: ir.Value, size: int, kept: list[ir.Node], shapes: dict) -> bool:
    """A result over the size cap is still stored when what it replaces is no smaller: the producer's inputs
    that nothing else reads (onnxscript's rule, so a big weight's Transpose folds as before)."""
    producer = value.producer()
    freed = 0
    for source in producer.inputs if producer is not None else ():
        if source is not None and len(source.uses()) == 1:
            freed += fold_cost.elements(shapes.get(source.name))
    return freed >= size


def _materialize(graph: ir.Graph, value: ir.Value, array: np.ndarray) -> None:
    """`value`'s readers read an initializer of the same name instead; its producer, unread, is removed later."""
    name = value.name
    value.name = f"{name}__computed"  # the producer's output, soon unused, gives up the name
    tensor = ir.tensor(array, name=name)
    initializer = ir.Value(name=name, type=ir.TensorType(tensor.dtype), shape=ir.Shape(array.shape),
                           const_value=tensor)
    value.replace_all_uses_with(initializer)
    graph.register_initializer(initializer)
