"""The QDQ stages on tiny hand-built graphs: every rule, its preconditions, its record and its rollback.

Each graph is built with onnx.helper the way quantizers write them (Q → DQ pairs, int32 bias with scale
x_scale·w_scale, per-channel weights on axis 0); ONNX Runtime runs before and after on seeded inputs.
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphs import make_model, value
from qprep.errors import ConfigError
from qprep.graph.verify import Tolerance, Verifier
from qprep.model.runtime import run_model
from qprep.qdq import params as qdq_params
from qprep.qdq.fuse_conv import operands as fuse_conv_operands
from qprep.qdq.params import QParams, quantize_array
from qprep.model.saturation import u8s8_saturates
from qprep.schema import settings, validate
from qprep.stage_registry import registry

RNG = np.random.default_rng(0)


class Graph:
    """`g.op("Conv", a, b)` returns the output name; nodes named '<op>_<i>', like the loader names them."""

    def __init__(self, opset: int = 13):
        self.opset, self.nodes, self.initializers, self.inputs, self.count = opset, [], [], [], 0

    def input(self, name="x", shape=(1, 3, 8, 8)):
        self.inputs.append(value(name, list(shape)))
        return name

    def init(self, value, dtype=np.float32):
        self.count += 1
        name = f"c{self.count}"
        self.initializers.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def op(self, op_type, *inputs, outputs=1, **attrs):
        self.count += 1
        name = f"{op_type}_{self.count}"
        outs = [f"{name}_out{i}" if i else f"{name}_out" for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=name, **attrs))
        return outs[0] if outputs == 1 else outs

    def q(self, x, scale, zero, dtype=np.uint8):
        return self.op("QuantizeLinear", x, self.init(scale), self.init(zero, dtype))

    def dq(self, x, scale, zero, dtype=np.uint8, **attrs):
        return self.op("DequantizeLinear", x, self.init(scale), self.init(zero, dtype), **attrs)

    def qdq(self, x, scale, zero, dtype=np.uint8):
        return self.dq(self.q(x, scale, zero, dtype), scale, zero, dtype)

    def model(self, *outputs):
        return make_model(self.nodes, self.inputs, list(outputs), self.initializers, opset=self.opset, name="t")


def samples(shape=(1, 3, 8, 8), count=3, name="x"):
    return [{name: np.random.default_rng(i).standard_normal(shape).astype(np.float32)} for i in range(count)]


def run_stage(name, model, options=None, data=None):
    """Call a registered stage the way the pipeline does (options validated, a run context with a verifier)."""
    stage = registry()[name]
    ctx = SimpleNamespace(verifier=Verifier(data or samples(), Tolerance(), threads=1, source="test"),
                          float_set=frozenset(), config={"evaluation": None})
    return stage.run(model, ctx, settings(stage.options, validate(options or {}, stage.options, name, None), name))


def ops(model) -> Counter:
    return Counter(n.op_type for n in model.graph.node)


def max_abs(a, b, data):
    ra, rb = run_model(a, data), run_model(b, data)
    return max(float(np.abs(x[k].astype(np.float64) - y[k]).max()) for x, y in zip(ra, rb) for k in x)


# ------------------------------------------------------------------------------------ remove_redundant_qdq


def test_round_trips_and_doubled_pairs_go_and_a_requantization_stays_counted():
    g = Graph()
    x = g.input()
    doubled = g.op("Relu", g.qdq(g.dq(g.q(x, 0.05, 128), 0.05, 128), 0.05, 128))  # Q→DQ→Q→DQ, equal params
    requantized = g.dq(g.q(g.dq(g.q(x, 0.05, 128), 0.05, 128), 0.1, 128), 0.1, 128)  # DQ→Q with another scale
    model = g.model(doubled, requantized)
    result = run_stage("remove_redundant_qdq", model)
    assert result.details["rewrites"] == {"round_trip": 1, "scaled_round_trip": 0, "data_movement": 0, "sink_dq": 0}
    assert result.details["qdq_nodes_removed"] == 2
    kept = result.details["requantizations_kept"]
    assert kept["count"] == 1 and kept["nodes"][0]["from"]["scale"] == pytest.approx(0.05)
    assert kept["nodes"][0]["to"]["scale"] == pytest.approx(0.1)
    assert max_abs(model, result.model, samples()) == 0.0
    assert result.details["verification"]["tolerance"] == {"atol": 1e-6, "rtol": 0.0, "min_cosine": -1.0,
                                                          "reference": "the stage's input model"}


def test_a_scalar_div_or_mul_between_matching_grids_is_a_scaled_round_trip():
    """Hardswish's /6 as ONNX Runtime quantizes it: DQ(s) → Div 6 → Q(s/6); a grid that does not match stays."""
    g = Graph()
    x = g.input()
    hard = g.q(g.op("Relu", x), 0.03, 10)
    divided = g.dq(g.q(g.op("Div", g.dq(hard, 0.03, 10), g.init(6.0)), 0.03 / 6, 10), 0.03 / 6, 10)
    scaled = g.dq(g.q(g.op("Mul", g.init([0.5]), g.dq(hard, 0.03, 10)), 0.015, 10), 0.015, 10)
    coarser = g.dq(g.q(g.op("Mul", g.dq(hard, 0.03, 10), g.init(0.5)), 0.02, 10), 0.02, 10)
    shifted = g.dq(g.q(g.op("Mul", g.dq(hard, 0.03, 10), g.init(0.5)), 0.015, 11), 0.015, 11)
    model = g.model(divided, scaled, coarser, shifted)
    data = [{"x": 4 * d["x"]} for d in samples()]
    result = run_stage("remove_redundant_qdq", model, data=data)
    assert result.details["rewrites"]["scaled_round_trip"] == 2
    assert ops(result.model)["Div"] == 0 and ops(result.model)["Mul"] == 2
    assert max_abs(model, result.model, data) == 0.0
    from qprep.qdq.remove_redundant import simplify# what the ORT backend runs on each re-quantization

    for verify in (True, False):
        simplified, kinds = simplify(model, data, threads=1, verify=verify)
        assert kinds == {"scaled_round_trip": 2} and max_abs(model, simplified, data) == 0.0


