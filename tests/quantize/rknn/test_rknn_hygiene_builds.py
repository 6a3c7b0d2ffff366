"""Graphs rknn-toolkit2 failed on (exit 3) that qprep now normalizes or refuses up front (static_graph/hygiene.py),
run end to end with the CLI on the toolkit's simulator: tiny models, one run each."""

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
import yaml
from onnx import helper

from conftest import ROOT, run_config
from graphs import make_model
from test_rknn_hygiene import recurrent_model

pytestmark = pytest.mark.slow  # the CLI in subprocesses and the toolkit's builds

pytest.importorskip("rknn.api", reason="rknn-toolkit2 is not installed (scripts/setup.sh or `qprep setup rknn` installs it)")


def _config(tmp_path, model: onnx.ModelProto, samples: list[dict], optimize: bool = False) -> dict:
    onnx.save(model, str(tmp_path / "m.onnx"))
    (tmp_path / "samples").mkdir()
    for i, sample in enumerate(samples):
        np.savez(tmp_path / "samples" / f"{i}.npz", **sample)
    return {"model": "m.onnx", "output_dir": "out", "calibration": {"source": "samples"},
            "evaluation": {"source": "samples", "layers": False, "latency": {"runs": 0}},
            "pipeline": [*([{"optimize": {}}] if optimize else []), {"quantize": {"backend": "rknn"}}]}


def test_inputs_no_node_reads_after_optimize_are_ignored_and_the_run_ends_ok(tmp_path):
    """z: read by no node; s: read only by the Shape that optimize folds. The toolkit refused both in load_onnx
    ("The 'z' in inputs=[...] is invalid!"); the samples hold them, the contract lists them as ignored."""
    weight = np.random.default_rng(0).standard_normal((4, 3, 3, 3)).astype(np.float32)
    model = make_model([helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name="conv"),
                        helper.make_node("Shape", ["s"], ["shape"], name="shape"),
                        helper.make_node("Reshape", ["c", "shape"], ["y"], name="flatten")],
                       [("x", [1, 3, 8, 8]), ("z", [1, 2]), ("s", [1, 256])], [("y", [1, 256])], {"w": weight})
    rng = np.random.default_rng(1)
    samples = [{"x": rng.standard_normal((1, 3, 8, 8)).astype(np.float32), "z": np.zeros((1, 2), np.float32),
                "s": np.zeros((1, 256), np.float32)} for _ in range(6)]
    done, report = run_config(tmp_path, _config(tmp_path, model, samples, optimize=True))
    assert done.returncode == 0, done.stderr
    assert report["stages"][-1]["static_graph"]["unread_inputs_removed"] == ["z", "s"]
    contract = json.loads((tmp_path / "out" / "input_contract.json").read_text())
    assert [(i["name"], i.get("ignored", False)) for i in contract["inputs"]] == [("x", False), ("z", True),
                                                                                  ("s", True)]
    assert report["evaluation"]["outputs"]["y"]["samples"] == 6
    files = (tmp_path / "out" / "report.md").read_text()
    assert "`z`: not fed (no node of the model reads it" in files and "(one array per input: `x`, as above)" in files


def test_a_gru_with_empty_sequence_lens_whose_last_state_is_read_builds_and_matches_float(tmp_path):
    """torch's `_, h = gru(x)`: sequence_lens '', Y computed for nobody, Y_h read. The toolkit's build failed
    (KeyError on Y_h's name)."""
    model = recurrent_model("GRU", ["W", "R", "B", "", "h0"], ["_Y", "Y_h"])
    rng = np.random.default_rng(2)
    samples = [{"x": rng.standard_normal((6, 1, 5)).astype(np.float32)} for _ in range(8)]
    done, report = run_config(tmp_path, _config(tmp_path, model, samples))
    assert done.returncode == 0, done.stderr
    assert report["stages"][-1]["static_graph"]["last_state_from_sequence"] == ["gru"]
    metrics = report["evaluation"]["outputs"]["Y_h"]
    assert metrics["samples"] == 8 and metrics["cosine_mean"] > 0.999


def test_an_lstm_with_peepholes_is_refused_in_one_line_before_the_toolkit_aborts(tmp_path):
    """The toolkit aborted the build (SIGABRT, "SubGraphManager: not support yet"): exit 3 before."""
    model = recurrent_model("LSTM", ["W", "R", "B", "", "", "", "P"], ["Y"], "bidirectional", peepholes=0.3)
    samples = [{"x": np.random.default_rng(i).standard_normal((6, 1, 5)).astype(np.float32)} for i in range(4)]
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(_config(tmp_path, model, samples)))
    done = subprocess.run([sys.executable, "-m", "qprep", "run", str(tmp_path / "c.yaml"), "--force", "--quiet"],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "qprep: error: quantize.rknn: node 'lstm' is an LSTM with peephole weights (input P), which rknn-toolkit2 "
        "cannot compile (it fails: \"SubGraphManager: not support yet\"); export the LSTM without peepholes, or "
        "use backend ort"]
