"""What every graph rewrite rule shares (optimize passes and qdq rewrites): written once, here.

    Names           unique node / value names for what a replacement adds (`names_in_use`, `unique_node_name`,
                    `unique_value_name`); `NewNames` for the names onnx_ir gives what a rewrite adds unnamed
    OpsetUpgrade    a rule whose replacement needs a newer opset: dry run first (`count_matches`), convert only
                    when something matches and max_opset allows it
    IdentityElimination  onnx_ir's pass, safe for If/Loop branches returning an outer value
    per_channel     a constant on a Conv output as one value per output channel, or why it is not one

How to write a rule: see the docstring of qprep/optimize/passes/__init__.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import IdentityEliminationPass
from onnxscript.version_converter import ConvertVersionPass

from qprep.graph.ir import FLOAT_TYPES, default_opset


class IdentityElimination(IdentityEliminationPass):
    """onnx_ir's IdentityEliminationPass, except for a subgraph output that is Identity(value from an enclosing
    graph) (If branches returning an outer tensor): eliminating it would rename the outer value, so it stays."""

    def _try_eliminate_identity_node(self, node: ir.Node) -> bool:
        graph = node.graph
        if node.outputs and node.outputs[0].is_graph_output() and graph is not None and node.inputs:
            source = node.inputs[0]
            if source is not None and source.graph is not graph and (
                    source.producer() is None or source.producer().graph is not graph):
                return False
        return super()._try_eliminate_identity_node(node)


# ---------------------------------------------------------------------------------------------------------
# Unique names
# ---------------------------------------------------------------------------------------------------------


def first_free(wanted: str, taken: set[str]) -> str:
    """`wanted`, or `wanted_1`, `wanted_2`, … — the first one not in `taken`."""
    name, i = wanted, 1
    while name in taken:
        name, i = f"{wanted}_{i}", i + 1
    return name


@dataclass
class Names:
    """The node and value names in use; `node`/`value` hand out a free one and count it as taken."""

    nodes: set[str] = field(default_factory=set)
    values: set[str] = field(default_factory=set)

    def node(self, wanted: str) -> str:
        name = first_free(wanted, self.nodes)
        self.nodes.add(name)
        return name

    def value(self, wanted: str) -> str:
        name = first_free(wanted, self.values)
        self.values.add(name)
        return name


def names_in_use(container: ir.Model | ir.Graph) -> Names:
    """Every node and value name of a model (its graph, subgraphs and functions) or of one graph (with its
    subgraphs): inputs, initializers, node outputs."""
    graphs = all_graphs(container)
    names = Names()
    for graph in graphs:
        names.values.update(graph.initializers)
        names.values.update(v.name for v in graph.inputs if v.name)
    for node in all_nodes(container):
        if node.name:
            names.nodes.add(node.name)
        names.values.update(v.name for v in node.outputs if v.name)
    return names


class NewNames:
    """Names a rewrite's new node outputs unique in the whole model: `NewNames(model)` before the rewrite,
    `settle()` after it renames each new output whose name another value has (`first_free`).

    Why: onnx_ir names an output added without a name `val_<counter>` by its graph's own name authority, which
    knows that graph's names only: in an If/Loop body it hands out `val_0`, the name torch's dynamo exporter gave
    a value of the main graph (one the body may read). The onnxscript rewriter adds such outputs for the inner
    nodes of a replacement (a LayerNormalization over a Transpose). ReplacementBuilder names what it adds from
    `Names`; this covers what a rewrite lets onnx_ir name."""

    def __init__(self, model: ir.Model):
        self.model = model
        self.before = set(_model_values(model))

    def settle(self) -> dict[str, str]:
        """{name onnx_ir gave: name kept} for each new output renamed."""
        values = list(_model_values(self.model))
        taken = {v.name for v in values if v in self.before and v.name}
        renamed = {}
        for value in values:
            if value in self.before or not value.name or value.producer() is None:
                continue
            if value.name in taken:
                given = value.name
                value.name = renamed[given] = first_free(given, taken)
            taken.add(value.name)
        return renamed


def _model_values(model: ir.Model) -> Iterator[ir.Value]:
    """Graph inputs, initializers and node outputs of every graph of the model (functions included)."""
    for graph in [*all_graphs(model), *(f.graph for f in model.functions.values())]:
        yield from graph.inputs
        yield from graph.initializers.values()
    for node in all_nodes(model):
        yield from node.outputs


def unique_node_name(graph: ir.Graph, wanted: str) -> str:
    """The first name like `wanted` that no node of the graph has."""
    return names_in_use(graph).node(wanted)


def unique_value_name(graph: ir.Graph, wanted: str) -> str:
    """The first name like `wanted` that no value of the graph has (inputs, initializers, node outputs)."""
    return names_in_use(graph).value(wanted)


def take_over(old: ir.Value, new: ir.Value) -> None:
    """`new` replaces `old`: its uses, its place among the graph outputs, its name, type and shape (the value
    keeps the name users and value_info know; `old`'s producer is left to die unused)."""
    if new.type is None:
        new.type = old.type
    if new.shape is None:
        new.shape = old.shape
    graph = old.graph if old.graph is not None else old.producer().graph
    name = old.name
    if old.is_graph_output():
        index = list(graph.outputs).index(old)
        old.name = None
        graph.outputs[index] = new
    ir.convenience.replace_all_uses_with(old, new)
    new.name = name


def all_nodes(container: ir.Model | ir.Graph) -> Iterator[ir.Node]:
    """Nodes of the graph and its subgraphs, and of a model's functions: everywhere apply_to_model rewrites."""
    if isinstance(container, ir.Graph):
        yield from ir.traversal.RecursiveGraphIterator(container)
        return
    yield from ir.traversal.RecursiveGraphIterator(container.graph)
    for function in container.functions.values():
        yield from ir.traversal.RecursiveGraphIterator(function)


def all_graphs(container: ir.Model | ir.Graph) -> list[ir.Graph]:
    """The graph and every subgraph (If/Loop/Scan bodies) under it."""
    graphs = [container if isinstance(container, ir.Graph) else container.graph]
    for node in all_nodes(container):
        for attr in node.attributes.values():
            if attr.type == ir.AttributeType.GRAPH:
                graphs.append(attr.as_graph())
            elif attr.type == ir.AttributeType.GRAPHS:
                graphs.extend(attr.as_graphs())
    return graphs


# ---------------------------------------------------------------------------------------------------------
# Dry run, then opset upgrade
# ---------------------------------------------------------------------------------------------------------


def count_matches(model: ir.Model, rules: Iterable) -> int:
    """At how many nodes one of `rules` matches, without changing the model."""
    rules = list(rules)

    def candidates():  # (container the rewriter would pass, node), like RewriteRuleSet.apply_to_model
        for node in ir.traversal.RecursiveGraphIterator(model.graph):
            yield node.graph, node
        for function in model.functions.values():
            for node in ir.traversal.RecursiveGraphIterator(function):
                yield (function if node.graph is function.graph else node.graph), node

    return sum(any(rule.match(model, container, node) for rule in rules) for container, node in candidates())


@dataclass(frozen=True)
class OpsetUpgrade:
    """A replacement op that exists from `opset` on. A model below it is converted (onnx's version converter)
    only when the rules match somewhere and max_opset allows it.

    `forbidden` and `failed` word the record's `skipped` reason; they may use {opset} (the model's), {target},
    {max_opset} and {found} (how many matches the dry run saw).
    """

    opset: int
    forbidden: str
    failed: str

    def prepare(self, model: ir.Model, max_opset: int, dry_run: Callable[[], int]) -> tuple[bool, dict]:
        """(whether to run the rules, facts for the record). `dry_run()` counts the matches on the unchanged
        model and runs only when the model is below `opset`."""
        opset = default_opset(model)
        if opset >= self.opset:
            return True, {}
        found = dry_run()
        if not found:
            return False, {}
        words = {"opset": opset, "target": self.opset, "max_opset": max_opset, "found": found}
        if max_opset < self.opset:
            return False, {"skipped": self.forbidden.format(**words)}
        if not upgrade_opset(model, self.opset):
            return False, {"skipped": self.failed.format(**words)}
        return True, {"opset_upgraded_from": opset}


def upgrade_opset(model: ir.Model, opset: int) -> bool:
    """Convert in place (onnx's C converter below 18, onnxscript's own above). True when it worked.

    ConvertVersionPass logs a warning for the expected fallback and only logs a failed conversion, so the
    result is judged by the opset it leaves.
    """
    converter_log = logging.getLogger("onnxscript.version_converter")
    level = converter_log.level
    converter_log.setLevel(logging.ERROR)
    try:
        ConvertVersionPass(opset, fallback=True)(model)
    finally:
        converter_log.setLevel(level)
    return default_opset(model) == opset


# ---------------------------------------------------------------------------------------------------------
# Per-channel constants
# ---------------------------------------------------------------------------------------------------------


def per_channel(array: np.ndarray | None, channels: int, rank: int) -> np.ndarray | str:
    """`array`, broadcast against a rank-`rank` output [N, C, ...], as one value per channel C (a read-only
    view, same dtype); or why it is not a per-channel constant (None: not a constant)."""
    if array is None:
        return "not a constant"
    if array.ndim > rank:
        return f"constant of rank {array.ndim} on a rank-{rank} output"
    shape = (1,) * (rank - array.ndim) + array.shape
    if any(d != 1 for i, d in enumerate(shape) if i != 1) or (rank > 1 and shape[1] not in (1, channels)):
        return f"constant shape {array.shape} is not per-channel for {channels} channels"
    return np.broadcast_to(array.reshape(-1), (channels,))


class ReplacementBuilder:
    """Writes one node's replacement: ops named after the node, scalar constants in the node's float type
    (initializers, or Constant nodes inside a function, which holds no initializers). `nodes` are the new ops in
    order, for `graph.insert_before(node, builder.nodes)`."""

    def __init__(self, node: ir.Node, names: Names, opset: int, model_float: ir.DataType = ir.DataType.FLOAT,
                 in_function: bool = False):
        self.node, self.names, self.opset = node, names, opset
        self.nodes: list[ir.Node] = []
        self.dtype = float_type(node, model_float)
        self.in_function = in_function  # a function holds no initializers: constants are Constant nodes there

    def op(self, op_type: str, *inputs: ir.Value | None, **attributes) -> ir.Value:
        node = ir.node(op_type, list(inputs), attributes={k: v for k, v in attributes.items() if v is not None},
                       name=self.names.node(f"{self.node.name or self.node.op_type}/{op_type}"))
        node.outputs[0].name = self.names.value(f"{self.node.name or self.node.op_type}/{op_type}_output")
        self.nodes.append(node)
        return node.outputs[0]

    def scalar(self, value: float, label: str) -> ir.Value:
        return self._constant(np.array(value, dtype=self.dtype.numpy()), label)

    def axes(self, op_type: str, x: ir.Value, axes: list[int], **attributes) -> ir.Value:
        """ReduceMean over `axes`: an attribute below opset 18, an input from it."""
        if self.opset >= 18:
            return self.op(op_type, x, self._constant(np.array(axes, dtype=np.int64), "axes"), **attributes)
        return self.op(op_type, x, axes=axes, **attributes)

    def _constant(self, array: np.ndarray, label: str) -> ir.Value:
        if self.in_function:
            return self.op("Constant", value=ir.tensor(array))
        name = self.names.value(f"{self.node.name or self.node.op_type}/{label}")
        dtype = ir.TensorType(ir.DataType.from_numpy(array.dtype))
        constant = ir.Value(name=name, shape=ir.Shape(array.shape), type=dtype, const_value=ir.tensor(array, name=name))
        self.node.graph.register_initializer(constant)
        return constant


def float_type(node: ir.Node, model_float: ir.DataType) -> ir.DataType:
    """The node's float type: its first typed float input's (weights are always typed), else the model's."""
    for value in node.inputs:
        if value is not None and value.dtype in FLOAT_TYPES:
            return value.dtype
    return model_float
