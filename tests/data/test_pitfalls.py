"""Data that runs but measures the wrong thing is named in the report's warnings (qprep/data/pitfalls.py)."""

import numpy as np
from onnx import helper

from graphs import make_model, tiny_conv_model
from qprep.data import SampleSet
from qprep.data.pitfalls import data_warnings

IMAGES = {"input": "x", "dtype": "float32", "layout": "nchw", "channel_order": "rgb", "size_hw": [8, 8],
          "resize": "stretch", "mean": None, "std": None}


def images(seed: int, count: int = 4, **preprocess) -> SampleSet:
    rng = np.random.default_rng(seed)
    return SampleSet(samples=[{"x": rng.random((1, 3, 8, 8), dtype=np.float32)} for _ in range(count)],
                     format="images", preprocess={**IMAGES, **preprocess})


def test_raw_pixels_into_a_conv_are_flagged_unless_the_model_normalizes_itself():
    conv = tiny_conv_model(batch=1)
    assert any("raw 0..255 pixels" in w and "'x'" in w for w in data_warnings(conv, images(0), None))
    assert data_warnings(conv, images(0, mean=[0.0], std=[1.0]), None) == []  # stated: raw pixels are right
    scaled = make_model([helper.make_node("Div", ["x", "k"], ["y"])], [("x", [1, 3, 8, 8])], [("y", [1, 3, 8, 8])],
                        {"k": np.float32(255)})
    assert data_warnings(scaled, images(0), None) == []


def test_calibration_and_evaluation_preprocessed_differently_is_flagged():
    conv = tiny_conv_model(batch=1)
    calibration, evaluation = images(0, mean=[127.5], std=[127.5]), images(1, mean=[127.5], std=[127.5],
                                                                           channel_order="bgr")
    warnings = data_warnings(conv, calibration, evaluation)
    assert len(warnings) == 1 and "channel_order rgb vs bgr" in warnings[0]
    assert data_warnings(conv, calibration, images(1, mean=[127.5], std=[127.5])) == []


def test_evaluation_samples_that_are_calibration_samples_are_flagged_even_as_copies():
    conv = tiny_conv_model(batch=1)
    calibration = images(0, mean=[0.0], std=[1.0])
    copy = SampleSet(samples=[{k: v.copy() for k, v in s.items()} for s in calibration.samples],
                     format="images", preprocess=calibration.preprocess)
    assert any("samples are the calibration samples" in w for w in data_warnings(conv, calibration, copy))
    partly = SampleSet(samples=copy.samples[:1] + images(5, mean=[0.0], std=[1.0]).samples, format="images",
                       preprocess=calibration.preprocess)
    assert any("share 1 of 5 samples" in w for w in data_warnings(conv, calibration, None, partly))
    assert data_warnings(conv, calibration, images(9, mean=[0.0], std=[1.0])) == []


def test_the_same_files_read_with_another_preprocess_are_still_shared_samples():
    conv = tiny_conv_model(batch=1)
    calibration, evaluation = images(0, mean=[0.0], std=[1.0]), images(1, mean=[0.0], std=[1.0])
    calibration.files = evaluation.files = [f"/data/{i}.png" for i in range(4)]
    assert any("samples are the calibration samples" in w for w in data_warnings(conv, calibration, evaluation))


def conv_batchnorm(constants: bool = False):
    """x[1,3,8,8] → Conv 1x1 (identity) → BatchNormalization trained on values of mean 0.5 and std 0.3 (a model
    trained on [0, 1] inputs); its weights as initializers or, as a Paddle export holds them, Constant nodes."""
    values = {"w": np.eye(3, dtype=np.float32).reshape(3, 3, 1, 1), "b": np.zeros(3, np.float32),
              "scale": np.ones(3, np.float32), "bias": np.zeros(3, np.float32),
              "mean": np.full(3, 0.5, np.float32), "var": np.full(3, 0.09, np.float32)}
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"]),
             helper.make_node("BatchNormalization", ["c", "scale", "bias", "mean", "var"], ["y"], name="bn0")]
    if constants:
        from onnx import numpy_helper

        nodes = [helper.make_node("Constant", [], [name], value=numpy_helper.from_array(array, name))
                 for name, array in values.items()] + nodes
        values = {}
    return make_model(nodes, [("x", [1, 3, 8, 8])], [("y", [1, 3, 8, 8])], values)


def test_samples_far_off_the_first_batchnorms_training_statistics_are_flagged():
    """Issue #59: mean/std written wrong (raw 0..255 pixels for a model trained on [0, 1] or [-1, 1]) passed
    without a word; the BatchNormalization after the input's Conv records what the training fed it."""
    for constants in (False, True):
        model = conv_batchnorm(constants)
        right = images(0, mean=[0.0], std=[255.0])  # the samples' [0, 1] values, as trained
        assert data_warnings(model, right, None) == []
        raw = SampleSet(samples=[{"x": 255 * s["x"]} for s in right.samples], format="images",
                        preprocess={**IMAGES, "mean": [0.0], "std": [1.0]})  # stated, but not as trained
        warning, = data_warnings(model, raw, None)
        assert warning.startswith("calibration: at the model's first BatchNormalization ('bn0', after the Conv "
                                  "reading 'x') the samples have ") and "× the spread of the training data" in warning
