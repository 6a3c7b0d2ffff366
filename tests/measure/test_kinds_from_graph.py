"""Output kinds read from what produces the output, not from its shape: an LSTM's Y_h/Y_c are states, a small
Gemm head with no Softmax is a regression, a Softmax head stays classification, and rows a TopK chose that hold a
box, a score and a class are detections matched by class and IoU (share found, share extra)."""

import math

import numpy as np
import onnx
import pytest
from onnx import helper

from graphs import make_model, rand
from qprep.measure.gate import check_gate
from qprep.measure.kinds import output_kinds
from qprep.measure.metrics import compare_output
from qprep.measure.outputs import output_metrics
from qprep.model.runtime import run_model
from qprep.report.verdict import task_text


def kinds_of(model: onnx.ModelProto, samples: list[dict]) -> dict[str, str]:
    return {name: kind for name, (kind, _) in output_kinds(model, run_model(model, samples), {}).items()}


def lstm_model() -> onnx.ModelProto:
    """x[5,1,4] → LSTM(hidden 3) → Y[5,1,1,3], and its Y_h / Y_c squeezed to [1,3] under names that pair with no
    input (`hidden`, `cell`): a decoder's state outputs."""
    rng = np.random.default_rng(0)
    return make_model([helper.make_node("LSTM", ["x", "w", "r"], ["y", "y_h", "y_c"], hidden_size=3, name="lstm"),
                       helper.make_node("Squeeze", ["y_h", "zero"], ["hidden"]),
                       helper.make_node("Squeeze", ["y_c", "zero"], ["cell"])],
                      [("x", [5, 1, 4])], [("y", [5, 1, 1, 3]), ("hidden", [1, 3]), ("cell", [1, 3])],
                      {"w": rng.standard_normal((1, 12, 4)).astype(np.float32),
                       "r": rng.standard_normal((1, 12, 3)).astype(np.float32), "zero": np.array([0], np.int64)})


def test_an_lstms_last_hidden_and_cell_states_are_states_whatever_their_names():
    model = lstm_model()
    kinds = output_kinds(model, run_model(model, [{"x": rand(5, 1, 4, seed=i)} for i in range(4)]), {})
    assert kinds["hidden"][0] == kinds["cell"][0] == "state"  # were classification: a top-1 of a hidden state
    assert "Y_h" in kinds["hidden"][1] and "Y_c" in kinds["cell"][1] and "LSTM 'lstm'" in kinds["cell"][1]
    assert kinds["y"][0] == "tensor"  # the sequence of hidden states is no state the next call takes


def head_model(ending: str = "", name: str = "mos") -> onnx.ModelProto:
    """features[1,8] → Gemm(8→3) → `name`[1,3]: three scores (a speech-quality model's MOS head); `ending` adds a
    Softmax after the Gemm, or an affine rescale (4·x + 1)."""
    rng = np.random.default_rng(1)
    nodes = [helper.make_node("Gemm", ["features", "w", "b"], ["gemm" if ending else name], name="head")]
    if ending == "softmax":
        nodes.append(helper.make_node("Softmax", ["gemm"], [name], axis=-1))
    elif ending == "affine":
        nodes += [helper.make_node("Mul", ["gemm", "four"], ["scaled"]), helper.make_node("Add", ["scaled", "one"],
                                                                                         [name])]
    return make_model(nodes, [("features", [1, 8])], [(name, [1, 3])],
                      {"w": rng.standard_normal((8, 3)).astype(np.float32),
                       "b": rng.standard_normal(3).astype(np.float32),
                       "four": np.array(4, np.float32), "one": np.array(1, np.float32)})


