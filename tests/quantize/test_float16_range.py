"""Float16 range: a chain whose values overflow float16 (a log-power spectrum of 16-bit audio, a dense layer
feeding a LayerNorm) is scaled down by a power of two from its weighted start and restored where it ends, exactly
in float32 and finite in float16; a chain no weight starts, or one that would change the outputs, is left."""

import warnings

import numpy as np
import onnx
import pytest
from onnx import helper
from onnx.reference import ReferenceEvaluator
from onnxconverter_common import float16

from graphs import make_model, ops
from qprep.model.runtime import intermediate_values, run_model
from qprep.quantize import float16_range, nonfinite

FRAMES, BINS, MELS = 5, 16, 6


def _log_power(power_is_output: bool = False) -> onnx.ModelProto:
    """16-bit audio frames → MatMul (an STFT) → Pow 2 → MatMul (a mel filterbank) → Clip(1e-10, inf) → Log →
    Mul 10/ln 10 (dB): the STFT reaches ~1e5, its power ~1e10 (openWakeWord's melspectrogram, in small)."""
    rng = np.random.default_rng(0)
    weights = {"stft": rng.standard_normal((BINS, BINS)).astype(np.float32),
               "two": np.array(2.0, np.float32),
               "mel": rng.uniform(0, 0.05, (BINS, MELS)).astype(np.float32),
               "low": np.array(1e-10, np.float32), "high": np.array(np.inf, np.float32),
               "db": np.array(10 / np.log(10), np.float32)}
    nodes = [helper.make_node("MatMul", ["audio", "stft"], ["spectrum"], name="stft"),
             helper.make_node("Pow", ["spectrum", "two"], ["power"], name="power"),
             helper.make_node("MatMul", ["power", "mel"], ["mel_power"], name="filterbank"),
             helper.make_node("Clip", ["mel_power", "low", "high"], ["clipped"], name="floor"),
             helper.make_node("Log", ["clipped"], ["log"], name="log"),
             helper.make_node("Mul", ["log", "db"], ["decibels"], name="decibels")]
    outputs = [("decibels", [1, FRAMES, MELS])] + ([("power", [1, FRAMES, BINS])] if power_is_output else [])
    return make_model(nodes, [("audio", [1, FRAMES, BINS])], outputs, weights, opset=17)


def _audio(count: int = 4, loudness: float = 20000.0) -> list[dict]:
    rng = np.random.default_rng(1)
    return [{"audio": (rng.uniform(-1, 1, (1, FRAMES, BINS)) * loudness).astype(np.float32)} for _ in range(count)]


