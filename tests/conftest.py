"""Shared fixtures: the real demo models, a CLI runner, an RKNN job (tiny hand-built graphs: graphs.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
import yaml

from qprep.cli import main

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"
CALIBRATION = ROOT / "calibration_data"


def demo_model(name: str) -> Path:
    """A real demo model fetched by scripts/setup.sh; a missing one is a set-up failure, not a skip."""
    path = MODELS / name
    assert path.is_file(), f"{path} missing: run ./scripts/setup.sh (it fetches the demo models)"
    return path


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


def run_on_samples(tmp_path: Path, model: onnx.ModelProto, samples: list[dict], pipeline: list,
                   evaluate: bool = True, latency_runs: int = 0) -> dict:
    """qprep.run of `model` (saved in tmp_path) with `samples` as .npz files for calibration and, with `evaluate`,
    evaluation (no per-layer error) → the report."""
    import numpy as np

    import qprep

    onnx.save(model, str(tmp_path / "m.onnx"))
    (tmp_path / "samples").mkdir()
    for i, sample in enumerate(samples):
        np.savez(tmp_path / "samples" / f"{i:04d}.npz", **sample)
    config = {"model": str(tmp_path / "m.onnx"), "calibration": {"source": str(tmp_path / "samples")},
              "pipeline": pipeline}
    if evaluate:
        config["evaluation"] = {"source": str(tmp_path / "samples"), "layers": False,
                                "latency": {"runs": latency_runs}}
    return qprep.run(config, output_dir=str(tmp_path / "out"))


OCR_DATA = {"ppocr_cls": ("ocr_cls", [1, 3, 48, 192]), "ppocrv4_rec": ("ocr_rec", [1, 3, 48, 320])}


def rknn_job(tmp_path: Path, name: str, **options):
    """A demo PP-OCR model optimized for the RKNN backend (opset ≤ 19) with 8 calibration samples, as qprep hands
    them to rknn.quantize / RknnBuilder; `options` override rk3588 w8a8 defaults → QuantizeJob."""
    import qprep
    from qprep.quantize.backend import QuantizeJob
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
               "analysis_samples": 0, "weight_rounding": "nearest", "split_outlier_positions": True, **options}
    return QuantizeJob(model=model, calibration=calibration, max_samples=8, float_set=frozenset(),
                       options=typed("rknn", **options),
                        work_dir=tmp_path / "work")


def typed(section: str, **values):
    """A config section as the quantize stage hands it to a backend or the search (validated, then
    schema.settings): `section` is ort, rknn, fp16 or fallback; keys not given take their defaults."""
    from qprep import schema
    from qprep.quantize import fp16, ort, search
    from qprep.quantize.rknn import convert

    sections = {"ort": ort.OPTIONS, "rknn": convert.OPTIONS, "fp16": fp16.OPTIONS, "fallback": search.OPTIONS}
    return schema.settings(sections[section], schema.validate(values, sections[section], section, Path.cwd()),
                           section)
