"""The QDQ stages on the real fixtures: ORT quantize_static output (EfficientNet-Lite0, MiniLM), a PyTorch QAT
export, and redundant pairs injected on purpose — the acceptance numbers of issue 4."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

import qprep
from conftest import ROOT, demo_model
from qprep.errors import QprepError
from qprep.model import info as model_info
from qprep.model.saturation import u8s8_saturates
from qprep.config import data_source
from qprep.data import load_samples
from qprep.graph.verify import cosine
from qprep.model.runtime import run_model
from qprep.schema import validate
from test_qdq_fixtures import IMAGENET, MINILM, qdq_fixtures  # noqa: F401 - the session fixture

pytestmark = pytest.mark.slow  # real models or the CLI in subprocesses: `pytest -m "not slow"` skips them

QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")


def run(model, calibration, pipeline, out, **extra) -> tuple[dict, onnx.ModelProto]:
    report = qprep.run({"model": str(model), "calibration": {**calibration, "max_samples": 8}, "pipeline": pipeline,
                        **extra}, output_dir=str(out), force=True)
    assert report["status"] == "ok"
    return report, onnx.load(str(out / "model.onnx"))


def eval_samples(model: onnx.ModelProto, data: dict, count: int) -> list[dict]:
    """Held-out samples (the eval split), through qprep's loader."""
    cfg = validate({**data, "source": data["source"].rsplit("/calib", 1)[0] + "/eval", "max_samples": count},
                   data_source(""), "evaluation", ROOT)
    return load_samples(cfg, model_info.graph_inputs(model), role="evaluation").samples


def without(counts: dict, ops=QDQ_OPS) -> dict:
    return {op: n for op, n in counts.items() if op not in ops}


def output_step(model: onnx.ModelProto, output: str) -> float:
    """The scale of the DequantizeLinear that gives `output`: one step of the QDQ model's int8 output."""
    last = next(n for n in model.graph.node if output in n.output)
    assert last.op_type == "DequantizeLinear"
    scale = onnx.numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == last.input[1]))
    assert scale.size == 1  # per tensor
    return float(scale.reshape(-1)[0])


# ------------------------------------------------------------------------------------ remove_redundant_qdq


def test_every_injected_redundant_pair_is_removed_and_nothing_else(qdq_fixtures, tmp_path):
    expected = json.loads((qdq_fixtures / "efficientnet_lite0.qdq.injected.json").read_text())
    stage = [{"remove_redundant_qdq": {}}]
    base, _ = run(qdq_fixtures / "efficientnet_lite0.qdq.onnx", IMAGENET, stage, tmp_path / "base")
    injected, result = run(qdq_fixtures / "efficientnet_lite0.qdq.injected.onnx", IMAGENET, stage, tmp_path / "inj")
    b, i = base["stages"][0], injected["stages"][0]
    # the uninjected QDQ model has one pair of its own: DQ → Reshape → Q before the classifier
    assert b["rewrites"] == {"round_trip": 0, "scaled_round_trip": 0, "data_movement": 1, "sink_dq": 0}
    assert i["rewrites"] == {"round_trip": b["rewrites"]["round_trip"] + expected["round_trip"],
                             "scaled_round_trip": 0,
                             "data_movement": b["rewrites"]["data_movement"] + expected["data_movement"],
                             "sink_dq": 0}
    assert i["qdq_nodes_removed"] == b["qdq_nodes_removed"] + expected["qdq_nodes_removable"] == 2 + 26
    assert i["requantizations_kept"]["count"] == b["requantizations_kept"]["count"] + expected["requantizations"]
    # nothing else removed: same op histogram as the cleaned base model, plus the injected data-movement ops
    # (now running on uint8) and the injected requantization pair
    after, base_after = i["op_counts_after"], b["op_counts_after"]
    assert without(after, (*QDQ_OPS, "Reshape", "Transpose")) == without(base_after, (*QDQ_OPS, "Reshape", "Transpose"))
    assert after["Reshape"] == base_after["Reshape"] + expected["reshape_added"]
    assert after["Transpose"] == base_after.get("Transpose", 0) + expected["transpose_added"]
    assert {op: after[op] - base_after[op] for op in QDQ_OPS} == {"QuantizeLinear": 1, "DequantizeLinear": 1}
    assert i["rolled_back"] == [] and i["verification"]["ok"]
    assert i["verification"]["outputs"]["logits"]["max_abs"] <= 1e-6
    source = onnx.load(str(qdq_fixtures / "efficientnet_lite0.qdq.injected.onnx"))
    held_out = eval_samples(source, IMAGENET, 8)  # not the verification samples
    assert max(float(np.abs(a["logits"] - c["logits"]).max())
               for a, c in zip(run_model(source, held_out), run_model(result, held_out))) <= 1e-6


