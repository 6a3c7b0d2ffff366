"""Absorb neighbours into Conv, so fewer ops run and fewer activations are re-rounded once quantized:
BatchNormalization (also into ConvTranspose/Gemm), a constant per-channel Add (also on a ConvTranspose) or Mul on
the output, HardSigmoid on the output, a constant scalar Add or Mul on the input of an unpadded Conv, and a
constant zero-value Pad.

Preconditions (checked by the rules): the constants and the Conv's weights are constants; the intermediate value
feeds only the pattern (a second consumer would need the unfolded value), inference-mode BN.
Math, per output channel c (W[c] spans the input channels and the kernel):
    BatchNormalization   s = gamma / sqrt(var + eps): W'[c] = W[c]·s, b'[c] = (b[c] - mean)·s + beta
    Add(Conv, C)         b'[c] = b[c] + C[c]        (the same for ConvTranspose, c over W.shape[1]·group)
    Mul(Conv, C)         W'[c] = W[c]·C[c], b'[c] = b[c]·C[c]
    HardSigmoid(Conv)    = Clip(α·Conv + β, 0, 1): W' = α·W, b' = α·b + β, then Clip — which a quantizer
                         absorbs into the Conv's output range (PP-LCNet's squeeze-excitation gates)
    Conv(x·a)            W' = a·W                      (scalar a; any padding: zero stays zero)
    Conv(x + a)          b'[c] = b[c] + a·ΣW[c]        (scalar a; only without padding, where the padded zeros
                                                        would have needed to be -a)
The BN and Pad rules are onnxscript's (`_fuse_batchnorm`, `_fuse_pad_into_conv`), the others are ours.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass
from onnxscript.rewriter import MatchResult, RewriteRuleClassBase, RewriteRuleSet
from onnxscript.rewriter.rules.common import (
    fuse_batchnorm_into_conv_rule,
    fuse_batchnorm_into_conv_transpose_rule,
    fuse_batchnorm_into_gemm_rule,
    fuse_pad_into_conv_rule,
    normalize_pad_format_conv_rule,
)

from qprep.graph.ir import constant_array, default_opset
from qprep.graph.rules import per_channel, unique_value_name
from qprep.optimize.passes import GraphPass, PassOutcome, PassSettings

CLIP_INPUTS_OPSET = 11  # Clip's bounds became inputs in opset 11; older models keep their HardSigmoid


def _conv_parts(conv: ir.Value) -> tuple[ir.Node, np.ndarray | None, np.ndarray | None] | str:
    """(Conv node, weights, bias — zeros when absent) when both are constants, else why not."""
    node = conv.producer()
    weights = constant_array(node.inputs[1])
    old = node.inputs[2] if len(node.inputs) > 2 and node.inputs[2] is not None else None
    bias = constant_array(old) if old is not None else (None if weights is None else
                                                         np.zeros(weights.shape[0], weights.dtype))
    if weights is None or bias is None:
        return "weights or bias not constant"
    return node, weights, bias


def _per_output_channel(extra: np.ndarray | None, weights: np.ndarray) -> np.ndarray | str:
    """`extra`, broadcast against the Conv's output, as one value per output channel, or why it is not."""
    if extra is not None and extra.dtype != weights.dtype:
        return "dtype differs from the weights"
    return per_channel(extra, weights.shape[0], weights.ndim)  # Conv output rank = weight rank


def _scalar(extra: np.ndarray | None, weights: np.ndarray) -> float | str:
    if extra is None or extra.size != 1:
        return "not a scalar constant"
    if extra.dtype != weights.dtype:
        return "dtype differs from the weights"
    return float(extra.reshape(-1)[0])


def _conv(op, node: ir.Node, x, weights: np.ndarray, bias: np.ndarray, suffix: str):
    """The same Conv (name and attributes) with new weights and bias, as fresh initializers."""
    dtype = constant_array(node.inputs[1]).dtype  # the arithmetic above may have widened to float64
    w_name = unique_value_name(node.graph, f"{node.name}/weights_{suffix}")  # a second fold must not collide
    b_name = unique_value_name(node.graph, f"{node.name}/bias_{suffix}")
    return op.Conv(x, op.initializer(ir.tensor(weights.astype(dtype), name=w_name), name=w_name),
                   op.initializer(ir.tensor(bias.astype(dtype), name=b_name), name=b_name),
                   **dict(node.attributes), _name=node.name)


def _conv_output(op, x, w):
    return op.Conv(x, w, _allow_other_inputs=True, _allow_other_attributes=True, _outputs=["conv"])


