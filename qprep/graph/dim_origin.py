"""Where a tensor's dimension comes from: proof that two dynamic dims have the same size at run time.

Why: dynamic exports rebuild shapes from `Shape(y)[k]` (attention heads: Reshape(q, [B, S, 12, 32]) with B, S
read from the layer's input). ONNX shape inference names such dims `unk__N`, and a name it made up proves
nothing (broadcasting merges dims). Walking producer edges back through ops that provably carry a dim through
(elementwise ops, MatMul, Transpose, Unsqueeze, Reshape's copied dims, ...) gives each dim an *origin*; two dims
with the same origin are equal in every run of a valid model, so `Reshape(q, Concat(B, S, 12, 32))` can become
`Reshape(q, [0, 0, 12, 32])` and the shape subgraph dies.

An origin is one of:
    int                     a static size (shape inference)
    ("dim", name)           a named dim_param of a graph input (ONNX: one name, one size within the model)
    (value, axis)           the furthest value the walk could reach; equal only to itself

Rules of the walk (output dim `axis` ← ...):
    shape-keeping ops       Relu, Cast, Softmax, LayerNormalization, Gelu, ...: the same dim of input 0
    broadcasting ops        Add, Mul, Where, ...: the inputs' aligned dims, skipping static 1s; all must agree
    MatMul                  A[-2], B[-1]; batch dims broadcast like Add
    Transpose / Unsqueeze   the permuted / shifted input dim (an inserted axis is the static 1)
    Reshape                 a constant d > 0 is d; 0 (allowzero=0) copies the input dim; a piece of a Concat
                            that reads Shape(y)[k] is y's dim k
    Gather                  the data or indices dim it carries
    Range(0, n, 1)          n, when n is read from a dim
    Conv, pools             N of the input; C of the input (pools) or the weight's dim 0 (Conv)
    Flatten(axis 1), Gemm   N of the input; Gemm's dims of A and B
    Concat / Slice / Reduce (keepdims) along other axes: the input dim
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np
import onnx_ir as ir

from qprep.graph.ir import SHAPE_KEEPING_CONTRIB_OPS, constant_array

SHAPE_KEEPING = frozenset({
    "Abs", "Cast", "CastLike", "Ceil", "Clip", "Cos", "Dropout", "Elu", "Erf", "Exp", "Floor", "Gelu", "HardSigmoid",
    "HardSwish", "Identity", "IsInf", "IsNaN", "LayerNormalization", "LeakyRelu", "Log", "LogSoftmax", "Neg", "Not",
    "Reciprocal", "Relu", "Round", "Selu", "Sigmoid", "Sign", "Sin", "Softmax", "Softplus", "Softsign", "Sqrt",
    "Tanh", "ThresholdedRelu", "BatchNormalization", "InstanceNormalization", "LpNormalization", "Mish",
    "QuantizeLinear", "DequantizeLinear",
})
BATCH_AND_CHANNELS = frozenset({"Conv", "MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "LpPool",
                                "GlobalLpPool"})
BROADCASTING = frozenset({
    "Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Mean", "Sum", "Mod", "And", "Or", "Xor", "Equal", "Greater",
    "GreaterOrEqual", "Less", "LessOrEqual", "Where", "PRelu", "BitShift",
})
MAX_DEPTH = 300  # deeper walks stop at an opaque origin (sound, only less provable)


class DimOrigins:
    """Origins of (value, axis), memoized. One instance per pass application: rewrites that keep every dim
    (a computed Reshape shape replaced by an equivalent constant) leave the cached answers true."""

    def __init__(self) -> None:
        self._cache: dict[tuple[ir.Value, int], Hashable] = {}

    def same(self, a: ir.Value, a_axis: int, b: ir.Value, b_axis: int) -> bool:
        """Dim a_axis of a and dim b_axis of b are provably the same size."""
        return self.of(a, a_axis) == self.of(b, b_axis)

    def of(self, value: ir.Value, axis: int, depth: int = 0) -> Hashable:
        """The origin of dim `axis` (non-negative) of `value`."""
        key = (value, axis)
        if key not in self._cache:
            self._cache[key] = self._walk(value, axis, depth)
        return self._cache[key]

    def _walk(self, value: ir.Value, axis: int, depth: int) -> Hashable:
        opaque = (value, axis)
        dim = _dim(value, axis)
        if isinstance(dim, int) and not value.is_graph_output():
            return dim
        if value.is_graph_input():
            name = getattr(dim, "value", None)
            return ("dim", name) if name and not str(name).startswith("unk__") else opaque
        node = value.producer()
        if node is not None and (node.domain, node.op_type) in SHAPE_KEEPING_CONTRIB_OPS and depth <= MAX_DEPTH:
            return self.of(node.inputs[0], axis, depth + 1)
        if node is None or depth > MAX_DEPTH or node.domain not in ("", "ai.onnx"):
            return opaque
        rank = _rank(value)
        if rank is None:
            return opaque
        found = self._through(node, value, axis, rank, depth + 1)
        return opaque if found is None else found

    def _through(self, node: ir.Node, value: ir.Value, axis: int, rank: int, depth: int) -> Hashable | None:
        """The origin the producer `node` carries to dim `axis` of its output `value`, or None."""
        op, inputs = node.op_type, node.inputs
        if value is not node.outputs[0]:
            return None
        if op in SHAPE_KEEPING:
            return self.of(inputs[0], axis, depth) if _rank(inputs[0]) == rank else None
        if op in BROADCASTING:
            return self._broadcast([(v, _rank(v)) for v in inputs], axis, rank, depth)
        if op in BATCH_AND_CHANNELS and axis < 2:  # [N, C, spatial...]: N from x, C from x or the weight
            return self.of(inputs[1], 0, depth) if axis == 1 and op == "Conv" else self.of(inputs[0], axis, depth)
        if op == "Flatten" and axis == 0 and node.attributes.get_int("axis", 1) == 1:
            return self.of(inputs[0], 0, depth)
        if op == "Gemm":
            a, b = ("transA", inputs[0]), ("transB", inputs[1])
            name, operand = a if axis == 0 else b
            transposed = node.attributes.get_int(name, 0)
            return self.of(operand, axis if not transposed else 1 - axis, depth)
        if op == "Expand":
            return self._expand(node, axis, rank, depth)
        if op == "MatMul":
            return self._matmul(inputs[0], inputs[1], axis, rank, depth)
        if op == "Transpose":
            perm = node.attributes.get_ints("perm", list(range(rank))[::-1])
            return self.of(inputs[0], int(perm[axis]), depth)
        if op == "Unsqueeze":
            axes = _axes(node, rank)
            if axes is None:
                return None
            return 1 if axis in axes else self.of(inputs[0], axis - sum(a < axis for a in axes), depth)
        if op == "Reshape":
            return self._reshape(node, axis, depth)
        if op == "Gather":
            return self._gather(node, axis, depth)
        if op == "Range":  # Range(0, n, 1) has n elements
            start, delta = constant_array(inputs[0]), constant_array(inputs[2])
            if start is None or delta is None or start.size != 1 or delta.size != 1:
                return None
            return _scalar_dim(inputs[1], self, depth) if float(start) == 0 and float(delta) == 1 else None
        if op == "Concat":
            concat_axis = node.attributes.get_int("axis", 0) % rank
            return None if axis == concat_axis else self.of(inputs[0], axis, depth)
        if op == "Slice":
            axes = constant_array(inputs[3]) if len(inputs) > 3 and inputs[3] is not None else np.arange(rank)
            if axes is None:
                return None
            return None if axis in {int(a) % rank for a in axes.reshape(-1)} else self.of(inputs[0], axis, depth)
        if op.startswith("Reduce") and node.attributes.get_int("keepdims", 1) == 1:
            axes = _axes(node, rank)
            return None if axes is None or axis in axes else self.of(inputs[0], axis, depth)
        return None

    def _broadcast(self, operands, axis: int, rank: int, depth: int) -> Hashable | None:
        """Numpy broadcasting of (value, rank) operands aligned at the right."""
        origins = []
        for operand, operand_rank in operands:
            if operand is None or operand_rank is None:
                return None
            aligned = axis - (rank - operand_rank)
            if aligned >= 0:
                origins.append(self.of(operand, aligned, depth))
        return _common(origins)

    def _expand(self, node: ir.Node, axis: int, rank: int, depth: int) -> Hashable | None:
        """Expand(x, shape) broadcasts x against the shape tensor's elements."""
        x, shape = node.inputs
        length, x_rank = _length(shape), _rank(x)
        if length is None or x_rank is None:
            return None
        origins = []
        if axis - (rank - x_rank) >= 0:
            origins.append(self.of(x, axis - (rank - x_rank), depth))
        if axis - (rank - length) >= 0:
            origins.append(shape_element(shape, axis - (rank - length), self, depth))
        return _common(origins)

    def _matmul(self, a: ir.Value, b: ir.Value, axis: int, rank: int, depth: int) -> Hashable | None:
        rank_a, rank_b = _rank(a), _rank(b)
        if rank_a is None or rank_b is None or rank_a < 2 or rank_b < 2:
            return None
        if axis == rank - 1:
            return self.of(b, rank_b - 1, depth)
        if axis == rank - 2:
            return self.of(a, rank_a - 2, depth)
        return self._broadcast([(a, rank_a - 2), (b, rank_b - 2)], axis, rank - 2, depth)

    def _reshape(self, node: ir.Node, axis: int, depth: int) -> Hashable | None:
        if node.attributes.get_int("allowzero", 0) != 0:
            return None
        element = shape_element(node.inputs[1], axis, self, depth)
        if element == 0:
            return self.of(node.inputs[0], axis, depth)
        if isinstance(element, int):
            return element if element > 0 else None
        return element

    def _gather(self, node: ir.Node, axis: int, depth: int) -> Hashable | None:
        data, indices = node.inputs
        rank_d, rank_i = _rank(data), _rank(indices)
        if rank_d is None or rank_i is None:
            return None
        gather_axis = node.attributes.get_int("axis", 0) % rank_d
        if axis < gather_axis:
            return self.of(data, axis, depth)
        if axis < gather_axis + rank_i:
            return self.of(indices, axis - gather_axis, depth)
        return self.of(data, axis - rank_i + 1, depth)


