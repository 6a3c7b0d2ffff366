"""Transpose/Reshape cleanup: compose consecutive Transposes (dropped when the result is the identity), merge
Reshape→Reshape and Unsqueeze→Unsqueeze chains, and replace a Reshape's computed shape by a constant when
shape inference already knows the output (at most one dynamic dim, which becomes -1).

Why: exporters write `x.view(x.size(0), -1)` as Shape→Gather→Unsqueeze→Concat→Reshape and attention heads as
Transpose pairs; each extra node is another tensor a quantizer may round. Engine: onnxscript's basic rules.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import IdentityEliminationPass, RemoveUnusedNodesPass
from onnxscript.rewriter import MatchResult, RewriteRuleClassBase, RewriteRuleSet
from onnxscript.rewriter.rules.common import (no_op_transpose_rule, reshape_reshape_rule, squeeze_reshape_1d_rule,
                                              transpose_transpose_rule, unsqueeze_unsqueeze_rule)

from qprep.optimize.ir_utils import constant_array, infer_shapes
from qprep.optimize.passes import GraphPass, PassOutcome, PassSettings
from qprep.third_party import MaterializeReshapeShape, materialized_dims


class ReshapeKeepingOwnDims(RewriteRuleClassBase):
    """Reshape(x, Concat(Unsqueeze(Gather(Shape(x), k)), c, ...)) → Reshape(x, [0 or c, ...]).

    The `x.view(x.size(0), -1)` idiom: a piece that copies dim k (of x, or of a tensor whose dim k is provably
    the same) into position k is what Reshape's 0 means (allowzero=0); every other piece must be a constant.
    The shape subgraph then dies.
    """

    def pattern(self, op, x, shape):
        return op.Reshape(x, shape)

    def check(self, context, x, shape, **_) -> MatchResult:
        result = MatchResult()
        self._dims = _dims_copying(x, shape)
        return result if self._dims is not None else result.fail("shape is not built from x's dims and constants")

    def rewrite(self, op, x, shape, **_):
        name = f"{shape.name}/constant"
        return op.Reshape(x, op.initializer(ir.tensor(np.array(self._dims, dtype=np.int64), name=name), name=name))


def _dims_copying(x: ir.Value, shape: ir.Value) -> list[int] | None:
    concat = shape.producer()
    if concat is None or concat.op_type != "Concat" or concat.attributes.get_int("axis", 0) != 0:
        return None
    dims: list[int] = []
    for piece in concat.inputs:
        value = constant_array(piece)
        if value is not None:
            dims.extend(int(v) for v in value.reshape(-1))
            continue
        unsqueeze = piece.producer()
        gather = unsqueeze.inputs[0].producer() if unsqueeze is not None and unsqueeze.op_type == "Unsqueeze" else None
        source = gather.inputs[0].producer() if gather is not None and gather.op_type == "Gather" else None
        index = constant_array(gather.inputs[1]) if source is not None else None
        if (source is None or source.op_type != "Shape" or index is None or index.size != 1
                or source.attributes.get_int("start", 0) != 0 or int(index) != len(dims)
                or not _same_dim(source.inputs[0], x, len(dims))):
            return None
        dims.append(0)
    return dims if dims.count(-1) <= 1 else None


def _same_dim(a: ir.Value, b: ir.Value, axis: int) -> bool:
    """Dim `axis` of a and b is provably equal: same tensor, same static size, or the same named symbolic dim
    (ONNX: one dim_param name means one size within a graph; inference's `unk__` names prove nothing)."""
    if a is b:
        return True
    if a.shape is None or b.shape is None or axis >= min(len(a.shape), len(b.shape)):
        return False
    da, db = a.shape[axis], b.shape[axis]
    if isinstance(da, int) or isinstance(db, int):
        return da == db
    return da.value is not None and da.value == db.value and not str(da.value).startswith("unk__")


class ConstantReshapeShape(MaterializeReshapeShape):
    """onnxscript's rule (the output shape is known: the computed shape becomes a constant) without its
    allowzero=1, an attribute that exists from opset 14 only: on an opset-13 model the checker refused it and
    the whole pass was rolled back. A shape without a 0 does not need it, so shapes with a 0 are left alone."""

    def check(self, context, data, shape) -> MatchResult:
        result = super().check(context, data, shape)
        if result and 0 in materialized_dims(self):
            return MatchResult().fail("a 0 dim would need allowzero (opset 14)")
        self._name = f"{context.output_values[0].name}/shape"
        return result

    def rewrite(self, op, data, shape, **_):
        return op.Reshape(data, op.initializer(ir.tensor(np.array(materialized_dims(self), np.int64), name=self._name)))


RULES = RewriteRuleSet([ReshapeKeepingOwnDims.rule(), transpose_transpose_rule, no_op_transpose_rule, reshape_reshape_rule,
                        unsqueeze_unsqueeze_rule, squeeze_reshape_1d_rule, ConstantReshapeShape.rule()])


def apply(model: ir.Model, settings: PassSettings) -> PassOutcome:
    infer_shapes(model)  # the rules check ranks/shapes
    count = RULES.apply_to_model(model)
    IdentityEliminationPass()(model)  # composed Transposes that cancel out become Identity first
    RemoveUnusedNodesPass()(model)
    return PassOutcome(matches=count, details={"rewrites": count})


PASS = GraphPass(name="simplify_shapes", apply=apply,
                 doc="compose Transposes, merge Reshape/Unsqueeze chains, constant Reshape shapes")
