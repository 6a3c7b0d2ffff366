import os

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from qprep.optimize.passes import fold_into_conv, layernorm
from qprep.graph.verify import Float32Noise, Tolerance, Verifier, compare, cosine, weights_one_ulp_away
from graphs import apply_pass, make_model, ops, tiny_conv_model


def sample(seed=0):
    return {"x": np.random.default_rng(seed).standard_normal((1, 3, 8, 8)).astype(np.float32)}


def test_identical_models_pass_and_perturbed_weights_fail_with_the_output_named():
    model = tiny_conv_model()
    verifier = Verifier([sample(0), sample(1)], Tolerance())
    verifier.set_reference(model)
    assert verifier.check(model).ok
    changed = onnx.ModelProto()
    changed.CopyFrom(model)
    w = numpy_helper.to_array(changed.graph.initializer[0]).copy()
    w[0, 0, 0, 0] += 1e-2
    changed.graph.initializer[0].CopyFrom(numpy_helper.from_array(w, "w"))
    verdict = verifier.check(changed)
    assert not verdict.ok
    assert "output 'y'" in verdict.reason
    assert verdict.outputs["y"]["max_abs"] > 1e-3


def test_tolerance_is_atol_plus_rtol_times_reference():
    ref = [{"y": np.array([1000.0, 0.0], dtype=np.float32)}]
    within = [{"y": np.array([1000.0 + 0.09, 5e-6], dtype=np.float32)}]  # 1e-5 + 1e-4*1000 = 0.10001
    beyond = [{"y": np.array([1000.0 + 0.2, 0.0], dtype=np.float32)}]
    assert compare(ref, within, Tolerance()).ok
    assert not compare(ref, beyond, Tolerance()).ok


def test_nan_in_result_where_reference_is_finite_fails():
    ref = [{"y": np.array([1.0, 2.0])}]
    got = [{"y": np.array([1.0, np.nan])}]
    assert not compare(ref, got, Tolerance()).ok


def test_non_numeric_outputs_must_stay_identical():
    """String labels or ZipMap's maps cannot be compared numerically: unchanged passes, changed fails."""
    ref = [{"label": np.array(["cat"], dtype=object), "y": np.ones(2)}]
    assert compare(ref, [{"label": np.array(["cat"], dtype=object), "y": np.ones(2)}], Tolerance()).ok
    verdict = compare(ref, [{"label": np.array(["dog"], dtype=object), "y": np.ones(2)}], Tolerance())
    assert not verdict.ok and "output 'label'" in verdict.reason


def test_cosine_edge_cases():
    assert cosine(np.zeros(3), np.zeros(3)) == 1.0
    assert cosine(np.ones(3), np.zeros(3)) == 0.0
    assert abs(cosine(np.array([1.0, 0.0]), np.array([0.0, 1.0]))) < 1e-12


def test_near_zero_outputs_are_judged_by_tolerance_not_direction():
    ref = [{"y": np.array([1e-8, -2e-8, 0.0])}]
    got = [{"y": np.array([-3e-8, 1e-8, 5e-8])}]  # opposite direction, but all within atol
    assert compare(ref, got, Tolerance()).ok


# Float32 noise: exact-in-math rewrites of deep graphs pass, real breaks fail (both sides on tiny graphs)

def deep_conv_bn(depth=24, channels=8):
    """x → depth × (Conv 3x3 → BatchNorm → Relu) → y: deep enough that folding's extra rounding adds up."""
    rng = np.random.default_rng(0)
    nodes, inits, x = [], {}, "x"
    for i in range(depth):
        inits.update({f"w{i}": (rng.standard_normal((channels, channels, 3, 3)) / np.sqrt(9 * channels)),
                      f"g{i}": rng.uniform(0.5, 2, channels), f"b{i}": rng.uniform(-1, 1, channels),
                      f"m{i}": rng.uniform(-1, 1, channels), f"v{i}": rng.uniform(0.2, 3, channels)})
        nodes += [helper.make_node("Conv", [x, f"w{i}"], [f"c{i}"], pads=[1, 1, 1, 1]),
                  helper.make_node("BatchNormalization", [f"c{i}", f"g{i}", f"b{i}", f"m{i}", f"v{i}"], [f"n{i}"]),
                  helper.make_node("Relu", [f"n{i}"], [f"r{i}"])]
        x = f"r{i}"
    nodes[-1] = helper.make_node("Identity", [f"n{depth - 1}"], ["y"])
    return make_model(nodes, [("x", [1, channels, 16, 16])], [("y", [1, channels, 16, 16])],
                      {k: v.astype(np.float32) for k, v in inits.items()})


