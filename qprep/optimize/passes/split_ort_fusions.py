"""ONNX Runtime's fused ops (com.microsoft) taken back apart into ONNX ops.

Why: a model saved from an ONNX Runtime session (ORT_ENABLE_EXTENDED) or passed through its transformer optimizer
holds FusedConv, FusedMatMul, BiasGelu, SkipLayerNormalization, ... ONNX Runtime's quantizer quantizes none of
them (EfficientNet-Lite0 saved at EXTENDED: its 33 FusedConv stayed float under "ok"), rknn-toolkit2 takes no op
outside the ONNX domain, and the later passes (LayerNorm, GELU) cannot see into them. Apart, each is a layer the
quantizers know plus what it had fused, and the GELU/LayerNorm passes fuse again into what the backend runs.

Forms (node → replacement; every attribute read from the node):
    FusedConv(X, W, B?, Z?)             act(Conv(X, W, B) [+ Z])       activation, activation_params
    FusedGemm(A, B, C?)                 act(Gemm(A, B, C))             activation, activation_alpha/beta/gamma
    FusedMatMul(A, B)                   MatMul(A', B') [* alpha]       transA/transB swap the last two axes
    BiasGelu(A, B)                      gelu_erf(A + B)
    FastGelu(X, bias?)                  gelu_tanh(X [+ bias])
    Gelu(X) / QuickGelu(X)              gelu_erf(X) / X * Sigmoid(alpha * X)
    SkipLayerNormalization(x, skip, gamma, beta?, bias?)      LayerNorm(x + skip [+ bias]) over the last axis
    SkipSimplifiedLayerNormalization(x, skip, gamma, bias?)   RMSNorm(x + skip [+ bias]) over the last axis
GELUs are written decomposed: the GELU pass then writes Gelu, com.microsoft Gelu or nothing, per backend. For
the same reason Gelu/FastGelu/QuickGelu are left alone when that pass would write them back (gelu: microsoft).
LayerNorm is LayerNormalization from opset 17, else decomposed (the LayerNorm pass fuses it, upgrading the
opset where allowed); the Skip ops' `input_skip_bias_sum` output is the sum.

Check (else the node stays, its reason in details["left"]): an activation ONNX has, with its parameters;
FusedMatMul without transBatchA/B, and A/B's rank known where transposed; the Skip ops' mean and inv_std_var
outputs unused. Math: ONNX Runtime's contrib op definitions; the optimize stage verifies the result on samples.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Callable

import numpy as np
import onnx_ir as ir

from qprep.graph.ir import FLOAT_TYPES, MS_DOMAIN, default_opset, infer_shapes
from qprep.graph.rules import Names, ReplacementBuilder, all_nodes, names_in_use, take_over
from qprep.optimize.passes import GraphPass, PassOutcome, PassSettings
from qprep.optimize.passes.gelu import resolve_mode
from qprep.optimize.passes.layernorm import LAYERNORM_OPSET

# activation name → the ONNX attributes its parameters are, in order (Clip's are its min/max inputs)
ACTIVATIONS: dict[str, tuple[str, ...]] = {
    "Relu": (), "Sigmoid": (), "Tanh": (), "Softplus": (), "Softsign": (),
    "LeakyRelu": ("alpha",), "Elu": ("alpha",), "ThresholdedRelu": ("alpha",),
    "HardSigmoid": ("alpha", "beta"), "Selu": ("alpha", "gamma"), "Clip": ("min", "max"),
}


class Left(Exception):
    """This node stays as it is, for the reason given."""


def _activation(b: ReplacementBuilder, x: ir.Value, name: str, params: dict[str, float]) -> ir.Value:
    if name == "Clip":
        if b.opset < 11:
            return b.op("Clip", x, min=params.get("min"), max=params.get("max"))
        low = b.scalar(params["min"], "clip_min") if "min" in params else None
        high = b.scalar(params["max"], "clip_max") if "max" in params else None
        return b.op("Clip", x, low, high)
    return b.op(name, x, **params)


def _model_float(model: ir.Model) -> ir.DataType:
    """The float type most of the model's weights have (float32 without any): a float16 model's untyped
    intermediate values are float16, and a float32 constant beside them fails the checker."""
    types = Counter(v.dtype for v in model.graph.initializers.values() if v.dtype in FLOAT_TYPES)
    return types.most_common(1)[0][0] if types else ir.DataType.FLOAT


def _input(node: ir.Node, index: int) -> ir.Value | None:
    return node.inputs[index] if index < len(node.inputs) else None


def _attr(node: ir.Node, name: str, default=None):
    attr = node.attributes.get(name)
    return default if attr is None else attr.value


def _activation_params(name: str, values: list) -> dict[str, float]:
    """The activation's ONNX attributes from its parameters in order (those not given keep ONNX's defaults)."""
    if name not in ACTIVATIONS:
        raise Left(f"activation {name} has no ONNX op qprep writes")
    return {k: float(v) for k, v in zip(ACTIVATIONS[name], values) if v is not None}


# ---------------------------------------------------------------------------------------------------------
# One function per op: the replacement's outputs, in the node's output order (None: an output nobody reads)
# ---------------------------------------------------------------------------------------------------------


def _fused_conv(b: ReplacementBuilder, node: ir.Node) -> list[ir.Value]:
    conv_attributes = {k: _attr(node, k) for k in ("auto_pad", "dilations", "group", "kernel_shape", "pads",
                                                    "strides")}
    activation = _attr(node, "activation")
    params = _activation_params(activation, list(_attr(node, "activation_params", []))) if activation else {}
    y = b.op("Conv", *[v for v in node.inputs[:3]], **conv_attributes)
    if _input(node, 3) is not None:
        y = b.op("Add", y, node.inputs[3])
    return [_activation(b, y, activation, params) if activation else y]


def _fused_gemm(b: ReplacementBuilder, node: ir.Node) -> list[ir.Value]:
    activation = _attr(node, "activation")
    if activation == "Clip":
        raise Left("FusedGemm with Clip: its bounds are in no attribute")
    given = {k: _attr(node, f"activation_{k}") for k in ("alpha", "beta", "gamma")}
    params = _activation_params(activation, [given[k] for k in ACTIVATIONS.get(activation, ())]) if activation else {}
    y = b.op("Gemm", *node.inputs[:3], **{k: _attr(node, k) for k in ("alpha", "beta", "transA", "transB")})
    return [_activation(b, y, activation, params) if activation else y]


def _fused_matmul(b: ReplacementBuilder, node: ir.Node) -> list[ir.Value]:
    if _attr(node, "transBatchA", 0) or _attr(node, "transBatchB", 0):
        raise Left("FusedMatMul with transBatchA/transBatchB")
    operands = []
    for value, flag in ((node.inputs[0], "transA"), (node.inputs[1], "transB")):
        if _attr(node, flag, 0):
            rank = None if value.shape is None else len(value.shape)
            if rank is None or rank < 2:
                raise Left(f"FusedMatMul with {flag} on an operand of unknown rank")
            value = b.op("Transpose", value, perm=[*range(rank - 2), rank - 1, rank - 2])
        operands.append(value)
    y = b.op("MatMul", *operands)
    alpha = float(_attr(node, "alpha", 1.0))
    return [y if alpha == 1.0 else b.op("Mul", y, b.scalar(alpha, "alpha"))]


def _gelu_erf(b: ReplacementBuilder, x: ir.Value) -> ir.Value:
    """0.5 * x * (1 + erf(x / sqrt 2)), as PyTorch exports it (the GELU pass reads it back)."""
    t = b.op("Erf", b.op("Mul", x, b.scalar(math.sqrt(0.5), "one_over_sqrt2")))
    return b.op("Mul", b.op("Mul", x, b.op("Add", t, b.scalar(1.0, "one"))), b.scalar(0.5, "half"))


def _gelu_tanh(b: ReplacementBuilder, x: ir.Value) -> ir.Value:
    """0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))."""
    cube = b.op("Mul", b.op("Mul", x, x), x)
    inner = b.op("Add", x, b.op("Mul", cube, b.scalar(0.044715, "cubic")))
    t = b.op("Tanh", b.op("Mul", inner, b.scalar(math.sqrt(2 / math.pi), "sqrt_2_over_pi")))
    return b.op("Mul", b.op("Mul", x, b.op("Add", t, b.scalar(1.0, "one"))), b.scalar(0.5, "half"))


def _bias_gelu(b: ReplacementBuilder, node: ir.Node) -> list[ir.Value]:
    return [_gelu_erf(b, b.op("Add", node.inputs[0], node.inputs[1]))]


def _gelu(b: ReplacementBuilder, node: ir.Node) -> list[ir.Value]:
    return [_gelu_erf(b, node.inputs[0])]


def _fast_gelu(b: ReplacementBuilder, node: ir.Node) -> list[ir.Value]:
    x = node.inputs[0] if _input(node, 1) is None else b.op("Add", node.inputs[0], node.inputs[1])
    return [_gelu_tanh(b, x)]


def _quick_gelu(b: ReplacementBuilder, node: ir.Node) -> list[ir.Value]:
    x, alpha = node.inputs[0], float(_attr(node, "alpha", 1.702))
    u = x if alpha == 1.0 else b.op("Mul", x, b.scalar(alpha, "alpha"))
    return [b.op("Mul", x, b.op("Sigmoid", u))]


def _skip_sum(b: ReplacementBuilder, node: ir.Node, bias_index: int) -> ir.Value:
    for unread in (1, 2):  # mean, inv_std_var: statistics for training
        output = node.outputs[unread] if unread < len(node.outputs) else None
        if output is not None and (output.uses() or output.is_graph_output()):
            raise Left(f"{node.op_type} whose {'mean' if unread == 1 else 'inv_std_var'} output is read")
    total = b.op("Add", node.inputs[0], node.inputs[1])
    return total if _input(node, bias_index) is None else b.op("Add", total, node.inputs[bias_index])


def _skip_layernorm(b: ReplacementBuilder, node: ir.Node) -> list[ir.Value]:
    total = _skip_sum(b, node, bias_index=4)
    epsilon = float(_attr(node, "epsilon", 1e-12))
    gamma, beta = node.inputs[2], _input(node, 3)
    if b.opset >= LAYERNORM_OPSET:
        y = b.op("LayerNormalization", total, gamma, beta, axis=-1, epsilon=epsilon)
    else:
        centred = b.op("Sub", total, b.axes("ReduceMean", total, [-1], keepdims=1))
        variance = b.axes("ReduceMean", b.op("Pow", centred, b.scalar(2.0, "two")), [-1], keepdims=1)
        deviation = b.op("Sqrt", b.op("Add", variance, b.scalar(epsilon, "epsilon")))
        y = b.op("Mul", b.op("Div", centred, deviation), gamma)
        y = y if beta is None else b.op("Add", y, beta)
    return [y, None, None, total]


def _skip_rmsnorm(b: ReplacementBuilder, node: ir.Node) -> list[ir.Value]:
    total = _skip_sum(b, node, bias_index=3)
    epsilon = float(_attr(node, "epsilon", 1e-12))
    mean_square = b.axes("ReduceMean", b.op("Mul", total, total), [-1], keepdims=1)
    rms = b.op("Sqrt", b.op("Add", mean_square, b.scalar(epsilon, "epsilon")))
    return [b.op("Mul", b.op("Div", total, rms), node.inputs[2]), None, None, total]


SPLITS: dict[str, Callable[[ReplacementBuilder, ir.Node], list[ir.Value]]] = {
    "FusedConv": _fused_conv, "FusedGemm": _fused_gemm, "FusedMatMul": _fused_matmul,
    "BiasGelu": _bias_gelu, "FastGelu": _fast_gelu, "Gelu": _gelu, "QuickGelu": _quick_gelu,
    "SkipLayerNormalization": _skip_layernorm, "SkipSimplifiedLayerNormalization": _skip_rmsnorm,
}
GELU_OPS = frozenset({"Gelu", "FastGelu", "QuickGelu"})  # what the GELU pass writes in its microsoft mode


def _split(node: ir.Node, names: Names, opset: int, model_float: ir.DataType, in_function: bool) -> None:
    builder = ReplacementBuilder(node, names, opset, model_float, in_function)
    outputs = SPLITS[node.op_type](builder, node)
    node.graph.insert_before(node, builder.nodes)
    for old, new in zip(node.outputs, outputs):
        if new is not None:
            take_over(old, new)
    node.graph.remove(node, safe=True)  # now, not later: its outputs' names are the new values'


def apply(model: ir.Model, settings: PassSettings) -> PassOutcome:
    """Split in place; details: split per op, left per reason."""
    opset = default_opset(model)
    keep_gelus = resolve_mode(settings, opset)[0] == "microsoft"
    candidates = [n for n in all_nodes(model) if n.domain == MS_DOMAIN and n.op_type in SPLITS
                  and not (keep_gelus and n.op_type in GELU_OPS) and n.graph is not None]
    if not candidates:
        return PassOutcome(0)
    names = names_in_use(model)
    split, left = Counter(), Counter()
    # FusedMatMul last, after shape inference: its transposes need ranks, which inference finds only once the
    # contrib ops before it are ONNX ops
    candidates.sort(key=lambda n: n.op_type == "FusedMatMul")
    inferred = False
    model_float = _model_float(model)
    in_functions = {id(n) for function in model.functions.values()
                    for n in ir.traversal.RecursiveGraphIterator(function)}
    for node in candidates:
        if node.op_type == "FusedMatMul" and not inferred:
            inferred = infer_shapes(model) or True
        try:
            _split(node, names, opset, model_float, id(node) in in_functions)
            split[node.op_type] += 1
        except Left as reason:
            left[str(reason)] += 1
    details: dict = {}
    if split:
        details["split"] = dict(sorted(split.items()))
    if left:
        details["left"] = dict(sorted(left.items()))
    return PassOutcome(sum(split.values()), details)


PASS = GraphPass(name="split_ort_fusions", apply=apply,
                 doc="take ONNX Runtime's fused com.microsoft ops (FusedConv, FusedMatMul, BiasGelu, "
                     "SkipLayerNormalization, ...) back apart into ONNX ops the quantizers and RKNN know")
