"""Non-finite and float16-overflowing values (additive attention masks) never reach a calibrator: found by the
graph's constants and the calibration statistics, kept float with a reason, on a tiny masked attention."""

import numpy as np
import onnx
import pytest
from onnx import helper

from qprep.errors import EXIT_INTERNAL
from qprep.quantize import nonfinite
from qprep.model.runtime import intermediate_values
from qprep.quantize.ranges import mse_ranges
from conftest import typed
from graphs import (log_power_model, make_model, masked_attention_model, masked_attention_samples,
                    power_samples)

MASK_CHAIN = {"mask_where", "mask_rows", "mask_add", "softmax"}  # the mask until the Softmax that reads it


@pytest.mark.parametrize("style, fill, producer", [("where", -np.inf, "mask_where"),
                                                    ("scale", np.finfo(np.float32).min, "mask_scale")])
def test_the_mask_chain_is_found_by_values_not_names(style, fill, producer):
    found = nonfinite.find(masked_attention_model(fill, style), masked_attention_samples(4))
    assert set(found.nodes) == MASK_CHAIN - {"mask_where"} | {producer}
    assert {name: t["kind"] for name, t in found.tensors.items()} == {
        "fill": "constant", "additive": "activation", "additive_rows": "activation", "masked": "activation"}
    assert found.tensors["masked"]["min"] == float(np.float32(fill)) and 0 < found.tensors["masked"]["max"] < 100
    assert found.nodes["softmax"].startswith("reads 'masked' (activation, values [")
    record = found.record()
    assert record["limit"] == 65504.0 and {t["tensor"] for t in record["tensors"]} == set(found.tensors)


def _masked_rise(model, samples) -> float:
    """What mask_bound should find, computed here with numpy: the highest a padded key's score rises above the
    largest real one of its row."""
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    rise = 0.0
    for sample in samples:
        x, real = sample["x"][0], sample["mask"][0] > 0
        scores = (x @ weights["wq"]) @ (x @ weights["wk"]).T
        if real.all():
            continue
        rise = max(rise, float((scores[:, ~real] - scores[:, real].max(axis=1, keepdims=True)).max()))
    return max(rise, 0.0)


@pytest.mark.parametrize("style, fill", [("where", -np.inf), ("scale", np.finfo(np.float32).min), ("scale", -1e4)])
def test_the_mask_fill_bound_is_the_highest_masked_score_rise_doubled_plus_a_margin(style, fill):
    """An int8 attention spreads its grid over the mask's fill (MiniLM on RKNN: fill -10000 cosine 0.49, -60
    0.83): the fill needs only to sink every masked key well below its row's largest real score."""
    model, samples = masked_attention_model(fill, style), masked_attention_samples(6)
    bound = nonfinite.mask_bound(model, samples)
    rise = _masked_rise(model, samples)
    assert rise > 0.5  # these samples do have padded keys scoring above the real ones
    assert bound.bound == pytest.approx(2 * rise + nonfinite.MASK_MARGIN, rel=1e-5)
    assert bound.excess == pytest.approx(rise, rel=1e-5)
    assert bound.adds == ["mask_add"] and bound.constants == {"fill"}


def test_a_later_attention_s_mask_is_found_although_its_scores_come_from_the_fill_too():
    """Layer 2's scores are computed from layer 1's output, which the fill reached through layer 1's softmax:
    the mask side is the one that no earlier attention computes (all-MiniLM-L6-v2: only layer 0 was found)."""
    model, samples = masked_attention_model(np.finfo(np.float32).min, "scale", layers=3), masked_attention_samples(6)
    bound = nonfinite.mask_bound(model, samples)
    assert sorted(bound.adds) == ["mask_add", "mask_add_2", "mask_add_3"]
    assert bound.mask_inputs == {name: "additive_rows" for name in bound.adds}
    # queries 10x smaller after the first attention: their masked keys rise less, so their own bounds are lower
    assert bound.own["mask_add"] == pytest.approx(bound.bound)
    assert bound.own["mask_add_2"] < bound.bound and bound.own["mask_add_3"] < bound.bound


