"""Unique value and node names, checked where a model is handed to a third party: the one check, and the error
that names the step which broke them.

Why: ONNX Runtime refuses a model that defines a name twice ("Duplicate definition of name (val_3589)"), and a
quantizer that fails on it looks like the user's model failing (issue #61: a dynamo U-Net bisected for 454 s,
then told to exclude a node). A duplicate is never the user's when the model qprep loaded was valid: some step
of qprep's, or a tool qprep drove, minted it. Checking after each step that rewrites the model before a third
party reads it turns that into one line naming the step, at the step.

What counts (as ONNX Runtime and onnx.checker see it): in each graph, a name defined by more than one of the
graph inputs, the initializers (an initializer also listed as a graph input is one definition, as IR < 4
writes them) and the node outputs, or a node output of a subgraph that an enclosing graph defines already; and
two nodes of one graph with the same non-empty name.
"""

from __future__ import annotations

from collections import Counter

import onnx


class DuplicateNames(RuntimeError):
    """A step of qprep's (or a tool it drove) left a model that defines a name twice: qprep's bug, exit 3. Not a
    QprepError: nothing the user changes fixes it."""


def duplicate_names(model: onnx.ModelProto | onnx.GraphProto) -> list[str]:
    """Each name defined twice, as `value 'x'` or `node 'n'`, in graph order (empty: every name is unique)."""
    graph = model.graph if isinstance(model, onnx.ModelProto) else model
    found: list[str] = []
    _graph_duplicates(graph, frozenset(), found)
    return list(dict.fromkeys(found))


def value_names(model: onnx.ModelProto) -> set[str]:
    """Every value name of the model, subgraphs included (inputs, initializers, node outputs): what a new name
    must not be."""
    names: set[str] = set()
    graphs = [model.graph]
    while graphs:
        graph = graphs.pop()
        names.update(i.name for i in graph.input)
        names.update(t.name for t in graph.initializer)
        for node in graph.node:
            names.update(node.output)
            graphs.extend(body for a in node.attribute
                          for body in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)))
    names.discard("")
    return names


def renamed(model: onnx.ModelProto, names: dict[str, str]) -> onnx.ModelProto:
    """A copy of `model` with values renamed old → new wherever a graph defines or reads them (subgraphs
    included, value_info too). Graph inputs and outputs are the caller's to leave out: they are the model's
    contract."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    graphs = [copy.graph]
    while graphs:
        graph = graphs.pop()
        for tensor in graph.initializer:
            tensor.name = names.get(tensor.name, tensor.name)
        for info in (*graph.input, *graph.output, *graph.value_info):
            info.name = names.get(info.name, info.name)
        for node in graph.node:
            node.input[:] = [names.get(name, name) for name in node.input]
            node.output[:] = [names.get(name, name) for name in node.output]
            graphs.extend(body for a in node.attribute
                          for body in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)))
    return copy


def require_unique(model: onnx.ModelProto, step: str) -> None:
    """Raise DuplicateNames naming `step` (what just rewrote the model) when `model` defines a name twice."""
    duplicates = duplicate_names(model)
    if duplicates:
        more = f" and {len(duplicates) - 3} more" if len(duplicates) > 3 else ""
        raise DuplicateNames(f"{step} left a model that defines a name twice ({', '.join(duplicates[:3])}{more}): "
                             "qprep's bug, not the model's")


def _graph_duplicates(graph: onnx.GraphProto, outer: frozenset[str], found: list[str]) -> None:
    initializers = [t.name for t in graph.initializer] + [t.values.name for t in graph.sparse_initializer]
    listed = set(initializers)
    defined = Counter(initializers)
    defined.update(i.name for i in graph.input if i.name and i.name not in listed)
    outputs = [name for node in graph.node for name in node.output if name]
    defined.update(outputs)
    found.extend(f"value '{name}'" for name, count in defined.items() if count > 1)
    found.extend(f"value '{name}'" for name in outputs if name in outer)
    nodes = Counter(node.name for node in graph.node if node.name)
    found.extend(f"node '{name}'" for name, count in nodes.items() if count > 1)
    visible = outer | frozenset(defined)
    for node in graph.node:
        for attribute in node.attribute:
            for body in ([attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else list(attribute.graphs)):
                _graph_duplicates(body, visible, found)
