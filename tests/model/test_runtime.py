"""SessionRecipe: a session built after its model's proto is gone, once."""

import numpy as np
import pytest
from onnx import helper

from graphs import make_model
from qprep.model import io
from qprep.model.runtime import SessionRecipe, ort_session, run_model


@pytest.mark.parametrize("heavy", [False, True])
def test_a_recipe_builds_the_same_session_without_its_model_and_only_once(monkeypatch, heavy):
    if heavy:  # the weights travel as arrays beside the weightless graph
        monkeypatch.setattr(io, "HEAVY_BYTES", 1024)
    rng = np.random.default_rng(0)
    model = make_model([helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
                       [("x", [2, 256])], [("y", [2, 128])],
                       {"w": rng.standard_normal((256, 128)).astype(np.float32)})
    feeds = {"x": rng.standard_normal((2, 256)).astype(np.float32)}
    expected = run_model(model, [feeds])[0]["y"]
    recipe = SessionRecipe(model, extra_outputs=["h"])
    del model
    session = ort_session(recipe)
    y, h = session.run(["y", "h"], feeds)
    np.testing.assert_array_equal(y, expected)
    np.testing.assert_array_equal(np.maximum(h, 0), y)
    with pytest.raises(RuntimeError, match="one session"):
        ort_session(recipe)