# ------------------------------------------------------------------------------------------- fuse_conv_qdq


@pytest.fixture(scope="module")
def effnet_fused(qdq_fixtures, tmp_path_factory):
    """QDQ EfficientNet-Lite0 through remove_redundant_qdq → fuse_conv_qdq, in both formats."""
    runs = {}
    for fmt in ("qlinear", "integer"):
        runs[fmt] = run(qdq_fixtures / "efficientnet_lite0.qdq.onnx", IMAGENET,
                        [{"remove_redundant_qdq": {}}, {"fuse_conv_qdq": {"format": fmt}}],
                        tmp_path_factory.mktemp(fmt))
    return runs


def test_every_conv_of_qdq_efficientnet_becomes_qlinearconv_within_one_step(effnet_fused, qdq_fixtures):
    report, model = effnet_fused["qlinear"]
    stage = report["stages"][1]
    counts = model_info.op_counts(model)
    assert counts["QLinearConv"] == 49 and "Conv" not in counts
    assert stage["converted"] == {"QLinearConv": 49} and stage["rolled_back"] == []
    assert all(k.startswith("per-channel") for k in stage["weights"]) and sum(stage["weights"].values()) == 49
    assert stage["bias"] == {"int32 kept": 49}  # quantize_static's bias scale is exactly x_scale·w_scale
    probes = stage["verification"]["probes"]
    assert probes["count"] == 49 and probes["max_steps_at_q_output"] <= 1  # each Conv within one step
    # end to end the rounding differences of 49 integer kernels add up (as in ONNX Runtime's own fusion) ...
    logits = stage["verification"]["outputs"]["logits"]
    assert logits["cosine_min"] >= 0.99 and logits["step_from"] == "DequantizeLinear logits_DequantizeLinear"
    # ... and as deployed, the fused model is ONNX Runtime's session-time fusion of the QDQ model, bit for bit,
    # except on a CPU whose u8s8 kernels saturate: there ORT's own fusion is off, and the stage says so
    if u8s8_saturates():
        assert stage["verification"]["deployed"]["logits"] > 0 and "saturate" in stage["verification"]["deployed_note"]
        assert all("uint8 (int8 weights + 128" in t for t in stage["types"])
    else:
        assert stage["verification"]["deployed"] == {"logits": 0.0} and "deployed_note" not in stage["verification"]
    source = onnx.load(str(qdq_fixtures / "efficientnet_lite0.qdq.onnx"))
    held_out = eval_samples(source, IMAGENET, 32)
    expected, got = run_model(source, held_out), run_model(model, held_out)
    # Each sample's logits within a few output steps of the QDQ model's, not a top-1 agreement: 7 of these 32
    # have their top two closer than twice that difference, and which of them flip depends on the CPU's float
    # kernels in the QDQ model run as written (measured: 4 steps at most, top-1 32 of 32).
    step = output_step(source, "logits")
    steps = max(float(np.abs(e["logits"] - g["logits"]).max()) for e, g in zip(expected, got)) / step
    assert steps <= 8, f"the fused model's logits are {steps:.1f} output steps from the QDQ model's"
    assert min(cosine(e["logits"], g["logits"]) for e, g in zip(expected, got)) >= 0.99


def test_format_integer_turns_every_conv_into_convinteger(effnet_fused):
    report, model = effnet_fused["integer"]
    stage = report["stages"][1]
    counts = model_info.op_counts(model)
    assert counts["ConvInteger"] == 49 and "Conv" not in counts and "QLinearConv" not in counts
    assert stage["verification"]["probes"]["max_steps_at_q_output"] <= 1 and stage["rolled_back"] == []
    assert stage["verification"]["outputs"]["logits"]["cosine_min"] >= 0.99


# ---------------------------------------------------------------------------------------------- keep_float


