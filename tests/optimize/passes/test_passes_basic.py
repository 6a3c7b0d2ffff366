"""cleanup, fold_constants, fold_into_conv, simplify_shapes, fuse_gemm on tiny graphs: what must change,
what must not."""

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qprep.optimize.passes import cleanup
from qprep.optimize.passes import fold_constants
from qprep.optimize.passes import fold_into_conv
from qprep.optimize.passes import fuse_gemm
from qprep.optimize.passes import simplify_shapes
from graphs import apply_pass, make_graph, make_model, max_diff, ops, rand

X = ("x", [1, 3, 8, 8])


def test_cleanup_removes_no_ops_and_keeps_real_ops():
    nodes = [helper.make_node("Identity", ["x"], ["a"]),
             helper.make_node("Mul", ["a", "one"], ["b"]),
             helper.make_node("Add", ["b", "zero"], ["c"]),
             helper.make_node("Cast", ["c"], ["d"], to=onnx.TensorProto.FLOAT),
             helper.make_node("Dropout", ["d"], ["e"]),
             helper.make_node("Pad", ["e", "pads"], ["f"]),
             helper.make_node("Relu", ["f"], ["y"])]
    model = make_model(nodes, [X], [("y", [1, 3, 8, 8])],
                       {"one": np.float32(1), "zero": np.float32(0), "pads": np.zeros(8, np.int64)})
    out, outcome = apply_pass(cleanup.PASS, model)
    assert ops(out) == {"Relu": 1}
    assert outcome.matches > 0
    assert max_diff(model, out, {"x": rand(1, 3, 8, 8)}) == 0.0


def test_cleanup_keeps_mul_by_two_and_a_real_pad():
    nodes = [helper.make_node("Mul", ["x", "two"], ["a"]), helper.make_node("Pad", ["a", "pads"], ["y"])]
    pads = np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64)
    model = make_model(nodes, [X], [("y", [1, 3, 10, 10])], {"two": np.float32(2), "pads": pads})
    out, outcome = apply_pass(cleanup.PASS, model)
    assert ops(out) == {"Mul": 1, "Pad": 1} and outcome.matches == 0


def test_cleanup_merges_duplicate_initializers():
    """w1 and w2 hold the same numbers, other does not: both Adds read the one kept copy, other is left alone,
    and the outputs do not move."""
    w, other = rand(3), rand(3, seed=1)
    nodes = [helper.make_node("Add", ["x", "w1"], ["a"]), helper.make_node("Add", ["a", "w2"], ["b"]),
             helper.make_node("Add", ["b", "other"], ["y"])]
    model = make_model(nodes, [("x", [3])], [("y", [3])], {"w1": w, "w2": w.copy(), "other": other})
    out, outcome = apply_pass(cleanup.PASS, model)
    inits = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}
    assert len(inits) == 2 and "other" in inits and outcome.matches > 0
    kept = next(name for name in inits if name != "other")
    assert kept in ("w1", "w2")
    np.testing.assert_array_equal(inits[kept], w)
    np.testing.assert_array_equal(inits["other"], other)
    assert [(n.op_type, list(n.input), list(n.output)) for n in out.graph.node] == [
        ("Add", ["x", kept], ["a"]), ("Add", ["a", kept], ["b"]), ("Add", ["b", "other"], ["y"])]
    assert max_diff(model, out, {"x": rand(3, seed=2)}) == 0.0


def test_fold_constants_folds_weight_arithmetic_but_never_dequantize():
    w = rand(3, 3)
    nodes = [helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),
             helper.make_node("MatMul", ["x", "wt"], ["m"]),
             helper.make_node("DequantizeLinear", ["q", "scale"], ["dq"]),
             helper.make_node("Add", ["m", "dq"], ["y"])]
    model = make_model(nodes, [("x", [2, 3])], [("y", [2, 3])],
                       {"w": w, "q": np.array([1, 2, 3], np.int8), "scale": np.float32(0.5)})
    out, _ = apply_pass(fold_constants.PASS, model)
    assert ops(out) == {"MatMul": 1, "DequantizeLinear": 1, "Add": 1}
    assert max_diff(model, out, {"x": rand(2, 3)}) == 0.0


