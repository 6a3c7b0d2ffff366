"""Constant folding: compute every node whose inputs are all constant, and shape subgraphs whose shapes are
known once input dims are fixed, then keep the results as initializers.

Why: exporters leave weight transposes, shape arithmetic and Constant nodes in the graph; a quantizer would
calibrate and round each of them. Two engines, each for what it does well:
- onnxscript's folder for partial evaluation (shape arithmetic on symbolic shapes) and for cheap ops on tiny
  tensors, which it evaluates with onnx's pure-Python reference ops;
- ONNX Runtime for every other full evaluation (qprep/graph/fold_runtime.py): the whole constant closure in
  one session, each node's cost estimated first and a node over the budget left (a bicubic Resize in the
  reference ops took over ten minutes on one ViT).
The rounds alternate until nothing more folds. Never folded: QuantizeLinear/DequantizeLinear (QAT scales must
stay visible), random ops, control flow, domains ONNX Runtime cannot run. The size cap keeps folding from
materializing giant tensors (e.g. an Expand of a scalar to a big shape). What was left, and why, is counted in
the pass's details (`left`).
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import LiftConstantsToInitializersPass, RemoveUnusedNodesPass
from onnxscript.optimizer import fold_constants

from qprep.graph import fold_runtime
from qprep.graph.ir import constant_array
from qprep.optimize.passes import GraphPass, PassOutcome, PassSettings

ROUNDS = 4  # onnxscript, then ONNX Runtime, repeated while ONNX Runtime still folds something
TINY = 4096  # elements: ops on tensors this small stay with onnxscript's reference evaluator
# Ops whose reference implementation is a numpy call or two: shape arithmetic and light element-wise work.
CHEAP_OPS = frozenset({
    "Abs", "Add", "And", "Cast", "CastLike", "Ceil", "Concat", "Div", "Equal", "Flatten", "Floor", "Gather",
    "Greater", "GreaterOrEqual", "Identity", "Less", "LessOrEqual", "Max", "Min", "Mod", "Mul", "Neg", "Not",
    "Or", "Reciprocal", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceSum", "Reshape", "Shape", "Sign", "Size",
    "Slice", "Sqrt", "Squeeze", "Sub", "Transpose", "Unsqueeze", "Where", "Xor",
})


class _FoldPolicy:
    """onnxscript's should_fold: keeps cheap ops on tiny tensors, refuses the rest, which ONNX Runtime then
    evaluates (refused here, they are counted by the ONNX Runtime half, not here)."""

    def __init__(self, max_elements: int):
        self.max_elements = max_elements

    def __call__(self, node: ir.Node) -> bool | None:
        """Never Q/DQ or random ops; ConstantOfShape when its output is small (onnxscript keeps them all by
        default, which leaves exporters' padding arithmetic unfolded); otherwise the default for tiny cheap
        ops, and no (ONNX Runtime's turn) for the rest."""
        if node.op_type in fold_runtime.NEVER_FOLD:
            return False
        if node.op_type == "ConstantOfShape":
            shape = constant_array(node.inputs[0])
            return None if shape is None or int(np.prod(shape)) > self.max_elements else True
        if node.domain in ("", "ai.onnx") and node.op_type in CHEAP_OPS and _tiny(node):
            return None
        return False


def _tiny(node: ir.Node) -> bool:
    """Every input and every known output shape at most TINY elements."""
    for value in node.inputs:
        tensor = value.const_value if value is not None else None
        if tensor is not None and math.prod(tensor.shape.numpy()) > TINY:
            return False
    for value in node.outputs:
        shape = value.shape
        if shape is not None and shape.is_static() and math.prod(shape.numpy()) > TINY:
            return False
    return True


def apply(model: ir.Model, settings: PassSettings) -> PassOutcome:
    nodes_before = _count(model)
    constants_before = _count(model, "Constant")
    left, by_runtime, sessions = Counter(), 0, 0
    for _ in range(ROUNDS):
        fold_constants(model, input_size_limit=settings.fold_max_elements,
                       output_size_limit=settings.fold_max_elements, should_fold=_FoldPolicy(settings.fold_max_elements))
        evaluated = fold_runtime.fold_closure(model, settings.fold_max_elements, settings.threads)
        left |= evaluated.left  # a node left in one round is left again in the next: the most per reason
        by_runtime += evaluated.evaluated
        sessions += evaluated.sessions
        RemoveUnusedNodesPass()(model)
        if not evaluated.materialized:
            break
    folded = nodes_before - _count(model)
    lifted = _count(model, "Constant")
    LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0)(model)
    lifted -= _count(model, "Constant")
    RemoveUnusedNodesPass()(model)
    details = {"nodes_folded": folded, "constants_before": constants_before,
               "constants_lifted_to_initializers": lifted, "evaluated_by_onnxruntime": by_runtime,
               "onnxruntime_sessions": sessions}
    if left:
        details["left"] = dict(sorted(left.items()))
    return PassOutcome(matches=nodes_before - _count(model), details=details)


def _count(model: ir.Model, op_type: str | None = None) -> int:
    return sum(1 for n in ir.traversal.RecursiveGraphIterator(model.graph) if op_type in (None, n.op_type))


PASS = GraphPass(name="fold_constants", apply=apply,
                 doc="fold constant subgraphs (shape arithmetic included) into initializers: onnxscript for "
                     "shapes and tiny tensors, ONNX Runtime for the rest, cost-bounded and size-capped")