class _ConvOutputConstant(RewriteRuleClassBase):
    """Op(Conv(x, W[, b]), C) with C a per-channel constant: the op folds into the Conv's weights and bias."""

    op_type = ""

    def pattern(self, op, x, w, constant):
        return getattr(op, self.op_type)(_conv_output(op, x, w), constant)

    def check(self, context, x, w, constant, conv, **_) -> MatchResult:
        parts = _conv_parts(conv)
        extra = parts if isinstance(parts, str) else _per_output_channel(constant_array(constant), parts[1])
        return MatchResult().fail(extra) if isinstance(extra, str) else MatchResult()

    def rewrite(self, op, x, w, constant, conv, **_):
        node, weights, bias = _conv_parts(conv)
        values = _per_output_channel(constant_array(constant), weights).astype(np.float64)
        return _conv(op, node, x, *self.fold(weights, bias, values), f"{self.op_type.lower()}_folded")


class ConvBiasAdd(_ConvOutputConstant):
    """Conv(x, W[, b]) + C → Conv(x, W, b + C)."""

    op_type = "Add"

    @staticmethod
    def fold(weights, bias, c):
        return weights, bias + c


class ConvScaleMul(_ConvOutputConstant):
    """Conv(x, W[, b]) · C → Conv(x, W·C, b·C) (PP-LCNetV3's learnable affine scale after every Conv)."""

    op_type = "Mul"

    @staticmethod
    def fold(weights, bias, c):
        return weights * c.reshape((-1,) + (1,) * (weights.ndim - 1)), bias * c


class ConvTransposeBiasAdd(RewriteRuleClassBase):
    """ConvTranspose(x, W[, b]) + C → ConvTranspose(x, W, b + C), C one constant per output channel.

    A ConvTranspose's output channels are W.shape[1] · group (its weights are [C_in, C_out/group, k...]);
    paddle2onnx writes the bias of a `conv2d_transpose` as such an Add, and a BatchNormalization after it can
    then fold too (PP-OCRv3 det's upsampling head)."""

    def pattern(self, op, x, w, constant):
        deconv = op.ConvTranspose(x, w, _allow_other_inputs=True, _allow_other_attributes=True, _outputs=["deconv"])
        return op.Add(deconv, constant)

    def check(self, context, x, w, constant, deconv, **_) -> MatchResult:
        result = self._bias(deconv, constant)
        return MatchResult().fail(result) if isinstance(result, str) else MatchResult()

    @staticmethod
    def _bias(deconv: ir.Value, constant: ir.Value) -> np.ndarray | str:
        """The new bias b + C, or why there is none."""
        node = deconv.producer()
        weights = constant_array(node.inputs[1])
        old = node.inputs[2] if len(node.inputs) > 2 and node.inputs[2] is not None else None
        if weights is None or (old is not None and constant_array(old) is None):
            return "weights or bias not constant"
        channels = weights.shape[1] * node.attributes.get_int("group", 1)
        extra = constant_array(constant)
        if extra is not None and extra.dtype != weights.dtype:
            return "dtype differs from the weights"
        extra = per_channel(extra, channels, weights.ndim)
        if isinstance(extra, str):
            return extra
        bias = constant_array(old) if old is not None else np.zeros(channels, weights.dtype)
        return (bias.astype(np.float64) + extra).astype(weights.dtype)

    def rewrite(self, op, x, w, constant, deconv, **_):
        node = deconv.producer()
        name = unique_value_name(node.graph, f"{node.name}/bias_add_folded")
        bias = op.initializer(ir.tensor(self._bias(deconv, constant), name=name), name=name)
        return op.ConvTranspose(x, w, bias, **dict(node.attributes), _name=node.name)


class ConvHardSigmoid(RewriteRuleClassBase):
    """HardSigmoid(Conv(x, W[, b])) → Clip(Conv(x, α·W, α·b + β), 0, 1)."""

    def pattern(self, op, x, w):
        return op.HardSigmoid(_conv_output(op, x, w), _allow_other_attributes=True, _outputs=["gate"])

    def check(self, context, x, w, conv, gate, **_) -> MatchResult:
        parts = _conv_parts(conv)
        return MatchResult().fail(parts) if isinstance(parts, str) else MatchResult()

    def rewrite(self, op, x, w, conv, gate, **_):
        node, weights, bias = _conv_parts(conv)
        attributes = gate.producer().attributes
        alpha = attributes["alpha"].as_float() if "alpha" in attributes else 0.2
        beta = attributes["beta"].as_float() if "beta" in attributes else 0.5
        folded = _conv(op, node, x, weights * np.float64(alpha), bias * np.float64(alpha) + beta, "gate_folded")
        name = gate.producer().name
        bounds = [unique_value_name(node.graph, f"{name}/{k}") for k in ("min", "max")]
        low, high = (op.initializer(ir.tensor(np.array(v, weights.dtype), name=k), name=k)
                     for k, v in zip(bounds, (0, 1)))
        return op.Clip(folded, low, high, _name=name)