def test_fold_constants_respects_the_size_cap():
    from qprep.optimize.passes import PassSettings

    nodes = [helper.make_node("ConstantOfShape", ["shape"], ["big"], value=helper.make_tensor("v", 1, [1], [1.0])),
             helper.make_node("Add", ["x", "big"], ["y"])]
    model = make_model(nodes, [("x", [64, 64])], [("y", [64, 64])], {"shape": np.array([64, 64], np.int64)})
    out, _ = apply_pass(fold_constants.PASS, model, PassSettings(fold_max_elements=100))
    assert ops(out)["ConstantOfShape"] == 1
    out, _ = apply_pass(fold_constants.PASS, model, PassSettings(fold_max_elements=10_000))
    assert "ConstantOfShape" not in ops(out)


def conv_bn(extra_consumer=False):
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", "g", "b", "m", "v"], ["y"], epsilon=1e-3)]
    outputs = [("y", [1, 4, 8, 8])]
    if extra_consumer:
        nodes.append(helper.make_node("Relu", ["c"], ["z"]))
        outputs.append(("z", [1, 4, 8, 8]))
    inits = {"w": rand(4, 3, 3, 3), "g": rand(4, seed=1), "b": rand(4, seed=2), "m": rand(4, seed=3),
             "v": np.abs(rand(4, seed=4)) + 0.1}
    return make_model(nodes, [X], outputs, inits)


def test_batchnorm_folds_into_conv_with_its_epsilon():
    model = conv_bn()
    out, outcome = apply_pass(fold_into_conv.PASS, model)
    assert ops(out) == {"Conv": 1} and outcome.matches == 1
    assert max_diff(model, out, {"x": rand(1, 3, 8, 8)}) < 1e-5


def test_batchnorm_not_folded_when_conv_output_has_another_consumer():
    out, outcome = apply_pass(fold_into_conv.PASS, conv_bn(extra_consumer=True))
    assert ops(out)["BatchNormalization"] == 1 and outcome.matches == 0


