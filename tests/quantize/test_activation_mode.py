"""`activations: auto`: dynamic ranges for transformers (attention, MatMul-heavy), static for everything else."""

import numpy as np
from onnx import helper

from graphs import make_model
from qprep.quantize.ort.activations import attention_matmuls, choose
from qprep.report.decisions import decision_lines


def _attention_block():
    """x[1,8,16] → q,k projections (MatMul with weights) → q·kᵀ (a MatMul of two activations) → y[1,8,8]."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["x", "wq"], ["q"], name="q"),
             helper.make_node("MatMul", ["x", "wk"], ["k"], name="k"),
             helper.make_node("Transpose", ["k"], ["kt"], name="kt", perm=[0, 2, 1]),
             helper.make_node("MatMul", ["q", "kt"], ["y"], name="scores")]
    weights = {"wq": rng.standard_normal((16, 16)).astype(np.float32),
               "wk": rng.standard_normal((16, 16)).astype(np.float32)}
    return make_model(nodes, [("x", [1, 8, 16])], [("y", [1, 8, 8])], weights)


def _conv_then_attention():
    """A conv front end [1,4,32,32] → 16 channels whose multiply-adds dwarf a small attention after it."""
    rng = np.random.default_rng(1)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Reshape", ["c", "shape"], ["r"], name="flat"),
             helper.make_node("Transpose", ["r"], ["rt"], name="rt", perm=[0, 2, 1]),
             helper.make_node("MatMul", ["r", "rt"], ["y"], name="gram")]
    weights = {"w": rng.standard_normal((16, 4, 3, 3)).astype(np.float32), "shape": np.array([1, 16, 1024])}
    return make_model(nodes, [("x", [1, 4, 32, 32])], [("y", [1, 16, 16])], weights)


def test_a_transformer_block_gets_dynamic_ranges():
    model = _attention_block()
    assert attention_matmuls(model) == 1
    mode, why = choose(model)
    assert mode == "dynamic" and "1 attention MatMuls" in why


def test_a_conv_model_with_a_little_attention_stays_static():
    mode, why = choose(_conv_then_attention())
    assert mode == "static" and "1 attention MatMuls" in why


def test_the_report_states_the_choice_and_why():
    stage = {"name": "quantize", "status": "ok", "activations": {"configured": "auto", "chosen": "dynamic",
                                                                  "why": "auto: 12 attention MatMuls"}}
    assert decision_lines(stage)[0] == "activations: **dynamic** (auto: 12 attention MatMuls)"
