"""End-to-end on the real demo models and the shipped configs and calibration data."""

import json

import pytest

from conftest import CALIBRATION, ROOT, demo_model

pytestmark = pytest.mark.slow  # real models or the CLI in subprocesses: `pytest -m "not slow"` skips them

CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def test_inspect_efficientnet_counts_its_49_batchnorms(cli):
    code, out, _ = cli("inspect", demo_model("efficientnet_lite0.onnx"), "--json")
    info = json.loads(out)
    assert code == 0 and info["kind"] == "float"
    assert info["op_counts"]["BatchNormalization"] == 49
    assert info["inputs"][0]["name"] == "input" and info["inputs"][0]["shape"][1:] == [3, 224, 224]


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_shipped_configs_validate(cli, config):
    code, out, err = cli("validate", config)
    assert code == 0, err


def test_rknn_demo_config_runs_end_to_end_on_the_simulator(cli, tmp_path):
    code, _, err = cli("run", ROOT / "configs" / "rknn_int8.yaml", "--out", tmp_path / "run", "--quiet")
    assert code == 0, err
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["status"] == "ok"
    assert report["calibration"]["count"] == 32
    assert report["calibration"]["preprocess"]["channel_order"] == "bgr"
    assert report["load"]["inputs"] == [{"name": "x", "dtype": "float32", "shape": [1, 3, 48, 320]}]
    assert (tmp_path / "run" / "model.rknn").stat().st_size > 1_000_000
    assert report["result"]["deployable"]["path"] == "model.rknn"
    assert report["evaluation"]["size_bytes"]["result"] == (tmp_path / "run" / "model.rknn").stat().st_size
    quantize = next(s for s in report["stages"] if s["name"] == "quantize")
    assert quantize["backend"] == "rknn" and len(quantize["float16_layers"]["ir_tensors"]) == 5
    metrics = report["evaluation"]["outputs"]["softmax_11.tmp_0"]
    assert metrics["samples"] == 128 and metrics["step_agreement"] > 0.85  # measured 0.935
    # the model's dictionary (metadata `character`) makes it a CTC text output: lines that read the same
    assert metrics["kind"] == "ctc" and metrics["text_agreement"] > 0.6  # measured 0.742, CER 2.8%
    assert {"reference_text", "result_text"} <= set(metrics["worst_samples"][0])
    assert "**Verdict: met**" in (tmp_path / "run" / "report.md").read_text()
    assert report["evaluation"]["layers"]  # accuracy_analysis parsed


def test_minilm_calibration_matches_its_three_integer_inputs(tmp_path):
    from qprep.data import load_samples
    from qprep.model.info import graph_inputs
    from qprep.model.load import load_model

    inputs = graph_inputs(load_model(demo_model("minilm_l6_v2.onnx")))
    cfg = {"source": str(CALIBRATION / "minilm" / "calib"), "format": "auto", "max_samples": 8, "seed": 0,
           "preprocess": None}
    samples = load_samples(cfg, inputs)
    assert len(samples) == 8
    assert {k: v.dtype.name for k, v in samples.samples[0].items()} == {
        "input_ids": "int64", "attention_mask": "int64", "token_type_ids": "int64"}


def test_inspect_counts_decomposed_layernorms_with_the_optimize_matcher(cli):
    code, out, _ = cli("inspect", demo_model("minilm_l6_v2.onnx"), "--json")
    assert code == 0 and json.loads(out)["decomposed_layernorms"] == 13
    code, out, _ = cli("inspect", demo_model("ppocrv4_rec.onnx"))
    assert "LayerNorm: 0 fused, 5 decomposed" in out
