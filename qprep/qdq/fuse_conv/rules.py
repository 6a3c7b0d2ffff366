"""The fusion rules, pattern → check → replacement on graph edges (onnxscript rewriter): epilogue folds
(Div/Mul/Add/Sub, BatchNormalization) into the Conv's weight scales and bias, Conv → QLinearConv or ConvInteger,
MatMul → QLinearMatMul or MatMulInteger. What each rule does and why: the package docstring."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRuleClassBase, RewriteRuleSet
from onnxscript.rewriter import pattern as orp

from qprep.graph.ir import constant_array
from qprep.graph.rules import per_channel, unique_node_name
from qprep.qdq.fuse_conv.operands import (
    activation_bounds,
    activation_operand,
    add_constant,
    add_zero_point,
    b_inputs,
    bias_int32,
    bias_operand,
    channel_vector,
    float_probe,
    granularity,
    matmul_operands,
    probe_inputs,
    requantization,
    weight_inputs,
    weight_operand,
    weight_types,
    widened,
    widens,
)
from qprep.qdq.params import consumers, qparams
from qprep.qdq.verified import Probe, Rewrite, RewriteLog
from qprep.schema import Settings


class ConvRule(RewriteRuleClassBase):
    """Shared reading of a Conv whose input and weight are dequantized."""

    def __init__(self, log: RewriteLog, name: str):
        super().__init__(name=name)
        self.log = log
        self._found: dict = {}

    def _operands(self, conv: ir.Node) -> dict | str:
        x = activation_operand(conv.inputs[0], "input")
        if isinstance(x, str):
            return x
        weight = weight_operand(conv.inputs[1], 0)
        if isinstance(weight, str):
            return weight
        channels = weight.array.shape[0]
        bias = bias_operand(conv.inputs[2] if len(conv.inputs) > 2 else None, channels)
        if isinstance(bias, str):
            return bias
        if x.params.dtype == ir.DataType.INT8 and weight.params.dtype != ir.DataType.INT8:
            return "int8 input with uint8 weights (no ONNX Runtime kernel)"
        return {"x": x, "weight": weight, "bias": bias, "channels": channels}


class EpilogueAffine(ConvRule):
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
        weights = add_constant(op, graph, weight.array, f"{base}/weight_quantized")
        dq = op.DequantizeLinear(weights, add_constant(op, graph, scales.astype(np.float32), f"{base}/weight_scale"),
                                 add_constant(op, graph, np.ascontiguousarray(zero), f"{base}/weight_zero_point"),
                                 axis=0, _name=unique_node_name(graph, f"{base}/weight_DequantizeLinear"))
        self.log.orphans += [weight.dq, *(v.producer() for v in node.inputs[2:] if v is not None)]
        self.log.applied.append(Rewrite(base, "epilogue", {"op": self.op_type, "weights_from": weight.how}))
        return op.Conv(x, dq, add_constant(op, graph, new_bias, f"{base}/bias"), **dict(node.attributes.items()),
                       _name=base)


class EpilogueBatchNorm(EpilogueAffine):
    """Conv → BatchNormalization (inference): y·γ/√(var+ε) + (β − mean·γ/√(var+ε))."""

    def __init__(self, log: RewriteLog):
        ConvRule.__init__(self, log, "epilogue.BatchNormalization")
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
        params = [channel_vector(v, found["channels"]) for v in (gamma, beta, mean, var)]
        if any(p is None for p in params):
            return self.log.refuse(node.name, "BatchNormalization parameters are not per-channel constants")
        g, b, mu, v = params
        epsilon = norm.attributes.get_float("epsilon", 1e-5)
        multiplier = g / np.sqrt(v + epsilon)
        return self._accept(node, found, multiplier, b - mu * multiplier)


class ConvToQLinear(ConvRule):
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
        bounds = activation_bounds(activation, y, opset)
        if isinstance(bounds, str):
            return bounds
        return {**found, "y": y, "q": q, "activation": bounds}

    def rewrite(self, op, conv, quantized, **_):
        node, found = conv.producer(), self._found
        graph, x, weight, y, q = node.graph, found["x"], found["weight"], found["y"], found["q"]
        channels, base = found["channels"], node.name
        w_value, w_scale, w_zero = weight_inputs(op, graph, weight, base, x.params.dtype)
        accumulator_scale = x.params.scale.astype(np.float32) * weight.params.scale.astype(np.float32)
        bias, bias_how = bias_int32(found["bias"], accumulator_scale, channels)
        inputs = [x.quantized, x.dq.inputs[1], add_zero_point(op, graph, x.dq, x.params, f"{base}/x_zero_point"),
                  w_value, w_scale, w_zero, q.inputs[1], add_zero_point(op, graph, q, y, f"{base}/y_zero_point")]
        if bias is not None:
            inputs.append(add_constant(op, graph, bias, f"{base}/bias_quantized"))
        result = op.QLinearConv(*inputs, **dict(node.attributes.items()), _name=base)
        kind, bounds = found["activation"]
        if kind.startswith("kept"):
            low, high = bounds
            dtype = y.dtype.numpy()
            result = op.Clip(result, add_constant(op, graph, np.array(low, dtype), f"{base}/clip_min"),
                             add_constant(op, graph, np.array(high, dtype), f"{base}/clip_max"),
                             _name=unique_node_name(graph, f"{base}/Clip"))
        self.log.orphans += [x.dq, weight.dq, *(v.producer() for v in node.inputs[2:] if v is not None)]
        self.log.applied.append(Rewrite(base, "qlinear", {
            "to": "QLinearConv", "weights": granularity(weight.params), "weights_from": weight.how,
            "bias": bias_how, "activation": kind, "types": weight_types(x.params.dtype, weight)},
            Probe([x.quantized.name], quantized.name, atol=1.0,
                  unit=f"1 step of the {y.dtype.name.lower()} output, scale {float(y.scale):.4g}")))
        return result


class ConvToInteger(ConvRule):
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
        requantized = requantization(conv)
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
        bias, bias_how = bias_int32(found["bias"], accumulator_scale, channels)
        as_uint8 = widens(weight, x.params.dtype)
        array, zeros = widened(weight) if as_uint8 else (weight.array, weight.params.zero_point)
        weights = weight.dq.inputs[0] if not as_uint8 and weight.how == "integer constant" \
            and weight.dq.inputs[0].is_initializer() else add_constant(op, graph, array, f"{base}/weight_quantized")
        result = op.ConvInteger(x.quantized, weights,
                                add_zero_point(op, graph, x.dq, x.params, f"{base}/x_zero_point"),
                                add_constant(op, graph, np.asarray(zeros.reshape(-1)[0]), f"{base}/w_zero_point"),
                                **dict(node.attributes.items()), _name=base)
        channel_shape = (channels,) + (1,) * (rank - 2)
        if bias is not None:
            result = op.Add(result, add_constant(op, graph, bias.reshape(channel_shape), f"{base}/bias_quantized"),
                            _name=unique_node_name(graph, f"{base}/bias"))
        result = op.Cast(result, to=ir.DataType.FLOAT, _name=unique_node_name(graph, f"{base}/cast"))
        scale = np.broadcast_to(accumulator_scale, (channels,)).astype(np.float32)
        rescale = scale.reshape(channel_shape) if weight.params.axis is not None else np.asarray(scale[0])
        result = op.Mul(result, add_constant(op, graph, rescale, f"{base}/rescale"),
                        _name=unique_node_name(graph, f"{base}/rescale"))
        self.log.orphans += [x.dq, weight.dq, *(v.producer() for v in node.inputs[2:] if v is not None)]
        self.log.applied.append(Rewrite(base, "integer", {
            "to": "ConvInteger", "weights": granularity(weight.params), "weights_from": weight.how,
            "bias": bias_how, "types": weight_types(x.params.dtype, weight),
            **({"why_not_qlinear": found["why_not_qlinear"]} if found["why_not_qlinear"] else {})},
            float_probe(x, found["requantized"], conv.name, float(np.max(accumulator_scale)))))
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
        found = matmul_operands(node)
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
        b_value, b_scale, b_zero = b_inputs(op, graph, b, base, a.params.dtype)
        a_zero = add_zero_point(op, graph, a.dq, a.params, f"{base}/a_zero_point")
        result = op.QLinearMatMul(a.quantized, a.dq.inputs[1], a_zero,
                                  b_value, b_scale, b_zero, q.inputs[1],
                                  add_zero_point(op, graph, q, y, f"{base}/y_zero_point"), _name=base)
        self.log.orphans += [a.dq, b.dq]
        self.log.applied.append(Rewrite(base, "qlinear", {"to": "QLinearMatMul", "weights": granularity(b.params)},
                                        Probe(probe_inputs(a, b), quantized.name, atol=1.0,
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
        found = matmul_operands(node)
        if isinstance(found, str):
            return self.log.refuse(node.name, found)
        self._found = {**found, "requantized": requantized}
        return MatchResult()

    def rewrite(self, op, product, **_):
        node, found = product.producer(), self._found
        graph, a, b = node.graph, found["a"], found["b"]
        base = node.name
        b_value, _, b_zero = b_inputs(op, graph, b, base, a.params.dtype)
        result = op.MatMulInteger(a.quantized, b_value, add_zero_point(op, graph, a.dq, a.params, f"{base}/a_zero_point"),
                                  b_zero, _name=base)
        result = op.Cast(result, to=ir.DataType.FLOAT, _name=unique_node_name(graph, f"{base}/cast"))
        scale = (a.params.scale.astype(np.float32) * b.params.scale.astype(np.float32)).astype(np.float32)
        result = op.Mul(result, add_constant(op, graph, scale, f"{base}/rescale"),
                        _name=unique_node_name(graph, f"{base}/rescale"))
        self.log.orphans += [a.dq, b.dq]
        self.log.applied.append(Rewrite(base, "integer", {"to": "MatMulInteger", "weights": granularity(b.params)},
                                        float_probe(a, found["requantized"], product.name, float(np.max(scale)),
                                                     extra=probe_inputs(a, b)[1:])))
        return result


# ---------------------------------------------------------------------------------------------------------
# Rule helpers
# ---------------------------------------------------------------------------------------------------------



def rule_sets(log: RewriteLog, options: Settings) -> list[RewriteRuleSet]:
    """Two phases: epilogue folds first (a Conv must be clean before a fusion rule decides on it), then the
    fusions (none with format qdq)."""
    integer = options.format == "integer"
    epilogue = [EpilogueAffine.rule(log, "Div"), *EpilogueAffine.rule(log, "Mul").commute(),
                *EpilogueAffine.rule(log, "Add").commute(), EpilogueAffine.rule(log, "Sub"),
                EpilogueBatchNorm.rule(log)]
    if options.format == "qdq":  # the Convs stay between their Q/DQ, cleaned for a toolkit that reads them
        return [RewriteRuleSet(epilogue)]
    fusions = [] if integer else [ConvToQLinear.rule(log)]
    fusions.append(ConvToInteger.rule(log, integer))
    if options.matmul:
        if not integer:
            fusions.append(MatMulToQLinear.rule(log))
        fusions.append(MatMulToInteger.rule(log, integer))
    return [RewriteRuleSet(epilogue), RewriteRuleSet(fusions)]
