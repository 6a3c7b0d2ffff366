"""The QDQ fixture models (scripts/build_qdq_fixtures.py): built once per session when missing, and what they are.

Other test_qdq_* modules import `qdq_fixtures` from here (one session-scoped fixture for all of them).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import onnx
import pytest

import qprep
from conftest import CALIBRATION, ROOT, demo_model

pytestmark = pytest.mark.slow  # real models or the CLI in subprocesses: `pytest -m "not slow"` skips them

FIXTURES = ROOT / "models" / "qdq"
IMAGENET = {"source": str(CALIBRATION / "imagenet" / "calib"), "preprocess": {"mean": [127.0], "std": [128.0]}}
MINILM = {"source": str(CALIBRATION / "minilm" / "calib")}


@pytest.fixture(scope="session")
def qdq_fixtures():
    """models/qdq/, built by the fixture script if anything is missing (about a minute, once)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import build_qdq_fixtures

    if build_qdq_fixtures.missing():
        for name in ("efficientnet_lite0.onnx", "minilm_l6_v2.onnx"):
            demo_model(name)  # the demo models come first (scripts/setup.sh)
        proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "build_qdq_fixtures.py")],
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
    return FIXTURES


def ops(path) -> Counter:
    return Counter(n.op_type for n in onnx.load(str(path)).graph.node)


def test_ort_fixtures_are_quantize_static_qdq_models(qdq_fixtures):
    effnet = ops(qdq_fixtures / "efficientnet_lite0.qdq.onnx")
    assert effnet["Conv"] == 49 and effnet["BatchNormalization"] == 0  # optimize folded them first
    assert effnet["QuantizeLinear"] == 62 and effnet["DequantizeLinear"] == 162
    minilm = ops(qdq_fixtures / "minilm_l6_v2.qdq.onnx")
    assert minilm["LayerNormalization"] == 13 and minilm["MatMul"] == 48
    model = onnx.load(str(qdq_fixtures / "minilm_l6_v2.qdq.onnx"))
    producers = {o: n for n in model.graph.node for o in n.output}
    for node in (n for n in model.graph.node if n.op_type == "LayerNormalization"):  # LayerNorm quantized too
        assert producers[node.input[0]].op_type == "DequantizeLinear"


def test_qat_fixture_is_a_messy_real_pytorch_export(qdq_fixtures):
    counts = ops(qdq_fixtures / "qat_cnn.onnx")
    assert counts["Conv"] == 5 and counts["Div"] == 5 and counts["BatchNormalization"] == 5
    assert counts["Identity"] > 0 and counts["QuantizeLinear"] == counts["DequantizeLinear"] == 13
    model = onnx.load(str(qdq_fixtures / "qat_cnn.onnx"))
    initializers = {t.name for t in model.graph.initializer}
    weight_q = [n for n in model.graph.node if n.op_type == "QuantizeLinear" and n.input[0] in initializers]
    assert len(weight_q) == 6  # float weights quantized in the graph (5 Conv + the Linear), per channel
    inits = {t.name: t for t in model.graph.initializer}
    for n in weight_q:  # per channel: a scale per output channel along axis 0 (not a vacuous all() over no attributes)
        assert onnx.numpy_helper.to_array(inits[n.input[1]]).size > 1
        assert {a.name: a.i for a in n.attribute}.get("axis", 1) == 0
    facts = json.loads((qdq_fixtures / "qat_cnn.json").read_text())
    assert facts["model_top1_agreement_with_teacher"] >= 0.6  # it learned the teacher, it is a real model
    assert facts["model_onnx_vs_torch_output_steps"] <= 2
    assert "QuantizeLinear" not in ops(qdq_fixtures / "qat_cnn.fp32.onnx")


@pytest.mark.parametrize("name,data", [("qat_cnn", IMAGENET), ("efficientnet_lite0.qdq", IMAGENET),
                                       ("minilm_l6_v2.qdq", MINILM)])
def test_optimize_leaves_every_qdq_node_alone(qdq_fixtures, tmp_path, name, data):
    report = qprep.run({"model": str(qdq_fixtures / f"{name}.onnx"), "calibration": {**data, "max_samples": 2},
                        "pipeline": [{"optimize": {}}]}, output_dir=str(tmp_path), force=True)
    before, after = report["model"]["op_counts"], report["result"]["op_counts"]
    for op in ("QuantizeLinear", "DequantizeLinear"):
        assert after[op] == before[op], op
    assert report["stages"][0]["rolled_back"] == []
