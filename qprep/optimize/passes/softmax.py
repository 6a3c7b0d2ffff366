"""fuse_softmax: a softmax written out as its arithmetic → one Softmax over the last axis.

Why: jax2tf writes `jax.nn.softmax` as ReduceMax, Max(−inf, ·), Sub, Exp, ReduceSum, Div (the Flax MiniLM: one
per attention). A quantizer then rounds each of those tensors on its own grid, RKNN cannot fuse the attention into
its SDPA layer, and qprep's attention-mask handling (quantize/nonfinite.py) finds a mask by the Softmax that
reads it, so written out its mask nodes stay float16 on RKNN (BENCHMARKS.md: "a softmax written out fused").

Forms (x the scores, a its last axis):

    m = ReduceMax(x, a)  → [Max/Min with a constant]* → [Reshape/Unsqueeze restoring a]   (keepdims 0 or 1)
    e = Exp(Sub(x, m))
    s = ReduceSum(e, a)  → [Reshape/Unsqueeze restoring a]
    y = Div(e, s)

Check: every reduction over the single last axis of x (attribute or constant input; negative or not); a
Reshape on a path adds exactly the reduced axis back (static shapes: its output is its input with a 1 at a), an
Unsqueeze unsqueezes a; a Max/Min's other operand is a one-element constant; e, s, m and everything between are
read only inside this softmax and are no graph outputs.
Math: softmax is the same for any shift constant along the axis — exp(x − m) / Σ exp(x − m) = Softmax(x) for
every m that is one value per row — so the m path only has to be per row (jax's max(−inf, ·) included);
Softmax subtracts its own row maximum. The stage verifies the numbers, as for every pass.
Replacement: Softmax(x, axis=−1) where y was computed (its name kept if y is a graph output); the other nodes
die with their last reader.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from qprep.graph.ir import constant_array, infer_shapes
from qprep.graph.rules import all_graphs, unique_node_name
from qprep.optimize.passes import GraphPass, PassOutcome, PassSettings

BOUNDS = {"Max", "Min"}  # a per-row value bounded by a constant stays per row (jax: max(−inf, row max))
RESTORES = {"Reshape", "Unsqueeze"}


def apply(model: ir.Model, settings: PassSettings) -> PassOutcome:
    infer_shapes(model)  # the checks read ranks and shapes
    fused, refused = 0, {}
    for graph in all_graphs(model):
        for div in [node for node in graph if node.op_type == "Div" and node.domain == ""]:
            found = _softmax_input(div)
            if isinstance(found, str):
                if found:
                    refused[found] = refused.get(found, 0) + 1
                continue
            _replace(graph, div, found)
            fused += 1
    if fused:
        RemoveUnusedNodesPass()(model)
    details = {**({"fused": fused} if fused else {}), **({"refused": refused} if refused else {})}
    return PassOutcome(fused, details)


def _softmax_input(div: ir.Node) -> ir.Value | str:
    """The x of the softmax `div` ends, or why not ("" when `div` is no softmax candidate at all)."""
    e, s = div.inputs
    exp = e.producer() if e else None
    sum_path, reduce_sum = _chain(s)
    if exp is None or exp.op_type != "Exp" or reduce_sum is None or reduce_sum.op_type != "ReduceSum" \
            or reduce_sum.inputs[0] is not e:
        return ""  # not an Exp divided by its own sum
    sub = exp.inputs[0].producer()
    if sub is None or sub.op_type != "Sub":
        return "the Exp's input is not x minus its row maximum"
    x, shift = sub.inputs
    rank = len(x.shape) if x.shape is not None else None
    if rank is None:
        return "the scores' rank is unknown"
    max_path, reduce_max = _chain(shift, bounds=True)
    if reduce_max is None or reduce_max.op_type != "ReduceMax" or reduce_max.inputs[0] is not x:
        return "the shift is not the scores' row maximum"
    for reduction in (reduce_sum, reduce_max):
        if _axes(reduction, rank) != [rank - 1]:
            return f"{reduction.op_type} is not over the last axis alone"
    for path, reduction in ((sum_path, reduce_sum), (max_path, reduce_max)):
        problem = _restored(path, reduction, rank)
        if problem:
            return problem
    inside = {div, exp, sub, reduce_sum, reduce_max, *sum_path, *max_path}
    for node in inside - {div}:
        for out in node.outputs:
            if out.is_graph_output() or any(use.node not in inside for use in out.uses()):
                return f"{node.op_type} '{node.name}' is read outside the softmax"
    return x


def _chain(value: ir.Value | None, bounds: bool = False) -> tuple[list[ir.Node], ir.Node | None]:
    """The Reshape/Unsqueeze nodes (and, with `bounds`, Max/Min with a constant) above `value`, nearest first,
    and the first other node above them."""
    path, node = [], value.producer() if value is not None else None
    while node is not None and (node.op_type in RESTORES or (bounds and node.op_type in BOUNDS)):
        path.append(node)
        node = node.inputs[0].producer() if node.op_type in RESTORES else _bounded_operand(node)
    return path, node


def _bounded_operand(node: ir.Node) -> ir.Node | None:
    """The producer of a Max/Min's non-constant operand, when its other operand is a one-element constant."""
    if len(node.inputs) != 2:
        return None
    for value, other in ((node.inputs[0], node.inputs[1]), (node.inputs[1], node.inputs[0])):
        bound = constant_array(other)
        if (bound is not None and bound.size == 1 and constant_array(value) is None and value.shape is not None
                and bound.ndim <= len(value.shape)):  # a higher-rank constant would change the result's rank
            return value.producer()
    return None


