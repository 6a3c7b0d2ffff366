"""Dim origins and the shape rewrites built on them: dynamic-export shape subgraphs become constants only where
the dims are provably equal, and the numbers stay exact at several batch sizes and sequence lengths."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
from onnx import helper

from graphs import apply_pass, make_model, max_diff, ops, rand
from qprep.graph.dim_origin import DimOrigins
from qprep.graph.ir import infer_shapes
from qprep.optimize.passes import cleanup, simplify_shapes

I64 = {"zero": np.array(0, np.int64), "one": np.array(1, np.int64), "axes0": np.array([0], np.int64),
       "heads": np.array([4], np.int64), "width": np.array([8], np.int64), "w": rand(32, 32, seed=1)}


def _dim(source: str, index: str, out: str) -> list:
    """Unsqueeze(Gather(Shape(source), index)): how torch exports `source.size(k)` as a 1-element shape piece."""
    return [helper.make_node("Shape", [source], [f"{out}_shape"]),
            helper.make_node("Gather", [f"{out}_shape", index], [f"{out}_dim"], axis=0),
            helper.make_node("Unsqueeze", [f"{out}_dim", "axes0"], [out])]


def attention_heads(reshape_input: str = "q") -> onnx.ModelProto:
    """x[B, S, 32] → q = Relu(x @ w) → Reshape(q, [B, S, 4, 8]) with B, S read from x's shape (each piece
    computed twice, as the TorchScript exporter writes it)."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Relu", ["m"], ["q"]),
             *_dim("x", "zero", "b1"), *_dim("x", "one", "s1"), *_dim("x", "zero", "b2"), *_dim("x", "one", "s2"),
             helper.make_node("Concat", ["b1", "s1", "heads", "width"], ["shape1"], axis=0),
             helper.make_node("Concat", ["b2", "s2", "heads", "width"], ["shape2"], axis=0),
             helper.make_node("Reshape", [reshape_input, "shape1"], ["y1"]),
             helper.make_node("Reshape", ["q", "shape2"], ["y2"])]
    return make_model(nodes, [("x", ["B", "S", 32]), ("other", ["B", "T", 32])],
                      [("y1", None), ("y2", None)], I64, opset=14)


def test_duplicate_shape_subgraphs_are_merged_and_reshapes_get_constant_shapes():
    model = attention_heads()
    out, _ = apply_pass(cleanup.PASS, model)
    assert ops(out)["Shape"] == 1 and ops(out)["Concat"] == 1  # merged duplicates
    out, outcome = apply_pass(simplify_shapes.PASS, out)
    assert outcome.matches == 2
    assert set(ops(out)) == {"MatMul", "Relu", "Reshape"}
    for batch, seq in ((1, 3), (2, 11)):
        feeds = {"x": rand(batch, seq, 32), "other": rand(batch, seq + 1, 32)}
        assert max_diff(model, out, feeds) == 0.0


def test_a_dim_of_another_tensor_with_another_length_is_not_copied():
    """Reshape(other, [B, S, 4, 8]) with S read from x: `other`'s dim 1 is T, not S, so no 0 may replace S."""
    model = attention_heads(reshape_input="other")
    out, _ = apply_pass(simplify_shapes.PASS, model)
    assert ops(out)["Concat"] == 1  # the Reshape of `other` keeps its computed shape


def test_origins_follow_matmul_transpose_unsqueeze_and_broadcasting():
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]),
             helper.make_node("Transpose", ["m"], ["t"], perm=[1, 0, 2]),
             helper.make_node("Unsqueeze", ["t", "axes0"], ["u"]),
             helper.make_node("Add", ["x", "bias"], ["a"]),
             helper.make_node("Mul", ["x", "other"], ["p"])]
    proto = make_model(nodes, [("x", ["B", "S", 32]), ("other", ["B", "T", 32])],
                       [("u", None), ("a", None), ("p", None)], {**I64, "bias": rand(1, 1, 32)}, opset=14)
    model = ir.from_proto(proto)
    infer_shapes(model)
    values = {v.name: v for node in model.graph for v in node.outputs}
    origins = DimOrigins()
    assert origins.of(values["u"], 0) == 1  # the inserted axis
    assert origins.same(values["u"], 1, model.graph.inputs[0], 1)  # S through Transpose + Unsqueeze
    assert origins.same(values["u"], 2, model.graph.inputs[0], 0)  # B
    assert origins.same(values["a"], 1, values["m"], 1)  # a static-1 bias dim leaves S alone
    assert not origins.same(values["p"], 1, values["m"], 1)  # broadcast of S and T: unknown