def _in_float16(model: onnx.ModelProto, samples: list[dict]) -> list[dict]:
    """The outputs of `model` computed in float16 throughout, as the NPU's float layers do (numpy float16 through
    ONNX's reference evaluator: ONNX Runtime's CPU kernels would compute several of these ops in float32)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # float16's inf is the point here; onnxconverter-common's clip warnings
        half = float16.convert_float_to_float16(model, keep_io_types=True, min_positive_val=1e-30,
                                                max_finite_val=1e30)
        evaluator = ReferenceEvaluator(half)
        return [dict(zip(evaluator.output_names, evaluator.run(None, sample))) for sample in samples]


def _activations_beyond_float16(model, samples) -> list[str]:
    return [name for name, t in nonfinite.find(model, samples).tensors.items() if t["kind"] == "activation"]


def test_a_log_power_spectrum_is_scaled_into_float16_and_restored_by_an_add_after_the_log():
    model, samples = _log_power(), _audio()
    assert not np.isfinite(_in_float16(model, samples)[0]["decibels"]).all()  # as exported: inf in float16

    scaled = float16_range.scale(model, samples)

    record = scaled.record
    assert record["scaled"] and record["starts"] == ["stft"] and set(record["log_offsets"]) == {"log"}
    exponent = int(record["scale"].split("-")[1])
    assert record["log_offsets"]["log"] == pytest.approx(2 * exponent * np.log(2), rel=1e-6)  # -2·log s
    assert ops(scaled.model)["Add"] == 1 and scaled.float_nodes == {"log": ["log", "log_unscaled"]}
    assert scaled.chain == ["stft", "power", "filterbank", "floor", "log"]
    assert scaled.carried({"log", "power"}) == {"log", "power", "log_unscaled"}
    assert scaled.carried({"power"}) == {"power"}
    # exact in float32, within float16 / HEADROOM inside, and finite and close in float16
    for before, after in zip(run_model(model, samples), run_model(scaled.model, samples)):
        np.testing.assert_allclose(after["decibels"], before["decibels"], rtol=1e-5)
    assert _activations_beyond_float16(scaled.model, samples) == []
    peaks = [max(np.abs(v).max() for v in values.values())
             for values in intermediate_values(scaled.model, ["spectrum", "power", "mel_power"], samples)]
    assert max(peaks) <= float16_range.BOUND
    for before, half in zip(run_model(model, samples), _in_float16(scaled.model, samples)):
        assert np.abs(half["decibels"] - before["decibels"]).max() < 0.25  # float16's step at 90 dB: 0.0625


def test_a_scaled_tensor_that_is_an_output_is_restored_under_its_own_name_while_the_chain_reads_it_scaled():
    model, samples = _log_power(power_is_output=True), _audio()
    scaled = float16_range.scale(model, samples)
    assert scaled.record["restored"] == {"power": 2.0}
    restore = next(n for n in scaled.model.graph.node if n.op_type == "Mul" and n.output[0] == "power")
    filterbank = next(n for n in scaled.model.graph.node if n.name == "filterbank")
    assert filterbank.input[0] == restore.input[0] != "power"  # the filterbank reads the scaled power
    assert scaled.record["still_overflowing"] == ["power"]  # the output itself is as large as before
    for before, after in zip(run_model(model, samples), run_model(scaled.model, samples)):
        for name in before:
            np.testing.assert_allclose(after[name], before[name], rtol=1e-5)


def test_a_layernorm_takes_the_scale_in_its_epsilon():
    """magika's shape: a dense layer reaching millions, a bias, a LayerNorm (scale-free but for its epsilon)."""
    rng = np.random.default_rng(2)
    weights = {"w": (rng.standard_normal((8, 8)) * 3e4).astype(np.float32),
               "b": (rng.standard_normal(8) * 1e5).astype(np.float32),
               "gamma": np.ones(8, np.float32), "beta": np.zeros(8, np.float32)}
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="dense"),
             helper.make_node("Add", ["h", "b"], ["hb"], name="bias"),
             helper.make_node("LayerNormalization", ["hb", "gamma", "beta"], ["y"], name="norm", axis=-1,
                              epsilon=1e-3)]
    model = make_model(nodes, [("x", [1, 4, 8])], [("y", [1, 4, 8])], weights, opset=17)
    samples = [{"x": rng.standard_normal((1, 4, 8)).astype(np.float32) * 10} for _ in range(3)]
    scaled = float16_range.scale(model, samples)
    exponent = int(scaled.record["scale"].split("-")[1])
    assert scaled.record["epsilons"]["norm"] == pytest.approx(1e-3 * 2.0 ** (-2 * exponent), rel=1e-5)
    squares = [float((v["hb"].astype(np.float64) ** 2).max()) for v in intermediate_values(scaled.model, ["hb"], samples)]
    assert max(squares) <= float16_range.BOUND  # the LayerNorm's variance fits float16 too, not only its input
    assert _activations_beyond_float16(scaled.model, samples) == []
    for before, after in zip(run_model(model, samples), run_model(scaled.model, samples)):
        np.testing.assert_allclose(after["y"], before["y"], rtol=1e-4, atol=1e-5)


def test_a_chain_no_constant_weight_starts_is_left_with_its_reason():
    """x·x of a loud input: nothing inside the model can take a scale (the input is the user's)."""
    model = make_model([helper.make_node("Mul", ["x", "x"], ["square"], name="square"),
                        helper.make_node("Log", ["square"], ["y"], name="log")],
                       [("x", [1, 8])], [("y", [1, 8])], opset=17)
    samples = [{"x": np.full((1, 8), 1000.0, np.float32)}]
    scaled = float16_range.scale(model, samples)
    assert scaled.model is model and not scaled.chain
    assert scaled.record == {"overflowing": 1, "scaled": False,
                             "reason": "'square' overflows float16 and its chain reaches the input 'x' before any node "
                                       "with a constant weight"}