MOVEMENT = {  # op → (extra inputs built in the graph, attributes)
    "Reshape": (lambda g: [g.init([1, -1], np.int64)], {}),
    "Transpose": (lambda g: [], {"perm": [0, 2, 3, 1]}),
    "Flatten": (lambda g: [], {"axis": 1}),
    "Squeeze": (lambda g: [g.init([0], np.int64)], {}),
    "Unsqueeze": (lambda g: [g.init([0], np.int64)], {}),
    "MaxPool": (lambda g: [], {"kernel_shape": [2, 2], "strides": [2, 2]}),
    "Slice": (lambda g: [g.init([2], np.int64), g.init([6], np.int64), g.init([3], np.int64)], {}),
}


@pytest.mark.parametrize("op_type", [*MOVEMENT, "Concat"])
def test_pairs_around_data_movement_ops_go_and_the_op_runs_on_quantized_data(op_type):
    g = Graph()
    x = g.input()
    if op_type == "Concat":
        moved = g.op("Concat", g.qdq(x, 0.05, 128), g.qdq(g.op("Neg", x), 0.05, 128), axis=1)
    else:
        extra, attrs = MOVEMENT[op_type]
        moved = g.op(op_type, g.qdq(x, 0.05, 128), *extra(g), **attrs)
    model = g.model(g.qdq(moved, 0.05, 128))
    result = run_stage("remove_redundant_qdq", model)
    assert result.details["rewrites"]["data_movement"] == 1, result.details
    assert result.details["data_movement_ops"] == {op_type: 1}
    assert ops(result.model)["QuantizeLinear"] == ops(model)["QuantizeLinear"] - 1
    node = next(n for n in result.model.graph.node if n.op_type == op_type)
    producers = {o: n.op_type for n in result.model.graph.node for o in n.output}
    assert all(producers.get(i) == "QuantizeLinear" for i in node.input[:2 if op_type == "Concat" else 1])
    assert max_abs(model, result.model, samples()) == 0.0