@pytest.mark.parametrize("ending", ["", "affine"])
def test_a_small_gemm_head_without_softmax_is_a_regression_judged_by_its_errors(ending):
    model = head_model(ending)
    samples = [{"features": rand(1, 8, seed=i)} for i in range(8)]
    expected = run_model(model, samples)
    kinds = output_kinds(model, expected, {})
    assert kinds["mos"][0] == "regression" and "Gemm 'head'" in kinds["mos"][1]
    actual = [{"mos": e["mos"] + np.float32(0.05) * rand(1, 3, seed=50 + i)} for i, e in enumerate(expected)]
    mos = output_metrics(expected, actual, kinds)["mos"]
    assert mos["judged_by"] == ["rel_error", "mean_abs_error"] and "top1_agreement" not in mos
    assert 0 < mos["cosine_min"] <= mos["cosine_mean"] < 1  # shown beside them, as a state's
    ref = np.concatenate([e["mos"].ravel() for e in expected]).astype(np.float64)
    res = np.concatenate([a["mos"].ravel() for a in actual]).astype(np.float64)
    assert mos["mean_abs_error"] == pytest.approx(np.abs(ref - res).mean())
    assert mos["rel_error"] == pytest.approx(np.linalg.norm(ref - res) / np.linalg.norm(ref))
    check = check_gate({"cosine_mean": 0.99}, {"mos": mos})["checks"][0]
    assert check["metric"] == "mos.rel_error" and check["threshold"] == pytest.approx(math.sqrt(2 * 0.01))
    assert task_text(mos) == f"relative error {mos['rel_error']:.3g}"  # the report's line: no cosine "–"


def test_a_softmax_head_and_logits_named_so_stay_class_scores():
    samples = [{"features": rand(1, 8, seed=i)} for i in range(4)]
    assert kinds_of(head_model("softmax", "probs"), samples) == {"probs": "classification"}
    assert kinds_of(head_model("", "logits"), samples) == {"logits": "classification"}
    model = head_model("", "logits")
    why = output_kinds(model, run_model(model, samples), {})["logits"][1]
    assert "logits by their name" in why  # the report says what kept it from being a regression


BOXES = np.array([[[0, 0, 10, 10], [20, 20, 30, 30], [40, 0, 50, 10], [0, 40, 10, 50], [60, 60, 70, 70],
                   [80, 0, 90, 10]]], np.float32)


def class_scores(rows: list[tuple[int, float]]) -> np.ndarray:
    """[1, 6, 3] class scores whose best class and score per box are `rows`."""
    scores = np.full((1, 6, 3), 0.01, np.float32)
    for box, (label, score) in enumerate(rows):
        scores[0, box, label] = score
    return scores


def topk_detector() -> onnx.ModelProto:
    """boxes[1,6,4], class_scores[1,6,3] → each box's best score and class → TopK(4) → rows [1,4,6] of x1 y1 x2 y2,
    score, class: a detector's post-processing written into the graph (the rows Concat TopK's values)."""
    nodes = [helper.make_node("ReduceMax", ["class_scores"], ["best"], axes=[2], keepdims=0),
             helper.make_node("ArgMax", ["class_scores"], ["label"], axis=2, keepdims=0),
             helper.make_node("Cast", ["label"], ["label_f"], to=onnx.TensorProto.FLOAT),
             helper.make_node("TopK", ["best", "k"], ["top", "index"], axis=1, name="topk"),
             helper.make_node("Squeeze", ["index", "zero"], ["index1"]),
             helper.make_node("Gather", ["boxes", "index1"], ["kept"], axis=1),
             helper.make_node("Gather", ["label_f", "index1"], ["kept_label"], axis=1),
             helper.make_node("Unsqueeze", ["top", "two"], ["score_col"]),
             helper.make_node("Unsqueeze", ["kept_label", "two"], ["label_col"]),
             helper.make_node("Concat", ["kept", "score_col", "label_col"], ["detections"], axis=2)]
    return make_model(nodes, [("boxes", [1, 6, 4]), ("class_scores", [1, 6, 3])], [("detections", [1, 4, 6])],
                      {"k": np.array([4], np.int64), "zero": np.array([0], np.int64), "two": np.array([2], np.int64)})