def test_each_attention_s_mask_is_scaled_to_its_own_fill():
    model, samples = masked_attention_model(np.finfo(np.float32).min, "scale", layers=2), masked_attention_samples(6)
    bound = nonfinite.mask_bound(model, samples)
    clipped, _ = nonfinite.clip_constants(model, nonfinite.find(model, samples), 1e4, bounds={"fill": bound.bound})
    scaled, fills = nonfinite.own_fills(clipped, bound)
    assert fills == {"mask_add_2": pytest.approx(bound.own["mask_add_2"], abs=1e-3)}
    values = list(intermediate_values(scaled, ["masked_2", "masked", "y_2"], samples))
    padded = [s["mask"][0] == 0 for s in samples]
    # layer 2's padded keys sit near its own fill, layer 1's near the shared one; the outputs do not move
    assert min(v["masked_2"][0][:, p].max() for v, p in zip(values, padded) if p.any()) < -0.9 * fills["mask_add_2"]
    assert min(v["masked_2"].min() for v in values) > -1.2 * fills["mask_add_2"]
    assert min(v["masked"].min() for v in values) < -0.9 * bound.bound
    reference = list(intermediate_values(model, ["y_2"], samples))
    assert max(np.abs(v["y_2"] - r["y_2"]).max() for v, r in zip(values, reference)) < 1e-5


def test_a_mask_that_carries_more_than_the_fill_keeps_the_shared_one():
    """A position bias added to the mask would be scaled with it: such a mask is left as it is."""
    model = masked_attention_model(np.finfo(np.float32).min, "scale", layers=2)
    biased = next(n for n in model.graph.node if n.name == "mask_add_2")
    biased.input[1] = "biased_rows"
    model.graph.node.insert(list(model.graph.node).index(biased),
                            helper.make_node("Add", ["additive_rows", "bias"], ["biased_rows"], name="bias_add"))
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.full((1, 1, 6), 0.5, np.float32), "bias"))
    samples = masked_attention_samples(6)
    bound = nonfinite.mask_bound(model, samples)
    assert "mask_add_2" in bound.adds and "mask_add_2" not in bound.own
    assert nonfinite.own_fills(model, bound)[1] == {}


def test_no_mask_bound_without_a_softmax_reading_the_masked_sum():
    nodes = [helper.make_node("Add", ["x", "fill"], ["y"], name="add")]
    model = make_model(nodes, [("x", [1, 4])], [("y", [1, 4])], {"fill": np.array([0, 0, 0, -1e30], np.float32)})
    samples = [{"x": np.ones((1, 4), np.float32)}]
    assert nonfinite.mask_bound(model, samples) is None


def test_ordinary_values_and_a_float16_sized_mask_are_left_to_the_calibrator():
    assert not nonfinite.find(masked_attention_model(-1e4), masked_attention_samples(4)).nodes


def test_a_mask_fed_as_data_keeps_its_readers_float():
    model = make_model([helper.make_node("Add", ["scores", "mask"], ["masked"], name="add"),
                        helper.make_node("Softmax", ["masked"], ["y"], name="softmax")],
                       [("scores", [1, 4]), ("mask", [1, 4])], [("y", [1, 4])])
    sample = {"scores": np.ones((1, 4), np.float32), "mask": np.array([[0, 0, 0, -3.4e38]], np.float32)}
    assert set(nonfinite.find(model, [sample]).nodes) == {"add", "softmax"}


def test_a_nan_constant_keeps_its_reader_float():
    """jnp.take's out-of-bounds fill, as jax2tf writes it: Where(in_range, gathered, NaN)."""
    model = make_model([helper.make_node("Relu", ["x"], ["r"], name="relu"),
                        helper.make_node("Greater", ["x", "zero"], ["in_range"], name="check"),
                        helper.make_node("Where", ["in_range", "r", "fill"], ["y"], name="take")],
                       [("x", [1, 4])], [("y", [1, 4])],
                       {"zero": np.array(-10.0, np.float32), "fill": np.full((1, 4), np.nan, np.float32)})
    found = nonfinite.find(model, [{"x": np.ones((1, 4), np.float32)}])
    assert found.nodes == {"take": "reads 'fill' (constant, values [0, 0], NaN)"}


