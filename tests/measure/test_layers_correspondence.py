"""Per-layer correspondence (qprep/measure/correspondence.py): each float tensor is compared with the result
tensor that computes it, decided by the graphs, or left out with the reason. The hand-built results below are
the forms ONNX Runtime's quantizer and qprep's exact Q/DQ rules leave: a Conv renamed to the Relu it absorbed, a
MaxPool moved onto the integers, a BatchNorm folded, a DequantizeLinear sunk past a new node."""

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from graphs import make_model, rand
from qprep.measure import correspondence
from qprep.measure.correspondence import correspond
from qprep.measure.layers import LayerComparison, matched_tensors
from qprep.report.layer_chart import band_counts, left_out_note

W1, B1 = rand(4, 3, 3, 3, seed=1), rand(4, seed=2)
W2, B2 = rand(4, 4, 3, 3, seed=3), rand(4, seed=4)
SCALE = np.float32(0.05)


def conv_relu_pool_float() -> "onnx.ModelProto":  # noqa: F821
    """x → conv1/Conv (c) → conv1/Relu (r) → pool (p) → conv2/Conv (y)."""
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c"], name="conv1/Conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"], name="conv1/Relu"),
             helper.make_node("MaxPool", ["r"], ["p"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Conv", ["p", "w2", "b2"], ["y"], name="conv2/Conv", pads=[1, 1, 1, 1])]
    return make_model(nodes, [("x", [1, 3, 8, 8])], [("y", [1, 4, 4, 4])],
                      {"w1": W1, "b1": B1, "w2": W2, "b2": B2})


def qdq(tensor: str, out: str, zero_point: int = 0, quantize_only: bool = False) -> list:
    """Q (and DQ) of `tensor` on a uint8 grid of SCALE with `zero_point`, named as ORT names them."""
    q = helper.make_node("QuantizeLinear", [tensor, "s", f"zp{zero_point}"], [f"{tensor}_QuantizeLinear_Output"],
                         name=f"{tensor}_QuantizeLinear")
    if quantize_only:
        return [q]
    return [q, helper.make_node("DequantizeLinear", [f"{tensor}_QuantizeLinear_Output", "s", f"zp{zero_point}"],
                                [out], name=f"{tensor}_DequantizeLinear")]


def constants(**extra):
    return {"w1": W1, "b1": B1, "w2": W2, "b2": B2, "s": SCALE, "zp0": np.uint8(0), "zp128": np.uint8(128),
            **extra}


def absorbed_relu_on_integers(zero_point: int = 0) -> "onnx.ModelProto":  # noqa: F821
    """What ORT's QDQ quantizer and qprep's data-movement rule leave of conv_relu_pool_float: the Relu removed,
    conv1/Conv writing "r" (its pre-Relu values), the MaxPool on the uint8 "r" (no DequantizeLinear of r)."""
    nodes = [*qdq("x", "x_DequantizeLinear_Output"),
             helper.make_node("Conv", ["x_DequantizeLinear_Output", "w1", "b1"], ["r"], name="conv1/Conv",
                              pads=[1, 1, 1, 1]),
             *qdq("r", "unused", zero_point, quantize_only=True),
             helper.make_node("MaxPool", ["r_QuantizeLinear_Output"], ["p_QuantizeLinear_Output"], name="pool",
                              kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("DequantizeLinear", ["p_QuantizeLinear_Output", "s", f"zp{zero_point}"],
                              ["p_DequantizeLinear_Output"], name="p_DequantizeLinear"),
             helper.make_node("Conv", ["p_DequantizeLinear_Output", "w2", "b2"], ["y"], name="conv2/Conv",
                              pads=[1, 1, 1, 1])]
    return make_model(nodes, [("x", [1, 3, 8, 8])], [("y", [1, 4, 4, 4])], constants())


def samples(count=4):
    return [{"x": np.abs(rand(1, 3, 8, 8, seed=10 + i))} for i in range(count)]


def test_a_conv_renamed_to_its_absorbed_relu_is_compared_with_the_pre_relu_tensor():
    found = correspond(conv_relu_pool_float(), absorbed_relu_on_integers())
    # "r" in the result holds conv1/Conv's values: it is c's twin, never r's (by name it was r's); r is the
    # integers its Q clamps at zero, read on their grid
    assert {f: r for f, r, *_ in found.pairs} == {"c": "r", "r": "r_QuantizeLinear_Output",
                                                  "p": "p_DequantizeLinear_Output"}
    assert not found.left_out and set(found.grids) == {"r_QuantizeLinear_Output"}
    scale, zero = found.grids["r_QuantizeLinear_Output"]
    assert scale == np.float64(SCALE) and zero == 0


def test_no_false_red_where_the_name_matched_a_pre_relu_tensor():
    """By name, r (post-Relu) was compared with the result's r (pre-Relu): cosine ≈ 0.7, a red bar on a result
    whose every value agrees to the grid."""
    comparison = LayerComparison(conv_relu_pool_float(), absorbed_relu_on_integers())
    rows = comparison.errors(samples())
    assert {r["tensor"] for r in rows} == {"c", "r", "p"}
    assert band_counts(rows)["red"] == 0 and min(r["cosine_mean"] for r in rows) > 0.999
    assert min(r["sqnr_db"] for r in rows) > 30  # integers read on their grid: the values, not the codes
    assert comparison.left_out_counts() == {} and left_out_note({}) == ""


def test_the_left_out_tensors_are_counted_by_reason():
    comparison = LayerComparison(conv_relu_pool_float(), absorbed_relu_on_integers(zero_point=128))
    comparison.errors(samples(1))
    counts = comparison.left_out_counts()
    assert counts == {correspondence.UNCLAMPED: 1, correspondence.AFTER: 1}
    assert left_out_note(counts) == f"; left out: 2 (1 {correspondence.UNCLAMPED}, 1 {correspondence.AFTER})"


def test_a_q_range_that_does_not_clamp_at_zero_proves_nothing_about_the_relu():
    """Zero point 128: the Q lets negative values through, so its output is not the Relu's (nor the Conv's)."""
    found = correspond(conv_relu_pool_float(), absorbed_relu_on_integers(zero_point=128))
    assert [p[0] for p in found.pairs] == ["c"]
    assert found.left_out["r"] == correspondence.UNCLAMPED
    assert found.left_out["p"] == correspondence.AFTER  # read from r's integers: nothing provable follows


def test_the_rounded_copy_of_an_absorbed_relu_is_its_twin():
    """ORT's own form: conv1/Conv writes r, Q/DQ of r, the MaxPool on the float DQ output."""
    model = absorbed_relu_on_integers()
    nodes = [n for n in model.graph.node if n.name != "pool" and n.op_type != "DequantizeLinear"
             or n.name == "x_DequantizeLinear"]
    nodes[3:3] = [helper.make_node("DequantizeLinear", ["r_QuantizeLinear_Output", "s", "zp0"],
                                   ["r_DequantizeLinear_Output"], name="r_DequantizeLinear"),
                  helper.make_node("MaxPool", ["r_DequantizeLinear_Output"], ["p"], name="pool",
                                   kernel_shape=[2, 2], strides=[2, 2])]
    nodes[-1] = helper.make_node("Conv", ["p", "w2", "b2"], ["y"], name="conv2/Conv", pads=[1, 1, 1, 1])
    result = make_model(nodes, [("x", [1, 3, 8, 8])], [("y", [1, 4, 4, 4])], constants())
    pairs = {f: r for f, r, *_ in matched_tensors(conv_relu_pool_float(), result)}
    assert pairs == {"c": "r", "r": "r_DequantizeLinear_Output", "p": "p"}
    rows = LayerComparison(conv_relu_pool_float(), result).errors(samples())
    assert min(r["cosine_mean"] for r in rows) > 0.999


def test_a_folded_batchnorm_output_is_the_conv_that_took_its_name():
    scale, bias, mean, var = (np.float32([1.5, 0.5, 2.0, 1.0]), np.float32([0.1, -0.2, 0.3, 0.0]),
                              np.float32([0.2, 0.1, -0.1, 0.0]), np.float32([1.0, 4.0, 0.25, 1.0]))
    float_model = make_model(
        [helper.make_node("Conv", ["x", "w1", "b1"], ["c"], name="conv", pads=[1, 1, 1, 1]),
         helper.make_node("BatchNormalization", ["c", "g", "beta", "mean", "var"], ["bn"], name="bn"),
         helper.make_node("Sigmoid", ["bn"], ["y"], name="act")],
        [("x", [1, 3, 8, 8])], [("y", [1, 4, 8, 8])],
        {"w1": W1, "b1": B1, "g": scale, "beta": bias, "mean": mean, "var": var})
    factor = scale / np.sqrt(var + 1e-5)
    folded = make_model(
        [helper.make_node("Conv", ["x", "wf", "bf"], ["bn"], name="conv", pads=[1, 1, 1, 1]),
         helper.make_node("Sigmoid", ["bn"], ["y"], name="act")],
        [("x", [1, 3, 8, 8])], [("y", [1, 4, 8, 8])],
        {"wf": W1 * factor[:, None, None, None], "bf": (B1 - mean) * factor + bias})
    assert matched_tensors(float_model, folded) == [("bn", "bn", "BatchNormalization", "bn")]
    assert correspond(float_model, folded).left_out == {"c": correspondence.FUSED}
    rows = LayerComparison(float_model, folded).errors(samples(2))
    assert rows[0]["cosine_mean"] > 0.99999


def test_a_node_the_result_added_with_the_same_op_and_inputs_is_the_float_nodes_twin():
    """sink_dq moves a DequantizeLinear past a Transpose: a new, differently named Transpose on the integers."""
    float_model = make_model(
        [helper.make_node("Relu", ["x"], ["r"], name="relu"),
         helper.make_node("Transpose", ["r"], ["t"], name="transpose", perm=[0, 2, 3, 1]),
         helper.make_node("Sigmoid", ["t"], ["y"], name="act")],
        [("x", [1, 3, 8, 8])], [("y", [1, 8, 8, 3])])
    result = make_model(
        [helper.make_node("Relu", ["x"], ["r"], name="relu"), *qdq("r", "unused", quantize_only=True),
         helper.make_node("Transpose", ["r_QuantizeLinear_Output"], ["t_int"], name="node_Transpose_7",
                          perm=[0, 2, 3, 1]),
         helper.make_node("DequantizeLinear", ["t_int", "s", "zp0"], ["t"], name="node_DequantizeLinear_8"),
         helper.make_node("Sigmoid", ["t"], ["y"], name="act")],
        [("x", [1, 3, 8, 8])], [("y", [1, 8, 8, 3])], constants())
    assert [p[:2] for p in matched_tensors(float_model, result)] == [("r", "r"), ("t", "t")]
    other_perm = make_model([*result.graph.node[:2], helper.make_node(
        "Transpose", ["r_QuantizeLinear_Output"], ["t_int"], name="node_Transpose_7", perm=[0, 3, 2, 1]),
        *result.graph.node[3:]], [("x", [1, 3, 8, 8])], [("y", [1, 8, 8, 3])], constants(), infer_shapes=False)
    assert correspond(float_model, other_perm).left_out["t"] == correspondence.REMOVED


def test_a_dynamic_quantizers_replacement_writes_the_float_output_it_replaces(tmp_path):
    """ORT's quantize_dynamic replaces a MatMul by DynamicQuantizeLinear → MatMulInteger → Cast → Mul writing the
    MatMul's output: the replacement reads only the MatMul's inputs, so its output is the MatMul's twin."""
    import onnx
    from onnxruntime.quantization import quantize_dynamic

    float_model = make_model(
        [helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
         helper.make_node("Tanh", ["m"], ["y"], name="act")],
        [("x", [2, 16])], [("y", [2, 8])], {"w": rand(16, 8, seed=5)})
    onnx.save(float_model, tmp_path / "f.onnx")
    quantize_dynamic(tmp_path / "f.onnx", tmp_path / "q.onnx")
    result = onnx.load(tmp_path / "q.onnx")
    assert "MatMulInteger" in {n.op_type for n in result.graph.node}
    assert [p[:2] for p in matched_tensors(float_model, result)] == [("m", "m")]


def test_a_reshape_the_result_made_of_a_reshape_and_an_order_keeping_transpose():
    """Reshape → Transpose (moving only a size-1 axis) collapsed into one Reshape on the integers."""
    float_model = make_model(
        [helper.make_node("Relu", ["x"], ["r"], name="relu"),
         helper.make_node("Reshape", ["r", "shape"], ["a"], name="reshape"),
         helper.make_node("Transpose", ["a"], ["t"], name="transpose", perm=[1, 0, 2]),
         helper.make_node("Sigmoid", ["t"], ["y"], name="act")],
        [("x", [1, 6, 4])], [("y", [6, 1, 4])], {"shape": np.array([1, 6, 4], np.int64)})
    result = make_model(
        [helper.make_node("Relu", ["x"], ["r"], name="relu"), *qdq("r", "unused", quantize_only=True),
         helper.make_node("Reshape", ["r_QuantizeLinear_Output", "merged"], ["t_int"], name="node_Reshape_3"),
         helper.make_node("DequantizeLinear", ["t_int", "s", "zp0"], ["t_dq"], name="t_DequantizeLinear"),
         helper.make_node("Sigmoid", ["t_dq"], ["y"], name="act")],
        [("x", [1, 6, 4])], [("y", [6, 1, 4])], {**constants(), "merged": np.array([6, 1, 4], np.int64)})
    assert [p[:2] for p in matched_tensors(float_model, result)] == [("r", "r"), ("t", "t_dq")]
    assert correspond(float_model, result).left_out == {"a": correspondence.REMOVED}


def test_a_clip_absorbed_by_a_range_inside_its_bounds_is_proven():
    float_model = make_model(
        [helper.make_node("Conv", ["x", "w1", "b1"], ["c"], name="conv", pads=[1, 1, 1, 1]),
         helper.make_node("Clip", ["c", "lo", "hi"], ["r"], name="relu6"),
         helper.make_node("Sigmoid", ["r"], ["y"], name="act")],
        [("x", [1, 3, 8, 8])], [("y", [1, 4, 8, 8])],
        {"w1": W1, "b1": B1, "lo": np.float32(0), "hi": np.float32(6)})

    def result(scale: float):
        return make_model(
            [helper.make_node("Conv", ["x", "w1", "b1"], ["r"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("QuantizeLinear", ["r", "s", "zp0"], ["rq"], name="rq"),
             helper.make_node("DequantizeLinear", ["rq", "s", "zp0"], ["rd"], name="rd"),
             helper.make_node("Sigmoid", ["rd"], ["y"], name="act")],
            [("x", [1, 3, 8, 8])], [("y", [1, 4, 8, 8])], {**constants(), "s": np.float32(scale)})

    assert [p[:2] for p in matched_tensors(float_model, result(6 / 255))] == [("c", "r"), ("r", "rd")]
    assert [p[:2] for p in matched_tensors(float_model, result(4 / 255))] == [("c", "r"), ("r", "rd")]
    # a grid reaching to 12 lets through what Clip cut at 6
    assert correspond(float_model, result(12 / 255)).left_out == {"r": correspondence.UNCLAMPED}


def test_integer_tensors_of_the_float_model_stay_out_of_the_view():
    """Shape computations are not layers: neither compared nor counted as left out."""
    float_model = make_model(
        [helper.make_node("Shape", ["x"], ["shape"], name="shape"),
         helper.make_node("Reshape", ["x", "shape"], ["r"], name="reshape"),
         helper.make_node("Sigmoid", ["r"], ["y"], name="act")],
        [("x", [1, 4], TensorProto.FLOAT)], [("y", [1, 4])])
    found = correspond(float_model, float_model)
    assert [p[:2] for p in found.pairs] == [("r", "r")] and not found.left_out


def test_qprep_ort_run_of_a_channels_last_relu_classifier_shows_no_false_red(tmp_path):
    """End to end through qprep's ORT backend: Conv → Relu → MaxPool layers between NHWC Transposes (tf2onnx's
    form). ORT absorbs each Relu into its Conv, qprep's exact rules move the MaxPools onto the integers, and by
    name every post-Relu tensor met its Conv's pre-Relu values (3 of 9 red, cosine 0.61–0.74, on an output at
    0.9999)."""
    import qprep

    nodes, weights, x, channels = [], {}, "x", 3
    for i, out in enumerate([8, 8, 8]):
        weights[f"w{i}"], weights[f"b{i}"] = rand(out, channels, 3, 3, seed=i) * 0.3, rand(out, seed=9 + i)
        nodes += [helper.make_node("Transpose", [x], [f"in{i}"], name=f"conv{i}/in", perm=[0, 3, 1, 2]),
                  helper.make_node("Conv", [f"in{i}", f"w{i}", f"b{i}"], [f"c{i}"], name=f"conv{i}/Conv",
                                   pads=[1, 1, 1, 1]),
                  helper.make_node("Relu", [f"c{i}"], [f"r{i}"], name=f"conv{i}/Relu"),
                  helper.make_node("MaxPool", [f"r{i}"], [f"p{i}"], name=f"pool{i}", kernel_shape=[2, 2],
                                   strides=[2, 2]),
                  helper.make_node("Transpose", [f"p{i}"], [f"nhwc{i}"], name=f"conv{i}/out", perm=[0, 2, 3, 1])]
        x, channels = f"nhwc{i}", out
    nodes += [helper.make_node("ReduceMean", [x], ["gap"], name="gap", axes=[1, 2], keepdims=0),
              helper.make_node("MatMul", ["gap", "fc"], ["logits"], name="fc"),
              helper.make_node("Softmax", ["logits"], ["probs"], name="softmax")]
    model = make_model(nodes, [("x", [1, 16, 16, 3])], [("probs", [1, 5])], {**weights, "fc": rand(8, 5, seed=7)})
    import onnx
    onnx.save(model, tmp_path / "m.onnx")
    (tmp_path / "samples").mkdir()
    for i in range(8):
        np.savez(tmp_path / "samples" / f"{i:02d}.npz", x=np.abs(rand(1, 16, 16, 3, seed=20 + i)))
    report = qprep.run({"model": str(tmp_path / "m.onnx"), "calibration": {"source": str(tmp_path / "samples")},
                        "evaluation": {"source": str(tmp_path / "samples"), "latency": {"runs": 0}},
                        "pipeline": [{"quantize": {"backend": "ort", "ort": {"weight_rounding": "nearest"}}}]},
                       output_dir=str(tmp_path / "out"))
    evaluation = report["evaluation"]
    assert evaluation["outputs"]["probs"]["cosine_mean"] > 0.999
    layers = evaluation["layers"]
    assert band_counts(layers)["red"] == 0, [(r["tensor"], r["cosine_mean"]) for r in layers]
    # each Conv against its own (pre-Relu) values, each Relu against the integers its Q clamps
    assert {"c0", "c1", "c2", "r0", "r1", "r2"} <= {r["tensor"] for r in layers}
    assert evaluation["layers_left_out"] == {}


def hardswish_tail(dq_scale: float):
    """Float: r = Relu(x); d = r / 6; y = Sigmoid(d). Result: Q(r) read by a DQ on a grid of `dq_scale` (qprep's
    scaled round trip removes the Div by 6 when that grid is the Q's divided by 6)."""
    float_model = make_model(
        [helper.make_node("Relu", ["x"], ["r"], name="relu"), helper.make_node("Div", ["r", "six"], ["d"], name="div"),
         helper.make_node("Sigmoid", ["d"], ["y"], name="act")],
        [("x", [1, 8])], [("y", [1, 8])], {"six": np.float32(6)})
    result = make_model(
        [helper.make_node("Relu", ["x"], ["r"], name="relu"), *qdq("r", "unused", quantize_only=True),
         helper.make_node("DequantizeLinear", ["r_QuantizeLinear_Output", "s6", "zp0"], ["d_dq"], name="d_dq"),
         helper.make_node("Sigmoid", ["d_dq"], ["y"], name="act")],
        [("x", [1, 8])], [("y", [1, 8])], {**constants(), "s6": np.float32(dq_scale)})
    return float_model, result


def test_integers_read_on_a_grid_scaled_by_one_sixth_are_the_removed_division_by_six():
    float_model, result = hardswish_tail(float(SCALE) / 6)
    assert [p[:2] for p in matched_tensors(float_model, result)] == [("r", "r"), ("d", "d_dq")]


def test_integers_read_on_another_grid_mean_nothing():
    """By the Q's meaning alone, d_dq would have been r at a twelfth of its scale."""
    float_model, result = hardswish_tail(float(SCALE) / 12)
    assert [p[:2] for p in matched_tensors(float_model, result)] == [("r", "r")]
    assert correspond(float_model, result).left_out == {"d": correspondence.REMOVED}


def smoothed(gamma_scale: np.ndarray):
    """Float: LayerNorm(x; gamma, beta) → MatMul(w). Result: gamma and beta divided by `gamma_scale` per channel
    and the MatMul's rows multiplied by it (qprep's smooth_layernorm): the MatMul's output is the same, the
    LayerNorm's is not."""
    gamma, beta, w = rand(8, seed=30) + 2, rand(8, seed=31), rand(8, 4, seed=32)
    nodes = [helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["ln"], name="ln", axis=-1),
             helper.make_node("MatMul", ["ln", "w"], ["mm"], name="mm"),
             helper.make_node("Tanh", ["mm"], ["y"], name="act")]
    io = ([("x", [2, 8])], [("y", [2, 4])])
    float_model = make_model(nodes, *io, {"gamma": gamma, "beta": beta, "w": w}, opset=17)
    result = make_model(nodes, *io, {"gamma": gamma / gamma_scale, "beta": beta / gamma_scale,
                                     "w": w * gamma_scale[:, None]}, opset=17)
    return float_model, result


def test_a_layernorm_whose_scale_was_moved_into_the_next_matmul_is_compared_times_that_scale():
    """By name the smoothed LayerNorm's output met the float one at another scale per channel (cosine 0.89 on
    MiniLM's embeddings, a false amber-to-red)."""
    factor = np.float32([1, 2, 4, 1, 1, 8, 1, 1])
    float_model, result = smoothed(factor)
    found = correspond(float_model, result)
    assert [p[:2] for p in found.pairs] == [("ln", "ln"), ("mm", "mm")] and not found.left_out
    assert np.allclose(found.factors["ln"], factor) and "mm" not in found.factors
    rows = LayerComparison(float_model, result).errors([{"x": rand(2, 8, seed=i)} for i in range(3)])
    assert min(r["cosine_mean"] for r in rows) > 0.99999
    float_model, same = smoothed(np.ones(8, np.float32))
    assert correspond(float_model, same).factors == {}


def test_a_matmul_whose_rows_do_not_undo_the_smoothing_is_not_its_float_twin():
    float_model, result = smoothed(np.float32([1, 2, 4, 1, 1, 8, 1, 1]))
    weights = {t.name: t for t in result.graph.initializer}
    weights["w"].CopyFrom(numpy_helper.from_array(numpy_helper.to_array(weights["w"]) * 1.5, "w"))
    assert correspond(float_model, result).left_out == {"mm": correspondence.DIFFERENT}
