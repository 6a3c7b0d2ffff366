"""An Einsum that is one batched matmul → Transposes and a MatMul.

Facts (rknn-toolkit2 2.5.0): an Einsum (a batched matmul written as `nid,njd->nij`) fails the build in the
toolkit's own shape inference (KeyError on a value its Einsum conversion made, then in every rule disabled after
it). A two-operand Einsum that is one batched matmul (one contracted letter, one free letter per operand, the
rest shared batch letters) is rewritten as Transposes and a MatMul; other equations are left to the toolkit.
"""

from __future__ import annotations

import onnx
from onnx import helper

from qprep.model.info import iter_nodes, unique_name
from qprep.quantize.rknn.io_names import all_names
from qprep.quantize.rknn.static_graph.edit import replace_node


def matmul_plan(node: onnx.NodeProto) -> tuple[list[int], list[int], list[int]] | None:
    """(perm of A to [batch…, i, k], perm of B to [batch…, k, j], perm of [batch…, i, j] to the output) when the
    Einsum is one batched matmul; else None."""
    if node.op_type != "Einsum" or node.domain not in ("", "ai.onnx") or len(node.input) != 2:
        return None
    equation = next((a.s.decode() for a in node.attribute if a.name == "equation"), "").replace(" ", "")
    if "..." in equation or equation.count("->") != 1:
        return None
    terms, out = equation.split("->")
    if terms.count(",") != 1:
        return None
    a, b = terms.split(",")
    if any(len(set(t)) != len(t) for t in (a, b, out)):
        return None
    batch = [c for c in out if c in a and c in b]
    contracted = [c for c in a if c in b and c not in out]
    free_a, free_b = [c for c in a if c not in b], [c for c in b if c not in a]
    if len(contracted) != 1 or len(free_a) != 1 or len(free_b) != 1 or sorted(out) != sorted(batch + free_a + free_b):
        return None
    product = batch + free_a + free_b
    return ([a.index(c) for c in batch + free_a + contracted], [b.index(c) for c in batch + contracted + free_b],
            [product.index(c) for c in out])


def einsums_as_matmul(model: onnx.ModelProto) -> list[str]:
    """Each batched-matmul Einsum of the main graph → Transpose(A), Transpose(B), MatMul, Transpose (identity
    Transposes left out), in its place."""
    graph, done = model.graph, []
    taken = all_names(model) | {n.name for n in iter_nodes(graph)}
    plans = [(i, plan) for i, plan in enumerate(map(matmul_plan, graph.node)) if plan]
    for index, (perm_a, perm_b, perm_out) in reversed(plans):  # later ones first: earlier indices stay valid
        node = graph.node[index]
        prefix, replacement, operands = f"{node.name}/", [], []
        for operand, perm, label in ((node.input[0], perm_a, "a"), (node.input[1], perm_b, "b")):
            if perm != sorted(perm):
                moved = unique_name(f"{prefix}{label}", taken)
                replacement.append(helper.make_node("Transpose", [operand], [moved], perm=perm, name=moved))
                operand = moved
            operands.append(operand)
        product = node.output[0] if perm_out == sorted(perm_out) else unique_name(f"{prefix}product", taken)
        replacement.append(helper.make_node("MatMul", operands, [product], name=unique_name(f"{prefix}matmul", taken)))
        if product != node.output[0]:
            replacement.append(helper.make_node("Transpose", [product], [node.output[0]], perm=perm_out,
                                                name=unique_name(f"{prefix}out", taken)))
        replace_node(graph, index, replacement)
        done.insert(0, node.name)
    return done

