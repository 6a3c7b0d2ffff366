"""fuse_layernorm's check, the graph reading: reduced axes, scalar constants, gamma/beta in the shape
LayerNormalization takes, the affine step a longer form would match, and the new node's name.

Every function answers from the graph alone (constants through `constant_array`: an initializer or a Constant
node, never a graph input) and says why not in a string the record keeps; the rule's `check` in
qprep/optimize/passes/layernorm.py decides with them.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from qprep.graph.ir import constant_array


def scalar(value: ir.Value | None, rank: int | None) -> float | None:
    """The constant's single element, if it is one and broadcasting it cannot raise the rank of the result."""
    array = constant_array(value)
    if array is None or array.size != 1 or array.ndim > (rank if rank is not None else 1):
        return None
    return float(array.reshape(()))


def reduced_axes(node: ir.Node, rank: int | None) -> tuple[int, ...] | str:
    """The axes a ReduceMean/ReduceSum reduces, as sorted negative indices; a string says why they are unusable.

    Axes are an attribute before opset 18 (ReduceSum: 13) and an input after; absent axes mean all axes.
    """
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        array = constant_array(node.inputs[1])
        if array is None:
            return f"{node.op_type} axes are not constant"
        axes = [int(a) for a in array.reshape(-1)]
    else:
        axes = list(node.attributes.get_ints("axes", []))
    if not axes:
        if node.attributes.get_int("noop_with_empty_axes", 0):
            return f"{node.op_type} with empty axes is a no-op"
        if rank is None:
            return f"{node.op_type} reduces all axes of an input of unknown rank"
        axes = list(range(rank))
    if rank is None:
        if any(a >= 0 for a in axes):
            return f"{node.op_type} axes {axes} are positive and the input rank is unknown"
    elif any(not -rank <= a < rank for a in axes):
        return f"{node.op_type} axes {axes} out of range for rank {rank}"
    else:
        axes = [a - rank if a >= 0 else a for a in axes]
    if len(set(axes)) != len(axes):
        return f"{node.op_type} repeats axes {axes}"
    return tuple(sorted(axes))


def static_dims(x: ir.Value, axes: list[int]) -> tuple[int, ...] | None:
    """x's dims along the normalized `axes` (non-negative; empty when x's rank is unknown) when all are known
    integers."""
    if not axes or x.shape is None:
        return None
    dims = tuple(x.shape.dims[a] for a in axes)
    return dims if all(isinstance(d, int) for d in dims) else None


def affine_param(role: str, value: ir.Value | None, default: float, x: ir.Value, k: int, rank: int | None,
                 norm_shape: tuple[int, ...] | None, perm: tuple[int, ...] | None = None
                 ) -> ir.Value | np.ndarray | str:
    """gamma/beta as LayerNormalization needs them: the value itself, a reshaped copy, or a filled array.

    Returns a string saying why not when the parameter is not a constant of x's dtype that varies only along
    the normalized axes (a per-position gamma [S, D] with axes [-1] is not a LayerNorm parameter).
    """
    if value is None:
        if norm_shape is None:
            return f"no {role}: building one needs static normalized dims"
        return np.full(norm_shape, default, dtype=x.dtype.numpy())
    array = constant_array(value)
    if array is None:
        return f"{role} is not a constant (graph input or computed)"
    if array.dtype != x.dtype.numpy():
        return f"{role} dtype {array.dtype} differs from the input's {x.dtype.numpy()}"
    if rank is not None and array.ndim > rank:
        return f"{role} rank {array.ndim} exceeds the input rank {rank}"
    given = array.shape
    if perm is not None:  # normalized axes not trailing (norm_shape known): the constant moves with x
        array = np.transpose(array.reshape((1,) * (len(perm) - array.ndim) + given), perm)
    lead, tail = array.shape[: max(0, array.ndim - k)], array.shape[max(0, array.ndim - k):]
    if any(d != 1 for d in lead):
        return f"{role} shape {given} varies outside the normalized axes"
    if norm_shape is None:
        if len(tail) != k or 1 in tail:
            return f"{role} shape {given} needs broadcasting but the normalized dims are unknown"
        return value if array.shape == tail else np.ascontiguousarray(array.reshape(tail))
    try:
        full = np.broadcast_to(array.reshape(tail), norm_shape)
    except ValueError:
        return f"{role} shape {given} does not broadcast to the normalized shape {norm_shape}"
    return value if perm is None and array.shape == norm_shape else np.ascontiguousarray(full)


def affine_follower(output: ir.Value, op_types: tuple[str, ...]) -> ir.Node | None:
    """The single consumer of `output` when it is a Mul/Add by a parameter (initializer, Constant, input)."""
    uses = output.uses()
    if not op_types or len(uses) != 1 or output.is_graph_output():
        return None
    consumer = uses[0].node
    if consumer.domain != "" or consumer.op_type not in op_types:
        return None
    others = [v for v in consumer.inputs if v is not output]
    is_parameter = [v is not None and (v.producer() is None or v.producer().op_type == "Constant") for v in others]
    return consumer if any(is_parameter) else None


def scope_name(nodes, anchor: ir.Node) -> str:
    """'<common scope of the matched nodes>/LayerNormalization', e.g. '/bert/embeddings/LayerNorm/…'.

    Exports without scopes (paddle2onnx: 'p2o.ReduceMean.0') anchor on the mean's node name instead.
    """
    scopes = [n.name.split("/")[:-1] for n in nodes if n.name and "/" in n.name]
    common: list[str] = []
    if scopes and len(scopes) == sum(1 for n in nodes if n.name):
        for parts in zip(*scopes):
            if len(set(parts)) != 1:
                break
            common.append(parts[0])
    base = "/".join(common) if any(common) else (anchor.name or "")
    return f"{base}/LayerNormalization" if base else "LayerNormalization"
