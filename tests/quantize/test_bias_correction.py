"""Empirical bias correction on tiny graphs quantized by the ORT backend: it removes the channel-mean drift,
layer after layer, and the backend keeps it only when the output error goes down."""

import io
from dataclasses import replace

import numpy as np
import pytest
import onnx
from onnx import helper

from qprep.quantize import bias_correction
from qprep.quantize.ort.output_check import OutputCheck, output_sqnr
from qprep.quantize.ort.quantizer import OrtQuantizer
from qprep.model.prepare import name_nodes
from qprep.model.runtime import run_model
from qprep.progress import Progress
from conftest import run_config, typed
from graphs import make_model

CHANNELS = 8


def _chain() -> onnx.ModelProto:
    """Depthwise 3×3 → Relu → pointwise Conv: the depthwise layer's few products per output drift per channel."""
    rng = np.random.default_rng(0)
    depthwise = rng.standard_normal((CHANNELS, 1, 3, 3)) * np.linspace(0.05, 1.0, CHANNELS)[:, None, None, None]
    pointwise = rng.standard_normal((CHANNELS, CHANNELS, 1, 1)) * 0.3
    inits = {n: a.astype(np.float32) for n, a in
             (("dw", depthwise), ("dw_b", rng.standard_normal(CHANNELS) * 0.1),
              ("pw", pointwise), ("pw_b", rng.standard_normal(CHANNELS) * 0.1))}
    nodes = [helper.make_node("Conv", ["x", "dw", "dw_b"], ["d"], group=CHANNELS, pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["d"], ["r"]),
             helper.make_node("Conv", ["r", "pw", "pw_b"], ["y"])]
    model = make_model(nodes, [("x", [1, CHANNELS, 12, 12])], [("y", [1, CHANNELS, 12, 12])], inits,
                       infer_shapes=False)
    name_nodes(model.graph)
    return model


def _samples(count=16, seed=0):
    rng = np.random.default_rng(seed)
    return [{"x": (np.abs(rng.standard_normal((1, CHANNELS, 12, 12))) + 0.5).astype(np.float32)}
            for _ in range(count)]


def _quantized(model, tmp_path, progress=None, **options):
    # per-tensor weights: one coarse grid for all channels, so the small channels' rounding errors drift
    options = typed("ort", **{"per_channel": False, "weight_rounding": "nearest", **options})
    return OrtQuantizer(model, _samples(), options, tmp_path, progress=progress)


def _drift(model, quantized, layer, samples):
    """Largest |per-channel mean difference| of the layer's output between the float and the quantized model
    (ORT's quantizer drops a Relu after a Conv, so the names differ)."""
    from qprep.model.runtime import intermediate_values

    def means(m, name):
        return np.mean([v[name].mean(axis=(0, 2, 3)) for v in intermediate_values(m, [name], samples)], axis=0)

    return np.abs(means(model, layer.float_output) - means(quantized, layer.output)).max()


def test_layers_are_found_with_their_upstream_layers(tmp_path):
    model = _chain()
    quantized = _quantized(model, tmp_path, bias_correction=False).build(set())
    layers = bias_correction.find_layers(quantized, model)
    first, second = (n.name for n in model.graph.node if n.op_type == "Conv")
    assert [layer.node for layer in layers] == [first, second]
    assert layers[0].upstream == set() and layers[1].upstream == {first}
    assert [[layer.node for layer in wave] for wave in bias_correction.waves(layers)] == [[first], [second]]


def test_correction_removes_the_drift_of_every_layer_and_lowers_the_output_error(tmp_path):
    model = _chain()
    samples = _samples()
    quantized = _quantized(model, tmp_path, bias_correction=False).build(set())
    layers = bias_correction.find_layers(quantized, model)
    corrected = bias_correction.apply(quantized, layers, bias_correction.corrections(quantized, bias_correction.FloatMeans(model, samples), layers, samples))
    for layer in layers:
        before, after = (_drift(model, m, layer, samples) for m in (quantized, corrected))
        assert after < 0.2 * before, f"{layer.node}: drift {before:.4f} → {after:.4f}"
    held_out = _samples(8, seed=5)
    expected = run_model(model, held_out)
    gain = (output_sqnr(expected, run_model(corrected, held_out, optimize=True))
            - output_sqnr(expected, run_model(quantized, held_out, optimize=True)))
    assert gain > 1.0, f"bias correction gained only {gain:.2f} dB"


