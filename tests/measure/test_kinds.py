"""Each output judged by what means something for it: kinds read from tiny graphs, their metrics and values,
the gate and the fallback's score on the same metrics, "not measured" instead of inf, and the floor."""

import json
import math

import numpy as np
import onnx
import pytest
import yaml
from onnx import helper

from graphs import make_model, rand
from qprep.measure.outputs import output_metrics
from qprep.measure.gate import agreement_target, check_gate
from qprep.measure.kinds import output_kinds, state_key
from qprep.measure.metrics import compare_output, sqnr_db
from qprep.model.runtime import run_model
from qprep.quantize.search import score_of


def vad_model() -> onnx.ModelProto:
    """A voice detector's shape: x[1,16] and state[2,1,8] → prob[1,1] = Sigmoid(mean(x·w) + mean(state)),
    stateN[2,1,8] = Tanh(state + mean(x))."""
    w = np.linspace(-1, 1, 16, dtype=np.float32).reshape(16, 1)
    return make_model([helper.make_node("MatMul", ["x", "w"], ["xw"]),
                       helper.make_node("ReduceMean", ["state"], ["sm"], keepdims=0),
                       helper.make_node("Add", ["xw", "sm"], ["logit"]),
                       helper.make_node("Sigmoid", ["logit"], ["prob"]),
                       helper.make_node("ReduceMean", ["x"], ["xm"], keepdims=0),
                       helper.make_node("Add", ["state", "xm"], ["s1"]),
                       helper.make_node("Tanh", ["s1"], ["stateN"])],
                      [("x", [1, 16]), ("state", [2, 1, 8])], [("prob", [1, 1]), ("stateN", [2, 1, 8])], {"w": w})


def vad_outputs(count=8, noise=0.0):
    model = vad_model()
    samples = [{"x": rand(1, 16, seed=i), "state": rand(2, 1, 8, seed=100 + i)} for i in range(count)]
    expected = run_model(model, samples)
    noisy = [{k: v + noise * rand(*v.shape, seed=200 + i) for k, v in s.items()} for i, s in enumerate(samples)]
    return model, expected, run_model(model, noisy)


def test_a_one_element_probability_and_a_state_output_are_judged_by_their_own_metrics():
    model, expected, actual = vad_outputs(noise=0.3)
    kinds = output_kinds(model, expected, {})
    assert kinds["prob"][0] == "probability" and kinds["stateN"][0] == "state"
    assert "'state'" in kinds["stateN"][1]
    outputs = output_metrics(expected, actual, kinds)
    prob, state = outputs["prob"], outputs["stateN"]
    assert "cosine_mean" not in prob and prob["judged_by"] == ["decision_agreement", "mean_abs_error"]
    ref = np.array([e["prob"].item() for e in expected])
    res = np.array([a["prob"].item() for a in actual])
    assert prob["mean_abs_error"] == pytest.approx(np.abs(ref - res).mean())
    assert prob["decision_agreement"] == np.mean((ref >= 0.5) == (res >= 0.5))
    assert prob["decision_count"] == 8 and prob["score"] == pytest.approx(1 - prob["mean_abs_error"])
    rel = [np.linalg.norm(a["stateN"] - e["stateN"]) / np.linalg.norm(e["stateN"]) for e, a in zip(expected, actual)]
    assert state["judged_by"] == ["rel_error", "rel_error_max"]
    assert state["rel_error"] == pytest.approx(np.mean(rel)) and state["rel_error_max"] == pytest.approx(max(rel))
    assert 0 < state["cosine_mean"] < 1  # still shown: over 16 values it means something


def test_a_cosine_target_holds_each_output_to_its_own_metric_and_the_search_climbs_the_same():
    model, expected, actual = vad_outputs(noise=0.3)
    outputs = output_metrics(expected, actual, output_kinds(model, expected, {}))
    gate = check_gate({"cosine_mean": 0.99}, outputs)
    checks = {c["metric"]: c for c in gate["checks"]}
    assert set(checks) == {"prob.decision_agreement", "stateN.rel_error"}
    assert checks["stateN.rel_error"]["threshold"] == pytest.approx(math.sqrt(2 * 0.01))  # what cosine 0.99 allows
    assert checks["stateN.rel_error"]["stands_for"] == "cosine_mean 0.99"
    # decisions on 8 samples: the agreement a good INT8 result meets on 8 (one flip is 12.5%), not 0.99
    assert checks["prob.decision_agreement"]["threshold"] == agreement_target(8)[0] == 0.87
    worst = min(outputs["prob"]["score"], 1 - outputs["stateN"]["rel_error"] ** 2 / 2)
    assert score_of(outputs, {"cosine_mean": 0.99}) == pytest.approx(worst)
    exact = output_metrics(expected, expected, output_kinds(model, expected, {}))
    assert check_gate({"cosine_mean": 0.99}, exact)["passed"] and score_of(exact, {"cosine_mean": 0.99}) == 1.0