def test_dequantize_sinks_below_maxpool_so_the_next_conv_reads_dq():
    """The PyTorch eager QAT shape: Q → DQ → MaxPool → Conv (nothing requantizes the MaxPool output)."""
    g = Graph()
    pooled = g.op("MaxPool", g.qdq(g.input(), 0.05, 128), kernel_shape=[2, 2], strides=[2, 2])
    model = g.model(g.op("Relu", pooled))
    result = run_stage("remove_redundant_qdq", model)
    assert result.details["rewrites"]["sink_dq"] == 1
    producers = {o: n.op_type for n in result.model.graph.node for o in n.output}
    relu = next(n for n in result.model.graph.node if n.op_type == "Relu")
    assert producers[relu.input[0]] == "DequantizeLinear"
    assert max_abs(model, result.model, samples()) == 0.0


def test_per_axis_pairs_around_a_reshape_are_left_with_the_reason():
    g = Graph()
    x = g.input()
    scales, zeros = np.full(3, 0.05, np.float32), np.full(3, 128, np.uint8)
    quantized = g.op("QuantizeLinear", x, g.init(scales), g.init(zeros, np.uint8), axis=1)
    dq = g.op("DequantizeLinear", quantized, g.init(scales), g.init(zeros, np.uint8), axis=1)
    reshaped = g.op("Reshape", dq, g.init([1, 3, 64], np.int64))
    out = g.op("QuantizeLinear", reshaped, g.init(scales), g.init(zeros, np.uint8), axis=1)
    model = g.model(g.op("DequantizeLinear", out, g.init(scales), g.init(zeros, np.uint8), axis=1))
    result = run_stage("remove_redundant_qdq", model)
    assert result.details["rewrites"]["data_movement"] == 0
    assert result.details["refused"] == {"Reshape with per-axis quantization (the axis would need remapping)": 1}


def test_remove_redundant_skips_a_float_model_with_the_reason():
    g = Graph()
    result = run_stage("remove_redundant_qdq", g.model(g.op("Relu", g.input())))
    assert result.status == "skipped" and "no QuantizeLinear/DequantizeLinear" in result.reason


def test_a_wrong_removal_is_rolled_back_with_the_output_named(monkeypatch):
    """Force the round-trip rule to treat a requantization as identity: the verifier catches it."""
    g = Graph()
    x = g.input()
    model = g.model(g.dq(g.q(g.dq(g.q(x, 0.05, 128), 0.05, 128), 0.2, 100), 0.2, 100),
                    g.op("Relu", g.qdq(g.dq(g.q(x, 0.05, 128), 0.05, 128), 0.05, 128)))
    monkeypatch.setattr(QParams, "same_as", lambda self, other: True)
    result = run_stage("remove_redundant_qdq", model)
    assert result.status == "ok"
    assert [r["kind"] for r in result.rolled_back] == ["round_trip"]
    assert "output 'DequantizeLinear_" in result.rolled_back[0]["reason"]
    assert result.details["rewrites"]["round_trip"] == 1  # the real round trip still went
    assert max_abs(model, result.model, samples()) <= 1e-6


# ------------------------------------------------------------------------------------------- fuse_conv_qdq

X_SCALE, X_ZERO = 0.02, 128