def test_batchnorms_fold_into_convs_that_share_a_deduplicated_zero_bias():
    """Two Conv→BN branches whose all-zero biases cleanup merged into one initializer: both BNs still fold."""
    nodes = [helper.make_node("Conv", ["x", "w1", "zeros"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c1", "g", "b", "m", "v"], ["y1"]),
             helper.make_node("Conv", ["x", "w2", "zeros"], ["c2"], pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c2", "g", "b", "m", "v"], ["y2"])]
    inits = {"w1": rand(4, 3, 3, 3), "w2": rand(4, 3, 3, 3, seed=5), "zeros": np.zeros(4, np.float32),
             "g": rand(4, seed=1), "b": rand(4, seed=2), "m": rand(4, seed=3), "v": np.abs(rand(4, seed=4)) + 0.1}
    model = make_model(nodes, [X], [("y1", [1, 4, 8, 8]), ("y2", [1, 4, 8, 8])], inits)
    out, outcome = apply_pass(fold_into_conv.PASS, model)
    assert ops(out) == {"Conv": 2} and outcome.matches == 2 and outcome.details["weights_copied"] == 1
    assert max_diff(model, out, {"x": rand(1, 3, 8, 8)}) < 1e-5


def test_constant_bias_add_folds_into_conv_only_when_per_channel():
    def model(addend):
        nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"]), helper.make_node("Add", ["c", "a"], ["y"])]
        return make_model(nodes, [X], [("y", [1, 4, 6, 6])],
                          {"w": rand(4, 3, 3, 3), "b": rand(4, seed=1), "a": addend})
    per_channel = model(rand(1, 4, 1, 1, seed=2))
    out, outcome = apply_pass(fold_into_conv.PASS, per_channel)
    assert ops(out) == {"Conv": 1} and outcome.matches == 1
    assert max_diff(per_channel, out, {"x": rand(1, 3, 8, 8)}) < 1e-5
    per_pixel = model(rand(1, 4, 6, 6, seed=2))
    out, outcome = apply_pass(fold_into_conv.PASS, per_pixel)
    assert ops(out) == {"Conv": 1, "Add": 1} and outcome.matches == 0


def test_transposes_compose_and_shape_chains_become_constant():
    nodes = [helper.make_node("Transpose", ["x"], ["t1"], perm=[0, 2, 3, 1]),
             helper.make_node("Transpose", ["t1"], ["t2"], perm=[0, 3, 1, 2]),
             helper.make_node("Shape", ["t2"], ["s"]),
             helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
             helper.make_node("Unsqueeze", ["n", "axes"], ["n1"]),
             helper.make_node("Concat", ["n1", "minus1"], ["shape"], axis=0),
             helper.make_node("Reshape", ["t2", "shape"], ["y"])]
    model = make_model(nodes, [("x", ["N", 3, 8, 8])], [("y", ["N", 192])],
                       {"zero": np.array(0, np.int64), "axes": np.array([0], np.int64),
                        "minus1": np.array([-1], np.int64)})
    out, outcome = apply_pass(simplify_shapes.PASS, model)
    assert ops(out) == {"Reshape": 1}
    assert out.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "N"  # still dynamic
    feeds = {"x": rand(2, 3, 8, 8)}
    assert max_diff(model, out, feeds) == 0.0


def test_computed_reshape_shape_becomes_constant_on_opset_13():
    """Reshape's allowzero exists from opset 14: the constant shape must not carry it on older models."""
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Slice", ["s", "zero", "one"], ["n"]),
             helper.make_node("Concat", ["n", "minus1"], ["shape"], axis=0),
             helper.make_node("Reshape", ["x", "shape"], ["y"])]
    model = make_model(nodes, [("x", ["N", 3, 8, 8])], [("y", ["N", 192])],
                       {"zero": np.array([0], np.int64), "one": np.array([1], np.int64),
                        "minus1": np.array([-1], np.int64)}, opset=13)
    out, outcome = apply_pass(simplify_shapes.PASS, model)
    onnx.checker.check_model(out)
    assert ops(out) == {"Reshape": 1} and outcome.matches >= 1
    reshape = next(n for n in out.graph.node if n.op_type == "Reshape")
    assert [a.name for a in reshape.attribute] == []
    assert max_diff(model, out, {"x": rand(2, 3, 8, 8)}) == 0.0


def test_a_graph_outputs_declared_shape_is_no_proof_for_a_constant_reshape_shape():
    """The model declares y as [1, seq] but computes [N, 3, 4]: a constant [1, -1] would flatten the output
    (ddddocr's OCR model); and inside the graph, a known shape of another length than the computed one."""
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Slice", ["s", "zero", "one"], ["n"]),
             helper.make_node("Max", ["n", "one"], ["m"]),  # N, though no rule can prove it
             helper.make_node("Concat", ["m", "three", "four"], ["shape"], axis=0),
             helper.make_node("Reshape", ["x", "shape"], ["y"])]
    model = make_model(nodes, [("x", ["N", 12])], [("y", [1, "seq"])],
                       {"zero": np.array([0], np.int64), "one": np.array([1], np.int64),
                        "three": np.array([3], np.int64), "four": np.array([4], np.int64)})
    out, _ = apply_pass(simplify_shapes.PASS, model)
    assert max_diff(model, out, {"x": rand(2, 12)}) == 0.0  # max_diff refuses outputs of another shape


def test_matmul_add_becomes_gemm_only_for_2d():
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["y"])]
    flat = make_model(nodes, [("x", [2, 3])], [("y", [2, 4])], {"w": rand(3, 4), "b": rand(4, seed=1)})
    out, _ = apply_pass(fuse_gemm.PASS, flat)
    assert ops(out) == {"Gemm": 1}
    assert max_diff(flat, out, {"x": rand(2, 3)}) < 1e-6
    batched = make_model(nodes, [("x", [5, 2, 3])], [("y", [5, 2, 4])], {"w": rand(3, 4), "b": rand(4, seed=1)})
    out, _ = apply_pass(fuse_gemm.PASS, batched)
    assert ops(out) == {"MatMul": 1, "Add": 1}