def test_state_names_pair_by_structure_of_the_name_not_by_chance():
    assert state_key("state") == state_key("stateN") == ("state",)
    assert state_key("h0") == state_key("hn") == state_key("h_out") == ("h",)
    assert state_key("past_key_values.0.key") == state_key("present.0.key") == ("0", "key")
    assert state_key("cache") == state_key("new_cache")
    assert state_key("input") == state_key("output") == ()  # an image-to-image model has no state
    assert state_key("past_key_values.0.key") != state_key("present.1.key")


def test_an_output_of_an_input_shape_without_a_paired_name_is_not_a_state():
    """A denoiser: y has x's shape but is no state (its name does not pair with x's)."""
    model = make_model([helper.make_node("Tanh", ["input"], ["output"])], [("input", [1, 8, 4])], [("output", [1, 8, 4])])
    expected = run_model(model, [{"input": rand(1, 8, 4)}])
    assert output_kinds(model, expected, {})["output"][0] == "tensor"


def detector_model() -> onnx.ModelProto:
    """boxes[1,6,4], scores[1,1,6] → NonMaxSuppression → selected[K,3] → the kept boxes and scores; and TopK(3) of
    the scores (values, indices)."""
    return make_model([helper.make_node("NonMaxSuppression", ["boxes", "scores", "max_out", "iou", "thr"], ["selected"]),
                       helper.make_node("Gather", ["selected", "two"], ["box_index"], axis=1),
                       helper.make_node("Squeeze", ["boxes", "zero"], ["boxes2"]),
                       helper.make_node("Gather", ["boxes2", "box_index"], ["kept"]),
                       helper.make_node("Reshape", ["scores", "flat"], ["scores1"]),
                       helper.make_node("TopK", ["scores1", "k"], ["top_values", "top_indices"])],
                      [("boxes", [1, 6, 4]), ("scores", [1, 1, 6])],
                      [("selected", None, np.int64), ("kept", None), ("top_values", [3]), ("top_indices", [3], np.int64)],
                      {"max_out": np.array([6], np.int64), "iou": np.array([0.5], np.float32),
                       "thr": np.array([0.3], np.float32), "two": np.array(2, np.int64), "zero": np.array([0], np.int64),
                       "flat": np.array([-1], np.int64), "k": np.array([3], np.int64)}, opset=13)


def test_a_kind_named_in_tasks_wins_and_boxes_need_four_columns():
    from qprep.errors import ConfigError

    model, expected, _ = vad_outputs()
    assert output_kinds(model, expected, {"stateN": "tensor"})["stateN"] == ("tensor", "named in evaluation.tasks")
    with pytest.raises(ConfigError, match="evaluation.tasks.prob: boxes needs rows of at least 4 numbers"):
        output_kinds(model, expected, {"prob": "boxes"})


def test_rows_chosen_by_nms_and_topk_are_matched_not_compared_element_by_element():
    boxes = np.array([[[0, 0, 10, 10], [20, 20, 30, 30], [40, 0, 50, 10], [0, 40, 10, 50],
                       [60, 60, 70, 70], [80, 0, 90, 10]]], np.float32)
    scores = np.array([[[0.90, 0.80, 0.70, 0.35, 0.20, 0.10]]], np.float32)
    moved = np.array([[[0.70, 0.80, 0.90, 0.25, 0.20, 0.10]]], np.float32)  # order changes, one box lost
    model = detector_model()
    expected = run_model(model, [{"boxes": boxes, "scores": scores}])
    actual = run_model(model, [{"boxes": boxes + 0.5, "scores": moved}])
    kinds = output_kinds(model, expected, {})
    assert {name: kind for name, (kind, _) in kinds.items()} == {
        "selected": "ranked_ids", "kept": "boxes", "top_values": "ranked", "top_indices": "ranked_ids"}
    outputs = output_metrics(expected, actual, kinds)
    kept = outputs["kept"]
    assert kept["count_changed"] == 1  # 4 boxes kept, then 3
    assert kept["match_rate"] == pytest.approx(2 * 3 / 7)  # the 3 common boxes pair up whatever their order
    assert kept["mean_iou"] == pytest.approx((9.5 * 9.5) / (2 * 100 - 9.5 * 9.5))
    assert "cosine_mean" not in kept
    assert outputs["top_indices"]["set_agreement"] == 1.0  # the same three picks in another order
    assert outputs["top_values"]["rel_error"] == 0.0  # and the same values once sorted
    assert outputs["selected"]["set_agreement"] == 3 / 4  # (batch, class, box) rows: 3 shared of the 4 seen
    assert check_gate({"cosine_mean": 0.9}, {"kept": kept})["checks"][0]["metric"] == "kept.match_rate"


