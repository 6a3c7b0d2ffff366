"""Shared fixtures: tiny hand-built graphs, the real demo models, and a CLI runner."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper

from qprep.cli import main

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"
CALIBRATION = ROOT / "calibration_data"


def demo_model(name: str) -> Path:
    """A real demo model fetched by scripts/setup.sh; a missing one is a set-up failure, not a skip."""
    path = MODELS / name
    assert path.is_file(), f"{path} missing: run ./scripts/setup.sh (it fetches the demo models)"
    return path


def tiny_conv_model(batch="N", opset: int = 13) -> onnx.ModelProto:
    """x[N,3,8,8] → Conv(4, 3x3, pads 1) → Relu → y[N,4,8,8], unnamed nodes on purpose."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "b")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
         helper.make_node("Relu", ["c"], ["y"])],
        "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 4, 8, 8])], [w, b])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def two_input_model() -> onnx.ModelProto:
    """ids:int64[N,S], mask:float[N,S] → Gather(emb) * mask → y[N,S,4]: integer + float inputs."""
    emb = numpy_helper.from_array(np.arange(40, dtype=np.float32).reshape(10, 4), "emb")
    graph = helper.make_graph(
        [helper.make_node("Gather", ["emb", "ids"], ["g"]),
         helper.make_node("Unsqueeze", ["mask", "axes"], ["m"]),
         helper.make_node("Mul", ["g", "m"], ["y"])],
        "two", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", "S"]),
                helper.make_tensor_value_info("mask", TensorProto.FLOAT, ["N", "S"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "S", 4])],
        [emb, numpy_helper.from_array(np.array([-1], dtype=np.int64), "axes")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


@pytest.fixture
def save(tmp_path):
    """save(model, name) → path of the model written into the test's tmp folder."""

    def _save(model: onnx.ModelProto, name: str = "model.onnx") -> Path:
        path = tmp_path / name
        onnx.save(model, str(path))
        return path

    return _save


@pytest.fixture
def cli(capsys):
    """cli(*args) → (exit code, stdout, stderr) of the qprep command line, in-process."""

    def _cli(*args: str):
        code = main([str(a) for a in args])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return _cli


def run_config(tmp_path: Path, config: dict):
    """`qprep run` of `config` (written to tmp_path/c.yaml, output_dir relative to it) in a subprocess →
    (completed process, report.json of tmp_path/out)."""
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    done = subprocess.run([sys.executable, "-m", "qprep", "run", str(tmp_path / "c.yaml"), "--force", "--quiet"],
                          capture_output=True, text=True, cwd=ROOT)
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    return done, report


OCR_DATA = {"ppocr_cls": ("ocr_cls", [1, 3, 48, 192]), "ppocrv4_rec": ("ocr_rec", [1, 3, 48, 320])}


def rknn_job(tmp_path: Path, name: str, **options):
    """A demo PP-OCR model optimized for the RKNN backend (opset ≤ 19) with 8 calibration samples, as qprep hands
    them to rknn.quantize / RknnBuilder; `options` override rk3588 w8a8 defaults → BackendInput."""
    import qprep
    from qprep.quantize.backend import BackendInput
    from qprep.data import load_samples
    from qprep.model.info import graph_inputs

    data, shape = OCR_DATA[name]
    qprep.run({"model": str(demo_model(f"{name}.onnx")), "inputs": {"x": shape},
               "pipeline": [{"optimize": {"max_opset": 19}}]}, output_dir=str(tmp_path / "optimized"))
    model = onnx.load(str(tmp_path / "optimized" / "model.onnx"))
    preprocess = {"channel_order": "bgr", "mean": [127.5] * 3, "std": [127.5] * 3, "resize": "none", "layout": "auto"}
    calibration = load_samples({"source": str(CALIBRATION / data / "calib"), "format": "auto", "max_samples": 8,
                                "seed": 0, "preprocess": preprocess}, graph_inputs(model))
    (tmp_path / "work").mkdir()
    options = {"target_platform": "rk3588", "quantized_dtype": "w8a8", "quantized_algorithm": "normal",
               "quantized_method": "channel", "optimization_level": 3, "do_quantization": True,
               "analysis_samples": 0, "weight_rounding": "nearest", **options}
    return BackendInput(model=model, calibration=calibration, max_samples=8, float_set=set(), options=options,
                        work_dir=tmp_path / "work")
