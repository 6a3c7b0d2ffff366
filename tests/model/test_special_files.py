"""Issue #57: a path qprep reads as a file that is a FIFO, a device or a socket is refused in one line, never
opened (a FIFO opened for reading blocks until a writer appears, a read of /dev/zero never ends).

One test per read site, each given each kind of special file; `within` turns a hang into a failure."""

import contextlib
import json
import os
import signal
import socket

import numpy as np
import onnx
import pytest
import yaml

from graphs import tiny_conv_model
from qprep.config import load_config
from qprep.data import load_samples
from qprep.data.arrays import read_array_sample
from qprep.data.images import ImagePreprocess
from qprep.errors import QprepError
from qprep.pipeline.reevaluate import reevaluate
from qprep.model.info import graph_inputs
from qprep.model.load import load_model
from qprep.model.io import sha256_file

INPUTS = graph_inputs(tiny_conv_model())
PREPROCESS = {"mean": None, "std": None, "channel_order": "rgb", "layout": "auto", "resize": "stretch"}


@contextlib.contextmanager
def within(seconds: int = 5):
    """Fail, instead of hanging the suite, when the block blocks on a FIFO."""

    def expired(signum, frame):
        raise TimeoutError("blocked reading a special file")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(params=["fifo", "device", "socket"])
def special(request, tmp_path):
    """special(name) → a path in tmp_path that is not a regular file: a FIFO, a link to a device, a socket."""
    sockets = []

    def make(name: str):
        path = tmp_path / name
        if request.param == "fifo":
            os.mkfifo(path)
        elif request.param == "device":
            os.symlink("/dev/null", path)  # followed: the link names a device (not /dev/zero: a read of it never ends)
        else:
            sockets.append(socket.socket(socket.AF_UNIX))
            sockets[-1].bind(str(path))
        return path

    yield make
    for sock in sockets:
        sock.close()


def refused(call, path) -> str:
    with within(), pytest.raises(QprepError) as caught:
        call()
    message = str(caught.value)
    assert str(path) in message and "not a regular file" in message and "\n" not in message, message
    return message


def test_model_file(special):
    path = special("m.onnx")
    refused(lambda: load_model(path), path)


def test_sha256_file(special):
    path = special("m.onnx")
    refused(lambda: sha256_file(path), path)


def test_external_data_file(tmp_path, special):
    onnx.save_model(tiny_conv_model(), str(tmp_path / "m.onnx"), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="m.data", size_threshold=0)
    (tmp_path / "m.data").unlink()
    data = special("m.data")
    refused(lambda: load_model(tmp_path / "m.onnx"), data)


def test_config_and_overlay(tmp_path, special):
    config = special("c.yaml")
    refused(lambda: load_config(config), config)
    overlay = special("o.yaml")
    refused(lambda: load_config({"model": "m.onnx"}, overlay=overlay), overlay)


def test_sample_list_and_the_files_it_lists(tmp_path, special):
    listed = special("dataset.txt")
    refused(lambda: load_samples({"source": str(listed), "format": "auto", "max_samples": 8, "seed": 0,
                                  "preprocess": PREPROCESS}, INPUTS), listed)
    sample = special("a.npy")
    (tmp_path / "list.txt").write_text("a.npy\n")
    message = refused(lambda: load_samples({"source": str(tmp_path / "list.txt"), "format": "list",
                                            "max_samples": 8, "seed": 0, "preprocess": PREPROCESS}, INPUTS), sample)
    assert "list.txt line 1" in message


def test_sample_readers(special):
    """The readers refuse by themselves, whoever hands them a path (a list, a folder, the RKNN dataset)."""
    array, image = special("a.npz"), special("a.png")
    refused(lambda: read_array_sample(array, INPUTS), array)
    reader = ImagePreprocess.for_model(PREPROCESS, INPUTS, "calibration")
    refused(lambda: reader.read(image), image)
    refused(lambda: reader.read_raw(image), image)


def test_a_folder_of_samples_skips_special_entries(tmp_path, special):
    special("a.npy")
    np.save(tmp_path / "b.npy", np.zeros((1, 3, 8, 8), np.float32))
    with within():
        samples = load_samples({"source": str(tmp_path), "format": "auto", "max_samples": 8, "seed": 0,
                                "preprocess": PREPROCESS}, INPUTS)
    assert [os.path.basename(f) for f in samples.files] == ["b.npy"]
    assert any("skipped 1 entry" in w and "a.npy" in w for w in samples.warnings), samples.warnings  # said


def test_evaluate_run_files(tmp_path, special):
    run = tmp_path / "run"
    run.mkdir()
    (run / "manifest.json").write_text(json.dumps({"config": {"model": str(tmp_path / "m.onnx")}}))
    report = special("run/report.json")
    refused(lambda: reevaluate(run, tmp_path), report)


def test_a_regular_file_behind_a_link_is_read(tmp_path):
    """Links are followed: what decides is the file they name."""
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"model": "m.onnx"}))
    os.symlink(tmp_path / "c.yaml", tmp_path / "link.yaml")
    assert load_config(tmp_path / "link.yaml")["model"] == str(tmp_path / "m.onnx")
