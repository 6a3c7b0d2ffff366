"""A model from ONNX Runtime's transformer optimizer (ort_optimized.py): before, qprep refused it at load (its
LayerNormalization below opset 17: "No Op registered") and, past that, ORT's quantizer failed on every MatMul
behind a com.microsoft op ("Unable to find data type for weight_name")."""

import numpy as np
import onnx
import pytest
from onnx import helper

from conftest import demo_model, run_on_samples
from graphs import make_model, rand
from qprep.errors import ModelError
from qprep.model.load import load_model
from qprep.model.ort_optimized import with_runtime_types
from qprep.model.runtime import run_model


def ort_optimized_block(opset: int = 14, norm: str = "LayerNormalization") -> onnx.ModelProto:
    """x[2,4,16] → `norm` (ONNX domain, as ORT writes it) → com.microsoft BiasGelu → MatMul → y[2,4,8]."""
    rng = np.random.default_rng(0)
    model = make_model([helper.make_node(norm, ["x", "gamma", "beta"] if norm == "LayerNormalization"
                                         else ["x", "gamma"], ["n"], axis=-1, epsilon=1e-5),
                        helper.make_node("BiasGelu", ["n", "bias"], ["g"], domain="com.microsoft"),
                        helper.make_node("MatMul", ["g", "w"], ["y"])],
                       [("x", [2, 4, 16])], [("y", [2, 4, 8])],
                       {"gamma": rng.uniform(0.5, 1.5, 16).astype(np.float32),
                        "beta": rng.standard_normal(16).astype(np.float32) * 0.1,
                        "bias": rng.standard_normal(16).astype(np.float32) * 0.1,
                        "w": rng.standard_normal((16, 8)).astype(np.float32)}, opset=opset, infer_shapes=False)
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model


def samples(count: int = 8) -> list[dict]:
    return [{"x": rand(2, 4, 16, seed=i)} for i in range(count)]


def test_ort_layernorm_below_17_is_loaded_at_opset_17_with_the_same_numbers(tmp_path):
    model = ort_optimized_block()
    with pytest.raises(onnx.checker.ValidationError):  # what qprep used to pass on
        onnx.checker.check_model(model)
    onnx.save(model, str(tmp_path / "m.onnx"))
    loaded = load_model(tmp_path / "m.onnx")
    assert {o.domain: o.version for o in loaded.opset_import}[""] == 17
    assert [n.domain for n in loaded.graph.node] == ["", "com.microsoft", ""]
    before, after = run_model(model, samples(2)), run_model(loaded, samples(2))
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a["y"], b["y"])


@pytest.mark.parametrize("opset, dtype", [(14, np.float32), (18, np.float32), (14, np.float16)])
def test_onnx_runtimes_rms_norm_is_written_out_as_onnx_ops_with_the_same_numbers(tmp_path, opset, dtype):
    """SimplifiedLayerNormalization (LLaMA's and T5's RMS norm in every ORT-optimized export) is no ONNX op: it
    was refused at load. Written out (in float32 for a float16 model, as its stash_type says), the model loads
    and computes what ORT's kernel did."""
    model = ort_optimized_block(opset, norm="SimplifiedLayerNormalization")
    if dtype == np.float16:
        from onnxconverter_common.float16 import convert_float_to_float16

        model = convert_float_to_float16(model, keep_io_types=True)
    onnx.save(model, str(tmp_path / "m.onnx"))
    loaded = load_model(tmp_path / "m.onnx")
    assert "SimplifiedLayerNormalization" not in {n.op_type for n in loaded.graph.node}
    assert {"Pow", "ReduceMean", "Sqrt", "Div"} <= {n.op_type for n in loaded.graph.node}
    for a, b in zip(run_model(model, samples(2)), run_model(loaded, samples(2))):
        np.testing.assert_allclose(b["y"], a["y"], rtol=1e-2 if dtype == np.float16 else 1e-5, atol=1e-3)


