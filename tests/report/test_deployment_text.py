"""The report's deployment text is written from the input contract (contract.py writes it, report.json carries it)
and the calibration's image preprocessing, per input kind: raw uint8 pixels only where the NPU applies mean/std,
the normalized values an NHWC image classifier takes where it does not, and dtype and shape (no pixels) for audio."""

from __future__ import annotations

from types import SimpleNamespace

from synthetic_report import report

from qprep.model.info import TensorSpec
from qprep.quantize.rknn.contract import input_contract
from qprep.report.decisions import files_lines

OPTIONS = SimpleNamespace(target_platform="rk3588")


def rknn_report(contract: dict, preprocess: dict | None = None) -> dict:
    data = report()
    data["result"].update(artifacts=["input_contract.json", "model.rknn", "run_on_board.py"],
                          deployable={"path": "model.rknn", "bytes": 1000, "note": "x"}, input_contract=contract)
    if preprocess:
        data["calibration"] = {**data["calibration"], "format": "images", "preprocess": preprocess}
    return data


def image_preprocess(layout: str, mean=None, std=None, order: str = "rgb") -> dict:
    return {"input": "image", "dtype": "float32", "layout": layout, "channel_order": order, "size_hw": [224, 224],
            "resize": "stretch", "mean": mean, "std": std}


def text(data: dict) -> str:
    return "\n".join(files_lines(data))


def test_an_image_the_npu_normalizes_is_fed_as_raw_uint8_pixels_in_the_stated_layout_and_order():
    normalization = {"input": "image", "mean": [123.7, 116.3, 103.5], "std": [58.4, 57.1, 57.4],
                     "channel_order": "bgr", "layout": "nchw", "resize": "center_crop"}
    contract = input_contract([TensorSpec("image", "float32", [1, 3, 224, 224])], normalization, OPTIONS)
    lines = text(rknn_report(contract, image_preprocess("nchw", normalization["mean"], normalization["std"], "bgr")))
    assert ("`image`: raw uint8 pixels, NHWC [1, 224, 224, 3], BGR channel order, resized as the calibration images "
            "were (center_crop); the NPU applies (x − mean) / std itself (mean [123.7, 116.3, 103.5], std "
            "[58.4, 57.1, 57.4])") in lines
    assert "`python3 run_on_board.py image.png`" in lines


def test_a_channels_last_classifier_the_toolkit_got_no_mean_std_for_takes_its_normalized_values():
    """The walkthrough's NHWC classifier (BGR, mean subtraction): the toolkit got no mean/std, the contract says
    float32: the report must not say the NPU normalizes, nor offer an image file to the runner."""
    contract = input_contract([TensorSpec("image", "float32", [1, 224, 224, 3])], None, OPTIONS)
    lines = text(rknn_report(contract, image_preprocess("nhwc", [103.9, 116.8, 123.7], None, "bgr")))
    assert ("`image`: float32 [1, 224, 224, 3], NHWC: the image as calibration read it — BGR channel order, resized "
            "(stretch), x − mean of the 0–255 pixel values x with mean [103.9, 116.8, 123.7]; the NPU applies no "
            "mean/std") in lines
    assert "mean/std itself" not in lines and "uint8" not in lines and "image.png" not in lines
    assert "`python3 run_on_board.py sample.npz` (one array per input: `image`, as above)" in lines


