"""Fixes that leave the node in place (the other rewrites replace theirs).

Facts (rknn-toolkit2 2.5.0):
- An optional output left out ('' among a node's outputs: torch's LSTM export when only the last hidden state is
  used, Resemblyzer): the toolkit's constant folding fails in ONNX Runtime ("Could not find OrtValue with name
  ''"). Named, the node computes that output for nobody, and the model builds.
- An LSTM/GRU/RNN with its `layout` attribute written out at the default 0 (torch's dynamo exporter): the
  toolkit's recurrent-op shape inference writes the node into an older-opset model that the onnx checker then
  rejects ("Unrecognized attribute: layout for operator GRU"). The attribute is dropped (0 is the default).
"""

from __future__ import annotations

import onnx

from qprep.model.info import iter_nodes, unique_name
from qprep.quantize.rknn.io_names import all_names


def omitted_outputs_named(model: onnx.ModelProto) -> list[str]:
    """Each '' output of a node of the main graph named `<node>/unused_<index>` (a value nobody reads)."""
    taken = all_names(model) | {n.name for n in iter_nodes(model.graph)}
    named = []
    for node in model.graph.node:
        for index, output in enumerate(node.output):
            if output == "":
                node.output[index] = unique_name(f"{node.name or node.op_type}/unused_{index}", taken)
                named.append(node.name)
    return list(dict.fromkeys(named))


RECURRENT = {"LSTM", "GRU", "RNN"}


def default_layout(node: onnx.NodeProto) -> bool:
    return node.op_type in RECURRENT and any(a.name == "layout" and a.i == 0 for a in node.attribute)


def default_layouts_dropped(model: onnx.ModelProto) -> list[str]:
    """Each LSTM/GRU/RNN's `layout: 0` attribute removed (the same node: 0 is the default)."""
    dropped = []
    for node in model.graph.node:
        if default_layout(node):
            kept = [a for a in node.attribute if a.name != "layout"]
            del node.attribute[:]
            node.attribute.extend(kept)
            dropped.append(node.name)
    return dropped

