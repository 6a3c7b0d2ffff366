"""scripts/zoo_exports.py: the sample builders read each model's inputs and keep the splits disjoint; the export
check refuses an ONNX file that disagrees with its source framework. (The exports themselves need the export
venv and minutes each: they run once, by hand or by scripts/zoo.py, not here.)"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from PIL import Image

from graphs import make_model

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.fixture(scope="module")
def zoo_exports():
    sys.path.insert(0, str(SCRIPTS))
    try:
        yield importlib.import_module("zoo_exports")
    finally:
        sys.path.remove(str(SCRIPTS))


def save(model: onnx.ModelProto, path: Path) -> Path:
    onnx.save(model, str(path))
    return path


def token_model(path: Path, dtype, length) -> Path:
    """input_ids + attention_mask (no token_type_ids) → their sum as float: a stand-in for a text encoder."""
    nodes = [onnx.helper.make_node("Add", ["input_ids", "attention_mask"], ["s"]),
             onnx.helper.make_node("Cast", ["s"], ["y"], to=onnx.TensorProto.FLOAT)]
    inputs = [("input_ids", [1, length], dtype), ("attention_mask", [1, length], dtype)]
    return save(make_model(nodes, inputs, [("y", [1, length])]), path)


def image_model(path: Path, shape: list) -> Path:
    return save(make_model([onnx.helper.make_node("Relu", ["x"], ["y"])], [("x", shape)], [("y", shape)]), path)


def test_splits_are_disjoint_for_any_count(zoo_exports):
    for counts in ((32, 48, 48), (5, 100, 7)):
        indices = [{zoo_exports.sample_index(split, i) for i in range(count)}
                   for split, count in zip(zoo_exports.SPLITS, counts)]
        assert sum(map(len, indices)) == len(set().union(*indices)) == sum(counts)
    with pytest.raises(zoo_exports.ExportError, match="not one of"):
        zoo_exports.sample_index("train", 0)


@pytest.mark.parametrize("dtype,length,expected_length", [(np.int32, 16, 16), (np.int64, "sequence", 128)])
def test_samples_tokens_follow_the_model_inputs(zoo_exports, tmp_path, dtype, length, expected_length):
    model = token_model(tmp_path / "m.onnx", dtype, length)
    zoo_exports.samples_tokens(model, "evaluation", 3, tmp_path / "eval")
    zoo_exports.samples_tokens(model, "heldout", 3, tmp_path / "heldout")
    files = sorted((tmp_path / "eval").iterdir())
    assert [f.name for f in files] == ["0000.npz", "0001.npz", "0002.npz"]
    with np.load(files[0], allow_pickle=False) as sample:
        assert sorted(sample.files) == ["attention_mask", "input_ids"]  # only what the model takes
        ids, mask = sample["input_ids"], sample["attention_mask"]
    assert ids.dtype == dtype and ids.shape == (1, expected_length) and mask.shape == ids.shape
    assert ids[0, 0] == 101 and 3 < mask.sum() < expected_length + 1  # [CLS] first, a real sentence, padded
    evaluation = {np.load(f)["input_ids"].tobytes() for f in files}
    heldout = {np.load(f)["input_ids"].tobytes() for f in (tmp_path / "heldout").iterdir()}
    assert len(evaluation) == 3 and not evaluation & heldout


def test_samples_tokens_refuses_a_model_without_token_ids(zoo_exports, tmp_path):
    model = image_model(tmp_path / "m.onnx", [1, 3, 8, 8])
    with pytest.raises(zoo_exports.ExportError, match="no input named input_ids"):
        zoo_exports.samples_tokens(model, "calibration", 1, tmp_path / "out")


@pytest.mark.parametrize("shape,size,mode", [([1, 24, 40, 3], (40, 24), "RGB"), ([1, 1, 20, 20], (20, 20), "L")])
def test_samples_photos_at_the_model_input(zoo_exports, tmp_path, shape, size, mode):
    model = image_model(tmp_path / "m.onnx", shape)
    zoo_exports.samples_photos(model, "calibration", 4, tmp_path / "out")
    images = [Image.open(f) for f in sorted((tmp_path / "out").iterdir())]
    assert len(images) == 4 and {(im.size, im.mode) for im in images} == {(size, mode)}
    pixels = [np.asarray(im) for im in images]
    assert len({p.tobytes() for p in pixels}) == 4 and all(p.std() > 5 for p in pixels)  # real, varied crops


def test_samples_faces_fill_every_channel(zoo_exports, tmp_path):
    model = image_model(tmp_path / "m.onnx", [1, 3, 32, 32])
    zoo_exports.samples_faces(model, "heldout", 2, tmp_path / "out")
    pixels = np.asarray(Image.open(tmp_path / "out" / "0000.png"))
    assert pixels.shape == (32, 32, 3)
    assert (pixels[..., 0] == pixels[..., 1]).all() and (pixels[..., 1] == pixels[..., 2]).all()


def test_the_export_check_refuses_a_disagreeing_export(zoo_exports, tmp_path):
    model = image_model(tmp_path / "m.onnx", [1, 3, 2, 2])
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(1, 3, 2, 2)
    assert zoo_exports.require_close(model, {"x": x}, [np.maximum(x, 0)], "numpy") == 0.0
    with pytest.raises(zoo_exports.ExportError, match="relative error"):
        zoo_exports.require_close(model, {"x": x}, [np.maximum(x, 0) + 1e-3], "numpy")
    with pytest.raises(zoo_exports.ExportError, match="shape"):
        zoo_exports.require_close(model, {"x": x}, [np.maximum(x, 0).reshape(1, 12)], "numpy")


def test_a_failed_export_venv_build_is_one_line(zoo_exports, tmp_path, monkeypatch):
    """Called outside the export venv, a TensorFlow builder re-runs itself there; its failure comes back as the
    child's own one-line message (a crash without one as its exit code)."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'TensorFlow noise' >&2\necho 'zoo_exports: tf2onnx: op X unsupported' >&2\n"
                    "exit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(zoo_exports, "export_python", lambda: fake)
    with pytest.raises(zoo_exports.ExportError, match=r"^keras_fer_emotion \(export venv\): tf2onnx: op X unsupported$"):
        zoo_exports.keras_fer_emotion(tmp_path / "out.onnx")
    fake.write_text("#!/bin/sh\nkill -SEGV $$\n")
    with pytest.raises(zoo_exports.ExportError, match=r"exit code -11"):
        zoo_exports.keras_fer_emotion(tmp_path / "out.onnx")
