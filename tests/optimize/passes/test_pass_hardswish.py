"""hardswish_for_ort: HardSwish written out as x·clip(x+3, 0, 6)/6 for backend ort only, with the same numbers."""

import numpy as np
import pytest
from onnx import helper

from graphs import apply_pass, make_model, max_diff, ops, rand
from qprep.optimize.passes import PassSettings
from qprep.optimize.passes.hardswish import PASS


def _model(dtype=np.float32):
    return make_model([helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
                       helper.make_node("HardSwish", ["c"], ["y"], name="act")],
                      [("x", [1, 3, 8, 8], dtype)], [("y", [1, 4, 8, 8], dtype)], {"w": rand(4, 3, 1, 1).astype(dtype)},
                      opset=14)


def test_hardswish_is_written_out_for_ort_with_the_same_numbers():
    model = _model()
    out, outcome = apply_pass(PASS, model, PassSettings(backend="ort"))
    assert outcome.matches == 1 and ops(out) == {"Conv": 1, "Add": 1, "Clip": 1, "Div": 1, "Mul": 1}
    assert [o.name for o in out.graph.output] == ["y"]
    assert max_diff(model, out, {"x": rand(1, 3, 8, 8) * 4}) < 1e-6


@pytest.mark.parametrize("backend", ["rknn", "fp16", None])
def test_other_backends_keep_the_op(backend):
    out, outcome = apply_pass(PASS, _model(), PassSettings(backend=backend))
    assert outcome.matches == 0 and ops(out)["HardSwish"] == 1


def test_a_float16_hardswish_is_left_with_the_count():
    out, outcome = apply_pass(PASS, _model(np.float16), PassSettings(backend="ort"))
    assert outcome.matches == 0 and outcome.details == {"left_not_float32": 1}