def _ort_run(tmp_path, model, calibration: list[dict], evaluation: list[dict], method: str = "minmax") -> dict:
    """qprep.run with ORT static int8 (nearest rounding, no bias correction) on these samples → its report."""
    import qprep

    onnx.save(model, str(tmp_path / "m.onnx"))
    for role, samples in (("calib", calibration), ("eval", evaluation)):
        (tmp_path / role).mkdir()
        for i, sample in enumerate(samples):
            np.savez(tmp_path / role / f"{i:04d}.npz", **sample)
    return qprep.run({"model": str(tmp_path / "m.onnx"), "calibration": {"source": str(tmp_path / "calib")},
                      "evaluation": {"source": str(tmp_path / "eval"), "layers": False, "latency": {"runs": 0}},
                      "pipeline": [{"quantize": {"backend": "ort", "ort": {
                          "activations": "static", "weight_rounding": "nearest", "bias_correction": False,
                          "calibrate_method": method}}}]},
                     output_dir=str(tmp_path / "out"))


@pytest.mark.parametrize("method", ["minmax", "percentile"])
def test_masked_attention_quantizes_with_ort_without_collapsing(tmp_path, method):
    """Before: the mask's range [-inf, 0] reached ORT's calibrator and every score rounded to one integer
    (minmax: cosine 0.78, status ok; percentile: "autodetected range of [0.0, inf] is not finite", exit 2).
    After: the mask chain stays float32, the calibrator sees the mask clipped, the rest is int8."""
    report = _ort_run(tmp_path, masked_attention_model(), masked_attention_samples(8),
                      masked_attention_samples(16)[8:], method)
    assert report["evaluation"]["outputs"]["y"]["cosine_mean"] > 0.98
    assert MASK_CHAIN <= set(report["float_set"])
    assert set(report["stages"][0]["nonfinite"]["nodes"]) == MASK_CHAIN
    quantized = onnx.load(str(tmp_path / "out" / "model.onnx"))
    quantized_inputs = {n.input[0] for n in quantized.graph.node if n.op_type == "QuantizeLinear"}
    assert quantized_inputs and not quantized_inputs & {"additive", "additive_rows", "masked", "fill"}
    nonfinite.check_scales(quantized)


def _calibrated(model: onnx.ModelProto, samples: list[dict], method: str, tmp_path):
    """ORT's ranges by `method` for `model`, its extreme tensors found on `samples` as the quantize stage does."""
    from qprep.quantize.ort.quantizer import OrtQuantizer

    options = typed("ort", activations="static")
    return OrtQuantizer(model, samples, options, tmp_path, extremes=nonfinite.find(model, samples)).calibrate(method)


@pytest.mark.parametrize("ceiling", ["initializer", "Constant node", "Cast", "value_float"])
@pytest.mark.parametrize("method", ["minmax", "percentile", "entropy"])
def test_every_calibrator_measures_the_log_s_whole_range_beside_inf_and_a_mask(tmp_path, method, ceiling):
    """The calibrator runs the model as it is: the +inf ceiling (as an initializer, a Constant node, a Cast
    of one or a Constant's value_float, which ORT's calibrators collect as activations) is neither clipped,
    which capped the log at ln 65504 = 11.09, nor handed to a histogram, which fails on ±inf; the -inf mask's
    tensors neither."""
    model, samples = log_power_model(with_mask=True), power_samples(8, with_mask=True)
    if ceiling != "initializer":
        value = next(t for t in model.graph.initializer if t.name == "ceiling")
        model.graph.initializer.remove(value)
        made = [helper.make_node("Constant", [], ["ceiling"], value=value, name="ceiling_constant")]
        if ceiling == "value_float":
            made = [helper.make_node("Constant", [], ["ceiling"], value_float=np.inf, name="ceiling_constant")]
        if ceiling == "Cast":
            made[0].output[0] = "ceiling64"
            made[0].attribute[0].t.CopyFrom(onnx.numpy_helper.from_array(np.array(np.inf), "ceiling64"))
            made.append(helper.make_node("Cast", ["ceiling64"], ["ceiling"], to=onnx.TensorProto.FLOAT, name="cast"))
        for index, node in enumerate(made):
            model.graph.node.insert(index, node)
    ranges = _calibrated(model, samples, method, tmp_path)
    assert float(np.asarray(ranges["log"].range_value[1]).ravel()[0]) > 14
    assert not {"ceiling", "masked"} & set(ranges.keys())
    assert all(np.isfinite(np.asarray(data.range_value, dtype=float)).all() for _, data in ranges.items())


