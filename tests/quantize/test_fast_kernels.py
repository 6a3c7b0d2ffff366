"""Fitting ONNX Runtime's fast int8 convolutions: channel counts padded with zero channels (channel_padding.py) and
Convs reading the model's input over too few channels kept float (input_convs.py), on tiny MobileNet blocks."""

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from graphs import make_model
from qprep.model.runtime import run_model
from qprep.quantize.ort import channel_padding
from qprep.quantize.ort.input_convs import narrow_input_convs

SHAPE = [1, 4, 8, 8]


def _block(extra_output: bool = False) -> onnx.ModelProto:
    """Conv 4→24 → HardSwish written out → depthwise 3x3 over 24 → squeeze-excite (24 → 6 → 24) → Conv 24→8."""
    rng = np.random.default_rng(0)
    weights = {"w_expand": rng.standard_normal((24, 4, 1, 1)), "b_expand": rng.standard_normal(24),
               "w_dw": rng.standard_normal((24, 1, 3, 3)), "b_dw": rng.standard_normal(24),
               "w_se1": rng.standard_normal((6, 24, 1, 1)), "b_se1": rng.standard_normal(6),
               "w_se2": rng.standard_normal((24, 6, 1, 1)), "b_se2": rng.standard_normal(24),
               "w_project": rng.standard_normal((8, 24, 1, 1)), "b_project": rng.standard_normal(8),
               "three": np.array(3.0), "six": np.array(6.0), "zero": np.array(0.0)}
    weights = {k: v.astype(np.float32) for k, v in weights.items()}
    nodes = [helper.make_node("Conv", ["x", "w_expand", "b_expand"], ["e"], name="expand"),
             helper.make_node("Add", ["e", "three"], ["e3"], name="hs_add"),
             helper.make_node("Clip", ["e3", "zero", "six"], ["ec"], name="hs_clip"),
             helper.make_node("Div", ["ec", "six"], ["ed"], name="hs_div"),
             helper.make_node("Mul", ["e", "ed"], ["h"], name="hs_mul"),
             helper.make_node("Conv", ["h", "w_dw", "b_dw"], ["d"], name="depthwise", group=24,
                              kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["d"], ["dr"], name="dw_relu"),
             helper.make_node("GlobalAveragePool", ["dr"], ["pooled"], name="se_pool"),
             helper.make_node("Conv", ["pooled", "w_se1", "b_se1"], ["s1"], name="se_reduce"),
             helper.make_node("Relu", ["s1"], ["s1r"], name="se_relu"),
             helper.make_node("Conv", ["s1r", "w_se2", "b_se2"], ["s2"], name="se_expand"),
             helper.make_node("Sigmoid", ["s2"], ["gate"], name="se_gate"),
             helper.make_node("Mul", ["dr", "gate"], ["excited"], name="se_mul"),
             helper.make_node("Conv", ["excited", "w_project", "b_project"], ["y"], name="project")]
    outputs = [("y", [1, 8, 8, 8])] + ([("dr", [1, 24, 8, 8])] if extra_output else [])
    return make_model(nodes, [("x", SHAPE)], outputs, weights, opset=13)


def _samples(count=8, seed=0):
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal(SHAPE).astype(np.float32)} for _ in range(count)]


