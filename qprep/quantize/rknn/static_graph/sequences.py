"""A sequence appended to, then concatenated → Concat: what a torch list appended to in a loop becomes once the
loop is unrolled (loops.py). The toolkit has no sequence type and fails inside its own constant folding on any
sequence op, so one left after the rewrites is refused, naming the node.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qprep.errors import ModelError
from qprep.model.info import default_opset, iter_nodes, node_index, unique_name
from qprep.quantize.rknn.io_names import all_names
from qprep.quantize.rknn.static_graph.edit import replace_node


def _sequence_chain(graph: onnx.GraphProto, concat: onnx.NodeProto) -> tuple[list[str], list[onnx.NodeProto]] | None:
    """(the tensors in order, the nodes that built the sequence) when `concat`'s sequence was built only by
    SequenceEmpty/SequenceConstruct and appending SequenceInserts (through Identities), each step read by the
    next alone: a torch list appended to in a loop, once the loop is unrolled."""
    producers = {o: node for node in graph.node for o in node.output}
    readers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    outputs = {o.name for o in graph.output}
    tensors, chain, value = [], [], concat.input[0]
    while True:
        node = producers.get(value)
        if node is None or value in outputs or readers.get(value, 0) != 1:
            return None
        chain.append(node)
        if node.op_type == "SequenceEmpty":
            return tensors[::-1], chain
        if node.op_type == "SequenceConstruct":
            return list(node.input) + tensors[::-1], chain
        if node.op_type == "SequenceInsert" and len(node.input) == 2:
            tensors.append(node.input[1])
        elif node.op_type != "Identity":
            return None
        value = node.input[0]


def sequences_as_concat(model: onnx.ModelProto) -> list[str]:
    """Each ConcatFromSequence over such a chain → Concat of its tensors (each Unsqueezed first for new_axis)."""
    graph, done = model.graph, []
    taken = all_names(model) | {n.name for n in iter_nodes(graph)}
    opset = default_opset(model)
    for concat in [n for n in graph.node if n.op_type == "ConcatFromSequence" and n.domain in ("", "ai.onnx")]:
        found = _sequence_chain(graph, concat)
        if not found or not found[0]:
            continue
        tensors, chain = found
        attributes = {a.name: a.i for a in concat.attribute}
        axis, replacement = attributes.get("axis", 0), []
        if attributes.get("new_axis", 0):
            axes = unique_name(f"{concat.name}/axes", taken)
            if opset >= 13:
                graph.initializer.append(numpy_helper.from_array(np.array([axis], np.int64), axes))
            stacked = []
            for k, tensor in enumerate(tensors):
                stacked.append(unique_name(f"{concat.name}/{k}", taken))
                inputs, extra = ([tensor, axes], {}) if opset >= 13 else ([tensor], {"axes": [axis]})
                replacement.append(helper.make_node("Unsqueeze", inputs, [stacked[-1]], **extra,
                                                    name=unique_name(f"{concat.name}/unsqueeze_{k}", taken)))
            tensors = stacked
        replacement.append(helper.make_node("Concat", tensors, [concat.output[0]], axis=axis,
                                            name=unique_name(f"{concat.name}/concat", taken)))
        replace_node(graph, node_index(graph, concat), replacement)
        for node in chain:
            graph.node.remove(node)
        done.append(concat.name)
    return done


def refuse_sequences(model: onnx.ModelProto) -> None:
    """A sequence op left after the rewrites (one read other than by a concatenation of appends): the toolkit
    has no sequence type and fails inside its own constant folding."""
    node = next((n for n in model.graph.node if "Sequence" in n.op_type), None)
    if node is not None:
        raise ModelError(f"quantize.rknn: node '{node.name or node.output[0]}' is {node.op_type}, and rknn-toolkit2 "
                         "takes no sequence ops (qprep rewrites only a list appended to and then concatenated or "
                         "stacked); export the model with tensors instead of a list, or use backend ort")