def test_the_backend_keeps_the_correction_only_when_it_helps(tmp_path, monkeypatch):
    model = _chain()
    plain = _quantized(model, tmp_path, bias_correction=False).build(set())
    lines = io.StringIO()
    helped = _quantized(model, tmp_path, progress=Progress(enabled=True, stream=lines))
    assert helped.build(set()).SerializeToString() != plain.SerializeToString()
    assert helped.bias["applied"] is True and helped.bias["layers"] == 2
    assert "bias correction: 2 layers in 2 waves over 16 calibration samples" in lines.getvalue()
    assert ", kept (" in lines.getvalue()

    def harmful(quantized, float_model, layers, samples, threads=2, budget=None):
        return {layer.node: np.full(CHANNELS, 5.0) for layer in layers}

    monkeypatch.setattr(bias_correction, "corrections", harmful)
    refused = _quantized(model, tmp_path)
    assert refused.build(set()).SerializeToString() == plain.SerializeToString()
    assert refused.bias["applied"] is False and refused.bias["layers"] == 2


def test_each_build_takes_its_settings_and_the_quantizer_keeps_the_configured_ones(tmp_path):
    """The fallback measures bias correction on and off with one quantizer: settings go with each build (and key
    its cache), they are never set on the quantizer."""
    model = _chain()
    plain = _quantized(model, tmp_path, bias_correction=False).build(set())
    quantizer = _quantized(model, tmp_path)
    configured = quantizer.settings
    corrected = quantizer.build(set(), configured)
    without = quantizer.build(set(), replace(configured, bias_correction=False))
    assert without.SerializeToString() == plain.SerializeToString() and quantizer.bias["applied"] is False
    assert quantizer.build(set(), configured).SerializeToString() == corrected.SerializeToString()
    assert quantizer.settings == configured and quantizer.bias["applied"] is True
    with pytest.raises(ValueError, match="bias correction was not configured"):
        _quantized(model, tmp_path, bias_correction=False).build(set(), configured)


def _run(tmp_path, quantize: dict) -> dict:
    config = {"model": "m.onnx", "calibration": {"source": "calib"}, "output_dir": "out",
              "evaluation": {"source": "eval", "latency": {"runs": 0}, "gate": {"cosine_mean": 0.0}},
              "pipeline": [{"quantize": {"backend": "ort", **quantize}}]}
    done, report = run_config(tmp_path, config)
    assert done.returncode == 0, done.stderr
    return report


@pytest.mark.slow
def test_a_fallback_whose_target_bias_correction_meets_makes_nothing_float(tmp_path):
    """Between the plain and the corrected model's cosine, the target is met by the corrected base: no search."""
    onnx.save(_chain(), str(tmp_path / "m.onnx"))
    for split, samples in (("calib", _samples()), ("eval", _samples(24, seed=3))):
        (tmp_path / split).mkdir()
        for i, sample in enumerate(samples):
            np.save(tmp_path / split / f"{i}.npy", sample["x"])
    plain_ort = {"per_channel": False, "weight_rounding": "nearest", "bias_correction": False}
    cosine = {on: _run(tmp_path, {"ort": {**plain_ort, "bias_correction": on}})["evaluation"]["outputs"]["y"]
              ["cosine_mean"] for on in (False, True)}
    assert cosine[True] > cosine[False]
    target = {"cosine_mean": (cosine[True] + cosine[False]) / 2}
    report = _run(tmp_path, {"ort": {**plain_ort, "bias_correction": True}, "fallback": {"target": target}})
    stage = report["stages"][-1]
    assert stage["fallback"]["passed"] and stage["fallback"]["float_nodes"] == []
    assert stage["fallback"]["bias_correction"]["kept"] is True and stage["bias_correction"]["applied"] is True
    assert report["evaluation"]["outputs"]["y"]["cosine_mean"] >= target["cosine_mean"]


def test_a_wave_that_would_not_end_within_the_budget_is_not_started(tmp_path, monkeypatch):
    """The first wave takes 50 s on a fake clock and the caller's check of the whole model 30 s (recorded as
    "bias check"); 100 s left: the second wave and the two check runs after it (110 s) cannot fit, so only the
    first layer is corrected."""
    from qprep.quantize.budget import Budget

    model = _chain()
    quantized = _quantized(model, tmp_path, bias_correction=False).build(set())
    layers = bias_correction.find_layers(quantized, model)
    clock = [0.0]
    monkeypatch.setattr(bias_correction.time, "perf_counter", lambda: clock[0])
    measure = bias_correction._channel_means

    def slow_means(*args):
        clock[0] += 50.0
        return measure(*args)

    monkeypatch.setattr(bias_correction, "_channel_means", slow_means)
    budget = Budget(200, started=-50.0)  # the float model's means (one run) ended at 50 s of the budget
    budget.record("bias check", 30.0)
    shifts = bias_correction.corrections(quantized, bias_correction.FloatMeans(model, _samples()), layers, _samples(), budget=budget)
    assert list(shifts) == [layers[0].node]
    assert budget.durations["bias wave"] == [50.0] and budget.skipped[0].startswith("bias correction waves 2+")
    full = bias_correction.corrections(quantized, bias_correction.FloatMeans(model, _samples()), layers, _samples(), budget=Budget(1000, started=clock[0]))
    assert list(full) == [layer.node for layer in layers]