def _quantized(model: onnx.ModelProto, weight_type: str = "QInt8", exclude=()) -> onnx.ModelProto:
    """ORT's static QDQ quantization (uint8 activations, per-channel symmetric weights), as qprep's backend."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.samples = iter(_samples())

        def get_next(self):
            return next(self.samples, None)

    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        source, target = f"{tmp}/m.onnx", f"{tmp}/q.onnx"
        onnx.save(model, source)
        quantize_static(source, target, Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                        activation_type=QuantType.QUInt8, weight_type=getattr(QuantType, weight_type),
                        nodes_to_exclude=list(exclude), extra_options={"WeightSymmetric": True})
        return onnx.load(target)


def _group(model: onnx.ModelProto, name: str) -> int:
    node = next(n for n in model.graph.node if n.name == name)
    return next(a.i for a in node.attribute if a.name == "group")


@pytest.mark.parametrize("weight_type", ["QInt8", "QUInt8"])
def test_channel_counts_padded_to_16_with_the_same_outputs(weight_type):
    quantized = _quantized(_block(), weight_type)
    padded, spaces = channel_padding.pad(quantized)
    assert sorted((s["channels"], s["padded_to"]) for s in spaces) == [(6, 16), (24, 32)]
    assert _group(padded, "depthwise") == 32
    assert next(s for s in spaces if s["channels"] == 24)["convs"] == ["depthwise", "expand", "project",
                                                                       "se_expand", "se_reduce"]
    samples = _samples(4, seed=1)
    for optimize in (False, True):  # as written, and as ORT runs it (QLinearConv)
        for expected, actual in zip(run_model(quantized, samples, optimize=optimize),
                                    run_model(padded, samples, optimize=optimize)):
            np.testing.assert_array_equal(actual["y"], expected["y"])
    assert quantized.graph.node[5].name == padded.graph.node[5].name  # the model handed in is left as it was
    assert _group(quantized, "depthwise") == 24


def test_a_space_a_float_conv_reads_keeps_its_channels():
    """ORT's FP32 Conv sums in another order for another channel count (3.8e-6 off at 8 → 16): not the same
    outputs, so a float reader leaves its space alone; a float writer does not (its channels are independent)."""
    model = _block()
    assert channel_padding.pad(model) == (model, [])
    first_float = _quantized(model, exclude=["expand"])
    padded, spaces = channel_padding.pad(first_float)
    assert (24, 32) in [(s["channels"], s["padded_to"]) for s in spaces]
    samples = _samples(3)
    for expected, actual in zip(run_model(first_float, samples, optimize=True),
                                run_model(padded, samples, optimize=True)):
        np.testing.assert_array_equal(actual["y"], expected["y"])


def test_a_space_that_reaches_a_model_output_keeps_its_channels():
    padded, spaces = channel_padding.pad(_quantized(_block(extra_output=True)))
    assert [(s["channels"], s["padded_to"]) for s in spaces] == [(6, 16)]
    assert _group(padded, "depthwise") == 24


def test_a_weight_a_branch_also_reads_stays_for_it():
    """The padded Conv gets its own copy; the original, read only inside an If branch now, was deleted."""
    model = _block()
    branch = helper.make_graph([helper.make_node("Identity", ["b_expand"], ["t"])], "then", [],
                               [helper.make_tensor_value_info("t", onnx.TensorProto.FLOAT, [24])])
    model.graph.initializer.append(helper.make_tensor("cond", onnx.TensorProto.BOOL, [], [True]))
    model.graph.node.append(helper.make_node("If", ["cond"], ["z"], name="branch", then_branch=branch,
                                             else_branch=branch))
    model.graph.output.append(helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, [24]))
    quantized = _quantized(model, exclude=["expand"])  # expand reads the float b_expand itself
    padded, spaces = channel_padding.pad(quantized)
    assert (24, 32) in [(s["channels"], s["padded_to"]) for s in spaces]
    samples = _samples(2)
    for expected, actual in zip(run_model(quantized, samples), run_model(padded, samples)):
        np.testing.assert_array_equal(actual["y"], expected["y"])
        np.testing.assert_array_equal(actual["z"], expected["z"])


def test_a_per_channel_constant_behind_quantize_dequantize_keeps_its_space():
    model = _block()
    gamma = np.linspace(0.5, 1.5, 24, dtype=np.float32).reshape(1, 24, 1, 1)
    model.graph.initializer.extend([helper.make_tensor("gamma", onnx.TensorProto.FLOAT, [1, 24, 1, 1], gamma.ravel()),
                                    helper.make_tensor("gs", onnx.TensorProto.FLOAT, [], [0.01]),
                                    helper.make_tensor("gz", onnx.TensorProto.UINT8, [], [0])])
    relu = next(n for n in model.graph.node if n.name == "dw_relu")
    relu.input[0] = "scaled"
    model.graph.node.extend([helper.make_node("QuantizeLinear", ["gamma", "gs", "gz"], ["gq"], name="gq"),
                             helper.make_node("DequantizeLinear", ["gq", "gs", "gz"], ["gd"], name="gd"),
                             helper.make_node("Mul", ["d", "gd"], ["scaled"], name="layer_scale")])
    model = onnx.shape_inference.infer_shapes(_sorted(model))
    spaces = channel_padding.pad(_quantized(model))[1]
    assert [(s["channels"], s["padded_to"]) for s in spaces] == [(6, 16)]  # gamma behind Q → DQ is per channel


def test_squeeze_excite_written_as_reduce_mean_is_followed():
    """timm writes squeeze-excite as x.mean((2, 3), keepdim=True): a ReduceMean over the spatial axes."""
    model = _block()
    pool = next(n for n in model.graph.node if n.name == "se_pool")
    pool.CopyFrom(helper.make_node("ReduceMean", ["dr"], ["pooled"], name="se_pool", axes=[2, 3], keepdims=1))
    quantized = _quantized(model)
    padded, spaces = channel_padding.pad(quantized)
    assert sorted((s["channels"], s["padded_to"]) for s in spaces) == [(6, 16), (24, 32)]
    samples = _samples(3)
    for expected, actual in zip(run_model(quantized, samples, optimize=True), run_model(padded, samples, optimize=True)):
        np.testing.assert_array_equal(actual["y"], expected["y"])


def test_weights_declared_as_graph_inputs_follow_their_padding():
    """Old exporters (IR < 4) list weights among the inputs: ORT refused the padded model ("Shape of initializer
    b_expand does not match")."""
    model = _block()
    for tensor in model.graph.initializer:
        model.graph.input.append(helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims)))
    quantized = _quantized(model, exclude=["expand"])
    padded, spaces = channel_padding.pad(quantized)
    assert spaces
    samples = _samples(2)
    for expected, actual in zip(run_model(quantized, samples, optimize=True), run_model(padded, samples, optimize=True)):
        np.testing.assert_array_equal(actual["y"], expected["y"])