def test_outputs_whose_length_depends_on_the_input_are_compared_over_their_common_prefix():
    """Like a TTS model: 15 of 16 samples come out at another length; every sample is compared over the
    length both have, never only the one that happened to match."""
    rng = np.random.default_rng(0)
    ref = [rng.standard_normal((1, 100 + i)) for i in range(16)]
    res = [r[:, : r.shape[1] - (i > 0) * 3] + 0.01 for i, r in enumerate(ref)]
    metrics = compare_output(ref, res, "tensor")
    assert metrics["samples"] == 16 and metrics["shape_changed"] == 15
    assert metrics["cosine_min"] > 0.999
    assert len([v for v in metrics["per_sample"]["values"] if v is not None]) == 16


def test_figures_on_no_comparable_pair_are_not_measured_never_inf():
    ref = [np.ones((1, 4)), np.ones((1, 4))]
    res = [np.ones((4,)), np.ones((2, 2, 1))]  # another rank on every sample
    metrics = compare_output(ref, res, "tensor")
    assert metrics["cosine_mean"] is None and metrics["score"] is None and metrics["not_comparable"] == 2
    assert json.loads(json.dumps(metrics))["cosine_mean"] is None
    assert sqnr_db([], []) is None  # was inf: "SQNR -2.81 → inf dB" over zero pairs
    gate = check_gate({"cosine_mean": 0.9}, {"y": metrics})
    assert not gate["passed"] and gate["checks"][0]["reason"].startswith("not measured")
    assert check_gate({"cosine_mean": 0.9}, {"y": metrics}, floor=True)["passed"]  # no collapse seen, none claimed
    assert score_of({"y": metrics}, {"cosine_mean": 0.9}) == -math.inf


def test_weight_rounding_and_bias_correction_keep_the_safe_default_on_no_evidence():
    from qprep.quantize.ort.output_check import better, output_sqnr

    expected = [{"y": np.ones((1, 4), np.float32)}]
    assert output_sqnr(expected, [{"y": np.ones((4,), np.float32)}]) is None
    kept, why = better(-2.81, None, "nearest rounding kept")
    assert not kept and why.startswith("not measured") and why.endswith("nearest rounding kept")
    assert better(10.0, 12.0, "no correction") == (True, "")
    assert better(10.0, 9.0, "no correction") == (False, "not better: no correction")


def two_conv_models(tmp_path):
    """m.onnx and a reference with other weights: against it, m's result has collapsed."""
    from graphs import tiny_conv_model

    model = tiny_conv_model(batch=1)
    onnx.save(model, str(tmp_path / "m.onnx"))
    for init in model.graph.initializer:
        values = onnx.numpy_helper.to_array(init)
        init.CopyFrom(onnx.numpy_helper.from_array(-values[::-1].copy(), init.name))
    onnx.save(model, str(tmp_path / "reference.onnx"))
    (tmp_path / "eval").mkdir()
    for i in range(4):
        np.save(tmp_path / "eval" / f"{i}.npy", rand(1, 3, 8, 8, seed=i))


def test_a_collapsed_result_misses_the_default_floor_with_the_worst_tensors_named(tmp_path, cli):
    two_conv_models(tmp_path)
    config = {"model": "m.onnx", "output_dir": "out", "pipeline": [],
              "evaluation": {"source": "eval", "reference_model": "reference.onnx", "latency": {"runs": 0}}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    code, _, err = cli("run", tmp_path / "c.yaml", "--quiet")
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert code == 1 and report["status"] == "gate missed"
    assert report["evaluation"]["gate"]["source"] == "floor"
    assert "accuracy floor missed: cosine_mean" in err and "worst: output 'y'" in err
    assert "Accuracy floor (no gate configured" in (tmp_path / "out" / "report.md").read_text()
    code, _, _ = cli("run", tmp_path / "c.yaml", "--quiet", "--force", "--set", "evaluation.floor=none")
    assert code == 0 and "gate" not in json.loads((tmp_path / "out" / "report.json").read_text())["evaluation"]


def test_a_run_without_evaluation_says_that_nothing_was_measured(tmp_path, cli):
    two_conv_models(tmp_path)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"model": "m.onnx", "output_dir": "out", "pipeline": []}))
    code, out, _ = cli("run", tmp_path / "c.yaml")
    assert code == 0 and "accuracy not measured" in out
    assert "**Verdict: not measured** — the config has no `evaluation:`" in (tmp_path / "out" / "report.md").read_text()