def conv_model(y_zero=0, y_scale=0.05, per_channel=True, bias="int32", activation=None, x_type=np.uint8,
               y_type=None, opset=13, epilogue=False):
    """x → Q/DQ → Conv(DQ(w int8), bias) [→ epilogue] [→ activation] → Q → DQ → y."""
    g = Graph(opset)
    x_zero = X_ZERO if x_type == np.uint8 else 0
    x = g.qdq(g.input(), X_SCALE, x_zero, x_type)
    weights = RNG.integers(-127, 128, (4, 3, 3, 3)).astype(np.int8)
    w_scale = (RNG.uniform(0.002, 0.01, 4) if per_channel else np.array(0.005)).astype(np.float32)
    w = g.op("DequantizeLinear", g.init(weights, np.int8), g.init(w_scale),
             g.init(np.zeros(w_scale.shape, np.int8), np.int8), axis=0)
    values = RNG.uniform(-0.5, 0.5, 4).astype(np.float32)
    inputs = [x, w]
    if bias == "int32":
        b_scale = (np.float32(X_SCALE) * w_scale).astype(np.float32)
        inputs.append(g.op("DequantizeLinear", g.init(np.round(values / b_scale), np.int32),
                           g.init(np.broadcast_to(b_scale, (4,))), g.init(np.zeros(4), np.int32), axis=0))
    elif bias == "float":
        inputs.append(g.init(values))
    y = g.op("Conv", *inputs, pads=[1, 1, 1, 1])
    if epilogue:
        y = g.op("Div", y, g.init(RNG.uniform(0.5, 2.0, (1, 4, 1, 1))))
        y = g.op("BatchNormalization", y, g.init(RNG.uniform(0.5, 1.5, 4)), g.init(RNG.uniform(-0.2, 0.2, 4)),
                 g.init(RNG.uniform(-0.2, 0.2, 4)), g.init(RNG.uniform(0.5, 1.5, 4)))
    if activation == "Relu":
        y = g.op("Relu", y)
    elif activation is not None:
        y = g.op("Clip", y, g.init(activation[0]), g.init(activation[1]))
    return g.model(g.qdq(y, y_scale, y_zero, y_type or x_type)), weights, values, w_scale


def fused(model, options=None, data=None):
    result = run_stage("fuse_conv_qdq", model, options, data)
    return result


def within_one_step(model, result, step=0.05, data=None):
    data = data or samples(count=4)
    assert max_abs(model, result.model, data) <= step * (1 + 1e-5)


def test_per_channel_conv_with_int32_bias_becomes_qlinearconv_and_relu_is_absorbed():
    model, weights, _, _ = conv_model(activation="Relu", y_zero=0)
    result = fused(model)
    assert ops(result.model) == Counter({"QuantizeLinear": 1, "QLinearConv": 1, "DequantizeLinear": 1})
    node = result.details["nodes"][0]
    assert node["to"] == "QLinearConv" and node["weights"] == "per-channel (4)" and node["bias"] == "int32 kept"
    assert node["activation"].startswith("absorbed Relu") and node["probe_max_error"] <= 1
    stored = {t.name: numpy_helper.to_array(t) for t in result.model.graph.initializer}
    conv = next(n for n in result.model.graph.node if n.op_type == "QLinearConv")
    # the QDQ model's weights, or on a CPU whose u8s8 kernels saturate the same weights as uint8 (both + 128)
    shift = 128 if u8s8_saturates() else 0
    assert stored[conv.input[3]].dtype == (np.uint8 if shift else np.int8)
    assert np.array_equal(stored[conv.input[3]].astype(np.int16) - shift, weights)
    assert np.all(stored[conv.input[5]].astype(np.int16) == shift)
    within_one_step(model, result)
    if not shift:
        assert max(result.details["verification"]["deployed"].values()) <= 0.05  # ORT's own fusion: the same kernel


def test_int8_weights_go_in_as_uint8_where_the_cpus_u8s8_kernels_saturate(monkeypatch):
    """Weights of 127 against inputs of 255 overflow VPMADDUBSW's int16 pair sums on x86 without VNNI: as uint8
    (w + 128, zero point 128) the fused op computes the QDQ model's numbers on every CPU."""
    from qprep.qdq.fuse_conv import operands

    monkeypatch.setattr(operands, "u8s8_saturates", lambda: True, raising=False)
    model, weights, _, _ = conv_model(activation="Relu", y_zero=0)
    for tensor in model.graph.initializer:  # the worst case for int16 pair sums
        if numpy_helper.to_array(tensor).dtype == np.int8 and tensor.dims == list(weights.shape):
            tensor.CopyFrom(numpy_helper.from_array(np.full(weights.shape, 127, np.int8), tensor.name))
    result = fused(model)
    node = result.details["nodes"][0]
    assert node["to"] == "QLinearConv" and node["types"].startswith("uint8/uint8 (int8 weights + 128")
    conv = next(n for n in result.model.graph.node if n.op_type == "QLinearConv")
    stored = {t.name: numpy_helper.to_array(t) for t in result.model.graph.initializer}
    assert np.all(stored[conv.input[3]] == 255) and stored[conv.input[3]].dtype == np.uint8
    within_one_step(model, result)


