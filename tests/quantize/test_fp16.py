"""FP16 conversion: a heavy model (weights over HEAVY_BYTES) converted as its weightless skeleton with the weights
filled in after, so a multi-GB model is never copied whole nor shape-inferred over 2 GB (onnx returns an empty model
there), equal to the plain conversion; the converter's faults (a model's own Cast, a blocked Cast) fixed at the
source, and one that remains named with the fp16 settings."""

import numpy as np
import pytest
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


def cast_mul_model(source_dtype):
    """source[1, 4] → the model's own Cast(to=FLOAT) → Mul with x[1, 4] → y: a dynamo export casts its int64
    attention_mask so."""
    nodes = [helper.make_node("Cast", ["source"], ["as_float"], to=onnx.TensorProto.FLOAT, name="to_float"),
             helper.make_node("Mul", ["as_float", "x"], ["y"], name="mul")]
    return make_model(nodes, [("source", [1, 4], source_dtype), ("x", [1, 4])], [("y", [1, 4])])


def run_fp16(tmp_path, model, fp16=None):
    """qprep.run of `model` to FP16, evaluated on 4 samples (ONNX Runtime runs the result) → (report, samples)."""
    rng = np.random.default_rng(0)
    (tmp_path / "samples").mkdir()
    dtype = helper.tensor_dtype_to_np_dtype(model.graph.input[0].type.tensor_type.elem_type)
    samples = [{"source": rng.integers(0, 2, (1, 4)).astype(dtype), "x": rng.random((1, 4), dtype=np.float32)}
               for _ in range(4)]
    for i, sample in enumerate(samples):
        np.savez(tmp_path / "samples" / f"{i}.npz", **sample)
    onnx.save(model, tmp_path / "m.onnx")
    report = qprep.run({"model": str(tmp_path / "m.onnx"), "calibration": {"source": str(tmp_path / "samples")},
                        "evaluation": {"source": str(tmp_path / "samples"), "layers": False},
                        "pipeline": [{"quantize": {"backend": "fp16", **({"fp16": fp16} if fp16 else {})}}]},
                       output_dir=str(tmp_path / "run"), force=True)
    return report, samples


def test_the_models_own_cast_of_an_integer_to_float_converts_to_a_model_ort_runs(tmp_path):
    """onnxconverter-common typed the Cast's output float16 and left its `to` float32: ONNX Runtime refused the
    result, and the user was told to exclude the node with the ORT backend's setting."""
    from qprep.model.runtime import run_model

    report, samples = run_fp16(tmp_path, cast_mul_model(np.int64))
    assert report["status"] == "ok"
    result = run_model(onnx.load(tmp_path / "run" / "model.onnx"), samples)
    for sample, outputs in zip(samples, result):
        np.testing.assert_allclose(outputs["y"], sample["source"] * sample["x"], rtol=1e-3)


def test_cast_in_the_op_block_list_converts_without_casts_without_end(tmp_path, monkeypatch):
    """onnxconverter-common casts a blocked node's float16 input to float32 with a new Cast, which a blocked "Cast"
    blocked in turn: it inserted casts for minutes. Counted here, so the old loop fails instead of hanging."""
    from onnxconverter_common import float16

    calls, add = [], float16.add_cast_node

    def counted(*args, **kwargs):
        calls.append(args[3])
        assert len(calls) < 100, f"onnxconverter-common inserted casts without end: {calls[-3:]}"
        return add(*args, **kwargs)

    monkeypatch.setattr(float16, "add_cast_node", counted)
    report, _ = run_fp16(tmp_path, cast_mul_model(np.float32), {"op_block_list": ["LayerNormalization", "Cast"]})
    assert report["status"] == "ok"
    assert report["stages"][-1]["casts_left_as_they_are"] == ["to_float"]


def test_a_conversion_ort_cannot_load_names_the_fp16_settings_not_the_ort_backends(tmp_path, monkeypatch):
    """A fault of the converter that remains is said where the conversion runs, with the settings that change it
    (keep_float, quantize.fp16.op_block_list), not from the evaluation with quantize.ort's."""
    from onnxconverter_common import float16

    from qprep.errors import ModelError

    convert = float16.convert_float_to_float16

    def broken(*args, **kwargs):  # a Mul whose inputs disagree: one float32, one float16
        converted = convert(*args, **kwargs)
        mul = next(n for n in converted.graph.node if n.op_type == "Mul")
        mul.input[0] = "x"
        return converted

    monkeypatch.setattr(float16, "convert_float_to_float16", broken)
    with pytest.raises(ModelError) as refused:
        run_fp16(tmp_path, cast_mul_model(np.float32))
    said = str(refused.value)
    assert "float16 conversion" in said and "keep_float: {nodes: [mul]} or quantize.fp16.op_block_list: [Mul]" in said
    assert "quantize.ort" not in said and "\n" not in said