def test_a_chain_that_meets_a_tensor_of_another_scale_is_left():
    """The dense output is added to the raw input: the input would need the scale too."""
    rng = np.random.default_rng(3)
    weights = {"w": (rng.standard_normal((8, 8)) * 1e3).astype(np.float32)}
    model = make_model([helper.make_node("MatMul", ["x", "w"], ["h"], name="dense"),
                        helper.make_node("Add", ["h", "x"], ["y"], name="mix")],
                       [("x", [1, 8])], [("y", [1, 8])], weights, opset=17)
    scaled = float16_range.scale(model, [{"x": np.full((1, 8), 100.0, np.float32)}])
    assert scaled.model is model and scaled.record["reason"] == (
        "'y' overflows float16 and its chain reaches the input 'x' before any node with a constant weight")


def test_a_gemm_whose_bias_is_an_activation_starts_no_chain():
    """Gemm(x, W, C=x): C would need the scale as much as x·W, so the Gemm is no start and the walk goes on to
    the input (before: the reason named 'x' a constant qprep cannot scale)."""
    rng = np.random.default_rng(3)
    weights = {"w": (rng.standard_normal((8, 8)) * 1e3).astype(np.float32)}
    model = make_model([helper.make_node("Gemm", ["x", "w", "x"], ["h"], name="dense"),
                        helper.make_node("Relu", ["h"], ["y"], name="relu")],
                       [("x", [1, 8])], [("y", [1, 8])], weights, opset=17)
    scaled = float16_range.scale(model, [{"x": np.full((1, 8), 100.0, np.float32)}])
    assert scaled.model is model and scaled.record["reason"].endswith(
        "its chain reaches the input 'x' before any node with a constant weight")


def test_nothing_overflowing_is_nothing_to_do():
    model, samples = _log_power(), _audio(loudness=1.0)
    scaled = float16_range.scale(model, samples)
    assert scaled.model is model and scaled.record == {} and scaled.carried({"log"}) == {"log"}


def test_a_sum_of_two_degrees_is_left():
    """A dense output plus its own square: scaled by s and by s², the sum has no single scale."""
    rng = np.random.default_rng(4)
    weights = {"w": (rng.standard_normal((8, 8)) * 1e3).astype(np.float32), "two": np.array(2.0, np.float32)}
    model = make_model([helper.make_node("MatMul", ["x", "w"], ["h"], name="dense"),
                        helper.make_node("Pow", ["h", "two"], ["h2"], name="square"),
                        helper.make_node("Add", ["h", "h2"], ["y"], name="mix")],
                       [("x", [1, 8])], [("y", [1, 8])], weights, opset=17)
    scaled = float16_range.scale(model, [{"x": np.full((1, 8), 100.0, np.float32)}])
    assert scaled.model is model and scaled.record["reason"] == "Add 'mix' reads tensors of different scales"


@pytest.mark.parametrize("start", ["weight_first", "divided"])
def test_the_start_may_be_a_weight_times_x_or_x_over_a_constant(start):
    """W·x (the weight as MatMul's first input) and x / c: their constant takes the scale (c divided by it)."""
    rng = np.random.default_rng(5)
    if start == "weight_first":
        weights = {"w": (rng.standard_normal((8, 8)) * 1e3).astype(np.float32)}
        first = helper.make_node("MatMul", ["w", "x"], ["h"], name="start")
    else:
        weights = {"w": np.array(1e-3, np.float32)}
        first = helper.make_node("Div", ["x", "w"], ["h"], name="start")
    weights["two"] = np.array(2.0, np.float32)
    model = make_model([first, helper.make_node("Pow", ["h", "two"], ["h2"], name="square"),
                        helper.make_node("Log", ["h2"], ["y"], name="log")],
                       [("x", [8, 8])], [("y", [8, 8])], weights, opset=17)
    samples = [{"x": rng.uniform(1, 100, (8, 8)).astype(np.float32)}]
    scaled = float16_range.scale(model, samples)
    assert scaled.record["starts"] == ["start"] and _activations_beyond_float16(scaled.model, samples) == []
    for before, after in zip(run_model(model, samples), run_model(scaled.model, samples)):
        np.testing.assert_allclose(after["y"], before["y"], rtol=1e-5)