def test_float_bias_is_quantized_exactly_as_onnxruntime_quantization_does():
    model, _, values, _ = conv_model(per_channel=False, bias="float")
    result = fused(model)
    conv = next(n for n in result.model.graph.node if n.op_type == "QLinearConv")
    stored = {t.name: numpy_helper.to_array(t) for t in result.model.graph.initializer}
    bias_scale = np.float32(X_SCALE) * np.float32(0.005)  # input_scale * weight_scale, float32
    expected = np.round(values.astype(np.float64) / np.float64(bias_scale)).astype(np.int32)
    assert np.array_equal(stored[conv.input[8]], expected)
    assert result.details["bias"] == {"quantized from float (as onnxruntime.quantization does)": 1}
    within_one_step(model, result)


@pytest.mark.parametrize("activation,y_zero,y_scale,expected", [
    ("Relu", 128, 0.05, "kept Relu as integer Clip [128, 255]"),       # zero point mid-range: Relu cuts
    ((0.0, 6.0), 0, 6 / 255, "absorbed Clip"),                          # ReLU6 with Q's range [0, 6]
    ((0.0, 6.0), 0, 10 / 255, "kept Clip as integer Clip [0, 153]"),    # Q reaches 10: the 6 bound cuts
])
def test_relu_and_clip_are_absorbed_only_when_the_output_range_makes_them_no_ops(activation, y_zero, y_scale,
                                                                                 expected):
    model, *_ = conv_model(activation=activation, y_zero=y_zero, y_scale=y_scale)
    result = fused(model)
    assert result.details["nodes"][0]["activation"].startswith(expected), result.details["nodes"]
    assert "Relu" not in ops(result.model) and "Conv" not in ops(result.model)
    within_one_step(model, result, step=y_scale)


def test_int8_activations_fuse_and_a_type_change_falls_back_to_convinteger_with_the_reason():
    model, *_ = conv_model(x_type=np.int8)
    result = fused(model)
    assert result.details["nodes"][0]["types"] == "int8/int8"
    within_one_step(model, result)
    model, *_ = conv_model(x_type=np.uint8, y_type=np.int8)  # no ORT QLinearConv kernel for uint8 → int8
    result = fused(model)
    assert result.details["converted"] == {"ConvInteger": 1}
    assert "output type int8 differs from the input type uint8" in result.details["nodes"][0]["why_not_qlinear"]
    within_one_step(model, result)


def test_format_integer_gives_convinteger_with_float_rescale_and_keeps_the_q():
    model, *_ = conv_model(activation="Relu")
    result = fused(model, {"format": "integer"})
    counts = ops(result.model)
    assert counts["ConvInteger"] == 1 and counts["Cast"] == 1 and counts["Mul"] == 1 and counts["Add"] == 1
    assert counts["QuantizeLinear"] == 2 and "Conv" not in counts  # the output Q and the input's stay
    within_one_step(model, result)


def test_qat_epilogue_div_and_batchnorm_fold_into_the_weight_scales_and_bias():
    model, *_ = conv_model(epilogue=True, activation="Relu", bias="none")
    result = fused(model)
    assert result.details["epilogue_folded"] == {"Div": 1, "BatchNormalization": 1}
    assert ops(result.model) == Counter({"QuantizeLinear": 1, "QLinearConv": 1, "DequantizeLinear": 1})
    within_one_step(model, result)


def test_matmul_option_gives_qlinearmatmul_or_matmulinteger():
    g = Graph()
    a = g.qdq(g.input("x", (1, 5, 8)), 0.02, 128)
    b = g.op("DequantizeLinear", g.init(RNG.integers(-127, 128, (8, 6)), np.int8), g.init(np.full(6, 0.01)),
             g.init(np.zeros(6), np.int8), axis=1)
    model = g.model(g.qdq(g.op("MatMul", a, b), 0.02, 128))
    data = samples((1, 5, 8))
    assert fused(model, data=data).status == "skipped"  # MatMul is opt-in
    result = fused(model, {"matmul": True}, data)
    assert ops(result.model)["QLinearMatMul"] == 1
    within_one_step(model, result, 0.02, data)
    result = fused(model, {"matmul": True, "format": "integer"}, data)
    assert ops(result.model)["MatMulInteger"] == 1
    within_one_step(model, result, 0.02, data)