class _ConvInput(RewriteRuleClassBase):
    """Conv(Op(x, a), W[, b]) with `a` a scalar constant: the op folds into the Conv's weights or bias."""

    op_type = ""

    def pattern(self, op, x, a, w):
        return op.Conv(getattr(op, self.op_type)(x, a), w, _allow_other_inputs=True, _allow_other_attributes=True,
                       _outputs=["conv"])

    def check(self, context, x, a, w, conv, **_) -> MatchResult:
        parts = _conv_parts(conv)
        scalar = parts if isinstance(parts, str) else _scalar(constant_array(a), parts[1])
        if isinstance(scalar, str):
            return MatchResult().fail(scalar)
        return MatchResult()

    def rewrite(self, op, x, a, w, conv, **_):
        node, weights, bias = _conv_parts(conv)
        return _conv(op, node, x, *self.fold(weights, bias, _scalar(constant_array(a), weights)),
                     f"{self.op_type.lower()}_input_folded")


class ConvInputScale(_ConvInput):
    """Conv(x·a) → Conv(x) with weights a·W (zero padding stays zero)."""

    op_type = "Mul"

    @staticmethod
    def fold(weights, bias, a):
        return weights * np.float64(a), bias


class ConvInputShift(_ConvInput):
    """Conv(x + a) → Conv(x) with bias b + a·ΣW[c], only for a Conv without padding."""

    op_type = "Add"

    def check(self, context, x, a, w, conv, **_) -> MatchResult:
        node = conv.producer()
        auto_pad = node.attributes["auto_pad"].as_string() if "auto_pad" in node.attributes else "NOTSET"
        pads = node.attributes["pads"].as_ints() if "pads" in node.attributes else []
        if auto_pad not in ("NOTSET", "VALID") or any(pads):
            return MatchResult().fail("padded Conv: the padded zeros would not be shifted")
        return super().check(context, x, a, w, conv)

    @staticmethod
    def fold(weights, bias, a):
        return weights, bias + np.float64(a) * weights.reshape(weights.shape[0], -1).astype(np.float64).sum(axis=1)


RULES = [fuse_batchnorm_into_conv_rule, fuse_batchnorm_into_conv_transpose_rule, fuse_batchnorm_into_gemm_rule,
         *ConvBiasAdd.rule().commute(), *ConvTransposeBiasAdd.rule().commute(), *ConvScaleMul.rule().commute(), *ConvInputScale.rule().commute(),
         *ConvInputShift.rule().commute(), normalize_pad_format_conv_rule, fuse_pad_into_conv_rule]


def _constant_initializer(value: ir.Value | None) -> bool:
    """What onnxscript's BN rule asks of every parameter: a constant initializer that is no graph input."""
    return value is not None and value.is_initializer() and value.const_value is not None and not value.is_graph_input()


def _own_weights_before_batchnorm(model: ir.Model) -> int:
    """Give a Conv/ConvTranspose/Gemm that feeds only a foldable BatchNormalization its own copy of a shared
    weight or bias. Why: cleanup merges identical initializers (the all-zero Conv biases some exporters write)
    and onnxscript's BN rule refuses a layer whose weight or bias another node also reads."""
    copies = 0
    for bn in list(model.graph):
        layer = bn.inputs[0].producer() if bn.op_type == "BatchNormalization" and bn.inputs[0] is not None else None
        if (layer is None or layer.op_type not in ("Conv", "ConvTranspose", "Gemm") or len(bn.outputs) != 1
                or len(layer.outputs[0].uses()) != 1 or not all(_constant_initializer(v) for v in bn.inputs[1:5])):
            continue
        for index, value in list(enumerate(layer.inputs))[1:3]:
            if not _constant_initializer(value) or len(value.uses()) < 2:
                continue
            own = ir.Value(name=unique_value_name(model.graph, f"{value.name}/{layer.name}"), shape=value.shape,
                           type=value.type, const_value=value.const_value)
            model.graph.register_initializer(own)
            layer.replace_input_with(index, own)
            copies += 1
    return copies


def apply(model: ir.Model, settings: PassSettings) -> PassOutcome:
    rules = RULES + ([ConvHardSigmoid.rule()] if default_opset(model) >= CLIP_INPUTS_OPSET else [])
    # a copy the BN rule then leaves unfolded is only a duplicate initializer: the next cleanup merges it again
    copies = _own_weights_before_batchnorm(model)
    count = RewriteRuleSet(rules).apply_to_model(model)
    RemoveUnusedNodesPass()(model)
    return PassOutcome(matches=count, details={"folded": count, "weights_copied": copies})


PASS = GraphPass(name="fold_into_conv", apply=apply,
                 doc="fold BatchNormalization, constant Adds/Muls, HardSigmoid gates and zero Pads into Conv")