def _matmul_add(bias, bias_is_input=False):
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["y"])]
    inputs = [("x", [2, 3])] + ([("b", list(bias.shape))] if bias_is_input else [])
    return make_model(nodes, inputs, [("y", [2, 4])], {"w": rand(3, 4), **({} if bias_is_input else {"b": bias})})


def test_a_bias_broadcast_per_column_becomes_a_1d_gemm_bias_that_ort_quantizes_per_channel(tmp_path):
    """jax2tf/tf2onnx write the bias as [1, N]: fused as is, ORT's per-channel quantizer failed ("The truth
    value of an array with more than one element is ambiguous"); the Gemm gets it as [N]."""
    from qprep.quantize.ort.quantizer import OrtQuantizer
    from conftest import typed

    options = typed("ort")
    samples = [{"x": rand(2, 3, seed=s)} for s in range(4)]
    for bias in (rand(1, 4, seed=1), np.float32(0.5).reshape(()), rand(1, seed=2)):
        model = _matmul_add(bias)
        out, outcome = apply_pass(fuse_gemm.PASS, model)
        assert ops(out) == {"Gemm": 1} and outcome.matches == 1
        gemm_bias = next(t for t in out.graph.initializer if t.name == out.graph.node[0].input[2])
        assert list(gemm_bias.dims) == [4]
        assert max_diff(model, out, {"x": rand(2, 3)}) < 1e-6
        assert OrtQuantizer(out, samples, options, tmp_path).build(set()).graph.node


def test_an_add_that_is_not_one_bias_per_column_stays_an_add():
    for model in (_matmul_add(rand(2, 4, seed=1)), _matmul_add(rand(2, 1, seed=1)),
                  _matmul_add(rand(4, seed=1), bias_is_input=True)):
        out, outcome = apply_pass(fuse_gemm.PASS, model)
        assert ops(out) == {"MatMul": 1, "Add": 1} and outcome.matches == 0


def test_cleanup_keeps_a_tiny_epsilon_and_a_near_one_scale():
    """onnxscript's add_0/mul_by_1 accept |c| <= 1e-8 and 1 ± 1e-5; LayerNorm's 1e-12 epsilon must survive."""
    nodes = [helper.make_node("Add", ["x", "eps"], ["a"]), helper.make_node("Mul", ["a", "nearly_one"], ["y"])]
    model = make_model(nodes, [("x", [3])], [("y", [3])],
                       {"eps": np.float32(1e-12), "nearly_one": np.float32(1.000005)})
    out, outcome = apply_pass(cleanup.PASS, model)
    assert ops(out) == {"Add": 1, "Mul": 1} and outcome.matches == 0


def test_cleanup_keeps_an_add_that_broadcasts_to_a_bigger_shape():
    nodes = [helper.make_node("Add", ["x", "zeros"], ["y"])]
    model = make_model(nodes, [("x", [3])], [("y", [2, 3])], {"zeros": np.zeros((2, 3), np.float32)})
    out, _ = apply_pass(cleanup.PASS, model)
    assert ops(out) == {"Add": 1}


def _if_reading_outer_value(then_nodes):
    """x → a = Relu(x); If(sum(x) > 0): then_nodes (reading `a`, returning `t`) else Neg(a); y = If + a."""
    then = make_graph(then_nodes, [], [("t", [1, 3, 8, 8])], name="then")
    other = make_graph([helper.make_node("Neg", ["a"], ["e"])], [], [("e", [1, 3, 8, 8])], name="else")
    nodes = [helper.make_node("Relu", ["x"], ["a"]),
             helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
             helper.make_node("Greater", ["s", "zero"], ["c"]),
             helper.make_node("If", ["c"], ["i"], then_branch=then, else_branch=other),
             helper.make_node("Add", ["i", "a"], ["y"])]
    return make_model(nodes, [X], [("y", [1, 3, 8, 8])], {"zero": np.float32(0)})


