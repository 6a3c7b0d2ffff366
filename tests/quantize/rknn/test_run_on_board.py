"""run_on_board.py, the board's example runner, run here against a stand-in for rknn-toolkit-lite2 that records
what it is fed: images resized as the calibration was, .npz samples fed per input, outputs printed per kind."""

import json
import subprocess
import sys
from importlib import resources

import numpy as np
from PIL import Image

FAKE_LITE = '''
import json, numpy as np
class RKNNLite:
    def load_rknn(self, path): return 0
    def init_runtime(self): return 0
    def inference(self, inputs):
        json.dump([[list(a.shape), str(a.dtype), float(a.reshape(-1)[0])] for a in inputs], open("fed.json", "w"))
        return [np.array([[0.1, 0.7, 0.2]], np.float32), np.eye(4, dtype=np.float32)[None, [2, 0, 3]],
                np.zeros((1, 2, 5, 5), np.float32)]
    def release(self): pass
'''


def _board(tmp_path, inputs, **contract):
    (tmp_path / "rknnlite").mkdir()
    (tmp_path / "rknnlite" / "__init__.py").write_text("")
    (tmp_path / "rknnlite" / "api.py").write_text(FAKE_LITE)
    (tmp_path / "input_contract.json").write_text(json.dumps({"target_platform": "rk3588", "inputs": inputs,
                                                              **contract}))
    script = resources.files("qprep.quantize.rknn").joinpath("run_on_board.py").read_text()
    (tmp_path / "run_on_board.py").write_text(script)


def _run(tmp_path, sample):
    done = subprocess.run([sys.executable, "run_on_board.py", str(sample)], cwd=tmp_path, capture_output=True,
                          text=True, env={"PYTHONPATH": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    return done.stdout, json.loads((tmp_path / "fed.json").read_text())


def test_an_image_is_center_cropped_like_the_calibration_and_outputs_are_read_by_shape(tmp_path):
    _board(tmp_path, [{"name": "x", "shape": [1, 3, 8, 8], "mean": [0, 0, 0], "std": [1, 1, 1],
                       "channel_order": "rgb", "resize": "center_crop"}])
    pixels = np.zeros((8, 16, 3), np.uint8)
    pixels[:, 4:12] = 200  # the centre 8x8 is bright: a crop keeps only it, a stretch would not
    Image.fromarray(pixels).save(tmp_path / "wide.png")
    out, fed = _run(tmp_path, tmp_path / "wide.png")
    assert fed == [[[1, 8, 8, 3], "uint8", 200.0]]
    lines = out.splitlines()
    assert lines[0].startswith("output 0: top-5 1 (0.7), 2 (0.2), 0 (0.1)")
    assert lines[1] == "output 1: arg-max per step (3 steps) [2, 0, 3]"
    assert lines[2].startswith("output 2: shape [1, 2, 5, 5], min 0")


def test_a_model_of_other_inputs_is_fed_from_an_npz_by_input_name(tmp_path):
    _board(tmp_path, [{"name": "ids", "shape": [1, 4], "dtype": "int64"},
                      {"name": "mask", "shape": [1, 4], "dtype": "int64"}])
    np.savez(tmp_path / "s.npz", mask=np.ones((1, 4), np.int64), ids=np.full((1, 4), 7, np.int64))
    _, fed = _run(tmp_path, tmp_path / "s.npz")
    assert fed == [[[1, 4], "int64", 7.0], [[1, 4], "int64", 1.0]]


def test_a_recognizer_output_is_read_as_text_with_the_models_character_list(tmp_path):
    """Steps [2, 0, 3] over 4 classes (blank + 3 symbols): "b", blank, "c" → "bc"."""
    _board(tmp_path, [{"name": "ids", "shape": [1, 4], "dtype": "int64"}], ctc_characters=["a", "b", "c"])
    np.savez(tmp_path / "s.npz", ids=np.zeros((1, 4), np.int64))
    out, _ = _run(tmp_path, tmp_path / "s.npz")
    assert out.splitlines()[1] == "output 1: text 'bc'"


def test_an_input_the_contract_marks_ignored_is_not_fed(tmp_path):
    """model.rknn lacks a graph input no node read (static_graph/hygiene.py): a sample of the ONNX model's
    inputs, with or without it, feeds the others; an image model with such an input still takes an image."""
    _board(tmp_path, [{"name": "x", "shape": [1, 3, 8, 8], "mean": [0, 0, 0], "std": [1, 1, 1],
                       "channel_order": "rgb", "resize": "stretch"},
                      {"name": "unused", "shape": [1, 2], "dtype": "float32", "ignored": True}])
    np.savez(tmp_path / "s.npz", x=np.full((1, 3, 8, 8), 5, np.float32))
    _, fed = _run(tmp_path, tmp_path / "s.npz")
    assert fed == [[[1, 3, 8, 8], "float32", 5.0]]
    Image.fromarray(np.full((8, 8, 3), 9, np.uint8)).save(tmp_path / "i.png")
    _, fed = _run(tmp_path, tmp_path / "i.png")
    assert fed == [[[1, 8, 8, 3], "uint8", 9.0]]