def test_floor_values_are_checked_like_gate_metrics():
    from qprep.config import load_config
    from qprep.errors import ConfigError

    config = load_config({"model": "m.onnx", "evaluation": {"source": "d"}})
    assert config["evaluation"]["floor"] == {"cosine_mean": 0.9}
    assert load_config({"model": "m.onnx", "evaluation": {"source": "d", "floor": "none"}})["evaluation"]["floor"] == {}
    with pytest.raises(ConfigError, match="evaluation.floor.cosine_man: unknown metric"):
        load_config({"model": "m.onnx", "evaluation": {"source": "d", "floor": {"cosine_man": 0.9}}})
    with pytest.raises(ConfigError, match="evaluation.floor: expected a mapping"):
        load_config({"model": "m.onnx", "evaluation": {"source": "d", "floor": 0.9}})


@pytest.mark.parametrize("norm", ["ReduceL2", "F.normalize", "Sqrt(ReduceSum(x*x))", "softmax",
                                  "another tensor's norm"])
def test_an_output_divided_by_its_norm_is_an_embedding_not_class_scores(norm):
    """x / ‖x‖ as torch exports it (Resemblyzer's speaker embedding: Div by a ReduceL2, judged as class scores
    with a 'top-1 agreement'), or as F.normalize (Clip and Expand between) or a hand-written norm; a softmax's
    x / Σx stays class scores."""
    axes = helper.make_tensor("axes", onnx.TensorProto.INT64, [1], [1])
    shape = helper.make_tensor("shape", onnx.TensorProto.INT64, [2], [1, 8])
    nodes = [helper.make_node("Relu", ["x"], ["r"])]
    if norm == "ReduceL2":
        nodes.append(helper.make_node("ReduceL2", ["r"], ["n"], axes=[1], keepdims=1))
    elif norm == "F.normalize":
        nodes += [helper.make_node("ReduceL2", ["r"], ["l2"], axes=[1], keepdims=1),
                  helper.make_node("Clip", ["l2", "eps"], ["clipped"]),
                  helper.make_node("Expand", ["clipped", "shape"], ["n"])]
    elif norm == "another tensor's norm":  # a cosine classifier's logits over its features' norm
        nodes = [helper.make_node("Neg", ["x"], ["r"]), helper.make_node("ReduceL2", ["x"], ["n"], axes=[1], keepdims=1)]
    elif norm == "softmax":
        nodes = [helper.make_node("Exp", ["x"], ["r"]), helper.make_node("ReduceSum", ["r", "axes"], ["n"], keepdims=1)]
    else:
        nodes += [helper.make_node("Mul", ["r", "r"], ["sq"]), helper.make_node("ReduceSum", ["sq", "axes"], ["s"], keepdims=1),
                  helper.make_node("Sqrt", ["s"], ["n"])]
    nodes.append(helper.make_node("Div", ["r", "n"], ["embedding"]))
    model = make_model(nodes, [("x", [1, 8])], [("embedding", [1, 8])],
                       [axes, shape, helper.make_tensor("eps", onnx.TensorProto.FLOAT, [], [1e-12])])
    expected = run_model(model, [{"x": rand(1, 8)}, {"x": rand(1, 8)}])
    kind = output_kinds(model, expected, {})["embedding"][0]
    assert kind == ("classification" if norm in ("softmax", "another tensor's norm") else "tensor")


def test_an_input_passed_straight_through_to_an_output_is_not_its_own_state():
    """`state` as an output of the graph input `state` itself: the same tensor, not its next value (it paired
    with itself by name and was judged by relative error as a state)."""
    model = make_model([helper.make_node("Tanh", ["state"], ["y"])], [("state", [1, 8, 4])],
                       [("y", [1, 8, 4]), ("state", [1, 8, 4])])
    expected = run_model(model, [{"state": rand(1, 8, 4)}])
    assert output_kinds(model, expected, {})["state"][0] == "tensor"


def test_tied_top_scores_rank_by_index_as_argmax_does():
    """An INT8 model's dequantized scores tie: its top-1 is the first of the tied classes, as argmax reads it
    (numpy's default argsort breaks ties at random: on AVX-512 it did so in 30 of these 200 rows)."""
    rng = np.random.default_rng(0)
    result = [np.round(rng.standard_normal((1, 1000)).astype(np.float32) * 4) / 4 for _ in range(200)]
    reference = [r + np.linspace(0, 1e-3, 1000, dtype=np.float32)[::-1] * (r == r.max()) for r in result]
    assert all(r.argmax() == f.argmax() for r, f in zip(result, reference))  # the reference breaks no tie
    assert compare_output(reference, result, "classification")["top1_agreement"] == 1.0