def test_reshape_to_its_own_shape_with_one_minus_one_is_removed_and_a_rank_change_is_kept():
    nodes = [*_dim("x", "zero", "b"), *_dim("x", "two", "d"),
             helper.make_node("Concat", ["b", "minus1", "d"], ["same"], axis=0),
             helper.make_node("Reshape", ["x", "same"], ["y1"]),
             helper.make_node("Concat", ["b", "minus1"], ["flat"], axis=0),
             helper.make_node("Reshape", ["x", "flat"], ["y2"])]
    model = make_model(nodes, [("x", ["B", "S", 32]), ("other", ["B", "T", 32])], [("y1", None), ("y2", None)],
                       {**I64, "two": np.array(2, np.int64), "minus1": np.array([-1], np.int64)}, opset=14)
    out, _ = apply_pass(simplify_shapes.PASS, model)
    out, _ = apply_pass(cleanup.PASS, out)
    assert ops(out)["Reshape"] == 1  # y1 is x itself now; y2 flattens, with a constant [0, -1]
    for batch, seq in ((1, 3), (2, 11)):
        assert max_diff(model, out, {"x": rand(batch, seq, 32), "other": rand(batch, 1, 32)}) == 0.0


def test_torch_expand_minus_one_idiom_keeps_the_expanded_dims_provable():
    """Expand(m, Where(Equal(s, -1), 1, s)) with s = [Shape(x)[0], -1, 32]: -1 keeps m's dim, the others are
    x's dims, so the result's dims are x's."""
    nodes = [helper.make_node("ReduceSum", ["x", "axes_last"], ["m"], keepdims=1),
             *_dim("x", "zero", "b"),
             helper.make_node("Concat", ["b", "minus1", "width32"], ["s"], axis=0),
             helper.make_node("Equal", ["s", "minus1s"], ["is_minus1"]),
             helper.make_node("Where", ["is_minus1", "ones", "s"], ["target"]),
             helper.make_node("Expand", ["m", "target"], ["e"])]
    proto = make_model(nodes, [("x", ["B", "S", 32]), ("other", ["B", "T", 32])], [("e", None)],
                       {**I64, "axes_last": np.array([-1], np.int64), "minus1": np.array([-1], np.int64),
                        "width32": np.array([32], np.int64), "minus1s": np.full(3, -1, np.int64),
                        "ones": np.ones(3, np.int64)}, opset=14)
    model = ir.from_proto(proto)
    infer_shapes(model)
    expanded = next(node for node in model.graph if node.op_type == "Expand").outputs[0]
    origins = DimOrigins()
    assert all(origins.same(expanded, axis, model.graph.inputs[0], axis) for axis in range(3))


def test_shapes_are_inferred_through_a_fused_contrib_gelu():
    nodes = [helper.make_node("Gelu", ["x"], ["g"], domain="com.microsoft"),
             helper.make_node("MatMul", ["g", "w"], ["y"])]
    proto = make_model(nodes, [("x", ["B", "S", 32]), ("other", ["B", "T", 32])], [("y", None)], I64, opset=14,
                       infer_shapes=False)
    proto.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    model = ir.from_proto(proto)
    assert infer_shapes(model)
    gelu, matmul = list(model.graph)
    assert (gelu.domain, gelu.op_type) == ("com.microsoft", "Gelu")  # restored after inference
    assert matmul.outputs[0].shape.rank() == 3
    assert DimOrigins().same(matmul.outputs[0], 1, model.graph.inputs[0], 1)


def test_transpose_moving_only_unit_dims_merges_into_the_reshape_before_it():
    nodes = [helper.make_node("Reshape", ["x", "to3d"], ["r"]),
             helper.make_node("Transpose", ["r"], ["t"], perm=[0, 2, 1]),   # [12, 8, 1] → [12, 1, 8]
             helper.make_node("Transpose", ["r"], ["u"], perm=[1, 0, 2])]   # [8, 12, 1]: reorders 12 and 8
    model = make_model(nodes, [("x", [12, 8])], [("t", None), ("u", None)],
                       {"to3d": np.array([12, 8, 1], np.int64)}, opset=14)
    out, _ = apply_pass(simplify_shapes.PASS, model)
    assert ops(out) == {"Reshape": 2, "Transpose": 1}  # t is one Reshape of x; u keeps its Transpose
    assert max_diff(model, out, {"x": rand(12, 8)}) == 0.0


def test_softmax_over_flattened_rows_becomes_one_softmax_on_the_last_axis():
    """What onnx's version converter writes for a Softmax raised from opset 11 to 13; Flatten(axis=1) of a
    rank-3 tensor normalizes over two axes and stays."""
    def model(flatten_axis):
        nodes = [helper.make_node("Flatten", ["x"], ["f"], axis=flatten_axis),
                 helper.make_node("Softmax", ["f"], ["s"], axis=1),
                 helper.make_node("Shape", ["x"], ["shape"]),
                 helper.make_node("Reshape", ["s", "shape"], ["y"])]
        return make_model(nodes, [("x", ["B", 3, 5])], [("y", None)], opset=13)

    original = model(flatten_axis=2)
    out, _ = apply_pass(simplify_shapes.PASS, original)
    assert ops(out) == {"Softmax": 1}
    assert helper.get_attribute_value(out.graph.node[0].attribute[0]) == 2
    for batch in (1, 4):
        assert max_diff(original, out, {"x": rand(batch, 3, 5)}) < 1e-6
    out, _ = apply_pass(simplify_shapes.PASS, model(flatten_axis=1))
    assert ops(out)["Flatten"] == 1