def test_the_walk_back_through_many_residual_adds_visits_each_tensor_once():
    """Forty residual blocks h = h + Relu(h): 2^40 paths back to the one start (a walk per path: days)."""
    rng = np.random.default_rng(6)
    weights = {"w": np.abs(rng.standard_normal((8, 8)) * 1e3).astype(np.float32)}
    nodes, h = [helper.make_node("MatMul", ["x", "w"], ["h0"], name="dense")], "h0"
    for k in range(40):
        nodes += [helper.make_node("Relu", [h], [f"r{k}"], name=f"relu{k}"),
                  helper.make_node("Add", [h, f"r{k}"], [f"h{k + 1}"], name=f"add{k}")]
        h = f"h{k + 1}"
    nodes.append(helper.make_node("Log", [h], ["y"], name="log"))
    model = make_model(nodes, [("x", [1, 8])], [("y", [1, 8])], weights, opset=17)
    samples = [{"x": rng.uniform(10, 100, (1, 8)).astype(np.float32)}]
    scaled = float16_range.scale(model, samples)
    assert scaled.record["starts"] == ["dense"] and scaled.record["scaled"]
    for before, after in zip(run_model(model, samples), run_model(scaled.model, samples)):
        np.testing.assert_allclose(after["y"], before["y"], rtol=1e-5)


def _exit_model(named: bool = True) -> onnx.ModelProto:
    """The dense output feeds the chain (Pow, Log) and a Tanh outside it, which must read its true values."""
    weights = {"w": np.abs(np.random.default_rng(7).standard_normal((8, 8)) * 1e3).astype(np.float32),
               "two": np.array(2.0, np.float32)}
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Pow", ["h", "two"], ["h2"]),
             helper.make_node("Log", ["h2"], ["l"]), helper.make_node("Tanh", ["h"], ["t"]),
             helper.make_node("Add", ["l", "t"], ["y"])]
    for k, node in enumerate(nodes):
        node.name = f"n{k}" if named else ""
    return make_model(nodes, [("x", [1, 8])], [("y", [1, 8])], weights, opset=17)


def test_a_node_outside_the_chain_reads_the_restored_values_and_unnamed_nodes_are_left():
    samples = [{"x": np.random.default_rng(8).uniform(1, 100, (1, 8)).astype(np.float32)}]
    model = _exit_model()
    scaled = float16_range.scale(model, samples)
    assert scaled.record["restored"] == {"h": 1.0} and scaled.record["log_offsets"]
    tanh = next(n for n in scaled.model.graph.node if n.op_type == "Tanh")
    assert tanh.input[0] == "h"  # the restoring Mul's output, under the tensor's own name
    np.testing.assert_allclose(run_model(scaled.model, samples)[0]["y"], run_model(model, samples)[0]["y"], rtol=1e-5)
    unnamed = _exit_model(named=False)
    left = float16_range.scale(unnamed, samples)
    assert left.model is unnamed and left.record["reason"] == "its nodes have no unique names"


@pytest.mark.parametrize("bounds", ["attributes", "computed"])
def test_a_clip_whose_bounds_are_no_constant_tensors_is_left(bounds):
    """An opset-10 Clip keeps min/max as attributes, a computed bound is no constant: neither can take the scale
    (the calibration samples may never reach the floor, so the float32 check would not see it)."""
    rng = np.random.default_rng(9)
    weights = {"w": np.abs(rng.standard_normal((8, 8)) * 1e3).astype(np.float32), "floor": np.array(1.0, np.float32)}
    if bounds == "attributes":
        clip = [helper.make_node("Clip", ["h"], ["c"], name="clip", min=1e-3)]
    else:
        clip = [helper.make_node("Identity", ["floor"], ["low"], name="low"),
                helper.make_node("Clip", ["h", "low"], ["c"], name="clip")]
    model = make_model([helper.make_node("MatMul", ["x", "w"], ["h"], name="dense"), *clip,
                        helper.make_node("Log", ["c"], ["y"], name="log")],
                       [("x", [1, 8])], [("y", [1, 8])], weights, opset=10 if bounds == "attributes" else 17)
    scaled = float16_range.scale(model, [{"x": rng.uniform(10, 100, (1, 8)).astype(np.float32)}])
    assert scaled.model is model and scaled.record["reason"] == "Clip 'clip' has bounds that are no constant tensors"