def test_cleanup_keeps_an_if_branch_that_returns_an_outer_value_through_identity():
    """then-branch: Identity(a) with `a` from the main graph; renaming `a` would break the main graph."""
    model = _if_reading_outer_value([helper.make_node("Identity", ["a"], ["t"])])
    out, _ = apply_pass(cleanup.PASS, model)
    onnx.checker.check_model(out)
    for sign in (1, -1):
        assert max_diff(model, out, {"x": sign * np.abs(rand(1, 3, 8, 8))}) == 0.0


def test_simplify_shapes_keeps_an_if_branch_that_returns_an_outer_value():
    """then-branch: Transpose(Transpose(a)) with `a` from the main graph composes to nothing; the branch must
    still return `a` under its own output name (silero VAD: 'Graph output ... is not an output of any node')."""
    model = _if_reading_outer_value([helper.make_node("Transpose", ["a"], ["ta"], perm=[0, 2, 1, 3]),
                                     helper.make_node("Transpose", ["ta"], ["t"], perm=[0, 2, 1, 3])])
    out, outcome = apply_pass(simplify_shapes.PASS, model)
    assert outcome.matches > 0
    branch = next(n for n in out.graph.node if n.op_type == "If")
    assert [n.op_type for n in helper.get_node_attr_value(branch, "then_branch").node] == ["Identity"]
    onnx.checker.check_model(out)
    for sign in (1, -1):
        assert max_diff(model, out, {"x": sign * np.abs(rand(1, 3, 8, 8))}) == 0.0


def _slice_model(starts, ends, axes=None, steps=None, x_shape=("N", 4, 6)):
    """Slice of x whose parameters are Constant nodes (as torch.onnx writes them), then Relu."""
    params = {"starts": starts, "ends": ends, "axes": axes, "steps": steps}
    names = [n for n, v in params.items() if v is not None]
    nodes = [helper.make_node("Constant", [], [n], value=numpy_helper.from_array(np.array(params[n], np.int64)))
             for n in names]
    nodes += [helper.make_node("Slice", ["x", *names], ["s"]), helper.make_node("Relu", ["s"], ["y"])]
    return make_model(nodes, [("x", list(x_shape))], [("y", None)])


INT64_MAX = np.iinfo(np.int64).max


def test_cleanup_removes_a_slice_that_keeps_everything():
    for model in (_slice_model([0], [INT64_MAX], [0], [1]),  # x[:] on a dynamic dim
                  _slice_model([0, 0], [INT64_MAX, 6], [0, -1]),  # up to the static length, negative axis
                  _slice_model([0, 0, 0], [INT64_MAX, 9, 100])):  # no axes: the leading ones
        out, outcome = apply_pass(cleanup.PASS, model)
        assert ops(out) == {"Relu": 1} and outcome.matches > 0
        assert max_diff(model, out, {"x": rand(2, 4, 6)}) == 0.0


def test_cleanup_keeps_a_slice_that_cuts_reverses_or_may_cut():
    for model in (_slice_model([0], [3], [1]),  # cuts a static dim
                  _slice_model([1], [INT64_MAX], [1]),  # drops the first element
                  _slice_model([0], [INT64_MAX], [1], [2]),  # every other element
                  _slice_model([0], [100], [0])):  # a dynamic dim that may be longer than 100
        out, _ = apply_pass(cleanup.PASS, model)
        assert ops(out)["Slice"] == 1


