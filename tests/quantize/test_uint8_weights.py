"""weight_type: uint8 — symmetric weights, one zero point for every channel, so ONNX Runtime's QLinearConv runs
them (an all-zero output channel got zero point 0 from ORT's quantizer, and the session refused the model)."""

import numpy as np
import onnx
from onnx import helper, numpy_helper

import qprep
from graphs import make_model
from qprep.model.runtime import run_model
from qprep.quantize.ort.uint8_weights import ZERO_POINT, equal_zero_points


def conv_with_a_dead_channel():
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    weight[1] = 0  # pruned, or a channel training never used
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["y"])]
    return make_model(nodes, [("x", [1, 3, 8, 8])], [("y", [1, 4, 8, 8])],
                      {"w": weight, "b": rng.standard_normal(4).astype(np.float32)}, opset=17)


def test_uint8_weights_with_a_dead_channel_run_and_stay_close(tmp_path, save):
    data = tmp_path / "data"
    data.mkdir()
    for i in range(8):
        np.save(data / f"{i}.npy", np.random.default_rng(i).standard_normal((1, 3, 8, 8)).astype(np.float32))
    config = {"model": str(save(conv_with_a_dead_channel())), "calibration": {"source": str(data)},
              "evaluation": {"source": str(data)},
              "pipeline": [{"quantize": {"backend": "ort", "ort": {"weight_type": "uint8"}}}]}
    report = qprep.run(config, output_dir=str(tmp_path / "run"), force=True)
    assert report["status"] == "ok"
    assert report["evaluation"]["outputs"]["y"]["cosine_mean"] > 0.99
    model = onnx.load(str(tmp_path / "run" / "model.onnx"))
    points = [numpy_helper.to_array(t) for t in model.graph.initializer if t.data_type == onnx.TensorProto.UINT8
              and t.name.startswith("w") and t.name.endswith("zero_point")]
    assert len(points) == 1 and points[0].tolist() == [ZERO_POINT] * 4


def test_equal_zero_points_moves_only_all_zero_channels_and_keeps_the_values():
    integers = np.array([[1, 200, 128], [0, 0, 0], [128, 128, 128]], np.uint8)  # channel 2 is zero at 128 already
    nodes = [helper.make_node("DequantizeLinear", ["q", "s", "z"], ["w"], axis=0),
             helper.make_node("MatMul", ["w", "x"], ["y"])]
    model = make_model(nodes, [("x", [3, 2])], [("y", [3, 2])],
                       {"q": integers, "s": np.array([0.1, 1.0, 0.2], np.float32),
                        "z": np.array([128, 0, 128], np.uint8)}, opset=17)
    feeds = [{"x": np.random.default_rng(0).standard_normal((3, 2)).astype(np.float32)}]
    before = run_model(model, feeds)[0]["y"]
    assert equal_zero_points(model) == 1
    arrays = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    assert arrays["z"].tolist() == [128, 128, 128] and arrays["q"][1].tolist() == [128, 128, 128]
    assert arrays["q"][0].tolist() == [1, 200, 128]
    np.testing.assert_array_equal(run_model(model, feeds)[0]["y"], before)


def test_a_switched_off_channel_keeps_its_bias_with_uint8_weights(tmp_path, save):
    """A channel whose BatchNorm was switched off (weights ~1e-12 once folded) outputs its bias; with uint8
    weights ORT's quantizer clipped that bias to the int32 range on a bias scale of ~1e-14, and the channel output
    ~0 instead of 0.5 (PP-OCRv4 rec: 15 channels in 5 Convs). int32_bias.py gives it a coarser weight scale."""
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    weight[2] *= 1e-12
    bias = np.array([0.1, -0.2, 0.5, 0.3], np.float32)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[1, 1, 1, 1])]
    model = make_model(nodes, [("x", [1, 3, 8, 8])], [("y", [1, 4, 8, 8])], {"w": weight, "b": bias}, opset=17)
    data = tmp_path / "data"
    data.mkdir()
    for i in range(8):
        np.save(data / f"{i}.npy", rng.standard_normal((1, 3, 8, 8)).astype(np.float32))
    config = {"model": str(save(model)), "calibration": {"source": str(data)}, "evaluation": {"source": str(data)},
              "pipeline": [{"quantize": {"backend": "ort", "ort": {"weight_type": "uint8"}}}]}
    report = qprep.run(config, output_dir=str(tmp_path / "run"), force=True)
    stage = next(s for s in report["stages"] if s["name"] == "quantize")
    assert stage["weights"]["bias_channels_rescaled"] == 1
    quantized = onnx.load(str(tmp_path / "run" / "model.onnx"))
    feeds = [{"x": rng.standard_normal((1, 3, 8, 8)).astype(np.float32)}]
    channel = run_model(quantized, feeds)[0]["y"][0, 2]
    np.testing.assert_allclose(channel, 0.5, atol=0.05)  # within the output's int8 grid; clipped, it was ~0
    assert "coarser weight scale" in (tmp_path / "run" / "report.md").read_text()


def test_fit_biases_on_a_per_tensor_weight_keeps_the_scales_scalar():
    """A whole weight of ~1e-12 on one per-tensor scale: both scales grow (and stay scalars), the bias holds."""
    from qprep.quantize.ort.int32_bias import fit_biases

    weight = np.full((2, 1, 1, 1), 1e-12, np.float32)
    bias = np.array([0.5, -0.25], np.float32)
    float_model = make_model([helper.make_node("Conv", ["x", "w", "b"], ["y"], name="conv")], [("x", [1, 1, 2, 2])],
                             [("y", [1, 2, 2, 2])], {"w": weight, "b": bias}, opset=17)
    w_scale, x_scale = np.float32(1e-12 / 127), np.float32(0.01)
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
             helper.make_node("DequantizeLinear", ["wq", "ws"], ["wd"]),
             helper.make_node("DequantizeLinear", ["bq", "bs"], ["bd"]),
             helper.make_node("Conv", ["xd", "wd", "bd"], ["y"], name="conv")]
    clipped = np.clip(np.round(bias / (x_scale * w_scale)), -2**31, 2**31 - 1).astype(np.int32)
    qdq = make_model(nodes, [("x", [1, 1, 2, 2])], [("y", [1, 2, 2, 2])],
                     {"xs": np.array(x_scale), "xz": np.array(0, np.uint8), "wq": np.full((2, 1, 1, 1), 127, np.int8),
                      "ws": np.array(w_scale), "bq": clipped, "bs": np.array(x_scale * w_scale, np.float32)}, opset=17)
    assert fit_biases(qdq, float_model) == 2
    arrays = {t.name: numpy_helper.to_array(t) for t in qdq.graph.initializer}
    assert arrays["ws"].shape == () and arrays["bs"].shape == ()
    np.testing.assert_allclose(arrays["bq"] * arrays["bs"].astype(np.float64), bias, rtol=1e-6)
    out = run_model(qdq, [{"x": np.zeros((1, 1, 2, 2), np.float32)}])[0]["y"]
    np.testing.assert_allclose(out[0, :, 0, 0], bias, rtol=1e-6)