def test_a_space_that_divides_is_not_padded():
    model = _block()
    div = next(n for n in model.graph.node if n.name == "hs_div")
    div.input[:] = ["six", "shifted"]  # 6 / (clip(x + 3, 0, 6) + 3): finite here, another model's 6 / 0
    model.graph.node.append(helper.make_node("Add", ["ec", "three"], ["shifted"], name="shift"))
    model = onnx.shape_inference.infer_shapes(_sorted(model))
    padded, spaces = channel_padding.pad(_quantized(model))
    assert [(s["channels"], s["padded_to"]) for s in spaces] == [(6, 16)]


def _sorted(model: onnx.ModelProto) -> onnx.ModelProto:
    """Nodes in an order ONNX accepts (those appended by a test come after their readers)."""
    produced = {i.name for i in model.graph.input} | {t.name for t in model.graph.initializer}
    pending, ordered = list(model.graph.node), []
    while pending:
        ready = next(n for n in pending if all(not i or i in produced for i in n.input))
        ordered.append(ready)
        produced.update(ready.output)
        pending.remove(ready)
    del model.graph.node[:]
    model.graph.node.extend(ordered)
    return model


def test_apply_keeps_the_model_only_when_outputs_match():
    quantized = _quantized(_block())
    result, record = channel_padding.apply(quantized, _samples(2))
    assert record["spaces"] and "ms_before" in record and "ms_after" in record
    assert (result is not quantized) == record["kept"]
    aligned = _input_conv(4, False)  # 16 channels throughout
    assert channel_padding.apply(aligned, [{"x": np.zeros((1, 4, 16, 16), np.float32)}]) == (aligned, {})