def test_keep_float_on_qdq_minilm_removes_the_layernorm_pairs(qdq_fixtures, tmp_path):
    report, cleaned = run(qdq_fixtures / "minilm_l6_v2.qdq.onnx", MINILM, [{"remove_redundant_qdq": {}}],
                          tmp_path / "clean")
    assert report["stages"][0]["rewrites"]["data_movement"] == 48  # 24 Reshape + 24 Transpose in attention
    report, floated = run(tmp_path / "clean" / "model.onnx", MINILM, [{"keep_float": {}}], tmp_path / "ln")
    stage = report["stages"][0]
    assert stage["float_set"] == {"count": 13, "by_reason": {"LayerNormalization": 13}}
    assert len(report["float_set"]) == 13
    removed = stage["removed"]
    assert removed["input_pairs_bypassed"] == 13 and removed["output_pairs_bypassed"] == 13
    assert removed["qdq_nodes_removed"] == {"QuantizeLinear": 26, "DequantizeLinear": 26}
    producers = {o: n.op_type for n in floated.graph.node for o in n.output}
    for node in (n for n in floated.graph.node if n.op_type == "LayerNormalization"):
        assert producers.get(node.input[0]) != "DequantizeLinear"  # float input
    # the rounding around LayerNorm was not what broke this QDQ model: measure it against FP32 (the
    # evaluation section reports this in runs); the residual/attention Adds are (ORT's own advice)
    evaluation = {"source": MINILM["source"].rsplit("/calib", 1)[0] + "/eval", "max_samples": 8,
                  "reference_model": str(demo_model("minilm_l6_v2.onnx")), "latency": {"runs": 0}, "layers": False}
    report, with_adds = run(tmp_path / "clean" / "model.onnx", MINILM, [{"keep_float": {"op_types": ["Add"]}}],
                            tmp_path / "adds", evaluation=evaluation)
    against = report["stages"][0]["effect"]["against_fp32"]["outputs"]["last_hidden_state"]
    assert against["cosine_mean_after"] >= against["cosine_mean_before"] + 0.3  # the record says it went up
    assert abs(report["evaluation"]["outputs"]["last_hidden_state"]["cosine_mean"] - 0.98) < 0.05
    fp32 = onnx.load(str(demo_model("minilm_l6_v2.onnx")))
    held_out = eval_samples(fp32, MINILM, 16)
    reference = run_model(fp32, held_out)

    def mean_cosine(model):
        return float(np.mean([cosine(r["last_hidden_state"], o["last_hidden_state"])
                              for r, o in zip(reference, run_model(model, held_out))]))

    before, after_ln, after_adds = mean_cosine(cleaned), mean_cosine(floated), mean_cosine(with_adds)
    print(f"MiniLM cosine vs FP32: QDQ {before:.4f}, LayerNorm float {after_ln:.4f}, + Adds float {after_adds:.4f}")
    assert after_ln >= before - 0.02
    assert after_adds >= before + 0.3 and after_adds >= 0.95


# --------------------------------------------------------------------------------------------- QAT cleanup


def test_qat_cleanup_config_runs_on_the_pytorch_qat_export(cli, tmp_path, qdq_fixtures):
    code, _, err = cli("run", ROOT / "configs" / "qat_cleanup.yaml", "--out", tmp_path / "run", "--quiet")
    assert code == 0, err
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    optimize, redundant, keep, fuse = report["stages"]
    for op in QDQ_OPS:  # optimize leaves Q/DQ alone
        assert optimize["op_counts_after"][op] == optimize["op_counts_before"][op]
    assert redundant["rewrites"] == {"round_trip": 0, "scaled_round_trip": 0, "data_movement": 0,
                                     "sink_dq": 1}  # DQ below MaxPool
    assert keep["status"] == "skipped" and "no LayerNormalization" in keep["reason"]
    assert fuse["converted"] == {"QLinearConv": 5} and fuse["rolled_back"] == []
    assert fuse["epilogue_folded"] == {"Div": 5, "BatchNormalization": 5}
    assert fuse["activations"] == {"absorbed Relu (a no-op under the output's saturation)": 5}
    assert fuse["verification"]["probes"]["max_steps_at_q_output"] <= 1
    counts = report["result"]["op_counts"]
    assert not {"Conv", "Div", "BatchNormalization", "Relu"} & set(counts)
    assert report["result"]["kind"] == "integer"
    evaluation = report["evaluation"]
    assert evaluation["reference_model"].endswith("qat_cnn.fp32.onnx")
    assert evaluation["outputs"]["logits"]["top1_agreement"] >= 0.8


# --------------------------------------------------------------------------------------------- QAT → RKNN

QAT_DATA = {"source": str(ROOT / "calibration_data" / "imagenet" / "calib"),
            "preprocess": {"mean": [127.0, 127.0, 127.0], "std": [128.0, 128.0, 128.0]}}


