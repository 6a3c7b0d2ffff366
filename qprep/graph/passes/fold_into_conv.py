"""Absorb neighbours into Conv: BatchNormalization (also into ConvTranspose/Gemm), a constant bias Add, and a
constant zero-value Pad (into Conv's pads).

Preconditions (checked by the rules): the BN's statistics and the Conv's weights are constants, the Conv output
feeds only the BN (a second consumer would need the unfolded value), inference-mode BN. Math, per output
channel c with s = gamma / sqrt(var + eps): W'[c] = W[c] * s, b'[c] = (b[c] - mean) * s + beta.
The BN and Pad rules are onnxscript's (`_fuse_batchnorm`, `_fuse_pad_into_conv`); the bias rule is ours: Conv(x, W[, b]) + C with C constant
and broadcast only over the channel axis → Conv(x, W, b + C).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass
from onnxscript.rewriter import MatchResult, RewriteRuleClassBase, RewriteRuleSet
from onnxscript.rewriter.rules.common import (fuse_batchnorm_into_conv_rule, fuse_batchnorm_into_conv_transpose_rule,
                                              fuse_batchnorm_into_gemm_rule, fuse_pad_into_conv_rule,
                                              normalize_pad_format_conv_rule)

from qprep.graph.ir_utils import constant_array
from qprep.graph.passes import GraphPass, PassOutcome, PassSettings


class ConvBiasAdd(RewriteRuleClassBase):
    """Conv(x, W[, b]) → Add(·, C) with C a per-channel constant → Conv(x, W, b + C)."""

    def pattern(self, op, x, w, addend):
        return op.Add(op.Conv(x, w, _allow_other_inputs=True, _allow_other_attributes=True, _outputs=["conv"]),
                      addend)

    def check(self, context, x, w, addend, conv, **_) -> MatchResult:
        result = MatchResult()
        weights, extra = constant_array(w), constant_array(addend)
        node = conv.producer()
        bias = node.inputs[2] if len(node.inputs) > 2 and node.inputs[2] is not None else None
        if weights is None or extra is None:
            return result.fail("weights or addend not constant")
        if bias is not None and constant_array(bias) is None:
            return result.fail("existing bias not constant")
        channels, rank = weights.shape[0], weights.ndim  # Conv output rank = weight rank
        shape = (1,) * (rank - extra.ndim) + extra.shape if extra.ndim <= rank else None
        if shape is None or any(d != 1 for i, d in enumerate(shape) if i != 1) or shape[1] not in (1, channels):
            return result.fail(f"addend shape {extra.shape} is not per-channel for {channels} channels")
        if extra.dtype != weights.dtype:
            return result.fail("dtype mismatch")
        return result

    def rewrite(self, op, x, w, addend, conv, **_):
        node = conv.producer()
        weights, extra = constant_array(w), constant_array(addend)
        old = node.inputs[2] if len(node.inputs) > 2 and node.inputs[2] is not None else None
        bias = constant_array(old) if old is not None else np.zeros(weights.shape[0], weights.dtype)
        fused = (bias + np.broadcast_to(extra.reshape(-1), (weights.shape[0],))).astype(weights.dtype)
        name = f"{node.name}/bias_folded"
        return op.Conv(x, w, op.initializer(ir.tensor(fused, name=name), name=name),
                       **{k: v for k, v in node.attributes.items()}, _name=node.name)


RULES = RewriteRuleSet([fuse_batchnorm_into_conv_rule, fuse_batchnorm_into_conv_transpose_rule,
                        fuse_batchnorm_into_gemm_rule, *ConvBiasAdd.rule().commute(),
                        normalize_pad_format_conv_rule, fuse_pad_into_conv_rule])


def apply(model: ir.Model, settings: PassSettings) -> PassOutcome:
    count = RULES.apply_to_model(model)
    RemoveUnusedNodesPass()(model)
    return PassOutcome(matches=count, details={"folded": count})


PASS = GraphPass(name="fold_into_conv", apply=apply,
                 doc="fold BatchNormalization, constant bias Adds and constant Pads into Conv (BN also into Gemm)")
