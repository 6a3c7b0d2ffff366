"""ONNX Runtime's dynamic quantizer turns each Gemm into a MatMul by transposing its weight in place. Two ways that
broke a ViT (TorchScript and dynamo alike): a value_info naming the weight kept the old shape (the run failed:
"Inferred shape and existing shape differ"), and a weight two Gemms share was transposed twice (cosine 0.41)."""

import numpy as np
import onnx
from onnx import helper

from conftest import run_on_samples, typed
from graphs import make_model, rand
from qprep.model.runtime import run_model
from qprep.quantize.ort.prepare import shared_gemm_weights_transposed

DYNAMIC = [{"quantize": {"backend": "ort", "ort": {"activations": "dynamic"}}}]


def two_gemms(shared: bool) -> onnx.ModelProto:
    """x[4,16] → Gemm(w, transB) → Relu → Gemm(w or v, transB) → y[4,16]."""
    rng = np.random.default_rng(0)
    second = "w" if shared else "v"
    return make_model([helper.make_node("Gemm", ["x", "w", "b"], ["h"], transB=1),
                       helper.make_node("Relu", ["h"], ["r"]),
                       helper.make_node("Gemm", ["r", second, "b"], ["y"], transB=1)],
                      [("x", [4, 16])], [("y", [4, 16])],
                      {"w": rng.standard_normal((16, 16)).astype(np.float32) * 0.3,
                       "v": rng.standard_normal((16, 16)).astype(np.float32) * 0.3,
                       "b": rng.standard_normal(16).astype(np.float32) * 0.1}, infer_shapes=False)


def samples(count=8):
    return [{"x": rand(4, 16, seed=i)} for i in range(count)]


def test_gemms_that_share_a_weight_read_one_transposed_copy_with_the_same_numbers():
    model = two_gemms(shared=True)
    rewritten = shared_gemm_weights_transposed(model)
    gemms = [n for n in rewritten.graph.node if n.op_type == "Gemm"]
    assert {n.input[1] for n in gemms} == {"w/transposed"}
    assert not any(a.name == "transB" for n in gemms for a in n.attribute)
    for before, after in zip(run_model(model, samples(2)), run_model(rewritten, samples(2))):
        np.testing.assert_allclose(after["y"], before["y"], rtol=1e-5, atol=1e-6)
    unshared = two_gemms(shared=False)
    assert shared_gemm_weights_transposed(unshared) is unshared


def test_gemms_sharing_a_weight_are_quantized_dynamically_without_computing_something_else(tmp_path):
    report = run_on_samples(tmp_path, two_gemms(shared=True), samples(), DYNAMIC)
    assert report["status"] == "ok"
    assert report["evaluation"]["outputs"]["y"]["cosine_mean"] > 0.99  # before: the second Gemm read wᵀ
    ops = {n.op_type for n in onnx.load(str(tmp_path / "out" / "model.onnx")).graph.node}
    assert "MatMulInteger" in ops or "DynamicQuantizeLinear" in ops


def test_a_value_info_on_a_gemm_weight_does_not_stop_dynamic_quantization(tmp_path):
    """onnx-ir writes value_info for initializers (qprep's optimize stage did, and so may an exporter)."""
    weight = np.random.default_rng(1).standard_normal((8, 16)).astype(np.float32)
    model = make_model([helper.make_node("Gemm", ["x", "w"], ["y"], transB=1)], [("x", [4, 16])], [("y", [4, 8])],
                       {"w": weight}, infer_shapes=False)
    model.graph.value_info.append(helper.make_tensor_value_info("w", onnx.TensorProto.FLOAT, [8, 16]))
    report = run_on_samples(tmp_path, model, samples(), DYNAMIC)
    assert report["status"] == "ok"  # before: "Inferred shape and existing shape differ in dimension 0: (16) vs (8)"


def test_a_gemm_kept_float_stays_float_in_a_dynamic_build(tmp_path):
    """ORT's dynamic quantizer writes each Gemm as a MatMul named <gemm>_MatMul before it reads nodes_to_exclude:
    a Gemm in the float set is excluded under that name too, so only the other Gemm becomes MatMulInteger."""
    from qprep.model.prepare import name_nodes
    from qprep.quantize.ort.quantizer import OrtQuantizer

    model = two_gemms(shared=False)
    name_nodes(model.graph)
    first, second = [n.name for n in model.graph.node if n.op_type == "Gemm"]
    options = typed("ort", activations="dynamic")
    for reuse in (False, True):  # one build, and the fallback's builds from a kept shape-inferred copy
        built = OrtQuantizer(model, samples(), options, tmp_path, many_builds=reuse).build({first})
        integer = [n.name for n in built.graph.node if n.op_type == "MatMulInteger"]
        assert integer and not any(name.startswith(first) for name in integer), integer
        assert any(name.startswith(second) for name in integer)