def test_a_fusion_that_breaks_the_numbers_is_rolled_back_on_its_own(monkeypatch):
    """A wrong bias (offset by 5000 accumulator steps, ~10 output steps) fails the Conv's own probe; only that
    Conv is rolled back."""
    good, *_ = conv_model(bias="float")
    monkeypatch.setattr(fuse_conv_operands, "quantize_bias", lambda b, s: qdq_params.quantize_bias(b, s) + 5000)
    result = fused(good)
    assert ops(result.model)["Conv"] == 1
    (entry,) = result.rolled_back
    assert entry["kind"] == "qlinear" and "differs from the QDQ original by" in entry["reason"]
    assert max_abs(good, result.model, samples()) == 0.0


def test_a_conv_with_epilogue_folds_is_rolled_back_as_one_when_the_failure_names_no_rewrite(monkeypatch):
    """The epilogue folds and the fusion of one Conv share its anchor: bisection works on anchors (it used to
    split [A, A, A] forever)."""
    from qprep.qdq import verified

    good, *_ = conv_model(epilogue=True)
    monkeypatch.setattr(verified, "invalid", lambda model: "refused by the checker (test)")
    result = fused(good)
    (entry,) = result.rolled_back
    assert "qlinear" in entry["kind"] and "+" in entry["kind"] and "refused by the checker" in entry["reason"]
    assert max_abs(good, result.model, samples()) == 0.0


def test_fuse_skips_a_float_model():
    g = Graph()
    result = fused(g.model(g.op("Relu", g.input())))
    assert result.status == "skipped" and "no DequantizeLinear" in result.reason


def test_quantize_array_matches_onnxruntime_quantizelinear_on_ties():
    values = np.array([0.5, 1.5, 2.5, -0.5, -1.5, 127.6, -300.0, 0.25], np.float32) * np.float32(0.1)
    p = QParams(np.array(0.1, np.float32), np.array(3, np.uint8), onnx_type("uint8"), None)
    g = Graph()
    model = g.model(g.q(g.input("x", (8,)), 0.1, 3))
    model.graph.output[0].type.tensor_type.elem_type = TensorProto.UINT8
    expected = run_model(model, [{"x": values}])[0]
    assert np.array_equal(quantize_array(values, p), next(iter(expected.values())))


def onnx_type(name):
    import onnx_ir as ir

    return {"uint8": ir.DataType.UINT8, "int8": ir.DataType.INT8}[name]


# ---------------------------------------------------------------------------------------------- keep_float


def layernorm_model(quantized=True):
    g = Graph(17)
    x = g.input("x", (1, 4, 16))
    source = g.qdq(x, 0.02, 128) if quantized else x
    gamma = g.dq(g.init(RNG.integers(1, 127, 16), np.int8), 0.01, 0, np.int8) if quantized \
        else g.init(RNG.uniform(0.5, 1.5, 16))
    normed = g.op("LayerNormalization", source, gamma, g.init(np.zeros(16)), axis=-1)
    y = g.qdq(normed, 0.03, 128) if quantized else normed
    return g.model(g.op("Softmax", y, axis=-1))


def decomposed_layernorm_model():
    g = Graph(13)
    x = g.input("x", (1, 4, 16))
    mean = g.op("ReduceMean", x, axes=[-1])
    d = g.op("Sub", x, mean)
    var = g.op("ReduceMean", g.op("Pow", d, g.init(2.0)), axes=[-1])
    normed = g.op("Div", d, g.op("Sqrt", g.op("Add", var, g.init(1e-5))))
    y = g.op("Add", g.op("Mul", normed, g.init(RNG.uniform(0.5, 1.5, 16))), g.init(np.zeros(16)))
    return g.model(g.op("Relu", y))


