"""MatMul(X, W) + B with 2-D operands → Gemm(X, W, B) (also with a Transpose on either side absorbed).

Why: one node instead of two, and the bias then belongs to the layer: quantizers give Gemm an int32 bias
instead of rounding the MatMul output before the Add. Engine: onnxscript's matmul_add_to_gemm rules, which
check both operands are rank 2.
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass
from onnxscript.rewriter import RewriteRuleSet
from onnxscript.rewriter.rules.common import (matmul_add_to_gemm_rule, transpose_a_matmul_add_to_gemm_rule,
                                              transpose_ab_matmul_add_to_gemm_rule,
                                              transpose_b_matmul_add_to_gemm_rule)

from qprep.optimize.ir_utils import infer_shapes
from qprep.optimize.passes import GraphPass, PassOutcome, PassSettings

RULES = RewriteRuleSet([transpose_ab_matmul_add_to_gemm_rule, transpose_a_matmul_add_to_gemm_rule,
                        transpose_b_matmul_add_to_gemm_rule, matmul_add_to_gemm_rule], commute=True)


def apply(model: ir.Model, settings: PassSettings) -> PassOutcome:
    infer_shapes(model)  # the rules check ranks/shapes
    count = RULES.apply_to_model(model)
    RemoveUnusedNodesPass()(model)
    return PassOutcome(matches=count, details={"fused": count})


PASS = GraphPass(name="fuse_gemm", apply=apply, doc="fuse 2-D MatMul + bias Add into Gemm")