def raw_pixel_samples(count=3):
    """Unnormalized inputs (0..255-like magnitudes): a deep output's elements near zero carry absolute
    rounding error from the large activations before them."""
    return [{"x": (100 * np.random.default_rng(s).standard_normal((1, 8, 16, 16))).astype(np.float32)}
            for s in range(count)]


def scaled_initializer(model, name, factor):
    changed = onnx.ModelProto()
    changed.CopyFrom(model)
    for tensor in changed.graph.initializer:
        if tensor.name == name:
            tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor) * np.float32(factor), name))
    return changed


def test_batchnorms_folded_deep_in_a_network_pass_where_a_fixed_atol_rolled_them_back():
    model = deep_conv_bn()
    folded, outcome = apply_pass(fold_into_conv.PASS, model)
    assert outcome.matches == 24 and not ops(folded)["BatchNormalization"]
    fixed = Verifier(raw_pixel_samples(), Tolerance(noise_factor=0))
    fixed.set_reference(model)
    assert not fixed.check(folded).ok  # what main did: 1.4e-04 > atol 1e-05 on elements near zero
    verifier = Verifier(raw_pixel_samples(), Tolerance())
    verifier.set_reference(model)
    verdict = verifier.check(folded)
    assert verdict.ok, verdict.reason
    assert verdict.outputs["y"]["max_abs"] < verdict.outputs["y"]["float32_allows"]


def test_a_1e3_relative_error_in_one_deep_layer_still_fails():
    model = deep_conv_bn()
    folded, _ = apply_pass(fold_into_conv.PASS, model)
    conv = [n for n in folded.graph.node if n.op_type == "Conv"][12]
    broken = scaled_initializer(folded, conv.input[1], 1 + 1e-3)
    verifier = Verifier(raw_pixel_samples(), Tolerance())
    verifier.set_reference(model)
    verdict = verifier.check(broken)
    assert not verdict.ok and "float32 noise allows" in verdict.reason


def layernorm_between_matmuls(eps=1e-5):
    """x → MatMul → LayerNorm (decomposed, as torch exports it) → MatMul → y, the LN input small enough
    (variance ~1e-3) that its epsilon matters."""
    rng = np.random.default_rng(1)
    hidden = 16
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]),
             helper.make_node("ReduceMean", ["h"], ["mean"], axes=[-1]),
             helper.make_node("Sub", ["h", "mean"], ["d"]),
             helper.make_node("Pow", ["d", "two"], ["sq"]),
             helper.make_node("ReduceMean", ["sq"], ["var"], axes=[-1]),
             helper.make_node("Add", ["var", "eps"], ["ve"]),
             helper.make_node("Sqrt", ["ve"], ["std"]),
             helper.make_node("Div", ["d", "std"], ["normed"]),
             helper.make_node("Mul", ["normed", "gamma"], ["scaled"]),
             helper.make_node("Add", ["scaled", "beta"], ["ln"]),
             helper.make_node("MatMul", ["ln", "w2"], ["y"])]
    inits = {"w1": rng.standard_normal((hidden, hidden)) * 0.01, "w2": rng.standard_normal((hidden, hidden)),
             "two": np.array(2.0), "eps": np.array(eps), "gamma": rng.uniform(0.5, 1.5, hidden),
             "beta": rng.uniform(-0.5, 0.5, hidden)}
    return make_model(nodes, [("x", [2, 8, hidden])], [("y", [2, 8, hidden])],
                      {k: np.asarray(v, dtype=np.float32) for k, v in inits.items()})


def test_fused_layernorm_passes_and_a_wrong_epsilon_or_swapped_gamma_beta_fails():
    model = layernorm_between_matmuls()
    fused, outcome = apply_pass(layernorm.PASS, model)
    assert ops(fused)["LayerNormalization"] == 1
    samples = [{"x": np.random.default_rng(s).standard_normal((2, 8, 16)).astype(np.float32)} for s in range(3)]
    verifier = Verifier(samples, Tolerance())
    verifier.set_reference(model)
    assert verifier.check(fused).ok

    ln = next(n for n in fused.graph.node if n.op_type == "LayerNormalization")
    wrong_eps = onnx.ModelProto()
    wrong_eps.CopyFrom(fused)
    node = next(n for n in wrong_eps.graph.node if n.op_type == "LayerNormalization")
    next(a for a in node.attribute if a.name == "epsilon").f = 1e-6
    swapped = onnx.ModelProto()
    swapped.CopyFrom(fused)
    node = next(n for n in swapped.graph.node if n.op_type == "LayerNormalization")
    node.input[1], node.input[2] = ln.input[2], ln.input[1]
    for broken in (wrong_eps, swapped):
        verifier.set_reference(model)
        assert not verifier.check(broken).ok


