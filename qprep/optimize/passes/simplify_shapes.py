"""Transpose/Reshape cleanup: compose consecutive Transposes (dropped when the result is the identity), merge
Reshape→Reshape, Unsqueeze→Unsqueeze and Slice→Slice (disjoint axes) chains, and replace a Reshape's computed shape by a constant when
shape inference already knows the output (at most one dynamic dim, which becomes -1).

Why: exporters write `x.view(x.size(0), -1)` as Shape→Gather→Unsqueeze→Concat→Reshape and attention heads as
Transpose pairs; each extra node is another tensor a quantizer may round. Engine: onnxscript's basic rules.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass
from onnxscript.rewriter import MatchResult, RewriteRuleClassBase, RewriteRuleSet
from onnxscript.rewriter import pattern as orp
from onnxscript.rewriter.rules.common import (
    no_op_transpose_rule,
    reshape_reshape_rule,
    squeeze_reshape_1d_rule,
    transpose_transpose_rule,
    unsqueeze_unsqueeze_rule,
)

from qprep.graph.dim_origin import DimOrigins, shape_element
from qprep.graph.ir import constant_array, infer_shapes
from qprep.graph.rules import IdentityElimination, names_in_use
from qprep.optimize.passes import GraphPass, PassOutcome, PassSettings
from qprep.third_party import MaterializeReshapeShape, materialized_dims


class _ReshapeRule(RewriteRuleClassBase):
    """A Reshape, judged with the graph's dim origins (which dims provably have the same size)."""

    def __init__(self, origins: DimOrigins):
        super().__init__()
        self._origins = origins

    def pattern(self, op, x, shape):
        return op.Reshape(x, shape, _allow_other_attributes=True, _outputs=["y"])


class ReshapeKeepingOwnDims(_ReshapeRule):
    """Reshape(x, Concat(..., Unsqueeze(Gather(Shape(y), k)), ..., c)) → Reshape(x, [..., 0, ..., c]).

    The `x.view(x.size(0), -1)` and attention-head idioms: a piece that reads a dim of some tensor y into
    position i is what Reshape's 0 means (allowzero=0) when that dim provably equals x's dim i (the same
    origin, qprep/graph/dim_origin.py); every other piece must be a constant. The shape subgraph then dies.
    """

    def check(self, context, x, shape, y, **_) -> MatchResult:
        result = MatchResult()
        if constant_array(shape) is not None:
            return result.fail("the shape is already a constant")
        if y.producer().attributes.get_int("allowzero", 0) != 0:
            return result.fail("allowzero=1: a 0 in the shape is a zero-size dim, not a copy")
        self._dims = _dims_copying(x, shape, self._origins)
        if self._dims is None:
            return result.fail("shape is not built from x's dims and constants")
        self._name = names_in_use(context.model).value(f"{shape.name}/constant")
        return result

    def rewrite(self, op, x, shape, **_):
        name = self._name
        return op.Reshape(x, op.initializer(ir.tensor(np.array(self._dims, dtype=np.int64), name=name), name=name))


class ReshapeToOwnShape(_ReshapeRule):
    """Reshape(x, shape) → x when every element of the computed shape provably is x's own dim at its position
    (a constant equal to a static dim, a dim read from a tensor with the same origin, or one -1 once all the
    others are proved). Dynamic exports write such no-op Reshapes around attention (`view(b, -1, s, d)`)."""

    def check(self, context, x, shape, y, **_) -> MatchResult:
        result = MatchResult()
        rank = x.shape.rank() if x.shape is not None else None
        length = shape.shape[0] if shape.shape is not None and shape.shape.rank() == 1 else None
        if rank is None or length != rank:
            return result.fail("the target's length is not x's known rank")
        allowzero = y.producer().attributes.get_int("allowzero", 0)
        unproved = []
        for i in range(rank):
            element = shape_element(shape, i, self._origins)
            own = self._origins.of(x, i)
            if element == own or (element == 0 and not allowzero):
                continue
            if element == -1:
                unproved.append(i)
                continue
            return result.fail(f"target element {i} is not x's dim {i}")
        return result if len(unproved) <= 1 else result.fail("more than one -1")

    def rewrite(self, op, x, **_):
        return op.Identity(x)


