"""A real torch export of the class issue #61 found: a ViT whose position embeddings are resized bicubically at
forward time (scripts/export_vit_interp.py). With the input dims fixed, optimize folds the Resize through ONNX
Runtime (onnx's Python reference Resize ran for over ten minutes on a ViT-S) and the verification accepts it."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_an_interpolated_pos_embedding_vit_folds_its_resize(tmp_path, cli):
    model = tmp_path / "vit.onnx"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "export_vit_interp.py"), str(model), "--layers", "1",
                    "--dim", "64", "--heads", "2", "--grid", "7"], check=True, capture_output=True, timeout=600)
    config = tmp_path / "c.yaml"
    config.write_text(f"model: {model}\ninputs: {{pixel_values: [1, 3, 224, 224]}}\n"
                      f"output_dir: {tmp_path / 'run'}\npipeline: [{{optimize: {{}}}}]\n")
    code, _, err = cli("run", config, "--quiet")
    assert code == 0, err
    stage = json.loads((tmp_path / "run" / "report.json").read_text())["stages"][0]
    assert stage["op_counts_before"]["Resize"] == 1 and "Resize" not in stage["op_counts_after"]
    assert stage["rolled_back"] == []
    details = {p["pass"]: p for p in stage["passes"]}["fold_constants"]["details"]
    assert details["evaluated_by_onnxruntime"] >= 1 and "left" not in details, details
