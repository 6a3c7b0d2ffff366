"""The ORT build's optional refinements (GPTQ, bias correction) weighed before they run: the rule on injected
costs and gains, the gain estimates on constructed errors, and the backend skipping what the rule refuses."""

import numpy as np
import pytest
from onnx import helper, numpy_helper

from conftest import typed
from graphs import make_model
from qprep.model.prepare import name_nodes
from qprep.quantize import gptq
from qprep.quantize.ort import refinements
from qprep.quantize.ort.output_check import bias_share
from qprep.quantize.ort.quantizer import OrtQuantizer
from qprep.report.decisions import decision_lines


@pytest.mark.parametrize("predicted, gain, runs", [
    (0.9, 0.0, True),  # within one calibration: runs whatever it gains
    (1.5, 0.0, False),  # more than one calibration for nothing
    (1.5, 0.1, True),  # 1 + 10 × 0.1 = 2 calibrations allowed
    (30.0, 2.0, False),  # 21 allowed
    (30.0, 3.0, True),  # 31 allowed
])
def test_a_refinement_runs_when_its_expected_gain_pays_for_its_predicted_cost(predicted, gain, runs):
    record = refinements.decide("a refinement", predicted, gain, calibration_s=1.0)
    assert record["runs"] is runs
    assert record["allowed_s"] == pytest.approx(1.0 + 10.0 * gain)
    assert record["predicted_s"] == predicted and record["expected_gain_db"] == gain


def test_a_refinement_predicted_under_a_quarter_second_runs_whatever_it_gains():
    """A tiny model's calibration takes milliseconds: a rule on them would follow the machine's hiccups."""
    assert refinements.decide("a refinement", 0.2, 0.0, calibration_s=0.01)["runs"] is True
    assert refinements.decide("a refinement", 0.3, 0.0, calibration_s=0.01)["runs"] is False


def test_the_offset_share_of_an_error_is_one_for_an_offset_per_channel_and_zero_for_centred_noise():
    rng = np.random.default_rng(0)
    expected = [{"y": rng.standard_normal((1, 4, 6, 6)).astype(np.float32)} for _ in range(8)]
    offset = np.array([0.5, -1.0, 0.25, 2.0], np.float32)[None, :, None, None]
    shifted = [{"y": e["y"] + offset} for e in expected]
    assert bias_share(expected, shifted) == pytest.approx(1.0)
    noise = rng.standard_normal((8, 1, 4, 6, 6)).astype(np.float32)
    noise -= noise.mean(axis=(0, 1, 3, 4), keepdims=True)  # no mean per channel left, nor per any other axis
    noise -= noise.mean(axis=(0, 1, 2, 3), keepdims=True)
    noise -= noise.mean(axis=(0, 1, 2, 4), keepdims=True)
    noisy = [{"y": e["y"] + n} for e, n in zip(expected, noise)]
    assert bias_share(expected, noisy) < 0.01
    assert bias_share(expected, expected) == 0.0


def test_the_expected_gain_follows_the_share_of_the_error_a_refinement_can_remove():
    assert refinements.noise_share(20.0, 20.0) == pytest.approx(1.0)
    assert refinements.noise_share(20.0, 40.0) == pytest.approx(0.01)
    assert refinements.noise_share(20.0, float("inf")) == 0.0
    assert refinements.expected_gain_db(1.0, 0.5) == pytest.approx(10 * np.log10(2))
    assert refinements.expected_gain_db(0.0, 0.7) == 0.0


def _conv_model():
    rng = np.random.default_rng(1)
    inits = {"w": (rng.standard_normal((8, 4, 3, 3)) * 0.3).astype(np.float32),
             "b": np.linspace(-1, 1, 8).astype(np.float32)}
    model = make_model([helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[1, 1, 1, 1])],
                       [("x", [1, 4, 10, 10])], ["y"], inits, infer_shapes=False)
    name_nodes(model.graph)
    return model


def _samples(count=16):
    rng = np.random.default_rng(0)
    return [{"x": (np.maximum(rng.standard_normal((1, 4, 10, 10)), 0) + 1.0).astype(np.float32)}
            for _ in range(count)]


def test_the_weights_only_model_holds_the_builds_nearest_weights_dequantized(tmp_path):
    model = _conv_model()
    quantized = OrtQuantizer(model, _samples(), typed("ort", weight_rounding="nearest"), tmp_path).build(set())
    layers = gptq.find_layers(quantized, model)
    rounded = refinements.weights_only(quantized, model, layers)
    layer = layers[0]
    integers = numpy_helper.to_array(next(t for t in quantized.graph.initializer if t.name == layer.quantized))
    weight = numpy_helper.to_array(next(t for t in rounded.graph.initializer if t.name == "w"))
    scale = layer.scale.reshape(-1, 1, 1, 1)
    np.testing.assert_allclose(weight, ((integers - layer.zero_point.reshape(-1, 1, 1, 1)) * scale), rtol=1e-6)
    assert not np.array_equal(weight, numpy_helper.to_array(model.graph.initializer[0]))


@pytest.mark.parametrize("affordable", [False, True])
def test_gptq_runs_or_is_skipped_as_the_rule_decides_on_its_predicted_cost(tmp_path, monkeypatch, affordable):
    model, samples = _conv_model(), _samples()
    # the cost injected in calibrations: 0.5 fits the one calibration any refinement may cost, 1e6 fits no gain
    monkeypatch.setattr(refinements, "gptq_seconds", lambda layers, count, per_sample, float_s, check_s, rate:
                        (0.5 if affordable else 1e6) * quantizer.calibration.seconds)
    quantizer = OrtQuantizer(model, samples, typed("ort", bias_correction=False), tmp_path)
    quantized = quantizer.build(set())
    record = quantizer.rounding
    assert record["budget"]["runs"] is affordable
    if affordable:
        assert "calibration_sqnr_db" in record
        return
    assert record["kept"] is False and record["reason"].startswith("skipped: predicted")
    nearest = OrtQuantizer(model, samples, typed("ort", bias_correction=False, weight_rounding="nearest"),
                           tmp_path).build(set())
    assert [numpy_helper.to_array(t).tolist() for t in quantized.graph.initializer] == \
        [numpy_helper.to_array(t).tolist() for t in nearest.graph.initializer]
    lines = decision_lines({"name": "quantize", **_stage_record(quantizer)})
    assert any("GPTQ weight rounding: **not applied** (skipped: predicted" in line for line in lines)


@pytest.mark.parametrize("affordable", [False, True])
def test_bias_correction_runs_or_is_skipped_as_the_rule_decides_on_its_predicted_cost(tmp_path, monkeypatch,
                                                                                      affordable):
    model, samples = _conv_model(), _samples()
    monkeypatch.setattr(refinements, "bias_seconds", lambda layers, float_s, check_s:
                        (0.5 if affordable else 1e6) * quantizer.calibration.seconds)
    quantizer = OrtQuantizer(model, samples, typed("ort", weight_rounding="nearest", per_channel=False), tmp_path)
    quantizer.build(set())
    record = quantizer.bias
    assert record["budget"]["runs"] is affordable
    if affordable:
        assert "calibration_sqnr_db" in record
        return
    assert record["applied"] is False and record["reason"].startswith("skipped: predicted")
    lines = decision_lines({"name": "quantize", **_stage_record(quantizer)})
    assert any("bias correction: **left out** (skipped: predicted" in line for line in lines)


def _stage_record(quantizer) -> dict:
    return {"status": "ok", "backend": "ort", "weight_rounding": quantizer.rounding, "bias_correction": quantizer.bias}