def test_an_op_only_onnx_runtime_has_and_qprep_cannot_write_out_is_refused_naming_it(tmp_path):
    model = ort_optimized_block(norm="SimplifiedLayerNormalization")
    gamma = model.graph.initializer[0]
    model.graph.input.append(helper.make_tensor_value_info(gamma.name, gamma.data_type, list(gamma.dims)))
    del model.graph.initializer[0]  # the scale a graph input: not a constant qprep can check against the kernel
    onnx.save(model, str(tmp_path / "m.onnx"))
    with pytest.raises(ModelError, match=r"SimplifiedLayerNormalization.*transformer optimizer"):
        load_model(tmp_path / "m.onnx")


def test_a_model_saved_in_onnx_runtimes_cpu_layout_is_refused_naming_it(tmp_path):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.optimized_model_filepath = str(tmp_path / "saved.onnx")
    options.log_severity_level = 3
    onnx.save(make_model([helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node("Relu", ["c"], ["y"])],
                         [("x", [1, 8, 16, 16])], [("y", [1, 16, 14, 14])],
                         {"w": np.random.default_rng(0).standard_normal((16, 8, 3, 3)).astype(np.float32)}),
              str(tmp_path / "m.onnx"))
    ort.InferenceSession(str(tmp_path / "m.onnx"), options, providers=["CPUExecutionProvider"])
    with pytest.raises(ModelError, match=r"com.microsoft.nchwc .*ORT_ENABLE_ALL"):
        load_model(tmp_path / "saved.onnx")


def test_tensors_behind_a_contrib_op_get_the_types_onnx_runtime_knows():
    model = ort_optimized_block(opset=17)
    typed = {v.name: v for v in with_runtime_types(model).graph.value_info}
    assert typed["g"].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert not typed["g"].type.tensor_type.HasField("shape")  # ORT says [] for unknown and scalar alike
    plain = make_model([helper.make_node("Relu", ["x"], ["y"])], [("x", [2])], [("y", [2])], infer_shapes=False)
    assert with_runtime_types(plain) is plain  # no contrib op: nothing asked of ONNX Runtime


def test_the_matmul_behind_a_contrib_op_is_quantized(tmp_path):
    report = run_on_samples(tmp_path, ort_optimized_block(), samples(), [{"quantize": {"backend": "ort"}}])
    assert report["status"] == "ok"
    result = onnx.load(str(tmp_path / "out" / "model.onnx"))
    consumers = {i for n in result.graph.node for i in n.input if n.op_type == "MatMul"}
    dequantized = {o for n in result.graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    assert consumers <= dequantized, "the MatMul after BiasGelu stayed float"


@pytest.mark.slow
def test_minilm_through_onnx_runtimes_transformer_optimizer_is_loaded_with_the_same_numbers(tmp_path):
    from onnxruntime.transformers import optimizer

    optimized = optimizer.optimize_model(str(demo_model("minilm_l6_v2.onnx")), model_type="bert", num_heads=12,
                                         hidden_size=384).model
    contrib = {n.op_type for n in optimized.graph.node if n.domain == "com.microsoft"}
    assert {"SkipLayerNormalization", "BiasGelu"} <= contrib
    onnx.save(optimized, str(tmp_path / "optimized.onnx"))
    loaded = with_runtime_types(load_model(tmp_path / "optimized.onnx"))
    sample = {"input_ids": np.array([[101, 7592, 2088, 102]], np.int64),
              "attention_mask": np.ones((1, 4), np.int64), "token_type_ids": np.zeros((1, 4), np.int64)}
    names = {i.name for i in optimized.graph.input}
    sample = {k: v for k, v in sample.items() if k in names}
    before, after = run_model(optimized, [sample])[0], run_model(loaded, [sample])[0]
    for name in before:
        np.testing.assert_array_equal(before[name], after[name])
