import numpy as np
import onnx
from onnx import numpy_helper

from qprep.verify import Tolerance, Verifier, compare, cosine
from graphs import tiny_conv_model


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
