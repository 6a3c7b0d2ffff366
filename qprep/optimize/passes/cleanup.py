"""Remove what computes nothing: Identity, inference Dropout, x*1, x+0, x-0, x/1, Cast to the same type,
Expand/Transpose/Reshape that keep the shape, zero Pad, a Slice that keeps everything; then duplicate nodes
(the same op, attributes and inputs: dynamic exports compute `Shape(x)[0]` once per use), dead nodes, unused
and duplicate initializers.

Why first: every later pass matches fewer nodes, and quantizers do not insert Q/DQ around ops that are not
there. Each rule is exact (the output equals the input bit for bit), which the stage still verifies.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import DeduplicateInitializersPass, RemoveUnusedNodesPass, RemoveUnusedOpsetsPass
from onnxscript.rewriter import MatchResult, RewriteRuleClassBase, RewriteRuleSet
from onnxscript.rewriter.rules.common import (
    dropout_inference_rule,
    dropout_zero_rule,
    no_op_cast_rule,
    no_op_expand_rule,
    no_op_transpose_rule,
)

from qprep.graph.ir import constant_array
from qprep.graph.rules import IdentityElimination, all_graphs
from qprep.optimize.passes import GraphPass, PassOutcome, PassSettings


class _NeutralOperand(RewriteRuleClassBase):
    """x ∘ c → x when c is exactly the operation's neutral element, a single value that cannot broadcast x to
    a bigger shape. Exact comparison on purpose: onnxscript's add_0 rule accepts |c| <= 1e-8, which deletes
    LayerNorm's `+ 1e-12` epsilon."""

    op_type = ""
    neutral = 0.0
    constant_first = False  # match c ∘ x (only for commutative ops)

    def pattern(self, op, x, c):
        operands = (c, x) if self.constant_first else (x, c)
        return getattr(op, self.op_type)(*operands)

    def check(self, context, x, c, **_) -> MatchResult:
        result = MatchResult()
        value = constant_array(c)
        if value is None or value.size != 1 or value.dtype != _numpy_dtype(x):
            return result.fail("not a single constant of x's type")
        if x.shape is None or value.ndim > len(x.shape):
            return result.fail("the constant could broadcast x to a higher rank")
        return result if float(value.reshape(())) == self.neutral else result.fail("not the neutral element")

    def rewrite(self, op, x, c, **_):
        return op.Identity(x)


def _numpy_dtype(value: ir.Value):
    return None if value.dtype is None else value.dtype.numpy()


def _neutral_rule(op_type: str, neutral: float, constant_first: bool = False):
    name = f"{op_type}{'ConstFirst' if constant_first else ''}Neutral"
    rule_class = type(name, (_NeutralOperand,), {"op_type": op_type, "neutral": neutral,
                                                 "constant_first": constant_first})
    return rule_class.rule()


NEUTRAL_RULES = [_neutral_rule("Add", 0.0), _neutral_rule("Add", 0.0, True), _neutral_rule("Sub", 0.0),
                 _neutral_rule("Mul", 1.0), _neutral_rule("Mul", 1.0, True), _neutral_rule("Div", 1.0)]


class ReshapeToSameShape(RewriteRuleClassBase):
    """Reshape(x, shape) whose output shape equals x's static shape → x."""

    def pattern(self, op, x, shape):
        return op.Reshape(x, shape, _allow_other_attributes=True)

    def check(self, context, x, shape, **_) -> MatchResult:
        result = MatchResult()
        target = constant_array(shape)
        if x.shape is None or not x.shape.is_static() or target is None:
            return result.fail("input shape or target shape not static")
        dims = list(x.shape.numpy())
        wanted = [int(d) for d in target.reshape(-1)]
        if -1 in wanted or len(wanted) != len(dims):
            return result.fail("target has -1 or another rank")
        wanted = [dims[i] if d == 0 else d for i, d in enumerate(wanted)]  # 0 copies the input dim
        return result if wanted == dims else result.fail("shape changes")

    def rewrite(self, op, x, shape, **_):
        return op.Identity(x)


class FullSlice(RewriteRuleClassBase):
    """Slice(x, starts, ends[, axes[, steps]]) that keeps every element → x: on each sliced axis the start is
    0, the step 1 and the end INT64_MAX or at least the axis' static length. torch.onnx writes `x[:, :65]` as
    one Slice per dim, the untouched ones from 0 to INT64_MAX (silero VAD's STFT)."""

    def pattern(self, op, x, starts, ends):
        return op.Slice(x, starts, ends, _allow_other_inputs=True, _outputs=["y"])

    def check(self, context, x, starts, ends, y, **_) -> MatchResult:
        result = MatchResult()
        optional = list(y.producer().inputs[3:]) + [None, None]
        begin, end = constant_array(starts), constant_array(ends)
        axes = np.arange(begin.size) if begin is not None and optional[0] is None else constant_array(optional[0])
        steps = np.ones_like(begin) if begin is not None and optional[1] is None else constant_array(optional[1])
        if any(v is None for v in (begin, end, axes, steps)):
            return result.fail("starts, ends, axes or steps are not constants")
        if np.any(begin != 0) or np.any(steps != 1):
            return result.fail("a start is not 0 or a step not 1")
        for axis, stop in zip(axes.reshape(-1), end.reshape(-1)):
            if stop == np.iinfo(np.int64).max:
                continue
            rank = x.shape.rank() if x.shape is not None else None
            length = x.shape[int(axis) % rank] if rank else None
            if not isinstance(length, int) or stop < length:
                return result.fail(f"the end {stop} on axis {axis} may cut the axis")
        return result

    def rewrite(self, op, x, **_):
        return op.Identity(x)


