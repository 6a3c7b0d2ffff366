"""A cosine gate key on an output of decisions (a classifier's int64 label): held to the agreement the same
samples allow, not to the cosine threshold as an agreement."""

import numpy as np

from qprep.measure.gate import agreement_target, check_gate
from qprep.measure.metrics import compare_output


def labels(flips: int, samples: int = 80) -> dict:
    """An ArgMax label output [1] on `samples` samples of which `flips` changed."""
    reference = [np.array([i % 10], dtype=np.int64) for i in range(samples)]
    result = [np.array([(i % 10) + (1 if i < flips else 0)], dtype=np.int64) for i in range(samples)]
    return compare_output(reference, result, "integer")


def test_one_flip_of_80_labels_meets_a_cosine_gate_as_its_probabilities_would():
    gate = check_gate({"cosine_mean": 0.99}, {"label": labels(1)})
    check, = gate["checks"]
    assert gate["passed"] and check["metric"] == "label.element_agreement"
    assert check["threshold"] == agreement_target(80)[0] == 0.95
    assert "on 80 samples" in check["stands_for"]
    assert not check_gate({"cosine_mean": 0.99}, {"label": labels(8)})["passed"]  # 90%: more than a good result
    strict, = check_gate({"cosine_mean": 0.9}, {"label": labels(1)})["checks"]
    assert strict["threshold"] == 0.9  # lower than what 80 samples allow: the user's own bar stands


def test_the_gate_own_top1_agreement_is_the_labels_target():
    gate = check_gate({"cosine_mean": 0.99, "top1_agreement": 0.97}, {"label": labels(2)})
    check = next(c for c in gate["checks"] if c["metric"] == "label.element_agreement")
    assert check["threshold"] == 0.97 and check["passed"]  # 97.5%
    assert "top1_agreement" in check["stands_for"]