def _input_conv(channels: int, normalize: bool) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Sub", ["x", "mean"], ["centered"], name="sub"),
             helper.make_node("Div", ["centered", "std"], ["normalized"], name="div")] if normalize else []
    source = "normalized" if normalize else "x"
    nodes += [helper.make_node("Conv", [source, "w1"], ["c1"], name="first", strides=[2, 2], kernel_shape=[3, 3]),
              helper.make_node("Conv", ["c1", "w2"], ["y"], name="second", kernel_shape=[3, 3], pads=[1] * 4)]
    weights = {"w1": rng.standard_normal((16, channels, 3, 3)).astype(np.float32),
               "w2": rng.standard_normal((64, 16, 3, 3)).astype(np.float32),
               "mean": np.float32(0.5), "std": np.float32(0.25)}
    return make_model(nodes, [("x", [1, channels, 16, 16])], [("y", None)], weights)


@pytest.mark.parametrize("channels, normalize, expected", [
    (3, False, ["first"]), (3, True, ["first"]), (1, False, ["first"]), (4, False, []), (8, True, [])])
def test_convs_reading_the_input_over_too_few_channels(channels, normalize, expected):
    assert narrow_input_convs(_input_conv(channels, normalize)) == expected


def test_an_input_conv_that_is_much_of_the_model_is_quantized():
    model = _input_conv(3, False)
    second = next(t for t in model.graph.initializer if t.name == "w2")
    second.CopyFrom(numpy_helper.from_array(np.ones((16, 16, 1, 1), np.float32), "w2"))
    del model.graph.node[-1].attribute[:]
    model = onnx.shape_inference.infer_shapes(model)
    assert narrow_input_convs(model) == []  # the first Conv is 63% of its multiply-adds


def test_the_per_layer_error_reads_the_real_channels_of_padded_tensors():
    from qprep.measure.layers import layer_errors

    model = _block()
    quantized = _quantized(model)
    padded, _ = channel_padding.pad(quantized)
    rows = {r["tensor"]: r["sqnr_db"] for r in layer_errors(model, padded, _samples(2))}
    unpadded = {r["tensor"]: r["sqnr_db"] for r in layer_errors(model, quantized, _samples(2))}
    assert "dr" in rows and rows.keys() == unpadded.keys()
    assert rows == pytest.approx(unpadded)


def test_a_padded_model_onnx_runtime_refuses_leaves_the_model_as_it_was(monkeypatch):
    quantized = _quantized(_block())
    broken = onnx.ModelProto()
    broken.CopyFrom(quantized)
    next(n for n in broken.graph.node if n.name == "depthwise").attribute[0].i = 7  # group 7 of 24 channels
    monkeypatch.setattr(channel_padding, "pad", lambda model: (broken, [{"channels": 24, "padded_to": 32}]))
    result, record = channel_padding.apply(quantized, _samples(1))
    assert result is quantized and not record["kept"] and "refused" in record["why"]


def test_an_input_conv_of_symbolic_size_is_left_to_int8():
    """Symbolic dims count as 1 in the multiply-adds, which makes the first Conv's share look small."""
    model = _input_conv(3, False)
    model.graph.input[0].type.tensor_type.shape.dim[2].dim_param = "height"
    assert narrow_input_convs(onnx.shape_inference.infer_shapes(model)) == []


def test_a_padding_that_fails_leaves_the_model_and_says_why(monkeypatch):
    from qprep.report.decisions import decision_lines

    def fails(model):
        raise KeyError("w_dw")

    monkeypatch.setattr(channel_padding, "pad", fails)
    quantized = _quantized(_block())
    result, record = channel_padding.apply(quantized, _samples(1))
    assert result is quantized and record["why"] == "padding failed: KeyError: 'w_dw'"
    lines = decision_lines({"name": "quantize", "status": "ok", "channel_padding": record})
    assert any("channel padding not applied (padding failed" in line for line in lines)