@pytest.mark.parametrize("method", ["minmax", "percentile"])
def test_an_opset_10_clip_s_inf_attribute_is_not_calibrated(tmp_path, method):
    """Opset 10: Clip(max=+inf) is an attribute, which the quantizer's upgrade to opset 13 writes as a constant
    the quantize stage never saw: it is not calibrated either (percentile: "autodetected range of [inf, inf] is
    not finite"), and the log after it keeps its whole range."""
    clip = helper.make_node("Clip", ["x"], ["clamped"], name="clamp", min=1e-10, max=float("inf"))
    model = make_model([clip, helper.make_node("Log", ["clamped"], ["log"], name="log"),
                        helper.make_node("Mul", ["log", "ten"], ["y"], name="decibels")],
                       [("x", [1, 64])], [("y", [1, 64])], {"ten": np.array(10.0, np.float32)}, opset=10)
    ranges = _calibrated(model, power_samples(8), method, tmp_path)
    assert float(np.asarray(ranges["log"].range_value[1]).ravel()[0]) > 14
    assert all(np.isfinite(np.asarray(data.range_value, dtype=float)).all() for _, data in ranges.items())


@pytest.mark.parametrize("method", ["minmax", "percentile", "entropy"])
def test_a_model_with_nothing_left_to_calibrate_gets_no_ranges(tmp_path, method):
    """Every tensor ORT would calibrate is beyond float16 (the power and its clamp; Log is no op it quantizes):
    a histogram has nothing to collect, and the ranges are none, not "Histogram has not been collected"."""
    model = log_power_model()
    model.graph.node.pop()  # the dB Mul: the log is the output
    model.graph.output[0].name = "log"
    assert not set(_calibrated(model, power_samples(8), method, tmp_path).keys())


def test_a_log_of_values_beyond_float16_quantizes_with_its_whole_range(tmp_path):
    """oww_melspectrogram on ORT: with the ceiling clipped for the calibrator, every dB value saturated at
    10·ln 65504 and the outputs came out 20–30 dB low (cosine 0.9905, SQNR 8.7 dB; here 15 dB). Now the
    Log's range is its own: the output is int8-close (SQNR > 30 dB)."""
    report = _ort_run(tmp_path, log_power_model(), power_samples(8), power_samples(8, seed=1))
    assert report["evaluation"]["outputs"]["y"]["sqnr_db"] > 30


def test_a_constant_node_s_value_floats_are_found_and_clipped():
    """Constant(value_floats=[0, 0, 0, -inf]): found as an extreme constant, and clip_constants rewrites the node
    (as a `value` tensor), not a copy of its values."""
    model = make_model([helper.make_node("Constant", [], ["fill"], value_floats=[0, 0, 0, -np.inf], name="fill"),
                        helper.make_node("Add", ["x", "fill"], ["y"], name="add")], [("x", [1, 4])], [("y", [1, 4])])
    found = nonfinite.find(model, [{"x": np.zeros((1, 4), np.float32)}])
    assert found.tensors["fill"]["kind"] == "constant" and found.tensors["fill"]["min"] == float("-inf")
    clipped, changed = nonfinite.clip_constants(model, found, 10000.0)
    value = next(a.t for a in clipped.graph.node[0].attribute if a.name == "value")
    assert list(changed) == ["fill"] and onnx.numpy_helper.to_array(value).tolist() == [0, 0, 0, -10000]


def test_a_non_finite_scale_stops_the_run_naming_the_tensor():
    model = make_model([helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], name="q_x"),
                        helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], name="dq_x")],
                       [("x", [4])], [("y", [4])], {"s": np.array(np.inf, np.float32), "z": np.array(0, np.uint8)})
    with pytest.raises(nonfinite.NonFiniteRange, match=r"scale of tensor 'x' \(q_x\) is not finite") as error:
        nonfinite.check_scales(model)
    assert error.value.exit_code == EXIT_INTERNAL


def test_mse_ranges_leave_a_non_finite_range_alone():
    model = masked_attention_model()
    ranges = {"additive": (float("-inf"), 0.0), "q": (-4.0, 4.0)}
    chosen = mse_ranges(model, ranges, masked_attention_samples(4))
    assert chosen["additive"] == (float("-inf"), 0.0) and chosen["q"] != (-4.0, 4.0)
