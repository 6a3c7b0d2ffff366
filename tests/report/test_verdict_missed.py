"""The terminal's line for a missed gate carries what the report says of the miss: too few samples to decide,
and how many changed top-1s were FP32's near ties."""

from qprep.report.verdict import missed_text


def evaluation() -> dict:
    check = {"metric": "label.element_agreement", "threshold": 0.99, "value": 0.9875, "passed": False,
             "kind": "minimum", "worst_output": "label",
             "undecided": "80 samples: 95% interval 93.3–99.8% holds the threshold"}
    changed = [{"sample": "1022.npz", "float_gap": 0.09, "closer_than": 0.99}]
    heldout = {"samples": {"count": 80}, "outputs": {"label": {"samples": 80, "element_agreement": 0.9875},
                                                     "probabilities": {"samples": 80, "top1_changed": changed}}}
    return {"outputs": {"probabilities": {"samples": 64}}, "heldout": heldout,
            "gate": {"passed": False, "checks": [check]}}


def test_a_missed_agreement_names_too_few_to_decide_and_the_near_ties():
    text = missed_text(evaluation())
    assert text.startswith("label.element_agreement 0.9875 (needs >= 0.99; too few to decide: 80 samples: 95% "
                           "interval 93.3–99.8% holds the threshold)")
    assert text.endswith("; top-1 of probabilities changed on 1 of 80 held-out samples, 1 among FP32's 10% "
                         "nearest ties")


def test_a_missed_cosine_has_no_tie_note():
    found = evaluation()
    found["gate"]["checks"] = [{"metric": "cosine_mean", "threshold": 0.99, "value": 0.95, "passed": False,
                                "kind": "minimum"}]
    assert missed_text(found) == "cosine_mean 0.95 (needs >= 0.99)"
