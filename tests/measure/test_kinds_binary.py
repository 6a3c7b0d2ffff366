"""A two-class Softmax [N, 2] (or [N, ..., 2] per position) is a decision, judged as one: decision agreement at
evaluation.decision_threshold on class 1 and the absolute error of class 1's probability. As class scores, a
move of one class's probability by 0.144 on one sample read cosine 0.999 and top-1 100%."""

import numpy as np
import onnx
import pytest
from onnx import helper

from graphs import make_model, rand
from qprep.errors import ConfigError
from qprep.measure.gate import check_gate
from qprep.measure.kinds import output_kinds
from qprep.measure.metrics import compare_output
from qprep.measure.outputs import output_metrics
from qprep.model.runtime import run_model
from qprep.report.verdict import task_text


def softmax_head(classes: int = 2, steps: int = 0, ending: str = "Softmax", keep: int = 0) -> onnx.ModelProto:
    """x[1,8] (or x[1,steps,8]) → MatMul(8→classes) → `ending` → probs; `keep` slices the first columns after
    it (two columns of a three-class Softmax do not sum to 1)."""
    rng = np.random.default_rng(3)
    shape = [1, steps, 8] if steps else [1, 8]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["z"], name="head"),
             helper.make_node(ending, ["z"], ["p" if keep else "probs"], axis=-1, name="sm")]
    if keep:
        nodes.append(helper.make_node("Slice", ["p", "start", "stop", "axes"], ["probs"]))
    out = [*shape[:-1], keep or classes]
    return make_model(nodes, [("x", shape)], [("probs", out)],
                      {"w": (2 * rng.standard_normal((8, classes))).astype(np.float32),
                       "start": np.array([0], np.int64), "stop": np.array([keep], np.int64),
                       "axes": np.array([-1], np.int64)})


def kind_of(model: onnx.ModelProto, count: int = 8, **tasks) -> tuple[str, str]:
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    expected = run_model(model, [{"x": rand(*shape, seed=i)} for i in range(count)])
    return output_kinds(model, expected, tasks)["probs"]


def test_a_two_class_softmax_is_judged_as_a_decision_on_class_one():
    model = softmax_head()
    expected = run_model(model, [{"x": rand(1, 8, seed=i)} for i in range(16)])
    kind, why = output_kinds(model, expected, {})["probs"]
    assert kind == "binary" and "Softmax 'sm'" in why and "class 1" in why
    # one sample's class-1 probability moves by 0.144 towards 0.5 without crossing it: the decision holds
    far = max(range(16), key=lambda i: abs(expected[i]["probs"][0, 1] - 0.5))
    move = 0.144 if expected[far]["probs"][0, 1] < 0.5 else -0.144
    actual = [{"probs": e["probs"] + (np.array([[-move, move]], np.float32) if i == far else 0)}
              for i, e in enumerate(expected)]
    metrics = output_metrics(expected, actual, {"probs": (kind, why)})["probs"]
    assert metrics["judged_by"] == ["decision_agreement", "mean_abs_error"]
    assert metrics["cosine_mean"] > 0.995 and metrics["top1_agreement"] == 1.0  # what judged it before: shown
    assert metrics["positive_class"] == 1 and metrics["decision_agreement"] == 1.0
    assert metrics["mean_abs_error"] == pytest.approx(0.144 / 16, rel=1e-4)
    assert metrics["max_abs"] == pytest.approx(0.144, rel=1e-4)
    assert not check_gate({"mean_abs_error": 0.005}, {"probs": metrics})["passed"]
    text = task_text(metrics)
    assert text.startswith("decision agreement at 0.5 100.0%") and "top1" not in text and "cosine" not in text
    assert check_gate({"cosine_mean": 0.99}, {"probs": metrics})["checks"][0]["metric"] == "probs.decision_agreement"
    assert "mean abs error 0.009 of class 1's probability (largest 0.144)" in text
    assert kind_of(softmax_head(classes=3))[0] == "classification"  # three classes stay class scores
    assert kind_of(softmax_head(classes=3, keep=2))[0] != "binary"  # two columns of three do not sum to 1
    assert kind_of(softmax_head(ending="LogSoftmax"))[0] == "classification"  # log-probabilities: no threshold


def test_the_decision_is_class_ones_probability_at_the_configured_threshold():
    reference = [np.array([[0.65, 0.35]]), np.array([[0.1, 0.9]])]
    result = [np.array([[0.75, 0.25]]), np.array([[0.1, 0.9]])]  # the argmax holds; class 1 crosses 0.3
    at_03 = compare_output(reference, result, "binary", threshold=0.3)
    assert at_03["decision_agreement"] == 0.5 and at_03["decision_threshold"] == 0.3
    assert compare_output(reference, result, "binary")["decision_agreement"] == 1.0
    assert at_03["mean_abs_error"] == pytest.approx(0.05)  # class 1 only: 0.1 on one sample of two


def test_per_position_two_class_scores_make_one_decision_per_position():
    model = softmax_head(steps=6)
    expected = run_model(model, [{"x": rand(1, 6, 8, seed=i)} for i in range(4)])
    kind, why = output_kinds(model, expected, {})["probs"]
    assert kind == "binary"
    flipped = [{"probs": e["probs"][..., ::-1].copy()} for e in expected]  # every position's decision reversed
    metrics = output_metrics(expected, flipped, {"probs": (kind, why)})["probs"]
    agree = np.mean([((e["probs"][..., 1] >= 0.5) == (e["probs"][..., 0] >= 0.5)).mean() for e in expected])
    assert metrics["decision_agreement"] == pytest.approx(agree) and metrics["decision_count"] == 4


def test_naming_binary_for_an_output_that_is_not_two_class_scores_is_refused():
    assert kind_of(softmax_head(), probs="binary") == ("binary", "named in evaluation.tasks")
    with pytest.raises(ConfigError, match=r"evaluation.tasks.probs: binary needs two-class scores \[\.\.\., 2\].*"
                                          r"last axis holds 3"):
        kind_of(softmax_head(classes=3), probs="binary")


def test_labelled_accuracy_of_a_two_class_output_is_its_decision_at_the_threshold():
    """With labels, a two-class output's class is 1 where class 1's probability reaches decision_threshold, as
    its decision agreement counts it (the argmax is a threshold of 0.5)."""
    from qprep.evaluate import task_accuracy

    reference = [np.array([[0.4, 0.6]], np.float32), np.array([[0.8, 0.2]], np.float32)]
    result = [np.array([[0.3, 0.7]], np.float32), np.array([[0.75, 0.25]], np.float32)]
    assert task_accuracy(reference, result, [1, 0])["top1_accuracy"] == 1.0  # argmax
    at_065 = task_accuracy(reference, result, [1, 0], 0.65)
    assert at_065["reference_top1_accuracy"] == 0.5 and at_065["top1_accuracy"] == 1.0
