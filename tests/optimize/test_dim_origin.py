"""Dim origins and the shape rewrites built on them: dynamic-export shape subgraphs become constants only where
the dims are provably equal, and the numbers stay exact at several batch sizes and sequence lengths."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
from onnx import helper

from graphs import apply_pass, make_model, max_diff, ops, rand
from qprep.optimize.dim_origin import DimOrigins
from qprep.optimize.ir_utils import infer_shapes
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
