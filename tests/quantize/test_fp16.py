"""FP16 conversion of a heavy model (weights over HEAVY_BYTES): converted as its weightless skeleton with the
weights filled in after, so a multi-GB model is never copied whole nor shape-inferred over 2 GB (onnx returns an
empty model there). The result must equal the plain conversion's."""

import numpy as np
import onnx
from onnx import helper, numpy_helper

import qprep
from qprep.model import io
from graphs import make_model


def layernorm_mlp():
    """MatMul → LayerNormalization (kept float32 by default) → MatMul with a bias of values float16 clips."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]),
             helper.make_node("LayerNormalization", ["h", "gamma", "beta"], ["n"], axis=-1),
             helper.make_node("MatMul", ["n", "w2"], ["m"]),
             helper.make_node("Add", ["m", "bias"], ["y"])]
    return make_model(nodes, [("x", [2, 64])], [("y", [2, 32])],
                      {"w1": rng.standard_normal((64, 128)).astype(np.float32),
                       "gamma": rng.uniform(0.5, 1.5, 128).astype(np.float32),
                       "beta": rng.standard_normal(128).astype(np.float32),
                       "w2": rng.standard_normal((128, 32)).astype(np.float32) * 1e-8,  # under float16's range
                       "bias": np.full(32, 1e5, np.float32)},  # over it: clipped to 1e4 as the converter does
                      opset=17)


def converted(tmp_path, save, name):
    qprep.run({"model": str(save(layernorm_mlp())), "pipeline": [{"quantize": {"backend": "fp16"}}]},
              output_dir=str(tmp_path / name), force=True)
    return onnx.load(str(tmp_path / name / "model.onnx"))


def test_a_heavy_model_converts_to_the_same_float16_model(tmp_path, save, monkeypatch):
    plain = converted(tmp_path, save, "plain")
    monkeypatch.setattr(io, "HEAVY_BYTES", 1024)
    monkeypatch.setattr(io, "SMALL_TENSOR", 256)
    heavy = converted(tmp_path, save, "heavy")
    arrays = lambda model: {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    plain_arrays, heavy_arrays = arrays(plain), arrays(heavy)
    assert plain_arrays.keys() == heavy_arrays.keys()
    for name, array in plain_arrays.items():
        assert heavy_arrays[name].dtype == array.dtype and np.array_equal(heavy_arrays[name], array), name
    assert heavy_arrays["w1"].dtype == np.float16 and heavy_arrays["gamma"].dtype == np.float32
    assert heavy_arrays["bias"].max() == np.float16(1e4)
    assert [n.op_type for n in heavy.graph.node] == [n.op_type for n in plain.graph.node]


def test_clipped_weights_are_named_once_in_the_report_not_per_warning_in_the_log(tmp_path, save):
    """The 1e5 bias is clipped to 1e4 (a warning that names it); w2's 1e-8 values are raised to 1e-7 (no warning);
    onnxconverter-common's own per-tensor warnings stay out of the run log."""
    report = qprep.run({"model": str(save(layernorm_mlp())), "pipeline": [{"quantize": {"backend": "fp16"}}]},
                       output_dir=str(tmp_path / "run"), force=True)
    clipped = [w for w in report["warnings"] if "float16 clipped" in w]
    assert len(clipped) == 1 and "1 weight tensor(s) to ±10000: bias " in clipped[0] and "1e+05" in clipped[0]
    assert report["stages"][-1]["clipped_to_float16_range"] == {"bias": 1e5}
    assert "will be truncated" not in (tmp_path / "run" / "qprep.log").read_text()


def test_a_tied_parameter_read_by_a_float32_node_and_through_identity_converts_to_a_model_ort_loads(tmp_path, save):
    """TorchScript exports tied parameters as Identity(initializer) (BERT's pooler bias reads the embeddings'
    LayerNorm bias): the initializer stays float32 for LayerNormalization, and the Identity must cast it."""
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    nodes = [helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["n"], axis=-1),
             helper.make_node("Identity", ["beta"], ["bias"], name="tied"),
             helper.make_node("Gemm", ["n", "w", "bias"], ["y"])]
    model = make_model(nodes, [("x", [2, 32])], [("y", [2, 32])],
                       {"gamma": rng.uniform(0.5, 1.5, 32).astype(np.float32),
                        "beta": rng.standard_normal(32).astype(np.float32),
                        "w": rng.standard_normal((32, 32)).astype(np.float32)}, opset=17)
    report = qprep.run({"model": str(save(model)), "pipeline": [{"quantize": {"backend": "fp16"}}]},
                       output_dir=str(tmp_path / "run"), force=True)
    assert report["stages"][-1]["identities_cast"] == ["tied"]
    feeds = {"x": rng.standard_normal((2, 32)).astype(np.float32)}
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    result = ort.InferenceSession(str(tmp_path / "run" / "model.onnx"), providers=["CPUExecutionProvider"]).run(
        None, feeds)[0]
    np.testing.assert_allclose(result, expected, rtol=0.02, atol=0.05)