def shape_element(shape: ir.Value, index: int, origins: DimOrigins, depth: int = 0) -> Hashable | None:
    """Element `index` of a 1-D int64 shape tensor: an int when constant, the origin of the dim it reads
    (`Unsqueeze(Gather(Shape(y), k))`, `Shape(y)` or a Slice of it, inside a Concat), else None."""
    array = constant_array(shape)
    if array is not None:
        flat = array.reshape(-1)
        return int(flat[index]) if index < flat.size else None
    node = shape.producer()
    if node is None:
        return None
    if node.op_type == "Concat" and node.attributes.get_int("axis", 0) in (0, -1):
        offset = 0
        for piece in node.inputs:
            length = _length(piece)
            if length is None:
                return None
            if index < offset + length:
                return shape_element(piece, index - offset, origins, depth)
            offset += length
        return None
    if node.op_type == "Unsqueeze" and _rank(node.inputs[0]) == 0:
        return _scalar_dim(node.inputs[0], origins, depth) if index == 0 else None
    if node.op_type == "Shape":
        source, start = node.inputs[0], node.attributes.get_int("start", 0)
        rank = _rank(source)
        return None if rank is None else origins.of(source, (start % rank if start < 0 else start) + index, depth)
    if node.op_type == "Slice" and node.inputs[0].producer() is not None:
        starts, steps = constant_array(node.inputs[1]), (constant_array(node.inputs[4]) if len(node.inputs) > 4
                                                          and node.inputs[4] is not None else np.array([1]))
        axes = constant_array(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] is not None else np.array([0])
        if starts is None or steps is None or axes is None or starts.size != 1 or int(steps.reshape(-1)[0]) != 1:
            return None
        start = int(starts.reshape(-1)[0])
        return shape_element(node.inputs[0], start + index, origins, depth) if start >= 0 else None
    if node.op_type == "Cast" or node.op_type == "Reshape" and _rank(node.inputs[0]) == 1:
        return shape_element(node.inputs[0], index, origins, depth)  # a 1-D shape stays element for element
    if node.op_type == "Where":
        return _unless_negative(node, index, origins, depth)
    return None