@pytest.mark.parametrize("gain", [0.5, 2.0])
def test_the_backend_keeps_a_correction_only_when_it_gains_the_minimum(tmp_path, monkeypatch, gain):
    """Calibration SQNR 10 dB before the correction, 10 + gain × MIN_GAIN_DB after: kept only above the bar (a
    smaller rise is within the estimate's noise)."""
    sqnrs = iter([10.0, 10.0 + gain * bias_correction.MIN_GAIN_DB, 9.0])  # before, both waves, the first wave
    monkeypatch.setattr(OutputCheck, "sqnr", lambda self, model: (next(sqnrs),))
    quantizer = _quantized(_chain(), tmp_path)
    quantizer.build(set())
    assert quantizer.bias["applied"] is (gain > 1)
    if gain < 1:
        assert quantizer.bias["reason"] == f"not better by {bias_correction.MIN_GAIN_DB:g} dB: no correction"


def test_prefixes_are_the_first_1_2_4_and_all_waves_each_with_its_upstream_layers():
    layers = [bias_correction.BiasLayer(f"l{k}", f"o{k}", f"f{k}", f"b{k}", np.ones(1), 1,
                                        {f"l{k - 1}"} if k else set()) for k in range(6)]  # a chain: 6 waves
    shifts = {layer.node: np.full(1, float(k)) for k, layer in enumerate(layers)}
    found = bias_correction.prefixes(layers, shifts)
    assert [count for count, _ in found] == [1, 2, 4, 6]
    assert [sorted(subset) for _, subset in found] == [["l0"], ["l0", "l1"], ["l0", "l1", "l2", "l3"],
                                                       [f"l{k}" for k in range(6)]]
    cut = {name: shift for name, shift in shifts.items() if name in ("l0", "l1", "l2")}  # the budget stopped it
    assert [count for count, _ in bias_correction.prefixes(layers, cut)] == [1, 2, 3]
    assert bias_correction.prefixes(layers, {}) == []


@pytest.mark.parametrize("sqnrs, kept", [([10.0, 4.0, 11.0], 1), ([10.0, 12.0, 11.0], 2), ([10.0, 4.0, 9.0], 0)])
def test_the_backend_keeps_the_prefix_of_waves_that_measures_best(tmp_path, monkeypatch, sqnrs, kept):
    """Calibration SQNR before, with both waves, with the first: the better correction is kept if it beats none
    (PP-LCNet orientation: all 32 waves 44.4 → 26.0 dB, the first alone 45.6)."""
    values = iter(sqnrs)
    monkeypatch.setattr(OutputCheck, "sqnr", lambda self, model: (next(values),))
    quantizer = _quantized(_chain(), tmp_path)
    model = quantizer.build(set())
    record = quantizer.bias
    assert record["sqnr_db_by_waves"] == {2: sqnrs[1], 1: sqnrs[2]}
    assert record["applied"] is bool(kept) and record["layers"] == 2
    assert record.get("layers_kept") == (1 if kept == 1 else None)
    changed = [t.name for t, before in zip(model.graph.initializer, _quantized(_chain(), tmp_path, bias_correction=False)
                                           .build(set()).graph.initializer) if t.SerializeToString() != before.SerializeToString()]
    assert len(changed) == kept  # the int32 biases moved: the first layer's, both, or none


def _whole_model_shifts(quantized, model, layers, samples):
    """The corrections as measured by running the whole model, corrected so far, per wave (the reference)."""
    from qprep.model.runtime import intermediate_values

    def means(m, name):
        values = [v[name] for v in intermediate_values(m, [name], samples)]
        axis = tuple(i for i in range(values[0].ndim) if i != 1)
        return np.mean([v.mean(axis=axis) for v in values], axis=0)

    reference = {}
    for wave in bias_correction.waves(layers):
        corrected = bias_correction.apply(quantized, layers, reference)
        for layer in wave:
            reference[layer.node] = means(model, layer.float_output) - means(corrected, layer.output)
    return reference