def _focus_model(inner_axes=(2,), outer_axes=(3,)):
    """YOLO's Focus: x[..., ::2, ::2] and x[..., 1::2, ::2] — one inner Slice feeding two outer ones."""
    inits = {"zero": np.array([0], np.int64), "one": np.array([1], np.int64), "two": np.array([2], np.int64),
             "end": np.array([INT64_MAX], np.int64), "inner_axes": np.array(inner_axes, np.int64),
             "outer_axes": np.array(outer_axes, np.int64)}
    nodes = [helper.make_node("Slice", ["x", "zero", "end", "inner_axes", "two"], ["rows"]),
             helper.make_node("Slice", ["rows", "zero", "end", "outer_axes", "two"], ["a"]),
             helper.make_node("Slice", ["rows", "one", "end", "outer_axes", "two"], ["b"]),
             helper.make_node("Concat", ["a", "b"], ["y"], axis=1)]
    return make_model(nodes, [X], [("y", None)], inits)


def test_slices_of_a_slice_on_other_axes_become_one_slice_each():
    for model in (_focus_model(), _focus_model(inner_axes=(-2,), outer_axes=(-1,))):
        out, outcome = apply_pass(simplify_shapes.PASS, model)
        assert ops(out)["Slice"] == 2 and outcome.matches == 2
        assert max_diff(model, out, {"x": rand(1, 3, 8, 8)}) == 0.0


def test_slices_of_a_slice_on_the_same_axis_stay():
    out, _ = apply_pass(simplify_shapes.PASS, _focus_model(inner_axes=(3,), outer_axes=(-1,)))
    assert ops(out)["Slice"] == 3


def _conv_with(nodes_before, nodes_after, inits, conv_attrs=None, out_shape=(1, 4, 6, 6)):
    nodes = [*nodes_before, helper.make_node("Conv", ["ci", "w", "b"], ["c"], **(conv_attrs or {})), *nodes_after]
    base = {"w": rand(4, 3, 3, 3), "b": rand(4, seed=1)}
    return make_model(nodes, [X], [("y", list(out_shape))], {**base, **inits}, opset=13)


