"""Constant folding: compute every node whose inputs are all constant, and shape subgraphs whose shapes are
known once input dims are fixed, then keep the results as initializers.

Why: exporters leave weight transposes, shape arithmetic and Constant nodes in the graph; a quantizer would
calibrate and round each of them. Engine: onnxscript's FoldConstantsPass, which already skips
QuantizeLinear/DequantizeLinear (QAT scales must stay visible), control flow and random ops; the size cap
keeps folding from materializing giant tensors (e.g. an Expand of a scalar to a big shape).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import LiftConstantsToInitializersPass, RemoveUnusedNodesPass
from onnxscript.optimizer import fold_constants

from qprep.graph.ir import constant_array
from qprep.model.info import QDQ_OPS
from qprep.optimize.passes import GraphPass, PassOutcome, PassSettings


def _fold_policy(max_elements: int):
    def should_fold(node: ir.Node) -> bool | None:
        """Never Q/DQ (a QAT weight's DQ carries its scale); ConstantOfShape when its output is small (onnxscript
        keeps them all by default, which leaves exporters' padding arithmetic unfolded); default otherwise."""
        if node.op_type in QDQ_OPS:
            return False
        if node.op_type == "ConstantOfShape":
            shape = constant_array(node.inputs[0])
            return None if shape is None or int(np.prod(shape)) > max_elements else True
        return None

    return should_fold


def apply(model: ir.Model, settings: PassSettings) -> PassOutcome:
    nodes_before = _count(model)
    constants_before = _count(model, "Constant")
    fold_constants(model, input_size_limit=settings.fold_max_elements,
                   output_size_limit=settings.fold_max_elements, should_fold=_fold_policy(settings.fold_max_elements))
    RemoveUnusedNodesPass()(model)
    folded = nodes_before - _count(model)
    lifted = _count(model, "Constant")
    LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0)(model)
    lifted -= _count(model, "Constant")
    RemoveUnusedNodesPass()(model)
    return PassOutcome(matches=nodes_before - _count(model),
                       details={"nodes_folded": folded, "constants_before": constants_before,
                                "constants_lifted_to_initializers": lifted})


def _count(model: ir.Model, op_type: str | None = None) -> int:
    return sum(1 for n in ir.traversal.RecursiveGraphIterator(model.graph) if op_type in (None, n.op_type))


PASS = GraphPass(name="fold_constants", apply=apply,
                 doc="fold constant subgraphs (shape arithmetic included) into initializers, size-capped")