@pytest.mark.parametrize("held_cap", [None, 0])
def test_wave_by_wave_runs_of_the_parts_match_whole_model_runs_of_the_corrected_model(tmp_path, monkeypatch,
                                                                                     held_cap):
    """The corrections measured from the parts each wave adds (runtime.Stepwise, its layers' shifts added to
    what later waves read) are the ones measured by running the whole model, corrected so far, per wave; the
    waves after the held tensors outgrow MAX_HELD_BYTES are measured that way."""
    if held_cap is not None:
        monkeypatch.setattr(bias_correction, "MAX_HELD_BYTES", held_cap)
    model = _chain()
    samples = _samples()
    quantized = _quantized(model, tmp_path, bias_correction=False).build(set())
    layers = bias_correction.find_layers(quantized, model)
    shifts = bias_correction.corrections(quantized, bias_correction.FloatMeans(model, samples), layers, samples)
    reference = _whole_model_shifts(quantized, model, layers, samples)
    assert set(shifts) == set(reference) == {layer.node for layer in layers}
    for node, shift in shifts.items():
        np.testing.assert_allclose(shift, reference[node], rtol=1e-3, atol=1e-5)
    assert np.abs(reference[layers[1].node]).max() > 1e-3  # a second wave that has something to correct


def _if_between(quantized: bool) -> onnx.ModelProto:
    """Conv K → Conv L → If (its branches read L's output from the outer graph) → Conv M, a float model or its
    hand-made QDQ form (int32 biases; weights 10% off, so every layer drifts)."""
    rng = np.random.default_rng(0)
    nodes, inits = [], {"lo": np.array(-1e9, np.float32)}
    for name, source in (("K", "x"), ("L", "k"), ("M", "i")):
        inits[f"w{name}"] = (rng.standard_normal((2, 2, 1, 1)) * (1.1 if quantized else 1.0)).astype(np.float32)
        bias = rng.standard_normal(2).astype(np.float32)
        if quantized:
            inits[f"q{name}"], inits[f"s{name}"] = np.round(bias / 1e-3).astype(np.int32), np.array(1e-3, np.float32)
            nodes.append(helper.make_node("DequantizeLinear", [f"q{name}", f"s{name}"], [f"b{name}"], name=f"dq{name}"))
        else:
            inits[f"b{name}"] = bias
        nodes.append(helper.make_node("Conv", [source, f"w{name}", f"b{name}"], [name.lower()], name=name))
        if name == "L":
            body = helper.make_graph([helper.make_node("Relu", ["l"], ["z"])], "body", [],
                                     [helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, None)])
            nodes += [helper.make_node("ReduceSum", ["x"], ["t"], keepdims=0, name="sum"),
                      helper.make_node("Greater", ["t", "lo"], ["c"], name="greater"),
                      helper.make_node("If", ["c"], ["i"], then_branch=body, else_branch=body, name="if")]
    return make_model(nodes, [("x", [1, 2, 3, 3])], [("m", [1, 2, 3, 3])], inits, infer_shapes=False)


def test_a_layer_read_inside_an_if_branch_is_upstream_of_the_layers_after_the_if():
    """What an If's branches read counts as its input: M after the If is measured after L (whose output only a
    branch reads) and with L's and K's corrections, as a whole-model run of the corrected model measures it."""
    model, quantized = _if_between(False), _if_between(True)
    samples = [{"x": x} for x in np.random.default_rng(1).standard_normal((4, 1, 2, 3, 3)).astype(np.float32)]
    layers = bias_correction.find_layers(quantized, model)
    assert [[layer.node for layer in wave] for wave in bias_correction.waves(layers)] == [["K"], ["L"], ["M"]]
    shifts = bias_correction.corrections(quantized, bias_correction.FloatMeans(model, samples), layers, samples)
    reference = _whole_model_shifts(quantized, model, layers, samples)
    for node in "KLM":
        np.testing.assert_allclose(shifts[node], reference[node], rtol=1e-4, atol=1e-6)


def test_the_float_models_means_are_measured_once_per_tensor_across_corrections(tmp_path, monkeypatch):
    """Each float set's correction compares with the same float model: its means are run for once, and a
    second correction (another float set) computes the same shifts without running the float model again."""
    model, samples = _chain(), _samples()
    quantized = _quantized(model, tmp_path, bias_correction=False).build(set())
    layers = bias_correction.find_layers(quantized, model)
    means = bias_correction.FloatMeans(model, samples)
    first = bias_correction.corrections(quantized, means, layers, samples)
    runs = []
    real = bias_correction.intermediate_values
    monkeypatch.setattr(bias_correction, "intermediate_values", lambda m, *a: runs.append(m) or real(m, *a))
    second = bias_correction.corrections(quantized, means, layers, samples)
    assert not any(m is model for m in runs)  # (the QDQ model runs part by part: Stepwise)
    assert first.keys() == second.keys() and all(np.array_equal(first[k], second[k]) for k in first)