def _deconv_add(constant, group=1, bias=False):
    """ConvTranspose (weights [4, 6/group... ] → 6 output channels for group 1) without/with bias, + constant."""
    inputs = ["x4", "w"] + (["b"] if bias else [])
    nodes = [helper.make_node("ConvTranspose", inputs, ["d"], strides=[2, 2], group=group),
             helper.make_node("Add", ["d", "c"], ["y"])]
    inits = {"w": rand(4, 6 // group, 2, 2), "c": constant, **({"b": rand(6, seed=2)} if bias else {})}
    return make_model(nodes, [("x4", [1, 4, 5, 5])], [("y", None)], inits)


def test_a_per_channel_add_folds_into_a_convtranspose_bias():
    for model in (_deconv_add(rand(1, 6, 1, 1, seed=3)), _deconv_add(rand(6, 1, 1, seed=3), bias=True),
                  _deconv_add(rand(1, 6, 1, 1, seed=3), group=2), _deconv_add(np.float32(0.5))):
        out, outcome = apply_pass(fold_into_conv.PASS, model)
        assert ops(out) == {"ConvTranspose": 1} and outcome.matches == 1
        assert max_diff(model, out, {"x4": rand(1, 4, 5, 5)}) < 1e-6


def test_an_add_that_varies_inside_a_channel_stays_after_a_convtranspose():
    out, _ = apply_pass(fold_into_conv.PASS, _deconv_add(rand(1, 6, 10, 10, seed=3)))
    assert ops(out) == {"ConvTranspose": 1, "Add": 1}


def test_per_channel_mul_after_conv_folds_into_weights_and_bias():
    model = _conv_with([helper.make_node("Identity", ["x"], ["ci"])],
                       [helper.make_node("Mul", ["s", "c"], ["y"])], {"s": rand(1, 4, 1, 1, seed=3)})
    out, outcome = apply_pass(fold_into_conv.PASS, model)
    assert ops(out)["Mul"] == 0 and outcome.matches == 1
    assert max_diff(model, out, {"x": rand(1, 3, 8, 8)}) < 1e-5
    per_pixel = _conv_with([helper.make_node("Identity", ["x"], ["ci"])],
                           [helper.make_node("Mul", ["c", "s"], ["y"])], {"s": rand(1, 1, 6, 6, seed=3)})
    assert apply_pass(fold_into_conv.PASS, per_pixel)[1].matches == 0


def test_hardsigmoid_after_conv_becomes_a_clip_with_alpha_and_beta_in_the_conv():
    gate = helper.make_node("HardSigmoid", ["c"], ["y"], alpha=1 / 6, beta=0.5)
    model = _conv_with([helper.make_node("Identity", ["x"], ["ci"])], [gate], {})
    out, outcome = apply_pass(fold_into_conv.PASS, model)
    assert ops(out)["HardSigmoid"] == 0 and ops(out)["Clip"] == 1 and outcome.matches == 1
    assert out.graph.initializer[0].data_type == onnx.TensorProto.FLOAT  # float64 arithmetic cast back
    feeds = {"x": 3 * rand(1, 3, 8, 8)}
    assert max_diff(model, out, feeds) < 1e-5
    old = make_model(list(model.graph.node), [X], [("y", [1, 4, 6, 6])],
                     {"w": rand(4, 3, 3, 3), "b": rand(4, seed=1)}, opset=10)
    assert apply_pass(fold_into_conv.PASS, old)[1].matches == 0  # Clip has no bound inputs before opset 11


def test_scalar_affine_on_a_conv_input_folds_but_a_shift_only_without_padding():
    before = [helper.make_node("Mul", ["x", "a"], ["m"]), helper.make_node("Add", ["m", "s"], ["ci"])]
    inits = {"a": np.array([1.7], np.float32), "s": np.array([-0.4], np.float32)}
    unpadded = _conv_with(before, [helper.make_node("Relu", ["c"], ["y"])], inits, {"group": 1})
    out, outcome = apply_pass(fold_into_conv.PASS, unpadded)
    out, second = apply_pass(fold_into_conv.PASS, out)  # the Add folds first, then the Mul it exposed
    assert ops(out) == {"Conv": 1, "Relu": 1} and outcome.matches + second.matches == 2
    assert max_diff(unpadded, out, {"x": rand(1, 3, 8, 8)}) < 1e-5
    shift_then_scale = [helper.make_node("Add", ["x", "s"], ["m"]), helper.make_node("Mul", ["m", "a"], ["ci"])]
    padded = _conv_with(shift_then_scale, [helper.make_node("Relu", ["c"], ["y"])], inits, {"pads": [1, 1, 1, 1]},
                        out_shape=(1, 4, 8, 8))
    out, _ = apply_pass(fold_into_conv.PASS, padded)
    out, _ = apply_pass(fold_into_conv.PASS, out)
    assert ops(out)["Add"] == 1 and ops(out)["Mul"] == 0  # the scale folds, the shift cannot
    assert max_diff(padded, out, {"x": rand(1, 3, 8, 8)}) < 1e-5


def test_two_scales_fold_into_one_conv_under_distinct_names():
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv"),
             helper.make_node("Mul", ["c", "s1"], ["m"]), helper.make_node("Mul", ["m", "s2"], ["y"])]
    model = make_model(nodes, [X], [("y", [1, 4, 6, 6])], {"w": rand(4, 3, 3, 3), "b": rand(4, seed=1),
                                                          "s1": rand(1, 4, 1, 1, seed=2), "s2": np.float32(0.5)})
    out, first = apply_pass(fold_into_conv.PASS, model)
    out, second = apply_pass(fold_into_conv.PASS, out)
    assert ops(out) == {"Conv": 1} and first.matches + second.matches == 2
    assert len({i.name for i in out.graph.initializer}) == len(out.graph.initializer)
    assert max_diff(model, out, {"x": rand(1, 3, 8, 8)}) < 1e-5