class TransposeMovingUnitDims(RewriteRuleClassBase):
    """Transpose(x) that moves only size-1 dims (the other dims keep their order) next to a Reshape →
    Reshape(x, its output shape), which then merges with that Reshape: the same elements in the same order.
    jax2tf writes `Reshape → Transpose([0, 2, 1])` of [12, 128, 1] tensors in attention."""

    def pattern(self, op, x):
        return op.Transpose(x, _allow_other_attributes=True, _outputs=["y"])

    def check(self, context, x, y, **_) -> MatchResult:
        result = MatchResult()
        rank = x.shape.rank() if x.shape is not None else None
        if rank is None:
            return result.fail("unknown rank")
        perm = list(y.producer().attributes.get_ints("perm", list(range(rank))[::-1]))
        kept = [axis for axis in perm if x.shape[axis] != 1]
        if kept != sorted(kept):
            return result.fail("the transpose reorders dims longer than 1")
        beside_reshape = (x.producer() is not None and x.producer().op_type == "Reshape") or any(
            use.node.op_type == "Reshape" for use in y.uses())
        if not beside_reshape:
            return result.fail("no Reshape to merge with")
        target = []
        for position, axis in enumerate(perm):
            dim = x.shape[axis]
            if isinstance(dim, int) and dim > 0:
                target.append(dim)
            elif axis == position and not isinstance(dim, int):
                target.append(0)  # a dynamic dim that stays in place: Reshape's copy
            else:
                return result.fail("a dynamic or empty dim moves")
        self._target = target
        self._name = names_in_use(context.model).value(f"{y.name}/shape")
        return result

    def rewrite(self, op, x, **_):
        return op.Reshape(x, op.initializer(ir.tensor(np.array(self._target, np.int64), name=self._name)))


class SliceOfSlice(RewriteRuleClassBase):
    """Slice(Slice(x, p), q) with constant parameters on disjoint axes → one Slice(x, p ∪ q).

    Slicing different axes commutes, so the two compose into one Slice whose lists are the concatenation.
    Only the outer Slice is matched: an inner Slice that feeds several (YOLO's Focus, `x[..., ::2, ::2]` four
    times) is merged into each of them and then dies."""

    def pattern(self, op, inner, starts, ends):
        return op.Slice(inner, starts, ends, _allow_other_inputs=True, _outputs=["y"])

    def check(self, context, inner, y, **_) -> MatchResult:
        result = MatchResult()
        first = inner.producer()
        if first is None or first.op_type != "Slice" or first.domain not in ("", "ai.onnx"):
            return result.fail("the input is not a Slice")
        x = first.inputs[0]
        rank = x.shape.rank() if x.shape is not None else None
        lists = [_slice_parameters(node, rank) for node in (first, y.producer())]
        if any(p is None for p in lists):
            return result.fail("a Slice's starts, ends, axes or steps are not constants (or axes need a rank)")
        if set(lists[0][2]) & set(lists[1][2]):
            return result.fail("the Slices share an axis")
        self._x = x
        self._merged = [np.concatenate([a, b]) for a, b in zip(*lists)]
        self._name = names_in_use(context.model).value(f"{y.name}/slice")
        return result

    def rewrite(self, op, **_):
        params = [op.initializer(ir.tensor(v, name=f"{self._name}_{part}"))
                  for v, part in zip(self._merged, ("starts", "ends", "axes", "steps"))]
        return op.Slice(self._x, *params)


def _slice_parameters(node: ir.Node, rank: int | None) -> list[np.ndarray] | None:
    """[starts, ends, axes, steps] of a Slice as int64 arrays (defaults filled, axes made non-negative), or
    None when one is not a constant or a negative axis meets an unknown rank."""
    inputs = list(node.inputs[1:]) + [None] * 4
    starts, ends = constant_array(inputs[0]), constant_array(inputs[1])
    if starts is None or ends is None:
        return None
    axes = np.arange(starts.size) if inputs[2] is None else constant_array(inputs[2])
    steps = np.ones(starts.size, np.int64) if inputs[3] is None else constant_array(inputs[3])
    if axes is None or steps is None or (np.any(axes < 0) and rank is None):
        return None
    axes = np.where(axes < 0, axes + (rank or 0), axes)
    return [np.asarray(v, np.int64).reshape(-1) for v in (starts, ends, axes, steps)]


class SoftmaxOfFlattenedRows(RewriteRuleClassBase):
    """Reshape(Softmax(Flatten(x, axis=r-1)), Shape(x)) → Softmax(x, axis=r-1), also for LogSoftmax.

    onnx's version converter writes this when it raises a Softmax below opset 13 (which coerced its input to
    2-D) to 13 (one axis): flattening every dim but the last and normalizing along it is the same as
    normalizing x along its last axis, so the Flatten, Shape and Reshape go.
    """

    def pattern(self, op, x):
        flat = op.Flatten(x, _outputs=["flat"])
        normalized = orp.OrValue([op.Softmax(flat, _outputs=["normalized"]),
                                  op.LogSoftmax(flat, _outputs=["normalized"])])
        return op.Reshape(normalized, op.Shape(x, _outputs=["shape"]), _allow_other_attributes=True)

    def check(self, context, x, flat, normalized, shape, **_) -> MatchResult:
        result = MatchResult()
        rank = x.shape.rank() if x.shape is not None else None
        if rank is None or rank < 2:
            return result.fail("x's rank is unknown or below 2")
        if flat.producer().attributes.get_int("axis", 1) % rank != rank - 1:
            return result.fail("Flatten does not keep exactly the last axis apart")
        if normalized.producer().attributes.get_int("axis", -1) not in (1, -1):
            return result.fail("the normalization is not along the flattened rows")
        shape_node = shape.producer()
        if shape_node.attributes.get_int("start", 0) != 0 or "end" in shape_node.attributes:
            return result.fail("Shape reads only part of x's shape")
        self._op = normalized.producer().op_type
        return result

    def rewrite(self, op, x, **_):
        return getattr(op, self._op)(x, axis=x.shape.rank() - 1)


