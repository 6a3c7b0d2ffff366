"""Non-overlapping MaxPools in ONNX Runtime INT8 models become Reshape + ReduceMax, so they stay float.

Why: ONNX Runtime's QDQ propagation moves the QuantizeLinear that follows a float MaxPool (opset-12 MaxPool) in front
of it, and then runs the MaxPool on uint8 with a generic kernel, many times slower than the float MaxPool
(BENCHMARKS.md: "MaxPools kept float as ReduceMax"). ORT does not propagate over ReduceMax, and a MaxPool whose
kernel equals its stride, without padding or dilation, on dims its kernel divides, is exactly the max over the axes
of a [N, C, H/kh, kh, W/kw, kw] view: the rewrite changes no number (checked on the samples; the model is returned
unchanged otherwise).
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRuleClassBase, RewriteRuleSet

from qprep.graph.rules import unique_node_name, unique_value_name
from qprep.model.info import tensor_shapes
from qprep.model.runtime import run_model

log = logging.getLogger("qprep")


class BlockMaxPool(RewriteRuleClassBase):
    """MaxPool(x) with kernel = stride → ReduceMax(Reshape(x, [N, C, H/kh, kh, W/kw, kw]), axes [3, 5]).

    Preconditions: x is float with static [N, C, H, W] (from ONNX shape inference); a 2-D kernel equal to the
    strides; no padding, dilation, ceil_mode or storage_order; auto_pad NOTSET or VALID; kh divides H and kw
    divides W (otherwise MaxPool's floor drops a row the view would need); one output (no Indices).
    """

    def __init__(self, shapes: dict[str, list[int]], opset: int):
        super().__init__()
        # No rule name: the rewriter would tag every new node with it (node metadata), and the result is meant to
        # be the quantizer's model with only the MaxPools replaced.
        self.name = None
        self.shapes, self.opset = shapes, opset  # per run: float tensors' static dims, the model's opset

    def pattern(self, op, x):
        return op.MaxPool(x, _allow_other_attributes=True, _outputs=["pooled"])

    def check(self, context, x, pooled, **_) -> MatchResult:
        reason = _ineligible(pooled.producer(), self.shapes.get(x.name))
        return MatchResult().fail(reason) if reason else MatchResult()

    def rewrite(self, op, x, pooled, **_):
        node, graph = pooled.producer(), pooled.producer().graph
        (n, c, h, w), (kh, kw) = self.shapes[x.name], node.attributes.get_ints("kernel_shape")
        base = node.name or pooled.name
        view_name = unique_value_name(graph, f"{base}/blocks_shape")
        view = op.initializer(ir.tensor(np.array([n, c, h // kh, kh, w // kw, kw], np.int64), name=view_name),
                              name=view_name)
        blocks = op.Reshape(x, view, _name=unique_node_name(graph, f"{base}/Reshape"),
                            _outputs=[unique_value_name(graph, f"{base}/blocks")])
        if self.opset >= 18:  # axes became an input
            axes_name = unique_value_name(graph, f"{base}/axes")
            axes = op.initializer(ir.tensor(np.array([3, 5], np.int64), name=axes_name), name=axes_name)
            return op.ReduceMax(blocks, axes, keepdims=0, _name=node.name)
        return op.ReduceMax(blocks, axes=[3, 5], keepdims=0, _name=node.name)


def _ineligible(node: ir.Node, dims: list[int] | None) -> str | None:
    """Why the MaxPool is not a non-overlapping one on static float dims its kernel divides; None if it is."""
    attributes = node.attributes
    kernel = list(attributes.get_ints("kernel_shape", []))
    if len(node.outputs) != 1:
        return "MaxPool with an Indices output"
    if dims is None or len(dims) != 4 or len(kernel) != 2:
        return "not a 2-D MaxPool on a float input of static rank-4 shape"
    if (list(attributes.get_ints("strides", [1, 1])) != kernel or any(attributes.get_ints("pads", [0] * 4))
            or any(d != 1 for d in attributes.get_ints("dilations", [1, 1])) or attributes.get_int("ceil_mode", 0)
            or attributes.get_int("storage_order", 0)
            or attributes.get_string("auto_pad", "NOTSET") not in ("NOTSET", "VALID")):
        return "overlapping, padded, dilated or ceil-mode windows"
    if dims[2] % kernel[0] or dims[3] % kernel[1]:
        return f"kernel {kernel} does not divide the input's {dims[2]}x{dims[3]}"
    return None


def rewrite(model: onnx.ModelProto, samples: list[dict], threads: int = 2) -> tuple[onnx.ModelProto, int]:
    """(model with every eligible MaxPool rewritten, how many); unchanged if the outputs differ at all."""
    shapes = {name: dims for name, (kind, dims) in tensor_shapes(model).items()
              if kind == onnx.TensorProto.FLOAT and dims and None not in dims}
    ir_model = ir.from_proto(model)  # a new object graph: `model` itself is never changed
    count = RewriteRuleSet([BlockMaxPool.rule(shapes, ir_model.opset_imports.get("", 13))]).apply_to_model(ir_model)
    if not count:
        return model, 0
    result = _to_proto(ir_model, model)
    expected, actual = run_model(model, samples, threads), run_model(result, samples, threads)
    if any(not np.array_equal(e[name], a[name]) for e, a in zip(expected, actual) for name in e):
        log.warning("float_maxpool: the rewritten model's outputs differ; MaxPools left as they were")
        return model, 0
    return result, count


def _to_proto(ir_model: ir.Model, original: onnx.ModelProto) -> onnx.ModelProto:
    """The rewritten model with the original's value_info: onnx_ir would write its own (every typed value, in
    its own order), and the rewrite changes no existing value's type."""
    result = ir.to_proto(ir_model)
    del result.graph.value_info[:]
    result.graph.value_info.extend(original.graph.value_info)
    return result