def test_fuse_conv_qdq_format_qdq_folds_the_qat_epilogues_and_keeps_the_convs(tmp_path, qdq_fixtures):
    report, model = run(qdq_fixtures / "qat_cnn.onnx", QAT_DATA,
                        [{"optimize": {}}, {"remove_redundant_qdq": {}}, {"fuse_conv_qdq": {"format": "qdq"}}],
                        tmp_path)
    fuse = report["stages"][2]
    assert fuse["epilogue_folded"] == {"Div": 5, "BatchNormalization": 5} and fuse["converted"] == {}
    counts = model_info.op_counts(model)
    assert counts["Conv"] == 5 and not {"Div", "BatchNormalization", "QLinearConv"} & set(counts)
    assert model_info.model_kind(model) == model_info.QDQ


@pytest.mark.parametrize("folded", [True, False])
def test_a_qat_model_is_built_for_rknn_from_its_own_qdq(tmp_path, qdq_fixtures, folded, monkeypatch):
    """Before, quantize skipped a QDQ model on every backend: the RKNN user of a QAT export got no .rknn."""
    pytest.importorskip("rknn.api", reason="rknn-toolkit2 is not installed")
    pipeline = [{"optimize": {}}, {"remove_redundant_qdq": {}}, *([{"fuse_conv_qdq": {"format": "qdq"}}] if folded else []),
                {"quantize": {"backend": "rknn"}}]
    config = {"model": str(qdq_fixtures / "qat_cnn.onnx"), "calibration": QAT_DATA, "pipeline": pipeline,
              "inputs": {"input": [1, 3, 224, 224]},
              "evaluation": {**QAT_DATA, "source": QAT_DATA["source"].rsplit("/calib", 1)[0] + "/eval", "max_samples": 128,
                             "reference_model": str(qdq_fixtures / "qat_cnn.fp32.onnx"), "latency": {"runs": 0}}}
    with pytest.raises(QprepError, match="the model is QAT .* nothing to search"):  # trained scales: no search
        fallback = {"quantize": {"backend": "rknn", "fallback": {"target": {"cosine_mean": 0.99}}}}
        qprep.run({**config, "pipeline": [*pipeline[:-1], fallback]}, output_dir=str(tmp_path / "fb"), force=True)
    if not folded:  # the toolkit's build fails on Conv → Div outside the Q/DQ: named before it runs
        with pytest.raises(QprepError, match=r"fuse_conv_qdq: \{format: qdq\}"):
            qprep.run(config, output_dir=str(tmp_path / "run"), force=True)
        return
    from qprep.quantize.rknn.runner import Runner

    simulated, simulate = [], Runner.__call__  # the evaluation's samples and the simulator's outputs for them

    def recording(runner, samples):
        outputs = simulate(runner, samples)
        simulated.extend(zip(samples, outputs))
        return outputs

    monkeypatch.setattr(Runner, "__call__", recording)
    report = qprep.run(config, output_dir=str(tmp_path / "run"), force=True)
    quantize = report["stages"][-1]
    assert quantize["status"] == "ok" and "own Q/DQ" in quantize["qat"]["scales"]
    assert (tmp_path / "run" / "model.rknn").is_file()
    logits = report["evaluation"]["outputs"]["logits"]
    assert logits["cosine_mean"] > 0.99  # ORT on the QDQ model: 0.9993
    # Built from its own Q/DQ, the .rknn computes the QAT model's int8 logits, up to a few requantization
    # roundings. Compared with the QAT model itself, run as written (its Q/DQ in float arithmetic: no
    # CPU-dependent int8 kernel), sample by sample on the same machine. Not its top-1 agreement with the FP32
    # twin: which of FP32's near ties the QAT network's own quantization flips depends on how it trained (#58:
    # 14 of 16 agreed on a fresh AVX2 machine; here 14 of 16 with one fixture, 16 of 16 with one trained under
    # AVX2 kernels), and the .rknn flips exactly those the QAT model flips.
    # Measured: at most 3 output steps on these 128 samples, for three differently trained fixtures; a build with
    # every weight scale 3% off: 34 (its cosine and top-1 against FP32 still passed).
    assert len(simulated) == logits["samples"] == 128
    qat = onnx.load(str(qdq_fixtures / "qat_cnn.onnx"))
    expected = run_model(qat, [sample for sample, _ in simulated])
    steps = max(float(np.abs(e["logits"] - got["logits"]).max()) for e, (_, got) in zip(expected, simulated))
    steps /= output_step(qat, "logits")
    assert steps <= 8, f"the .rknn's logits are {steps:.1f} output steps from the QAT model's"