def _axes(node: ir.Node, rank: int) -> list[int] | None:
    """A reduction's axes, normalized (None when not constant or when it reduces everything)."""
    attribute = node.attributes.get("axes")
    if attribute is not None:
        axes = list(attribute.as_ints())
    elif len(node.inputs) > 1 and node.inputs[1] is not None:
        array = constant_array(node.inputs[1])
        if array is None:
            return None
        axes = [int(a) for a in np.asarray(array).reshape(-1)]
    else:
        return None
    return sorted(a % rank for a in axes)


def _restored(path: list[ir.Node], reduction: ir.Node, rank: int) -> str:
    """Why the reduction's output, taken down `path` (nearest the reader first), is not one value per row of rank
    `rank` ("" if it is)."""
    keepdims = reduction.attributes.get("keepdims")
    kept = keepdims is None or keepdims.as_int() == 1
    for node in reversed(path):
        if node.op_type in BOUNDS:
            continue
        if kept:
            return f"{node.op_type} '{node.name}' reshapes a row value that already has the axis"
        before, after = node.inputs[0].shape, node.outputs[0].shape
        if node.op_type == "Unsqueeze":
            axes = _axes(node, rank)
            if axes != [rank - 1]:
                return f"Unsqueeze '{node.name}' does not restore the last axis"
        elif before is None or after is None or not before.is_static() or not after.is_static() \
                or list(after) != [*before, 1]:
            return f"Reshape '{node.name}' does not restore the last axis as 1"
        kept = True
    return "" if kept else f"{reduction.op_type} drops the axis and nothing restores it"


def _replace(graph: ir.Graph, div: ir.Node, x: ir.Value) -> None:
    """Softmax(x, axis=-1) before `div`; y's uses (and its name, if a graph output) move to it."""
    y = div.outputs[0]
    scope = (div.name or "").rpartition("/")[0]
    node = ir.node("Softmax", [x], attributes={"axis": -1},
                   name=unique_node_name(graph, f"{scope}/Softmax" if scope else "Softmax"))
    out = node.outputs[0]
    out.type, out.shape = y.type, y.shape
    graph.insert_before(div, node)
    if y.is_graph_output():
        index = list(graph.outputs).index(y)
        name, y.name = y.name, None
        graph.outputs[index] = out
        out.name = name
    ir.convenience.replace_all_uses_with(y, out)
    if out.name is None:
        out.name = y.name


PASS = GraphPass(name="fuse_softmax", apply=apply,
                 doc="fuse a softmax written out (ReduceMax, Sub, Exp, ReduceSum, Div; jax2tf) into one Softmax "
                     "over the last axis")