def _same_element_count(shape, dims: list[int]) -> bool:
    """Whether a tensor of static `shape` can be reshaped to `dims` (at most one -1)."""
    total, known = int(np.prod(shape)), int(np.prod([d for d in dims if d != -1]))
    return total == known if -1 not in dims else known > 0 and total % known == 0


def _dims_copying(x: ir.Value, shape: ir.Value, origins: DimOrigins) -> list[int] | None:
    """The constant shape equivalent to `shape` for Reshape(x, shape), or None when one element is neither a
    constant nor a provable copy of x's dim at its position."""
    length = shape.shape[0] if shape.shape is not None and shape.shape.rank() == 1 else None
    if not isinstance(length, int):
        return None
    dims = []
    for i in range(length):
        element = shape_element(shape, i, origins)
        if isinstance(element, (int, np.integer)):
            dims.append(int(element))
        elif element is not None and x.shape is not None and i < x.shape.rank() and origins.of(x, i) == element:
            dims.append(0)
        else:
            return None
    return dims if dims.count(-1) <= 1 else None


class ConstantReshapeShape(MaterializeReshapeShape):
    """onnxscript's rule (the output shape is known: the computed shape becomes a constant) without its
    allowzero=1, an attribute that exists from opset 14 only: on an opset-13 model the checker refused it and
    the whole pass was rolled back. A shape without a 0 does not need it, so shapes with a 0 are left alone.

    The known shape must be evidence: not a graph output's (declared, never checked by ONNX Runtime), of the
    computed shape's length, and holding x's element count when x is static."""

    def check(self, context, data, shape) -> MatchResult:
        result = super().check(context, data, shape)
        if not result:
            return result
        dims = materialized_dims(self)
        if 0 in dims:
            return MatchResult().fail("a 0 dim would need allowzero (opset 14)")
        length = shape.shape[0] if shape.shape is not None and shape.shape.rank() == 1 else None
        if isinstance(length, int) and length != len(dims):
            return MatchResult().fail(f"the computed shape has {length} elements, the output rank {len(dims)}")
        if context.output_values[0].is_graph_output():
            return MatchResult().fail("a graph output's shape is its declaration, not inferred: no proof (an "
                                      "OCR model declares [1, seqlen] for a [24, 1, 8210] output)")
        if data.shape is not None and data.shape.is_static() and not _same_element_count(data.shape.numpy(), dims):
            return MatchResult().fail("the known output shape does not hold x's element count")
        self._name = f"{context.output_values[0].name}/shape"
        return result

    def rewrite(self, op, data, shape, **_):
        return op.Reshape(data, op.initializer(ir.tensor(np.array(materialized_dims(self), np.int64), name=self._name)))


def rules(origins: DimOrigins) -> RewriteRuleSet:
    return RewriteRuleSet([ReshapeToOwnShape.rule(origins), ReshapeKeepingOwnDims.rule(origins),
                           transpose_transpose_rule, no_op_transpose_rule, TransposeMovingUnitDims.rule(),
                           SoftmaxOfFlattenedRows.rule(), SliceOfSlice.rule(),
                           reshape_reshape_rule, unsqueeze_unsqueeze_rule, squeeze_reshape_1d_rule,
                           ConstantReshapeShape.rule()])


def apply(model: ir.Model, settings: PassSettings) -> PassOutcome:
    infer_shapes(model)  # the rules check ranks/shapes
    count = rules(DimOrigins()).apply_to_model(model)
    IdentityElimination()(model)  # composed Transposes that cancel out become Identity first (not the If
    # branch outputs that are an outer value: onnx_ir's pass renamed those, and the model no longer checked)
    RemoveUnusedNodesPass()(model)
    return PassOutcome(matches=count, details={"rewrites": count})


PASS = GraphPass(name="simplify_shapes", apply=apply,
                 doc="compose Transposes, merge Reshape/Unsqueeze chains, constant Reshape shapes")