def _unless_negative(where: ir.Node, index: int, origins: DimOrigins, depth: int) -> Hashable | None:
    """torch's `expand(-1)` idiom: Where(Equal(s, c), a, s) with c < 0 everywhere. An element of s that is a dim
    (never negative) is what Where picks; a negative constant element equal to c picks a's element."""
    condition, a, s = where.inputs
    equal = condition.producer() if condition is not None else None
    if equal is None or equal.op_type != "Equal" or s not in equal.inputs:
        return None
    c = constant_array(equal.inputs[0] if equal.inputs[1] is s else equal.inputs[1])
    if c is None or c.size == 0 or not np.all(c < 0):
        return None
    element = shape_element(s, index, origins, depth)
    if element is None:
        return None
    if not isinstance(element, (int, np.integer)) or element >= 0:
        return element
    flat = c.reshape(-1)
    if c.ndim > 1 or (flat.size != 1 and index >= flat.size) or int(flat[0 if flat.size == 1 else index]) != element:
        return None
    return shape_element(a, index, origins, depth)


def _common(origins: list) -> Hashable | None:
    """The broadcast of dims: their one origin once static 1s are left out (all 1s: 1); None when they differ
    or one is unknown."""
    rest = {o for o in origins if o != 1}
    if None in rest or len(rest) > 1:
        return None
    return rest.pop() if rest else 1


