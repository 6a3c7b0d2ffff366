"""The `fuse_conv_qdq` stage: Conv wrapped in Q/DQ → an integer operator (QLinearConv, or ConvInteger with a
float rescale), optionally MatMul likewise (QLinearMatMul / MatMulInteger).

Rules, applied per Conv (the anchor: each one is checked and rolled back on its own):

    epilogue       Conv(DQ(x), DQ(w), b) → Div|Mul|Add|Sub(c) or BatchNormalization, c per-channel constants
                   → Conv(DQ(x), DQ'(w), b'): y·m + c folds into the weight scales (w_scale·m, the integer
                   weights are untouched) and the bias (b·m + c). PyTorch eager QAT exports leave exactly this
                   (Conv → Div(scale factor) → BatchNormalization) behind. Needs m > 0 (scales stay positive).
    qlinear        Q([Relu|Clip](Conv(DQ(x), DQ(w)[, b]))) → QLinearConv(x, …, w, …, y_scale, y_zp, b_int32)
                   [→ Clip on integers]. Q is monotone, so Q(clip(y, lo, hi)) = clip(Q(y), Q(lo), Q(hi)) exactly:
                   the activation is absorbed when Q's saturation already does it (Relu: y_zp = qmin; Clip:
                   Q(lo) = qmin and Q(hi) = qmax), else kept as an integer Clip on the quantized output.
    integer        Conv(DQ(x), DQ(w)[, b]) → Mul(Cast(ConvInteger(x, w, x_zp, w_zp) + b_int32), x_scale·w_scale)
                   for every Conv with `format: integer`, and with `format: qlinear` for Convs whose output is
                   not requantized (QLinearConv needs an output scale) or that QLinearConv cannot take (the
                   reason is recorded as `why_not_qlinear`). A following Q/Relu stays as it is. Slow on ONNX
                   Runtime's CPU kernels (measured 26x slower than QLinearConv on EfficientNet-Lite0, BENCHMARKS.md).
    matmul         (option) Q(MatMul(DQ(a), DQ(b))) → QLinearMatMul; MatMul(DQ(a), DQ(b)) → MatMulInteger +
                   rescale where not requantized or with `format: integer`.

Bias: int32 with scale x_scale·w_scale (per output channel). A DQ'd int32 bias with exactly that scale is used
as it is; a float bias (or one with another scale) is quantized as onnxruntime.quantization does:
round(float64(b) / float64(float32(x_scale · w_scale))), clipped to int32. Weights: an integer constant, or
QuantizeLinear(float constant) (QAT exports), quantized here exactly as ORT's kernel would.

Preconditions (a miss leaves the Conv as it was, the reason in the record): per-tensor x and y parameters;
8-bit types; per-tensor or per-output-channel (axis 0) weights; y type = x type and int8 x only with int8
weights (ONNX Runtime's QLinearConv kernels); ConvInteger only with one weight zero point (its kernel has no
per-channel zero point); constant bias; no second consumer of an intermediate value.

Verification: each rewrite on its own, on the reference model's own input to that Conv (a per-node probe):
within one quantization step of its output (|Δ| <= 1 integer step at the Q output, or one int32 accumulator
step x_scale·w_scale for a float output); then the whole model against the stage input, gated by cosine per
output (`min_cosine`) and recorded in output steps. See qprep/qdq/verified.py for why both.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRuleClassBase, RewriteRuleSet
from onnxscript.rewriter import pattern as orp

from qprep.model import info as model_info
from qprep.optimize.ir_utils import constant_array
from qprep.optimize.rules import per_channel, unique_node_name, unique_value_name
from qprep.model.runtime import run_model
from qprep.qdq.params import (EIGHT_BIT, QParams, constant_weight, consumers, producer, qparams, quantize_array, quantize_bias)
from qprep.qdq.verified import ProbeCheck, Probe, Rewrite, RewriteLog, apply_verified
from qprep.schema import Key
from qprep.pipeline.context import RunContext, StageResult
from qprep.pipeline.stages import stage

MAX_SWEEPS = 10
# End-to-end gate. Integer kernels round a few elements per layer differently from float Conv + Q (ties,
# float summation order); through EfficientNet-Lite0's 49 Convs that adds up to 4 output steps and cosine
# 0.9988, exactly as much as ONNX Runtime's own session-time fusion of the same QDQ model. The per-node probe
# is the one-step proof; this gate only has to catch gross breakage (wiring, scales), hence 0.99.
DEFAULT_MIN_COSINE = 0.99


# ---------------------------------------------------------------------------------------------------------
# What the checks read from the graph
# ---------------------------------------------------------------------------------------------------------


@dataclass
class _Activation:
    """The quantized input: DQ(q) with per-tensor parameters."""

    dq: ir.Node
    params: QParams

    @property
    def quantized(self) -> ir.Value:
        return self.dq.inputs[0]


@dataclass
class _Weight:
    array: np.ndarray  # integers
    params: QParams
    how: str  # "integer constant" | "quantized from float (…)"
    dq: ir.Node


@dataclass
class _Bias:
    values: np.ndarray | None  # float32, as the QDQ graph computes them (None: no bias)
    integers: np.ndarray | None = None  # the int32 data of a DQ'd bias
    scale: np.ndarray | None = None  # its scale
    how: str = "none"


def _activation(value: ir.Value, role: str) -> _Activation | str:
    dq = producer(value, "DequantizeLinear")
    if dq is None:
        return f"{role} is not dequantized"
    params = qparams(dq)
    if isinstance(params, str):
        return params
    if not params.per_tensor:
        return f"{role} is quantized per axis (the integer ops need one scale)"
    if params.dtype not in EIGHT_BIT:
        return f"{role} is {params.dtype.name.lower()} (8-bit only)"
    return _Activation(dq, params)


def _weight(value: ir.Value, channel_axis: int) -> _Weight | str:
    found = constant_weight(value)
    if isinstance(found, str):
        return found
    array, params, how = found
    if params.dtype not in EIGHT_BIT:
        return f"weight is {params.dtype.name.lower()} (8-bit only)"
    axis = channel_axis if channel_axis >= 0 else array.ndim + channel_axis
    if not params.per_tensor and params.axis != axis:
        return f"weight is quantized along axis {params.axis}, not the output-channel axis {axis}"
    return _Weight(array, params, how, value.producer())


def _bias(value: ir.Value | None, channels: int) -> _Bias | str:
    if value is None:
        return _Bias(None)
    array = constant_array(value)
    if array is not None:
        return _Bias(array.astype(np.float32).reshape(-1), how="float")
    dq = producer(value, "DequantizeLinear")
    integers = constant_array(dq.inputs[0]) if dq is not None else None
    scale = constant_array(dq.inputs[1]) if dq is not None and len(dq.inputs) > 1 else None
    zero = constant_array(dq.inputs[2]) if dq is not None and len(dq.inputs) > 2 and dq.inputs[2] is not None else 0
    if integers is None or scale is None or zero is None:
        return "bias is neither a constant nor DequantizeLinear of constants"
    if np.any(np.asarray(zero) != 0):
        return "bias zero point is not 0"
    values = (integers.astype(np.float32) * scale.astype(np.float32)).reshape(-1)  # as DQ computes it
    if values.size != channels:
        return f"bias has {values.size} values for {channels} channels"
    return _Bias(values, integers.reshape(-1), scale, "int32")


def _bias_int32(bias: _Bias, scale: np.ndarray, channels: int) -> tuple[np.ndarray | None, str]:
    """The int32 bias for accumulator scale `scale` (x_scale · w_scale), and how it was obtained."""
    if bias.values is None:
        return None, "none"
    target = np.broadcast_to(scale.astype(np.float32), (channels,))
    if bias.integers is not None and bias.integers.dtype == np.int32:
        same = np.broadcast_to(bias.scale.astype(np.float32).reshape(-1), (channels,))
        if same.tobytes() == target.tobytes():
            return bias.integers.astype(np.int32), "int32 kept"
        return quantize_bias(bias.values, target), "int32 requantized to x_scale·w_scale"
    return quantize_bias(bias.values, target), "quantized from float (as onnxruntime.quantization does)"


def _vector(value: ir.Value, channels: int) -> np.ndarray | None:
    """A 1-D per-channel constant (BatchNormalization's parameters) as float64 [C]."""
    array = constant_array(value)
    if array is None or array.size not in (1, channels):
        return None
    return np.broadcast_to(array.reshape(-1).astype(np.float64), (channels,))


def _requantization(value: ir.Value) -> tuple[ir.Node | None, ir.Node] | None:
    """(Relu/Clip or None, Q) when `value` is read only by a Q, directly or through one Relu/Clip."""
    users = consumers(value)
    if len(users) != 1 or value.is_graph_output() or users[0].domain not in ("", "ai.onnx"):
        return None
    user = users[0]
    if user.op_type == "QuantizeLinear":
        return None, user
    if user.op_type in ("Relu", "Clip"):
        after = _requantization(user.outputs[0])
        if after is not None and after[0] is None:
            return user, after[1]
    return None


def _constant(op, graph: ir.Graph, array: np.ndarray, name: str) -> ir.Value:
    name = unique_value_name(graph, name)
    return op.initializer(ir.tensor(np.ascontiguousarray(array), name=name), name=name)


def _zero_point(op, graph: ir.Graph, node: ir.Node, params: QParams, name: str) -> ir.Value:
    """The node's zero-point input, or an explicit one (the integer ops require it)."""
    if len(node.inputs) > 2 and node.inputs[2] is not None:
        return node.inputs[2]
    return _constant(op, graph, params.zero_point, name)


# ---------------------------------------------------------------------------------------------------------
# Rules
# ---------------------------------------------------------------------------------------------------------


class _ConvRule(RewriteRuleClassBase):
    """Shared reading of a Conv whose input and weight are dequantized."""

    def __init__(self, log: RewriteLog, name: str):
        super().__init__(name=name)
        self.log = log
        self._found: dict = {}

    def _operands(self, conv: ir.Node) -> dict | str:
        x = _activation(conv.inputs[0], "input")
        if isinstance(x, str):
            return x
        weight = _weight(conv.inputs[1], 0)
        if isinstance(weight, str):
            return weight
        channels = weight.array.shape[0]
        bias = _bias(conv.inputs[2] if len(conv.inputs) > 2 else None, channels)
        if isinstance(bias, str):
            return bias
        if x.params.dtype == ir.DataType.INT8 and weight.params.dtype != ir.DataType.INT8:
            return "int8 input with uint8 weights (no ONNX Runtime kernel)"
        return {"x": x, "weight": weight, "bias": bias, "channels": channels}


class EpilogueAffine(_ConvRule):
    """Conv → Div|Mul|Add|Sub by a per-channel constant, folded into the weight scales and the bias."""

    def __init__(self, log: RewriteLog, op_type: str):
        super().__init__(log, f"epilogue.{op_type}")
        self.op_type = op_type

    def pattern(self, op, x, w, c):
        conv = op.Conv(x, w, _allow_other_inputs=True, _outputs=["conv"])
        return getattr(op, self.op_type)(conv, c)

    def _conv_in_batch(self, conv):
        """(Conv node, its quantized operands), or a failed MatchResult: the part every epilogue checks first."""
        node = conv.producer()
        if not self.log.permits(node.name):
            return node, MatchResult().fail("not in this batch")
        found = self._operands(node)
        return node, (MatchResult().fail(found) if isinstance(found, str) else found)

    def check(self, context, conv, c, **_) -> MatchResult:
        node, found = self._conv_in_batch(conv)
        if isinstance(found, MatchResult):
            return found
        if constant_array(c) is None:
            return MatchResult().fail(f"{self.op_type} by a computed value: not an epilogue")
        vector = per_channel(constant_array(c), found["channels"], found["weight"].array.ndim)
        if isinstance(vector, str):
            return self.log.refuse(node.name, f"{self.op_type} after the Conv is not by a per-channel constant")
        vector = vector.astype(np.float64)
        if self.op_type == "Div":
            if np.any(vector == 0):
                return self.log.refuse(node.name, "Div by zero after the Conv")
            multiplier, shift = 1.0 / vector, np.zeros_like(vector)
        elif self.op_type == "Mul":
            multiplier, shift = vector, np.zeros_like(vector)
        elif self.op_type == "Add":
            multiplier, shift = np.ones_like(vector), vector
        else:
            multiplier, shift = np.ones_like(vector), -vector
        return self._accept(node, found, multiplier, shift)

    def _accept(self, node, found, multiplier, shift) -> MatchResult:
        if np.any(~np.isfinite(multiplier)) or np.any(multiplier <= 0):
            return self.log.refuse(node.name, f"{self.op_type} after the Conv scales a channel by a non-positive "
                                   "factor (weight scales must stay positive)")
        self._found = {**found, "multiplier": multiplier, "shift": shift}
        return MatchResult()

    def rewrite(self, op, x, conv, **_):
        node, found = conv.producer(), self._found
        graph, weight, bias = node.graph, found["weight"], found["bias"]
        m, c = found["multiplier"], found["shift"]
        channels = found["channels"]
        scales = np.broadcast_to(weight.params.scale.astype(np.float64), (channels,)) * m
        zero = np.broadcast_to(weight.params.zero_point, (channels,))
        old_bias = bias.values.astype(np.float64) if bias.values is not None else np.zeros(channels)
        new_bias = (old_bias * m + c).astype(np.float32)
        base = node.name
        weights = _constant(op, graph, weight.array, f"{base}/weight_quantized")
        dq = op.DequantizeLinear(weights, _constant(op, graph, scales.astype(np.float32), f"{base}/weight_scale"),
                                 _constant(op, graph, np.ascontiguousarray(zero), f"{base}/weight_zero_point"),
                                 axis=0, _name=unique_node_name(graph, f"{base}/weight_DequantizeLinear"))
        self.log.orphans += [weight.dq, *(v.producer() for v in node.inputs[2:] if v is not None)]
        self.log.applied.append(Rewrite(base, "epilogue", {"op": self.op_type, "weights_from": weight.how}))
        return op.Conv(x, dq, _constant(op, graph, new_bias, f"{base}/bias"), **dict(node.attributes.items()),
                       _name=base)


class EpilogueBatchNorm(EpilogueAffine):
    """Conv → BatchNormalization (inference): y·γ/√(var+ε) + (β − mean·γ/√(var+ε))."""

    def __init__(self, log: RewriteLog):
        _ConvRule.__init__(self, log, "epilogue.BatchNormalization")
        self.op_type = "BatchNormalization"

    def pattern(self, op, x, w, gamma, beta, mean, var):
        conv = op.Conv(x, w, _allow_other_inputs=True, _outputs=["conv"])
        return op.BatchNormalization(conv, gamma, beta, mean, var, _allow_other_attributes=True, _outputs=["bn"])

    def check(self, context, conv, bn, gamma, beta, mean, var, **_) -> MatchResult:
        node, found = self._conv_in_batch(conv)
        if isinstance(found, MatchResult):
            return found
        norm = bn.producer()
        if norm.attributes.get_int("training_mode", 0) or len(norm.outputs) > 1:
            return self.log.refuse(node.name, "BatchNormalization in training mode")
        params = [_vector(v, found["channels"]) for v in (gamma, beta, mean, var)]
        if any(p is None for p in params):
            return self.log.refuse(node.name, "BatchNormalization parameters are not per-channel constants")
        g, b, mu, v = params
        epsilon = norm.attributes.get_float("epsilon", 1e-5)
        multiplier = g / np.sqrt(v + epsilon)
        return self._accept(node, found, multiplier, b - mu * multiplier)


class ConvToQLinear(_ConvRule):
    """Q([Relu|Clip](Conv(DQ(x), DQ(w)[, b]))) → QLinearConv [→ integer Clip]."""

    def __init__(self, log: RewriteLog):
        super().__init__(log, "qlinear_conv")

    def pattern(self, op, x, w, y_scale):
        conv = op.Conv(x, w, _allow_other_inputs=True, _outputs=["conv"])
        activated = orp.OrValue([op.Relu(conv, _outputs=["relu"]),
                                 op.Clip(conv, _allow_other_inputs=True, _allow_other_attributes=True,
                                         _outputs=["clip"]), conv])
        return op.QuantizeLinear(activated, y_scale, _allow_other_inputs=True, _outputs=["quantized"])

    def check(self, context, conv, quantized, relu=None, clip=None, **_) -> MatchResult:
        node = conv.producer()
        if not self.log.permits(node.name):
            return MatchResult().fail("not in this batch")
        activation = relu.producer() if relu is not None else clip.producer() if clip is not None else None
        found = self.plan(node, quantized.producer(), activation, context.model.opset_imports.get("", 0))
        if isinstance(found, str):
            return self.log.refuse(node.name, found)
        self._found = found
        return MatchResult()

    def plan(self, node: ir.Node, q: ir.Node, activation: ir.Node | None, opset: int) -> dict | str:
        """Everything the rewrite needs, or why this Conv cannot become a QLinearConv."""
        found = self._operands(node)
        if isinstance(found, str):
            return found
        y = qparams(q)
        if isinstance(y, str):
            return y
        if not y.per_tensor:
            return "output is quantized per axis (QLinearConv needs one output scale)"
        if y.dtype != found["x"].params.dtype:
            return (f"output type {y.dtype.name.lower()} differs from the input type "
                    f"{found['x'].params.dtype.name.lower()} (ONNX Runtime's QLinearConv kernels)")
        bounds = _activation_bounds(activation, y, opset)
        if isinstance(bounds, str):
            return bounds
        return {**found, "y": y, "q": q, "activation": bounds}

    def rewrite(self, op, conv, quantized, **_):
        node, found = conv.producer(), self._found
        graph, x, weight, y, q = node.graph, found["x"], found["weight"], found["y"], found["q"]
        channels, base = found["channels"], node.name
        w_value, w_scale, w_zero = _weight_inputs(op, graph, weight, base)
        accumulator_scale = x.params.scale.astype(np.float32) * weight.params.scale.astype(np.float32)
        bias, bias_how = _bias_int32(found["bias"], accumulator_scale, channels)
        inputs = [x.quantized, x.dq.inputs[1], _zero_point(op, graph, x.dq, x.params, f"{base}/x_zero_point"),
                  w_value, w_scale, w_zero, q.inputs[1], _zero_point(op, graph, q, y, f"{base}/y_zero_point")]
        if bias is not None:
            inputs.append(_constant(op, graph, bias, f"{base}/bias_quantized"))
        result = op.QLinearConv(*inputs, **dict(node.attributes.items()), _name=base)
        kind, bounds = found["activation"]
        if kind.startswith("kept"):
            low, high = bounds
            dtype = y.dtype.numpy()
            result = op.Clip(result, _constant(op, graph, np.array(low, dtype), f"{base}/clip_min"),
                             _constant(op, graph, np.array(high, dtype), f"{base}/clip_max"),
                             _name=unique_node_name(graph, f"{base}/Clip"))
        self.log.orphans += [x.dq, weight.dq, *(v.producer() for v in node.inputs[2:] if v is not None)]
        self.log.applied.append(Rewrite(base, "qlinear", {
            "to": "QLinearConv", "weights": _granularity(weight.params), "weights_from": weight.how,
            "bias": bias_how, "activation": kind, "types": f"{x.params.dtype.name.lower()}/"
            f"{weight.params.dtype.name.lower()}"},
            Probe([x.quantized.name], quantized.name, atol=1.0,
                  unit=f"1 step of the {y.dtype.name.lower()} output, scale {float(y.scale):.4g}")))
        return result


class ConvToInteger(_ConvRule):
    """Conv(DQ(x), DQ(w)[, b]) → Mul(Cast(ConvInteger(x, w) [+ b_int32]), x_scale·w_scale)."""

    def __init__(self, log: RewriteLog, everywhere: bool):
        super().__init__(log, "conv_integer")
        self.everywhere = everywhere  # format: integer (else only where QLinearConv cannot take the Conv)
        self.qlinear = ConvToQLinear(log)

    def pattern(self, op, x, w):
        return op.Conv(x, w, _allow_other_inputs=True, _outputs=["conv"])

    def check(self, context, conv, **_) -> MatchResult:
        node = conv.producer()
        if not self.log.permits(node.name):
            return MatchResult().fail("not in this batch")
        requantized = _requantization(conv)
        why_not_qlinear = None
        if not self.everywhere and requantized is not None:
            plan = self.qlinear.plan(node, requantized[1], requantized[0], context.model.opset_imports.get("", 0))
            if not isinstance(plan, str):
                return MatchResult().fail("requantized: the QLinearConv rule's match")
            why_not_qlinear = plan
        requantized = requantized[1] if requantized is not None else None
        found = self._operands(node)
        if isinstance(found, str):
            return self.log.refuse(node.name, found)
        zero = found["weight"].params.zero_point
        if np.unique(zero).size != 1:
            return self.log.refuse(node.name, "per-channel weight zero points differ (ConvInteger takes one)")
        self._found = {**found, "requantized": requantized, "why_not_qlinear": why_not_qlinear}
        return MatchResult()

    def rewrite(self, op, conv, **_):
        node, found = conv.producer(), self._found
        graph, x, weight = node.graph, found["x"], found["weight"]
        channels, base, rank = found["channels"], node.name, weight.array.ndim
        accumulator_scale = x.params.scale.astype(np.float32) * weight.params.scale.astype(np.float32)
        bias, bias_how = _bias_int32(found["bias"], accumulator_scale, channels)
        w_zero = np.asarray(weight.params.zero_point.reshape(-1)[0])
        weights = weight.dq.inputs[0] if weight.how == "integer constant" and weight.dq.inputs[0].is_initializer() \
            else _constant(op, graph, weight.array, f"{base}/weight_quantized")
        result = op.ConvInteger(x.quantized, weights,
                                _zero_point(op, graph, x.dq, x.params, f"{base}/x_zero_point"),
                                _constant(op, graph, w_zero, f"{base}/w_zero_point"),
                                **dict(node.attributes.items()), _name=base)
        channel_shape = (channels,) + (1,) * (rank - 2)
        if bias is not None:
            result = op.Add(result, _constant(op, graph, bias.reshape(channel_shape), f"{base}/bias_quantized"),
                            _name=unique_node_name(graph, f"{base}/bias"))
        result = op.Cast(result, to=ir.DataType.FLOAT, _name=unique_node_name(graph, f"{base}/cast"))
        scale = np.broadcast_to(accumulator_scale, (channels,)).astype(np.float32)
        rescale = scale.reshape(channel_shape) if weight.params.axis is not None else np.asarray(scale[0])
        result = op.Mul(result, _constant(op, graph, rescale, f"{base}/rescale"),
                        _name=unique_node_name(graph, f"{base}/rescale"))
        self.log.orphans += [x.dq, weight.dq, *(v.producer() for v in node.inputs[2:] if v is not None)]
        self.log.applied.append(Rewrite(base, "integer", {
            "to": "ConvInteger", "weights": _granularity(weight.params), "weights_from": weight.how,
            "bias": bias_how, "types": f"{x.params.dtype.name.lower()}/{weight.params.dtype.name.lower()}",
            **({"why_not_qlinear": found["why_not_qlinear"]} if found["why_not_qlinear"] else {})},
            _float_probe(x, found["requantized"], conv.name, float(np.max(accumulator_scale)))))
        return result


class MatMulToQLinear(RewriteRuleClassBase):
    """Q(MatMul(DQ(a), DQ(b))) → QLinearMatMul (b per-tensor, or per column when it is a 2-D weight)."""

    def __init__(self, log: RewriteLog):
        super().__init__(name="qlinear_matmul")
        self.log = log
        self._found: dict = {}

    def pattern(self, op, a, b, y_scale):
        product = op.MatMul(a, b, _outputs=["product"])
        return op.QuantizeLinear(product, y_scale, _allow_other_inputs=True, _outputs=["quantized"])

    def check(self, context, product, quantized, **_) -> MatchResult:
        node = product.producer()
        if not self.log.permits(node.name):
            return MatchResult().fail("not in this batch")
        found = _matmul_operands(node)
        if isinstance(found, str):
            return self.log.refuse(node.name, found)
        y = qparams(quantized.producer())
        if isinstance(y, str) or not y.per_tensor:
            return self.log.refuse(node.name, y if isinstance(y, str) else "output quantized per axis")
        if y.dtype != found["a"].params.dtype:
            return self.log.refuse(node.name, "output type differs from input a's type (ONNX Runtime's kernels)")
        self._found = {**found, "y": y, "q": quantized.producer()}
        return MatchResult()

    def rewrite(self, op, product, quantized, **_):
        node, found = product.producer(), self._found
        graph, a, b, y, q = node.graph, found["a"], found["b"], found["y"], found["q"]
        base = node.name
        b_value, b_scale, b_zero = _b_inputs(op, graph, b, base)
        a_zero = _zero_point(op, graph, a.dq, a.params, f"{base}/a_zero_point")
        result = op.QLinearMatMul(a.quantized, a.dq.inputs[1], a_zero,
                                  b_value, b_scale, b_zero, q.inputs[1],
                                  _zero_point(op, graph, q, y, f"{base}/y_zero_point"), _name=base)
        self.log.orphans += [a.dq, b.dq]
        self.log.applied.append(Rewrite(base, "qlinear", {"to": "QLinearMatMul", "weights": _granularity(b.params)},
                                        Probe(_probe_inputs(a, b), quantized.name, atol=1.0,
                                              unit=f"1 step of the output, scale {float(y.scale):.4g}")))
        return result


class MatMulToInteger(RewriteRuleClassBase):
    """MatMul(DQ(a), DQ(b)) → Mul(Cast(MatMulInteger(a, b, a_zp, b_zp)), a_scale·b_scale)."""

    def __init__(self, log: RewriteLog, everywhere: bool):
        super().__init__(name="matmul_integer")
        self.log, self.everywhere = log, everywhere
        self._found: dict = {}

    def pattern(self, op, a, b):
        return op.MatMul(a, b, _outputs=["product"])

    def check(self, context, product, **_) -> MatchResult:
        node = product.producer()
        if not self.log.permits(node.name):
            return MatchResult().fail("not in this batch")
        users = consumers(product)
        requantized = users[0] if len(users) == 1 and users[0].op_type == "QuantizeLinear" \
            and not product.is_graph_output() else None
        if not self.everywhere and requantized is not None:
            return MatchResult().fail("requantized: the QLinearMatMul rule's match")
        found = _matmul_operands(node)
        if isinstance(found, str):
            return self.log.refuse(node.name, found)
        self._found = {**found, "requantized": requantized}
        return MatchResult()

    def rewrite(self, op, product, **_):
        node, found = product.producer(), self._found
        graph, a, b = node.graph, found["a"], found["b"]
        base = node.name
        b_value, _, b_zero = _b_inputs(op, graph, b, base)
        result = op.MatMulInteger(a.quantized, b_value, _zero_point(op, graph, a.dq, a.params, f"{base}/a_zero_point"),
                                  b_zero, _name=base)
        result = op.Cast(result, to=ir.DataType.FLOAT, _name=unique_node_name(graph, f"{base}/cast"))
        scale = (a.params.scale.astype(np.float32) * b.params.scale.astype(np.float32)).astype(np.float32)
        result = op.Mul(result, _constant(op, graph, scale, f"{base}/rescale"),
                        _name=unique_node_name(graph, f"{base}/rescale"))
        self.log.orphans += [a.dq, b.dq]
        self.log.applied.append(Rewrite(base, "integer", {"to": "MatMulInteger", "weights": _granularity(b.params)},
                                        _float_probe(a, found["requantized"], product.name, float(np.max(scale)),
                                                     extra=_probe_inputs(a, b)[1:])))
        return result


# ---------------------------------------------------------------------------------------------------------
# Rule helpers
# ---------------------------------------------------------------------------------------------------------


def _activation_bounds(node: ir.Node | None, y: QParams, opset: int) -> tuple[str, tuple | None] | str:
    """How a Relu/Clip between Conv and Q is handled: ('none'|'absorbed …'|'kept … as integer Clip', bounds)."""
    if node is None:
        return "none", None
    if node.op_type == "Relu":
        low, high = 0.0, None
    else:
        low, high = _clip_limits(node)
        if isinstance(low, str):
            return low
    q_low = int(quantize_array(np.array(low), y)) if low is not None else y.qmin
    q_high = int(quantize_array(np.array(high), y)) if high is not None else y.qmax
    if q_low <= y.qmin and q_high >= y.qmax:
        return f"absorbed {node.op_type} (a no-op under the output's saturation)", None
    if opset < 12:
        return f"{node.op_type} is not a no-op under the output range and integer Clip needs opset 12 (model: {opset})"
    return f"kept {node.op_type} as integer Clip [{q_low}, {q_high}]", (q_low, q_high)


def _clip_limits(node: ir.Node) -> tuple:
    if len(node.inputs) == 1 and ("min" in node.attributes or "max" in node.attributes):  # Clip before opset 11
        return node.attributes.get_float("min", None), node.attributes.get_float("max", None)
    limits = []
    for index in (1, 2):
        value = node.inputs[index] if len(node.inputs) > index else None
        if value is None:
            limits.append(None)
            continue
        array = constant_array(value)
        if array is None or array.size != 1:
            return "Clip bounds are not constants", None
        limits.append(float(array.reshape(())))
    return tuple(limits)


def _weight_inputs(op, graph: ir.Graph, weight: _Weight, base: str) -> tuple[ir.Value, ir.Value, ir.Value]:
    """Integer weight, scale and zero point values: the DQ's own when they are stored as needed."""
    dq = weight.dq
    if weight.how == "integer constant" and dq.inputs[0].is_initializer():
        zero = dq.inputs[2] if len(dq.inputs) > 2 and dq.inputs[2] is not None else \
            _constant(op, graph, weight.params.zero_point, f"{base}/w_zero_point")
        return dq.inputs[0], dq.inputs[1], zero
    return (_constant(op, graph, weight.array, f"{base}/weight_quantized"),
            _constant(op, graph, weight.params.scale, f"{base}/weight_scale"),
            _constant(op, graph, weight.params.zero_point, f"{base}/w_zero_point"))


def _matmul_operands(node: ir.Node) -> dict | str:
    a = _activation(node.inputs[0], "input a")
    if isinstance(a, str):
        return a
    b = _activation(node.inputs[1], "input b")
    if isinstance(b, str):
        weight = _weight(node.inputs[1], -1)
        if isinstance(weight, str):
            return f"input b: {weight}"
        if weight.array.ndim != 2 and not weight.params.per_tensor:
            return "per-column b must be 2-D"
        b = weight
    if a.params.dtype == ir.DataType.INT8 and b.params.dtype != ir.DataType.INT8:
        return "int8 input a with uint8 b (no ONNX Runtime kernel)"
    return {"a": a, "b": b}


def _b_inputs(op, graph, b, base):
    if isinstance(b, _Activation):
        return b.quantized, b.dq.inputs[1], _zero_point(op, graph, b.dq, b.params, f"{base}/b_zero_point")
    return _weight_inputs(op, graph, b, base)


def _probe_inputs(a: _Activation, b) -> list[str]:
    return [a.quantized.name] + ([b.quantized.name] if isinstance(b, _Activation) else [])


def _float_probe(x: _Activation, requantized: ir.Node | None, output: str, accumulator_step: float,
                 extra: list[str] = ()) -> Probe:
    """Check at the Q after the op when there is one (1 integer step), else at the float output: one step of
    the int32 accumulator (x_scale·w_scale), plus float32 summation noise relative to the value."""
    inputs = [x.quantized.name, *extra]
    if requantized is not None:
        params = qparams(requantized)
        return Probe(inputs, requantized.outputs[0].name, atol=1.0,
                     unit=f"1 step of the output, scale {float(params.scale):.4g}")
    return Probe(inputs, output, atol=accumulator_step, rtol=1e-5,
                 unit=f"one int32 accumulator step {accumulator_step:.3g} (x_scale·w_scale) + 1e-5 relative")


def _granularity(params: QParams) -> str:
    return "per-tensor" if params.per_tensor else f"per-channel ({params.scale.size})"


def rule_sets(log: RewriteLog, options: dict) -> list[RewriteRuleSet]:
    """Two phases: epilogue folds first (a Conv must be clean before a fusion rule decides on it), then the
    fusions."""
    integer = options["format"] == "integer"
    epilogue = [EpilogueAffine.rule(log, "Div"), *EpilogueAffine.rule(log, "Mul").commute(),
                *EpilogueAffine.rule(log, "Add").commute(), EpilogueAffine.rule(log, "Sub"),
                EpilogueBatchNorm.rule(log)]
    fusions = [] if integer else [ConvToQLinear.rule(log)]
    fusions.append(ConvToInteger.rule(log, integer))
    if options["matmul"]:
        if not integer:
            fusions.append(MatMulToQLinear.rule(log))
        fusions.append(MatMulToInteger.rule(log, integer))
    return [RewriteRuleSet(epilogue), RewriteRuleSet(fusions)]


def output_steps(model: onnx.ModelProto) -> dict[str, dict]:
    """Per graph output: the quantization step it is read at (its final DequantizeLinear), or, for a float
    output, the largest step among the nearest DequantizeLinear nodes upstream (reported, not gated)."""
    graph = ir.from_proto(model).graph
    steps = {}
    for output in graph.outputs:
        dq = producer(output, "DequantizeLinear")
        if dq is not None:
            params = qparams(dq)
            if not isinstance(params, str):
                steps[output.name] = {"scale": float(np.max(params.scale)), "from": f"DequantizeLinear {dq.name}"}
            continue
        nearest, stack, seen = [], [output], set()
        while stack:
            value = stack.pop()
            node = value.producer()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            if node.op_type == "DequantizeLinear":
                nearest.append(node)
            else:
                stack.extend(v for v in node.inputs if v is not None)
        scales = [float(np.max(p.scale)) for p in map(qparams, nearest) if not isinstance(p, str)]
        if scales:
            steps[output.name] = {"scale": max(scales), "from": f"nearest upstream DequantizeLinear "
                                  f"({len(scales)}; the output itself is float)"}
    return steps


def _convertible(model: onnx.ModelProto, matmul: bool) -> int:
    counts = model_info.op_counts(model)
    return counts.get("Conv", 0) + (counts.get("MatMul", 0) if matmul else 0)


@stage("fuse_conv_qdq",
       summary="DQ→Conv→Q into QLinearConv (or ConvInteger + rescale), optionally MatMul; each within one step",
       format=Key("str", default="qlinear", choices=("qlinear", "integer"),
                  doc="qlinear: QLinearConv where the output is requantized (ConvInteger + float rescale where "
                      "not); integer: ConvInteger + float rescale everywhere, the Q after it kept (for runtimes "
                      "without QLinearConv: ONNX Runtime's CPU ConvInteger is slow, 26x on EfficientNet-Lite0)"),
       matmul=Key("bool", default=False, doc="also fuse DQ→MatMul→Q into QLinearMatMul (MatMulInteger + rescale "
                                              "where not requantized or with format: integer)"),
       min_cosine=Key("float", default=DEFAULT_MIN_COSINE, minimum=-1,
                      doc="end-to-end gate: cosine of every output against the stage's input model (each rewrite "
                          "is also checked on its own: within one quantization step)"))
def fuse_conv_qdq(model: onnx.ModelProto, ctx: RunContext, options: dict) -> StageResult:
    """Q/DQ around Conv (optionally MatMul) into integer operators ahead of time, so a runtime that does not fuse
    QDQ itself runs integer kernels; each rewrite is checked on ctx.verifier's samples (within one quantization
    step) and rolled back on its own."""
    counts = model_info.op_counts(model)
    if not counts.get("DequantizeLinear"):
        return StageResult(model=model, status="skipped",
                           reason="no DequantizeLinear nodes (a float model): nothing to fuse; quantize it first")
    if not _convertible(model, options["matmul"]):
        what = "Conv or MatMul" if options["matmul"] else "Conv (set matmul: true for MatMul)"
        return StageResult(model=model, status="skipped", reason=f"no {what} in the model")
    verifier = ctx.verifier
    steps = output_steps(model)
    check = ProbeCheck(model, verifier.samples, steps, options["min_cosine"], verifier.threads)
    outcome = apply_verified(model, lambda m, log: _apply(m, log, options), check)
    folded = [r for r in outcome.applied if r.kind == "epilogue"]
    converted = [_with_epilogue(r, folded) for r in outcome.applied if r.kind in ("qlinear", "integer")]
    after = model_info.op_counts(outcome.model)
    details = {
        "format": options["format"],
        "converted": dict(Counter(r.facts["to"] for r in converted)),
        "convs": {"before": counts.get("Conv", 0), "left": after.get("Conv", 0)},
        "matmuls": {"before": counts.get("MatMul", 0), "left": after.get("MatMul", 0)} if options["matmul"] else None,
        "epilogue_folded": dict(Counter(r.facts["op"] for r in folded)),
        "activations": dict(Counter(r.facts["activation"].split(" [")[0] for r in converted
                                    if "activation" in r.facts)),
        "bias": dict(Counter(r.facts["bias"] for r in converted if "bias" in r.facts)),
        "weights": dict(Counter(f"{r.facts['weights']}, {r.facts.get('weights_from', 'integer constant')}"
                                for r in converted)),
        "nodes": [{"node": r.anchor, **r.facts, **_probe_fact(check, r.anchor)} for r in converted],
        "refused": dict(Counter(outcome.refused.values())),
        "refused_nodes": dict(sorted(outcome.refused.items())[:20]),
        "verification": {"per_rewrite": "each rewritten node fed the QDQ model's own input: within one "
                                        "quantization step of its output",
                         "probes": _probe_summary(check, converted),
                         "end_to_end": f"every output's cosine against the stage input >= {options['min_cosine']}",
                         **outcome.verification,
                         **({"deployed": _deployed(model, outcome.model, verifier)} if converted else {})},
        "verified_on": verifier.source,
        "checks": outcome.checks,
        "rewrite_seconds": outcome.rewrite_seconds,
        "verify_seconds": outcome.verify_seconds,
    }
    details = {k: v for k, v in details.items() if v is not None}
    return StageResult(model=outcome.model, details=details, rolled_back=outcome.rolled_back)


def _with_epilogue(rewrite: Rewrite, folded: list[Rewrite]) -> Rewrite:
    """The conversion's facts, with what was folded into that Conv first (and where its weights came from)."""
    mine = [r for r in folded if r.anchor == rewrite.anchor]
    if not mine:
        return rewrite
    facts = {**rewrite.facts, "weights_from": mine[0].facts["weights_from"],
             "epilogue": [r.facts["op"] for r in mine]}
    return Rewrite(rewrite.anchor, rewrite.kind, facts, rewrite.probe)


def _probe_fact(check: ProbeCheck, anchor: str) -> dict:
    measured = check.measured.get(anchor)
    return {"probe_max_error": round(measured[0], 6)} if measured else {}


def _probe_summary(check: ProbeCheck, converted: list[Rewrite]) -> dict:
    """The worst per-node probe error per unit kind (integer steps, or float accumulator steps)."""
    summary: dict = {"count": 0}
    for rewrite in converted:
        if rewrite.anchor in check.measured:
            error, unit = check.measured[rewrite.anchor]
            key = "max_steps_at_q_output" if unit.startswith("1 step") else "max_abs_at_float_output"
            summary["count"] += 1
            summary[key] = max(summary.get(key, 0.0), round(error, 6))
    return summary


def _deployed(reference: onnx.ModelProto, result: onnx.ModelProto, verifier) -> dict:
    """Both models as ONNX Runtime deploys them (ORT_ENABLE_ALL fuses the QDQ model itself at session
    creation): how far apart the outputs are. 0 means this stage did what ORT does, ahead of time."""
    expected = run_model(reference, verifier.samples, verifier.threads, optimize=True)
    actual = run_model(result, verifier.samples, verifier.threads, optimize=True)
    return {name: max(float(np.abs(e[name].astype(np.float64) - a[name]).max()) for e, a in zip(expected, actual))
            for name in expected[0]}


def _apply(model: ir.Model, log: RewriteLog, options: dict) -> None:
    for rule_set in rule_sets(log, options):
        for _ in range(MAX_SWEEPS):
            if not rule_set.apply_to_model(model):
                break
