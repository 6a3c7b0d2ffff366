"""The u8s8 saturation probe and what ORT quantization does with its answer (reduce_range: auto)."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import qprep
from graphs import tiny_conv_model
from qprep.model import saturation
from qprep.report.decisions import decision_lines


def run_probe(model, feeds, fused: bool):
    options = ort.SessionOptions()
    options.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if fused
                                        else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


@pytest.mark.parametrize("probe", [saturation._probe_matmul, saturation._probe_conv])
def test_the_probes_reference_is_exact_and_uint8_weights_never_saturate(probe):
    """Unfused, the probe computes the exact sum (so a fused result that differs is the kernel's error); the same
    weights as uint8 (+128, zero point 128: what fuse_conv_qdq writes on such CPUs) are exact fused, on any CPU."""
    model, feeds = probe()
    exact = run_probe(model, feeds, fused=False)
    assert np.allclose(exact, saturation.DEPTH, rtol=0.01)
    for tensor in model.graph.initializer:
        if tensor.name in ("w_q", "w_zero_point"):
            values = np.frombuffer(tensor.raw_data, np.int8) if tensor.raw_data else np.array(tensor.int32_data)
            tensor.data_type = 2  # UINT8
            shifted = (values.astype(np.int16) + 128).astype(np.uint8)
            tensor.ClearField("int32_data")
            tensor.raw_data = shifted.tobytes()
    assert np.allclose(run_probe(model, feeds, fused=True), exact, rtol=0, atol=1.01 * saturation.OUTPUT_STEP)


@pytest.mark.parametrize("saturates", [True, False])
def test_weights_auto_follow_the_probe_and_the_report_says_why(tmp_path, save, monkeypatch, saturates):
    from qprep.quantize.ort import weight_type

    monkeypatch.setattr(weight_type, "u8s8_saturates", lambda: saturates)
    data = tmp_path / "data"
    data.mkdir()
    for i in range(4):
        np.save(data / f"{i}.npy", np.random.default_rng(i).standard_normal((1, 3, 8, 8)).astype(np.float32))
    config = {"model": str(save(tiny_conv_model(batch=1))), "calibration": {"source": str(data)},
              "pipeline": [{"quantize": {"backend": "ort"}}]}
    report = qprep.run(config, output_dir=str(tmp_path / "auto"), force=True)
    stage = report["stages"][0]
    assert stage["weights"]["type"] == ("uint8" if saturates else "int8") and stage["weights"]["reduce_range"] is False
    assert any(line.startswith("weights: **uint8**" if saturates else "weights: 8-bit") for line in decision_lines(stage))
    stored = {t.data_type for t in onnx.load(tmp_path / "auto" / "model.onnx").graph.initializer
              if t.name.endswith("_quantized") and len(t.dims) == 4}
    assert stored == {onnx.TensorProto.UINT8 if saturates else onnx.TensorProto.INT8}
    config["pipeline"] = [{"quantize": {"backend": "ort", "ort": {"weight_type": "int8"}}}]
    int8 = qprep.run(config, output_dir=str(tmp_path / "int8"), force=True)["stages"][0]
    assert int8["weights"]["type"] == "int8" and int8["weights"]["reduce_range"] is saturates
    assert any(line.startswith("weights: **7-bit**" if saturates else "weights: 8-bit") for line in decision_lines(int8))
    config["pipeline"] = [{"quantize": {"backend": "ort", "ort": {"reduce_range": False}}}]
    configured = qprep.run(config, output_dir=str(tmp_path / "configured"), force=True)["stages"][0]["weights"]
    assert configured == {"type": "int8", "reduce_range": False, "why": "configured", "bias_channels_rescaled": 0}
