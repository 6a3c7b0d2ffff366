"""CTC text outputs: decoded greedily, rated by text agreement and character error rate, spelled with the
model's dictionary; an OCR recognizer's per-step Softmax over its dictionary is found without configuration."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from graphs import make_model
from qprep.measure import ctc
from qprep.evaluate import worst_samples
from qprep.measure.kinds import output_kinds
from qprep.measure.metrics import compare_output


def steps(ids: list[int], classes: int = 5) -> np.ndarray:
    """[1, T, C] scores whose per-step argmax is `ids`."""
    scores = np.full((1, len(ids), classes), 0.1, np.float32)
    scores[0, np.arange(len(ids)), ids] = 0.9
    return scores


def test_decode_collapses_repeats_and_drops_the_blank():
    assert ctc.decode(steps([0, 1, 1, 0, 1, 2, 2, 0])) == ((1, 1, 2),)
    assert ctc.spell((1, 1, 2, 4), ["a", "b", "c"]) == "aab "  # the class after the last symbol: a space
    assert ctc.spell((1, 3), None) == "#1 #3"
    assert ctc.edit_distance((1, 2, 3), (1, 3)) == 1 and ctc.edit_distance((), (4, 4)) == 2


def test_text_agreement_counts_lines_that_read_the_same_not_steps():
    reference = [steps([1, 0, 2, 2, 0, 3]), steps([1, 1, 0, 2, 0, 0]), steps([3, 0, 0, 0, 0, 0])]
    result = [steps([1, 1, 2, 0, 0, 3]),  # other steps, same text "1 2 3"
              steps([1, 1, 0, 3, 0, 0]),  # one symbol wrong
              steps([3, 0, 0, 0, 0, 0])]
    metrics = compare_output(reference, result, "ctc")
    assert metrics["text_agreement"] == 2 / 3 and metrics["text_count"] == 3
    assert metrics["step_agreement"] < 1 and metrics["char_error_rate"] == 1 / 6  # 1 edit over 3 + 2 + 1 symbols
    assert metrics["judged_by"] == ["cosine_mean", "text_agreement", "char_error_rate"]
    worst = worst_samples(metrics["per_sample"], ["a.png", "b.png", "c.png"])
    assert worst["worst_by"] == "character error rate"
    assert worst["worst_samples"][0] == {"sample": "b.png", "value": 0.5, "reference_ids": [1, 2],
                                         "result_ids": [1, 3]}
    assert len(worst["worst_samples"]) == 1  # the lines that read the same are no worst samples
    outputs = {"probs": worst}
    ctc.spell_worst(outputs, ["x", "y", "z"])
    assert outputs["probs"]["worst_samples"][0]["reference_text"] == "xy"
    assert outputs["probs"]["worst_samples"][0]["result_text"] == "xz"


def test_a_softmax_over_the_models_dictionary_is_ctc_and_other_sequences_are_not():
    def recognizer(dictionary: str | None) -> onnx.ModelProto:
        model = make_model([helper.make_node("Softmax", ["x"], ["probs"], axis=-1)],
                           [("x", [1, 6, 5])], [("probs", [1, 6, 5])])
        if dictionary is not None:
            helper.set_model_props(model, {"character": dictionary})
        return model

    expected = [{"probs": steps([1, 0, 2, 0, 3, 0])}]
    assert output_kinds(recognizer("a\nb\nc"), expected, {})["probs"][0] == "ctc"  # blank + 3 + space = 5
    assert output_kinds(recognizer("a\nb\nc\nd"), expected, {})["probs"][0] == "ctc"  # blank + 4 = 5
    assert output_kinds(recognizer("a\nb"), expected, {})["probs"][0] == "sequence"  # 5 classes do not fit
    assert output_kinds(recognizer(None), expected, {})["probs"][0] == "sequence"
    assert output_kinds(recognizer(None), expected, {"probs": "ctc"})["probs"][0] == "ctc"