def test_weights_one_ulp_away_moves_only_multiply_accumulate_operands():
    model = layernorm_between_matmuls()
    moved = {t.name: numpy_helper.to_array(t) for t in weights_one_ulp_away(model).graph.initializer}
    original = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for name in ("w1", "w2"):
        steps = np.abs(moved[name].view(np.int32) - original[name].view(np.int32))
        assert steps.max() == 1 and steps.min() == 1  # one ulp each, never more
    for name in ("two", "eps", "gamma", "beta"):  # an exponent or epsilon keeps its exact value
        assert np.array_equal(moved[name], original[name])


def test_noise_factor_zero_is_the_configured_tolerance_alone():
    ref = [{"y": np.array([1000.0, 0.0])}]
    got = [{"y": np.array([1000.0, 2e-5])}]
    noise = [{"y": Float32Noise(max_abs=1e-5, rel_l2=1e-8)}]
    assert not compare(ref, got, Tolerance(noise_factor=0), noise).ok
    assert compare(ref, got, Tolerance(noise_factor=8), noise).ok  # 8 × 1e-05 allowed
    assert not compare(ref, got, Tolerance(noise_factor=8)).ok  # no measured noise: configured tolerance


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the resident size from /proc")
def test_weights_one_ulp_away_holds_each_weight_once():
    """A copy whose weights are replaced in place keeps the replaced bytes as well (protobuf frees a message's
    memory only with the whole message): BERT-large's float32-noise copy took twice its weights."""
    import gc

    def resident_mb():
        return int(next(line for line in open("/proc/self/status") if line.startswith("VmRSS")).split()[1]) >> 10

    weight = np.ones((4096, 4096), np.float32)  # 64 MB
    model = make_model([helper.make_node("MatMul", ["x", "w"], ["y"])], [("x", [1, 4096])], [("y", [1, 4096])],
                       {"w": weight}, infer_shapes=False)
    del weight
    gc.collect()
    before = resident_mb()
    moved = weights_one_ulp_away(model)
    gc.collect()
    assert resident_mb() - before < 96  # one 64 MB copy, not two
    steps = np.abs(numpy_helper.to_array(moved.graph.initializer[0]).view(np.int32) - 0x3F800000)
    assert steps.min() == 1 and steps.max() == 1


def test_a_kernel_that_refuses_its_values_gets_no_input_dims_advice():
    """ORT 1.26's refusal of a QLinearConv whose per-channel weight zero points differ (newer releases run it):
    the message must keep ORT's explanation and not send the user to `inputs:` (it did); a shape error still
    does."""
    from qprep.model.runtime import model_error, short_ort_message

    refused = ("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Non-zero status code returned while running QLinearConv "
               "node. Name:'node_Conv_76_token_4' Status Message: /onnxruntime_src/onnxruntime/core/providers/cpu/"
               "quantization/qlinearconv.cc:83 static void onnxruntime::QLinearConv<ActType>::ComputeOffset(onnxrun"
               "time::OpKernelContext*, int64_t, ActType&, ActType&, uint8_t&) [with ActType = unsigned char; int64_t "
               "= long int; uint8_t = unsigned char] W_zero_point_data[i] == W_zero_point_value was false. QLinearConv "
               ": zero point of per-channel filter must be same. This happens by design if the quantization is "
               "symmetric.")
    short = short_ort_message(refused)
    assert "node_Conv_76_token_4" in short and "zero point of per-channel filter must be same" in short
    assert len(short) < 320
    said = str(model_error(RuntimeError(refused)))  # what the user reads: the short message, then what to do
    assert short in said and "inputs:" not in said and "keep that node float" in said
    shape = ("[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : Got invalid dimensions for input: x for the following "
             "indices index: 2 Got: 7 Expected: 8")
    assert "inputs:" in str(model_error(RuntimeError(shape)))
