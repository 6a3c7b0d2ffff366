"""If → both branches inlined and a selection.

Facts (rknn-toolkit2 2.5.0): an If whose condition is computed from the inputs (openWakeWord's verifier gate) is
refused by the toolkit ("The If will cause the graph to be a dynamic graph! Remove it manually"), and a branch
reading a value of the outer graph fails earlier in its If converter ("input 'x.1' of node Flatten_33 is not
output of any previous nodes"). Rewritten as both branches inlined and Where(condition, then, else)
(c·then + (1-c)·else for a one-element output: Where over one element crashes the build too): the NPU computes
both branches and keeps the one ONNX Runtime would have run. Branches whose outputs differ in shape cannot be,
and are refused.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qprep.errors import ModelError
from qprep.model.info import iter_nodes, unique_name
from qprep.quantize.rknn.io_names import all_names
from qprep.quantize.rknn.static_graph.edit import inlined, one_by_one, replace_node, value_shapes


def is_if(node: onnx.NodeProto) -> bool:
    return node.op_type == "If" and node.domain in ("", "ai.onnx")


def ifs_as_both_branches(model: onnx.ModelProto) -> list[str]:
    """Every If of the main graph (an inlined branch's own If included) → its branches' nodes + a selection."""
    done = []
    for index in one_by_one(model, is_if):
        graph = model.graph
        node = graph.node[index]
        inferred = onnx.shape_inference.infer_shapes(model)  # node order kept: the same If at `index`
        branches = {a.name: a.g for a in node.attribute}
        inferred_branches = {a.name: a.g for a in inferred.graph.node[index].attribute}
        outputs = branch_outputs(node, inferred_branches["then_branch"], inferred_branches["else_branch"])
        taken = all_names(model) | {n.name for n in iter_nodes(graph)}
        replacement, then_names = inlined(branches["then_branch"], f"{node.name}/then/", taken, graph)
        more, else_names = inlined(branches["else_branch"], f"{node.name}/else/", taken, graph)
        replacement += more
        condition_shape = value_shapes(inferred).get(node.input[0])
        for position, output in enumerate(node.output):
            if output:
                shape, elem_type = outputs[position]
                replacement += _selection(node, node.input[0], condition_shape, then_names[position],
                                          else_names[position], output, shape, elem_type, taken, graph)
        replace_node(graph, index, replacement)
        done.append(node.name)
    return done


def branch_outputs(node: onnx.NodeProto, then: onnx.GraphProto, other: onnx.GraphProto) -> list[tuple[list, int]]:
    """The branches' (output shape, element type), checked: both must give one fixed shape to select from."""
    def outputs(branch):
        return [([d.dim_value if d.HasField("dim_value") else None for d in o.type.tensor_type.shape.dim]
                 if o.type.tensor_type.HasField("shape") else None, o.type.tensor_type.elem_type)
                for o in branch.output]

    then_outputs, else_outputs = outputs(then), outputs(other)
    for position, ((a, _), (b, _)) in enumerate(zip(then_outputs, else_outputs)):
        if a is None or b is None or a != b or None in a:
            raise ModelError(f"quantize.rknn: node '{node.name}' is an If whose branches give output {position} "
                             f"shapes {a} and {b}; rknn-toolkit2 compiles static graphs only, and qprep can run both "
                             "branches only when they give one fixed shape: export the branch the device needs")
    return then_outputs


def _selection(node: onnx.NodeProto, condition: str, condition_shape: list | None, then: str, other: str,
               output: str, shape: list[int], elem_type: int, taken: set[str],
               graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """`output` = the `then` value where the one-element condition holds, else `other`: Where; for a one-element
    output c·then + (1-c)·other instead (exact for 0/1 and finite values), since Where over one element crashes
    the toolkit's build (SIGSEGV, measured on [1,1]; [1,8] builds). The condition is reshaped to the output's
    rank when its own is higher or unknown, so broadcasting keeps the output's shape."""
    def name(what: str) -> str:
        return unique_name(f"{node.name}/{what}", taken)

    nodes = []
    if condition_shape is None or len(condition_shape) > len(shape):
        reshaped, target = name("condition"), name("condition_shape")
        graph.initializer.append(numpy_helper.from_array(np.ones(len(shape), np.int64), target))
        nodes.append(helper.make_node("Reshape", [condition, target], [reshaped], name=name("reshape_condition")))
        condition = reshaped
    if int(np.prod(shape)) != 1:
        return nodes + [helper.make_node("Where", [condition, then, other], [output], name=name("where"))]
    one, taken_then, taken_else = name("one"), name("then_weight"), name("else_weight")
    chosen_then, chosen_else = name("then_selected"), name("else_selected")
    graph.initializer.append(numpy_helper.from_array(
        np.ones((), helper.tensor_dtype_to_np_dtype(elem_type)), one))
    return nodes + [helper.make_node("Cast", [condition], [taken_then], to=elem_type, name=name("cast_condition")),
                    helper.make_node("Sub", [one, taken_then], [taken_else], name=name("not_condition")),
                    helper.make_node("Mul", [then, taken_then], [chosen_then], name=name("select_then")),
                    helper.make_node("Mul", [other, taken_else], [chosen_else], name=name("select_else")),
                    helper.make_node("Add", [chosen_then, chosen_else], [output], name=name("selected"))]

