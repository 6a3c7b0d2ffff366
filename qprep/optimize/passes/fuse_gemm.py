"""MatMul(X, W) + B with 2-D operands → Gemm(X, W, B) (also with a Transpose on either side absorbed).

Why: one node instead of two, and the bias then belongs to the layer: quantizers give Gemm an int32 bias
instead of rounding the MatMul output before the Add.

Check: both MatMul operands rank 2, and B a constant that is the same for every row, i.e. one value per output
column (shape [N], [1, N], [1] or a scalar); the Gemm gets it as a 1-D [N] bias. Why so strict: ONNX allows any
C broadcastable to [M, N], but ONNX Runtime's per-channel quantizer takes C as a per-column int32 bias and fails
on anything else ([1, N]: "The truth value of an array with more than one element is ambiguous"; a scalar:
IndexError), and a bias that varies by row is no bias. Such an Add is left as it is.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass
from onnxscript.rewriter import MatchResult, RewriteRuleClassBase, RewriteRuleSet

from qprep.graph.ir import constant_array, infer_shapes
from qprep.graph.rules import unique_value_name
from qprep.optimize.passes import GraphPass, PassOutcome, PassSettings


class _MatMulAddToGemm(RewriteRuleClassBase):
    """Add(MatMul(a, b), c) → Gemm(a, b, c as [N]); subclasses absorb a Transpose of a and/or b."""

    trans_a = False
    trans_b = False

    def pattern(self, op, input_a, input_b, input_c):
        a = op.Transpose(input_a, perm=[1, 0]) if self.trans_a else input_a
        b = op.Transpose(input_b, perm=[1, 0]) if self.trans_b else input_b
        return op.Add(op.MatMul(a, b), input_c)

    def check(self, context, input_a, input_b, input_c, **_) -> MatchResult:
        if not (_rank(input_a) == 2 and _rank(input_b) == 2):
            return MatchResult().fail("MatMul operands are not both rank 2")
        bias = _bias(input_b, input_c, self.trans_b)
        return MatchResult().fail(bias) if isinstance(bias, str) else MatchResult()

    def rewrite(self, op, input_a, input_b, input_c, **_):
        attributes = {**({"transA": 1} if self.trans_a else {}), **({"transB": 1} if self.trans_b else {})}
        bias = _bias(input_b, input_c, self.trans_b)
        if bias.shape != tuple(input_c.shape or ()) or input_c.const_value is None:
            name = unique_value_name(input_a.graph or input_b.graph, f"{input_c.name}_per_column")
            input_c = op.initializer(ir.tensor(bias, name=name), name=name)
        return op.Gemm(input_a, input_b, input_c, **attributes)


class MatMulAddToGemm(_MatMulAddToGemm):
    pass


class TransAMatMulAddToGemm(_MatMulAddToGemm):
    trans_a = True


class TransBMatMulAddToGemm(_MatMulAddToGemm):
    trans_b = True


class TransABMatMulAddToGemm(_MatMulAddToGemm):
    trans_a = trans_b = True


def _rank(value: ir.Value) -> int | None:
    return None if value.shape is None else len(value.shape)


def _bias(input_b: ir.Value, input_c: ir.Value, trans_b: bool) -> np.ndarray | str:
    """C as one value per output column ([N]), or why it is not one."""
    c = constant_array(input_c)
    if c is None:
        return "the added value is not a constant"
    columns = None if input_b.shape is None else input_b.shape[0 if trans_b else 1]
    if not isinstance(columns, int):
        return "the number of output columns is unknown"
    if c.ndim > 2 or any(d != 1 for d in c.shape[:-1]) or (c.ndim and c.shape[-1] not in (1, columns)):
        return f"the added constant of shape {list(c.shape)} is not one value per output column"
    return np.ascontiguousarray(np.broadcast_to(c.reshape(-1), (columns,)))


RULES = RewriteRuleSet([TransABMatMulAddToGemm().rule(), TransAMatMulAddToGemm().rule(),
                        TransBMatMulAddToGemm().rule(), MatMulAddToGemm().rule()], commute=True)


def apply(model: ir.Model, settings: PassSettings) -> PassOutcome:
    infer_shapes(model)  # the rules check ranks/shapes
    count = RULES.apply_to_model(model)
    RemoveUnusedNodesPass()(model)
    return PassOutcome(matches=count, details={"fused": count})


PASS = GraphPass(name="fuse_gemm", apply=apply, doc="fuse 2-D MatMul + per-column bias Add into Gemm")