def test_keep_float_on_a_qdq_model_removes_the_pairs_around_layernorm():
    model = layernorm_model()
    data = samples((1, 4, 16))
    result = run_stage("keep_float", model, data=data)
    removed = result.details["removed"]
    assert removed["input_pairs_bypassed"] == 1 and removed["output_pairs_bypassed"] == 1
    assert removed["qdq_nodes_removed"] == {"QuantizeLinear": 2, "DequantizeLinear": 2}
    assert removed["kept"] == {"dequantized constant or integer tensor on an input (no float original in the "
                               "model)": 1}  # the int8 gamma's DQ stays: its float original is gone
    ln = next(n for n in result.model.graph.node if n.op_type == "LayerNormalization")
    assert ln.input[0] == "x" and result.float_set == {ln.name}
    softmax = next(n for n in result.model.graph.node if n.op_type == "Softmax")
    assert softmax.input[0] == ln.output[0]
    assert result.details["effect"]["outputs"]
    assert max_abs(model, result.model, data) > 0  # rounding removed on purpose


def test_keep_float_on_a_float_model_only_records_the_set_and_says_so():
    model = layernorm_model(quantized=False)
    result = run_stage("keep_float", model, {"op_types": ["Softmax"]}, samples((1, 4, 16)))
    assert result.status == "ok" and result.model is model
    assert "nothing removed" in result.details["note"]
    assert result.details["float_set"] == {"count": 2, "by_reason": {"LayerNormalization": 1, "op_types": 1}}
    assert len(result.float_set) == 2


def test_decomposed_layernorm_nodes_are_in_the_float_set():
    result = run_stage("keep_float", decomposed_layernorm_model(), data=samples((1, 4, 16)))
    assert result.details["float_set"]["by_reason"] == {"decomposed LayerNorm": 9}
    assert {n.split("_")[0] for n in result.float_set} == {"ReduceMean", "Sub", "Pow", "Add", "Sqrt", "Div", "Mul"}


def test_keep_float_options_name_nodes_patterns_and_op_types():
    model = layernorm_model(quantized=False)
    result = run_stage("keep_float", model, {"layernorm": False, "patterns": ["^Soft"]}, samples((1, 4, 16)))
    assert {n.split("_")[0] for n in result.float_set} == {"Softmax"}
    softmax = next(n.name for n in model.graph.node if n.op_type == "Softmax")
    result = run_stage("keep_float", model, {"layernorm": False, "nodes": [softmax]}, samples((1, 4, 16)))
    assert result.float_set == {softmax}


@pytest.mark.parametrize("options,message", [
    ({"nodes": ["Softmx_7"]}, r"keep_float\.nodes\[0\]: no node named 'Softmx_7' in the model; did you mean "
                              r"'Softmax_\d+'\?"),
    ({"op_types": ["LayerNorm"]}, r"keep_float\.op_types\[0\]: 'LayerNorm' is not an ONNX operator and no node in "
                                  r"the model has that type; did you mean 'LayerNormalization'\?"),
    ({"patterns": ["(unclosed"]}, r"keep_float\.patterns\[0\]: '\(unclosed' is not a regular expression"),
])
def test_keep_float_errors_are_one_actionable_line(options, message):
    with pytest.raises(ConfigError, match=message) as caught:
        run_stage("keep_float", layernorm_model(quantized=False), options, samples((1, 4, 16)))
    assert "\n" not in str(caught.value)


def test_keep_float_skips_when_the_float_set_is_empty():
    g = Graph()
    result = run_stage("keep_float", g.model(g.op("Relu", g.input())))
    assert result.status == "skipped" and "float set is empty" in result.reason


def test_probe_check_rejects_an_output_that_changed_shape():
    from qprep.qdq.verified import ProbeCheck

    def model(shape):
        g = Graph()
        return g.model(g.op("Reshape", g.op("Relu", g.input(shape=(1, 6))), g.init(shape, np.int64)))

    verdict = ProbeCheck(model([1, 6]), samples((1, 6)), {}, min_cosine=0.99, threads=1)(model([6, 1]), [])
    assert not verdict.ok and "changed shape (1, 6) -> (6, 1)" in verdict.reason