def test_rows_of_box_score_and_class_after_topk_are_detections_matched_by_class_and_iou():
    model = topk_detector()
    reference = {"boxes": BOXES, "class_scores": class_scores([(0, .9), (1, .8), (2, .7), (0, .6), (0, .2), (1, .1)])}
    # shifted by half a unit (IoU 0.82); box 2 now read as class 1, box 3 drops out, box 4 comes in
    shifted = {"boxes": BOXES + 0.5, "class_scores": class_scores([(0, .88), (1, .79), (1, .72), (0, .1), (0, .65),
                                                                   (1, .1)])}
    expected, actual = run_model(model, [reference]), run_model(model, [shifted])
    kinds = output_kinds(model, expected, {})
    assert kinds["detections"][0] == "boxes", kinds["detections"]  # was `ranked`: sorted values, rel_error 0.47
    rows = output_metrics(expected, actual, kinds)["detections"]
    assert rows["detections_found"] == pytest.approx(2 / 4)  # boxes 0 and 1; box 2 changed class, box 3 lost
    assert rows["detections_extra"] == pytest.approx(2 / 4)  # box 2 as class 1, box 4
    assert rows["match_rate"] == pytest.approx(2 * 2 / 8)
    assert rows["mean_iou"] == pytest.approx(9.5 * 9.5 / (200 - 9.5 * 9.5))
    assert rows["score_abs_error"] == pytest.approx(0.02, abs=1e-6)  # 0.9 → 0.88, the score column only
    assert rows["judged_by"][:3] == ["match_rate", "detections_found", "detections_extra"]
    assert "float detections found 50.0%, extra 50.0%" in task_text(rows)


def test_hand_made_detections_count_found_and_extra_rows_per_class():
    """NMS-style rows [x1 y1 x2 y2 score class]: three of four float detections found again (one shifted by
    2 px, IoU 0.67), one found with another class (not found, and extra), one more the float model did not make."""
    ref = np.array([[0, 0, 10, 10, .9, 0], [20, 20, 30, 30, .8, 1], [40, 0, 50, 10, .7, 2], [0, 40, 10, 50, .6, 0]],
                   np.float32)
    res = np.array([[2, 0, 12, 10, .85, 0], [20, 20, 30, 30, .8, 1], [40, 0, 50, 10, .7, 1], [0, 40, 10, 50, .6, 0],
                    [70, 70, 80, 80, .5, 2]], np.float32)
    metrics = compare_output([ref], [res], "boxes")
    assert metrics["detections_found"] == pytest.approx(3 / 4)
    assert metrics["detections_extra"] == pytest.approx(2 / 5)
    assert metrics["match_rate"] == pytest.approx(2 * 3 / 9)
    nothing = compare_output([ref[:0]], [ref[:0]], "boxes")  # both found nothing: all agree
    assert nothing["detections_found"] == 1.0 and nothing["detections_extra"] == 0.0


def kv_cache_model(appended: int = 1) -> onnx.ModelProto:
    """past_key_values.0.key [1,2,P,4] + this step's key → present.0.key [1,2,P+1,4]: a decoder's cache grows by the
    step's positions and is fed back as the next call's past. `appended` 0: a Concat on another axis too."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["k"]),
             helper.make_node("Reshape", ["k", "heads"], ["step"]),
             helper.make_node("Concat", ["past_key_values.0.key", "step"], ["present.0.key"], axis=2)]
    outputs = [("present.0.key", [1, 2, 6, 4])]
    if not appended:  # grows on two axes: not the next value of the past
        nodes += [helper.make_node("Concat", ["present.0.key", "present.0.key"], ["present.1.key"], axis=3)]
        outputs = [("present.1.key", [1, 2, 6, 8])]
    return make_model(nodes, [("x", [1, 1, 8]), ("past_key_values.0.key", [1, 2, 5, 4]),
                              ("past_key_values.1.key", [1, 2, 5, 4])], outputs,
                      {"w": rand(8, 8), "heads": np.array([1, 2, 1, 4], np.int64)})


def test_a_key_value_cache_one_step_longer_than_its_past_is_a_state():
    samples = [{"x": rand(1, 1, 8, seed=i), "past_key_values.0.key": rand(1, 2, 5, 4, seed=10 + i),
                "past_key_values.1.key": rand(1, 2, 5, 4, seed=20 + i)} for i in range(3)]
    assert kinds_of(kv_cache_model(), samples)["present.0.key"] == "state"  # was tensor: the shapes differ
    assert kinds_of(kv_cache_model(appended=0), samples)["present.1.key"] != "state"