def test_a_1_channel_image_is_grayscale_in_every_deployment_text_nchw_or_nhwc_npu_or_not():
    """A grayscale digits model (the config's rgb default means nothing for one channel): the NPU-normalized feed,
    a channels-last model the toolkit got no mean/std for, and an ONNX Runtime result never name an RGB order."""
    normalization = {"input": "image", "mean": [127.5], "std": [127.5], "channel_order": "rgb", "layout": "nchw",
                     "resize": "stretch"}
    contract = input_contract([TensorSpec("image", "float32", [1, 1, 32, 32])], normalization, OPTIONS)
    lines = text(rknn_report(contract, image_preprocess("nchw", [127.5], [127.5])))
    assert ("`image`: raw uint8 pixels, NHWC [1, 32, 32, 1], grayscale (1 channel), resized as the calibration "
            "images were (stretch)") in lines
    assert "RGB" not in lines and "`python3 run_on_board.py image.png`" in lines
    contract["inputs"][0]["feed"]["channel_order"] = "rgb"  # a contract written before `gray`: its shape tells
    assert "RGB" not in text(rknn_report(contract, image_preprocess("nchw", [127.5], [127.5])))
    nhwc = input_contract([TensorSpec("image", "float32", [1, 32, 32, 1])], None, OPTIONS)
    lines = text(rknn_report(nhwc, image_preprocess("nhwc", [127.5], [127.5])))
    assert "`image`: float32 [1, 32, 32, 1], NHWC: the image as calibration read it — grayscale (1 channel)" in lines
    assert "RGB" not in lines
    ort = report()
    ort["result"]["inputs"] = [TensorSpec("image", "float32", [1, 1, 32, 32]).as_dict()]
    ort["calibration"] = {**ort["calibration"], "format": "images",
                          "preprocess": image_preprocess("nchw", [127.5], [127.5], "bgr")}
    first = files_lines(ort)[0]
    assert "feed `image`: float32 [1, 1, 32, 32], NCHW: the image as calibration read it — grayscale (1 channel)" \
        in first and "BGR" not in first


def test_an_nchw_float_input_without_mean_std_is_fed_as_the_model_takes_it():
    contract = input_contract([TensorSpec("x", "float32", [1, 3, 224, 224])], None, OPTIONS)
    lines = text(rknn_report(contract))
    assert "`x`: float32 [1, 3, 224, 224], the values the ONNX model takes (as in the calibration samples)" in lines
    assert "mean/std itself" not in lines and "uint8" not in lines and "image.png" not in lines


def test_an_audio_model_is_told_its_dtype_and_shape_never_pixels():
    contract = input_contract([TensorSpec("input", "float32", [1, 16000])], None, OPTIONS)
    lines = text(rknn_report(contract))
    assert "`input`: float32 [1, 16000], the values the ONNX model takes" in lines
    assert "pixel" not in lines and "NHWC" not in lines and "mean/std" not in lines
    assert "`python3 run_on_board.py sample.npz` (one array per input: `input`, as above)" in lines


def test_a_token_model_lists_each_input_and_the_onnx_runtime_result_follows_the_same_text():
    inputs = [TensorSpec("input_ids", "int64", [1, 128]), TensorSpec("attention_mask", "int64", [1, 128])]
    lines = text(rknn_report(input_contract(inputs, None, OPTIONS)))
    assert "`input_ids`: int64 [1, 128]" in lines and "`attention_mask`: int64 [1, 128]" in lines
    assert "pixel" not in lines
    ort = report()
    ort["result"]["inputs"] = [spec.as_dict() for spec in inputs]
    first = files_lines(ort)[0]
    assert first.startswith("`model.onnx`: the qdq model to deploy with ONNX Runtime")
    assert "feed `input_ids`: int64 [1, 128], the values the ONNX model takes" in first


def test_a_contract_written_before_onnx_input_and_feed_is_described_in_general_words():
    """An earlier run's report.json: its flat mean/std are not read as this contract's fields, and the runner's
    command names both forms its runner takes."""
    old = {"target_platform": "rk3588", "inputs": [{"name": "x", "shape": [1, 3, 8, 8], "dtype": "float32",
                                                    "feed": "uint8 pixels, NHWC", "mean": [0, 0, 0], "std": [1, 1, 1]}]}
    lines = text(rknn_report(old))
    assert "`input_contract.json`: what to feed each input — names, shapes, dtypes" in lines
    assert ("`python3 run_on_board.py image.png` for a single input the NPU normalizes, else "
            "`python3 run_on_board.py sample.npz` (one array per input name)") in lines
