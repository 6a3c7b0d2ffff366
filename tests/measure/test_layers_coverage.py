"""How much of the float model a per-layer view compares (qprep/measure/correspondence.py): a rewrite qprep made
itself (the float MaxPool as Reshape + ReduceMax) and a -inf attention mask left every tensor after them out of
two unseen models' views, which then read "0 red"; and the line under the chart says how many were compared."""

import numpy as np
import onnx
import pytest
from onnx import helper

from graphs import make_model, masked_attention_model, masked_attention_samples, rand
from qprep.measure import correspondence
from qprep.measure.correspondence import correspond
from qprep.measure.layers import NOT_FLOAT, LayerComparison
from qprep.qdq import float_maxpool
from qprep.quantize import rewrites
from qprep.report.layer_chart import coverage, layer_chart_svg, layers_line

W1, B1, W2, B2 = rand(4, 3, 3, 3, seed=1), rand(4, seed=2), rand(4, 4, 3, 3, seed=3), rand(4, seed=4)
SCALE = np.float32(0.05)


def conv_pool_conv(pool: dict | None = None):
    """x → c1 (Conv) → r (Relu) → p (MaxPool, 2×2 windows unless `pool` says otherwise) → c2 (Conv) → y."""
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="c1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r"], name="relu"),
             helper.make_node("MaxPool", ["r"], ["p"], name="pool", **(pool or {"kernel_shape": [2, 2],
                                                                                "strides": [2, 2]})),
             helper.make_node("Conv", ["p", "w2", "b2"], ["c2"], name="c2", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c2"], ["y"], name="relu2")]
    return make_model(nodes, [("x", [1, 3, 8, 8])], [("y", None)], {"w1": W1, "b1": B1, "w2": W2, "b2": B2})


def with_rounded(model, tensor: str):
    """`model` with a uint8 Q/DQ pair (zero point 128) on `tensor` (ORT's naming), read by its readers."""
    model = type(model).FromString(model.SerializeToString())
    out = f"{tensor}_DequantizeLinear_Output"
    for node in model.graph.node:
        node.input[:] = [out if i == tensor else i for i in node.input]
    nodes = list(model.graph.node)
    producer = next(i for i, n in enumerate(nodes) if tensor in n.output)
    nodes[producer + 1:producer + 1] = [
        helper.make_node("QuantizeLinear", [tensor, "qs", "qz"], [f"{tensor}_q"], name=f"{tensor}_QuantizeLinear"),
        helper.make_node("DequantizeLinear", [f"{tensor}_q", "qs", "qz"], [out], name=f"{tensor}_DequantizeLinear")]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    if not any(i.name == "qs" for i in model.graph.initializer):
        model.graph.initializer.extend([helper.make_tensor("qs", 1, [], [float(SCALE)]),
                                        helper.make_tensor("qz", 2, [], [128])])
    return model


def pool_samples(count=3):
    return [{"x": rand(1, 3, 8, 8, seed=20 + i)} for i in range(count)]


def test_a_maxpool_qprep_made_a_reduce_max_is_compared_and_so_is_every_tensor_after_it():
    """qdq/float_maxpool.py rewrites the MaxPool after ORT's quantization: named as the MaxPool, op ReduceMax;
    the chain broke there (probe A: 2 of 10 tensors compared, all after the pool left out)."""
    float_model = conv_pool_conv()
    result, rewritten = float_maxpool.rewrite(with_rounded(with_rounded(float_model, "r"), "p"), pool_samples())
    assert rewritten == 1 and "ReduceMax" in {n.op_type for n in result.graph.node}
    found = correspond(float_model, result)
    assert {f: r for f, r, *_ in found.pairs} == {"c1": "c1", "r": "r_DequantizeLinear_Output",
                                                  "p": "p_DequantizeLinear_Output", "c2": "c2"}
    assert not found.left_out
    rows = LayerComparison(float_model, result).errors(pool_samples())
    assert len(rows) == 4 and min(r["cosine_mean"] for r in rows) > 0.99
    # against overlapping windows (stride 1) the same ReduceMax is no twin, whatever its name says
    found = correspond(conv_pool_conv({"kernel_shape": [2, 2], "strides": [1, 1]}), result)
    assert found.left_out == {"p": correspondence.DIFFERENT, "c2": correspondence.AFTER}


def test_a_minus_inf_attention_mask_is_proven_and_compared_over_its_finite_scores():
    """A Where filling -inf (torch's masked_fill, probe B): its constant met itself as inf - inf = NaN, so the
    mask, the masked scores and every tensor after them were left out."""
    float_model = masked_attention_model(-np.inf, "where")
    result = with_rounded(with_rounded(float_model, "q"), "context")
    found = correspond(float_model, result)
    assert not found.left_out
    assert {"additive", "masked", "attention", "context"} <= {p[0] for p in found.pairs}
    rows = {r["tensor"]: r for r in LayerComparison(float_model, result).errors(masked_attention_samples(4))}
    masked = rows["masked"]  # -inf at the same places in both: the finite scores compared
    assert masked["cosine_mean"] > 0.99 and masked["sqnr_db"] is not None and np.isfinite(masked["sqnr_db"])
    assert rows["attention"]["cosine_mean"] > 0.99


def test_a_mask_filled_with_another_value_is_not_the_float_models():
    float_model = masked_attention_model(-np.inf, "where")
    result = masked_attention_model(-1e9, "where")
    found = correspond(float_model, result)
    assert found.left_out["additive"] == correspondence.DIFFERENT
    assert found.left_out["attention"] == correspondence.AFTER


def test_a_tensor_held_as_integers_does_not_make_the_next_one_computed_from_a_tensor_left_out():
    """t exists in the result, as integers on a per-channel grid (left out: no one scale reads it); u is
    computed there from other inputs (its integers cast and scaled by hand), which is its reason, not t's."""
    float_model = make_model([helper.make_node("Conv", ["x", "w1", "b1"], ["c"], name="c", pads=[1, 1, 1, 1]),
                              helper.make_node("Transpose", ["c"], ["t"], name="t", perm=[0, 2, 3, 1]),
                              helper.make_node("Sigmoid", ["t"], ["u"], name="u"),
                              helper.make_node("Neg", ["u"], ["y"], name="y")],
                             [("x", [1, 3, 8, 8])], [("y", None)], {"w1": W1, "b1": B1})
    scales = np.full(4, SCALE, np.float32)
    result = make_model([helper.make_node("Conv", ["x", "w1", "b1"], ["c"], name="c", pads=[1, 1, 1, 1]),
                         helper.make_node("QuantizeLinear", ["c", "cs", "cz"], ["c_q"], name="c_q", axis=1),
                         helper.make_node("Transpose", ["c_q"], ["t_q"], name="t", perm=[0, 2, 3, 1]),
                         helper.make_node("Cast", ["t_q"], ["t_f"], name="t_f", to=1),
                         helper.make_node("Mul", ["t_f", "one_scale"], ["t_s"], name="t_s"),
                         helper.make_node("Sigmoid", ["t_s"], ["u"], name="u"),
                         helper.make_node("Neg", ["u"], ["y"], name="y")],
                        [("x", [1, 3, 8, 8])], [("y", None)],
                        {"w1": W1, "b1": B1, "cs": scales, "cz": np.zeros(4, np.int8),
                         "one_scale": np.float32(SCALE)})
    found = correspond(float_model, result)
    assert found.left_out == {"t": correspondence.INTEGERS, "u": correspondence.DIFFERENT}


def test_every_rewrite_qprep_makes_for_ort_is_followed_by_the_per_layer_view():
    """The float MaxPool was a rewrite of qprep's own that the view did not follow; a new one in the table must
    come with its rule (correspondence.py) and its name in FOLLOWED_REWRITES."""
    assert {r.name for r in rewrites.of("ort")} <= correspondence.FOLLOWED_REWRITES


def run_ort(tmp_path, model, samples: list[dict], first: list | None = None) -> dict:
    """qprep's ORT backend end to end on a tiny model: the report's evaluation."""
    import qprep

    onnx.save(model, tmp_path / "m.onnx")
    (tmp_path / "samples").mkdir()
    for i, sample in enumerate(samples):
        np.savez(tmp_path / "samples" / f"{i:02d}.npz", **sample)
    pipeline = [*(first or []), {"quantize": {"backend": "ort", "ort": {"weight_rounding": "nearest"}}}]
    report = qprep.run({"model": str(tmp_path / "m.onnx"), "calibration": {"source": str(tmp_path / "samples")},
                        "evaluation": {"source": str(tmp_path / "samples"), "latency": {"runs": 0}},
                        "pipeline": pipeline}, output_dir=str(tmp_path / "out"))
    return report["evaluation"]


@pytest.mark.slow
def test_qprep_ort_run_whose_maxpool_became_a_reduce_max_compares_every_tensor(tmp_path):
    """Probe A's form: the first Conv kept float, so its MaxPool reads floats and qprep rewrites it after the
    build; the view had stopped there (c2 and p left out)."""
    evaluation = run_ort(tmp_path, conv_pool_conv(), [{"x": rand(1, 3, 8, 8, seed=30 + i)} for i in range(8)],
                         [{"keep_float": {"nodes": ["c1"]}}])
    assert "ReduceMax" in {n.op_type for n in onnx.load(tmp_path / "out" / "model.onnx").graph.node}
    assert {r["tensor"] for r in evaluation["layers"]} == {"c1", "r", "p", "c2"}
    assert evaluation["layers_left_out"] == {}


@pytest.mark.slow
def test_qprep_ort_run_of_a_minus_inf_masked_attention_compares_the_layers_after_the_mask(tmp_path):
    """Probe B's form (torch's masked_fill with -inf): 5 of 21 tensors compared, every one after the mask left
    out. The mask's two bool tensors are no layer's float value: left out as such (they read "not one float
    tensor of one shape in every sample", as a tensor that changes shape does)."""
    evaluation = run_ort(tmp_path, masked_attention_model(-np.inf, "where", layers=2), masked_attention_samples(8))
    compared = {r["tensor"] for r in evaluation["layers"]}
    assert {"masked", "attention", "context", "y", "masked_2", "attention_2", "context_2"} <= compared
    assert evaluation["layers_left_out"] == {NOT_FLOAT: 2}
    assert min(r["cosine_mean"] for r in evaluation["layers"]) > 0.999


def test_the_line_under_the_chart_says_how_many_tensors_were_compared():
    """Probe B read "26 tensors: 0 red … left out: 62": 0 red of the 26 compared, nothing of the 62."""
    rows = [{"tensor": f"t{i}", "cosine_mean": 0.99999, "order": i} for i in range(26)]
    left = {correspondence.AFTER: 59, NOT_FLOAT: 2,
            correspondence.DIFFERENT: 1}
    line = layers_line(rows, left)
    assert line.startswith("26 of 88 tensors compared: **0 red**, 0 amber, 26 green (")
    assert "left out: 62 (59 computed from a tensor left out" in line and "bands speak for the compared" in line
    assert layers_line(rows, {}).startswith("All 26 tensors compared: **0 red**")
    assert coverage(rows, None) == "26 tensors compared"  # a toolkit's own analysis: no count of the rest
    assert layers_line([], {correspondence.AFTER: 7}) == \
        f"0 of 7 tensors compared; left out: 7 (7 {correspondence.AFTER})."
    assert "26 of 88 tensors compared, in graph order" in layer_chart_svg(rows, left_out=left)