class InferenceDropout(RewriteRuleClassBase):
    """Dropout without a true training_mode input (opset 12+: inference by default) and no mask used → x."""

    def pattern(self, op, x):
        return op.Dropout(x, _allow_other_inputs=True, _allow_other_attributes=True, _outputs=["y"])

    def check(self, context, x, y, **_) -> MatchResult:
        result = MatchResult()
        node = y.producer()
        if len(node.outputs) > 1 and (node.outputs[1].uses() or node.outputs[1].is_graph_output()):
            return result.fail("the mask output is used")
        training = node.inputs[2] if len(node.inputs) > 2 else None
        if training is not None and (constant_array(training) is None or bool(constant_array(training))):
            return result.fail("training_mode may be true")
        return result

    def rewrite(self, op, x, **_):
        return op.Identity(x)


class ZeroPad(RewriteRuleClassBase):
    """Pad with all-zero pads (constant mode or any mode) → x."""

    def pattern(self, op, x, pads):
        return op.Pad(x, pads, _allow_other_inputs=True, _allow_other_attributes=True)

    def check(self, context, x, pads, **_) -> MatchResult:
        result = MatchResult()
        values = constant_array(pads)
        if values is None or np.any(values != 0):
            return result.fail("pads are not constant zeros")
        return result

    def rewrite(self, op, x, pads, **_):
        return op.Identity(x)


RULES = RewriteRuleSet([
    *NEUTRAL_RULES, dropout_zero_rule, dropout_inference_rule, InferenceDropout.rule(), no_op_cast_rule, no_op_expand_rule, no_op_transpose_rule,
    ReshapeToSameShape.rule(), ZeroPad.rule(), FullSlice.rule(),
])


# Never merged: ops whose two calls may differ, and Q/DQ (QDQ tooling expects one DequantizeLinear per consumer).
NOT_MERGED = frozenset({"RandomUniform", "RandomNormal", "RandomUniformLike", "RandomNormalLike", "Multinomial",
                        "Dropout", "QuantizeLinear", "DequantizeLinear"})


def _merge_key(node: ir.Node) -> tuple | None:
    """What makes two nodes compute the same thing: op, attributes, the very same input values; None when the
    node must not be merged (subgraphs, randomness, Q/DQ, or no outputs)."""
    if node.op_type in NOT_MERGED or not node.outputs:
        return None
    attributes = []
    for name, attr in sorted(node.attributes.items()):
        if attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS):
            return None
        value = attr.value
        if attr.type == ir.AttributeType.TENSOR:
            array = value.numpy()
            value = (array.shape, str(array.dtype), array.tobytes())
        elif isinstance(value, (list, tuple)):
            value = tuple(value)
        attributes.append((name, attr.type, value))
    return (node.op_identifier(), len(node.outputs), tuple(id(v) for v in node.inputs), tuple(attributes))


def merge_duplicate_nodes(model: ir.Model) -> int:
    """Pattern: two nodes with the same merge key (graph order is topological, so the first one computes its
    outputs before any use of the second's). Check: the second's outputs are not graph outputs (their names
    are the model's interface). Replacement: every use of the second's outputs reads the first's."""
    merged = 0
    for graph in all_graphs(model):
        first: dict[tuple, ir.Node] = {}
        for node in list(graph):
            key = _merge_key(node)
            if key is None:
                continue
            if key not in first:
                first[key] = node
                continue
            if any(out.is_graph_output() for out in node.outputs):
                continue
            ir.convenience.replace_all_uses_with(node.outputs, first[key].outputs)
            graph.remove(node, safe=True)
            merged += 1
    return merged


def apply(model: ir.Model, settings: PassSettings) -> PassOutcome:
    nodes_before = _count_nodes(model)
    initializers_before = len(model.graph.initializers)
    no_ops = RULES.apply_to_model(model)
    for cleanup in (IdentityElimination(), RemoveUnusedNodesPass(), DeduplicateInitializersPass()):
        cleanup(model)
    duplicates = merge_duplicate_nodes(model)
    for cleanup in (RemoveUnusedNodesPass(), RemoveUnusedOpsetsPass()):
        cleanup(model)
    removed = nodes_before - _count_nodes(model)
    initializers_removed = initializers_before - len(model.graph.initializers)
    return PassOutcome(matches=removed + initializers_removed,
                       details={"no_op_rewrites": no_ops, "duplicate_nodes_merged": duplicates,
                                "nodes_removed": removed, "initializers_removed": initializers_removed})


def _count_nodes(model: ir.Model) -> int:
    return sum(1 for _ in ir.traversal.RecursiveGraphIterator(model.graph))


PASS = GraphPass(name="cleanup", apply=apply,
                 doc="remove Identity/Dropout/no-op ops, dead nodes, unused and duplicate initializers")