def _scalar_dim(scalar: ir.Value, origins: DimOrigins, depth: int) -> Hashable | None:
    """A 0-D value that is `Gather(Shape(y), k)` (k a constant scalar) as the origin of y's dim k."""
    node = scalar.producer()
    constant = constant_array(scalar)
    if constant is not None:
        return int(constant)
    if node is None:
        return None
    if node.op_type == "Cast":
        return _scalar_dim(node.inputs[0], origins, depth)
    if node.op_type != "Gather" or node.attributes.get_int("axis", 0) != 0:
        return None
    k = constant_array(node.inputs[1])
    if k is None or k.size != 1 or k.ndim != 0:
        return None
    return shape_element(node.inputs[0], int(k), origins, depth)


def _length(piece: ir.Value) -> int | None:
    """The static length of a 1-D shape piece."""
    if piece.shape is None or piece.shape.rank() != 1 or not isinstance(piece.shape[0], int):
        array = constant_array(piece)
        return None if array is None or array.ndim != 1 else array.size
    return piece.shape[0]


def _dim(value: ir.Value, axis: int):
    if value.shape is None or axis >= value.shape.rank():
        return None
    return value.shape[axis]


def _rank(value: ir.Value | None) -> int | None:
    return None if value is None or value.shape is None else value.shape.rank()


def _axes(node: ir.Node, rank: int) -> set[int] | None:
    """The constant axes of an Unsqueeze/Reduce* (attribute or input), non-negative against `rank`."""
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        array = constant_array(node.inputs[1])
        if array is None:
            return None
        axes = [int(a) for a in array.reshape(-1)]
    else:
        axes = list(node.attributes.get_ints("axes", []))
        if not axes:
            return None
    return {a % rank for a in axes}
