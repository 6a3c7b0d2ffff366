"""A met verdict says what it cost: the share of multiply-adds on integers and the speed against FP32; under
evaluation.min_integer_share it reads "met, but mostly float" (a BERT met its gate with 23% of them on integers at
1.03× FP32 and nothing said so). A figure that was not measured is said to be, never guessed."""

from __future__ import annotations

import pytest
from synthetic_report import report

from conftest import CALIBRATION, demo_model
from qprep.config import load_config
from qprep.errors import ConfigError
from qprep.measure.gate import check_gate
from qprep.report.markdown import render_markdown
from qprep.report.verdict import MET, MISSED, closing_line, verdict


def timing(ms: float) -> dict:
    return {"median_ms": ms, "runs": 20, "round_runs": [20], "rounds": 1}


def judged(gate: dict) -> dict:
    """The synthetic report with `gate` checked on its evaluation outputs, as evaluate() does."""
    data = report()
    data["evaluation"]["gate"] = {**check_gate(gate, data["evaluation"]["outputs"]), "judged_on": "evaluation"}
    return data


def costed(share: float | None = 0.97, speedup: float | None = 1.8, floor: float | None = 0.5,
           gate: dict | None = None) -> dict:
    data = judged(gate or {"cosine_mean": 0.5})
    if share is not None:
        data["result"]["integer_share"] = share
    if speedup is not None:
        data["evaluation"]["latency"] = {  # as evaluate.timed_latency writes it
            "settings": {"batch": 1, "threads": 2, "provider": "CPUExecutionProvider",
                         "graph_optimization": "ORT_ENABLE_ALL", "basic": "ORT_ENABLE_BASIC"},
            "reference": timing(1.8 * speedup), "result": timing(1.8), "speedup": speedup}
    if floor is not None:
        data["evaluation"]["min_integer_share"] = floor
    return data


def test_met_says_its_integer_share_and_its_speed_against_fp32():
    result = verdict(costed())
    assert result.state == MET and not result.mostly_float
    assert result.text.endswith("on 16 evaluation samples (`data/eval`); cost: 97% of the multiply-adds on "
                                "integers, 1.80× FP32")
    assert closing_line(costed()).startswith("met: gate: cosine_mean of logits ")  # plain text for the terminal
    assert closing_line(costed()).endswith("; cost: 97% of the multiply-adds on integers, 1.80× FP32")


def test_met_under_the_floor_reads_met_but_mostly_float():
    data = costed(share=0.23, speedup=1.03)
    result = verdict(data)
    assert result.state == MET and result.mostly_float
    assert result.text.startswith("but mostly float (23% of the multiply-adds on integers, 1.03× FP32; under "
                                  "`evaluation.min_integer_share` 50%): gate: `")
    assert "**Verdict: met** — but mostly float (23% of the multiply-adds" in render_markdown(data)
    assert closing_line(data).startswith("warning: met, but mostly float (23% of the multiply-adds on integers")
    assert not verdict(costed(share=0.23, floor=0.2)).mostly_float  # the floor is the config's
    assert not verdict(costed(share=0.23, floor=0.0)).mostly_float  # 0 turns the warning off
    missed = costed(share=0.23, gate={"top1_agreement": 0.99})  # a missed gate keeps its own text and lines
    assert verdict(missed).state == MISSED and "mostly float" not in verdict(missed).text
    assert "cost" not in verdict(missed).text and closing_line(missed) is None


def test_figures_that_were_not_measured_are_said_to_be():
    fp16 = costed(share=None)
    fp16["stages"][0]["backend"] = "fp16"
    assert verdict(fp16).cost == "an fp16 result (no integer multiply-adds), 1.80× FP32"
    rknn = costed(share=None, speedup=None)
    rknn["stages"][0]["backend"] = "rknn"
    rknn["result"]["deployable"] = {"path": "model.rknn", "bytes": 1000, "note": ""}
    rknn["evaluation"]["latency"] = {"status": "not measured (no device): the result runs on the toolkit's simulator"}
    assert verdict(rknn).cost == ("integer share of `model.rknn` not measured (the toolkit's own graph), speed not "
                                  "measured off the board")
    untimed = costed(speedup=None)
    assert verdict(untimed).cost.endswith(", speed not measured (`evaluation.latency.runs: 0`)")
    optimized = costed(share=None)
    optimized["stages"], optimized["result"]["kind"] = [], "float"
    assert verdict(optimized).cost.startswith("a float result (nothing quantized), ")
    qat = costed(share=None)
    qat["stages"], qat["model"]["kind"] = [], "qdq"
    assert verdict(qat).cost == ("integer share not measured (the input model came quantized), 1.80× the input "
                                 "model's speed")


def test_a_speed_whose_rounds_disagreed_is_said_to_be_unsteady():
    """latency's `unstable` (the rounds' ratios differ by over 15%) reaches the cost line with the rounds' range:
    "1.03× FP32" alone read as a steady figure while the report's notes said it was not."""
    from qprep.measure.latency import speedups

    data = costed(speedup=1.03)
    latency = data["evaluation"]["latency"]
    latency.update(speedups({"median_ms": 1.03, "round_ms": [0.9, 1.03, 1.2]},
                            {"median_ms": 1.0, "round_ms": [1.0] * 3}))
    assert latency["unstable"]
    assert verdict(data).cost == ("97% of the multiply-adds on integers, 1.03× FP32, unsteady: 0.90×–1.20× across "
                                  "timing rounds")
    steady = costed(speedup=1.03)
    steady["evaluation"]["latency"].update(speedups({"median_ms": 1.03, "round_ms": [1.0, 1.03, 1.05]},
                                                    {"median_ms": 1.0, "round_ms": [1.0] * 3}))
    assert verdict(steady).cost.endswith("1.03× FP32")


def test_the_floor_is_one_evaluation_key_resolved_with_the_config():
    base = {"model": "m.onnx", "evaluation": {"source": "d"}}
    assert load_config(base)["evaluation"]["min_integer_share"] == 0.5
    assert load_config(base, {"evaluation.min_integer_share": 0.8})["evaluation"]["min_integer_share"] == 0.8
    with pytest.raises(ConfigError, match="min_integer_share: 50.0 is above the maximum 1"):
        load_config(base, {"evaluation.min_integer_share": 50})  # a percent: refused, not read as 50x


@pytest.mark.slow
def test_a_run_on_a_demo_model_closes_with_what_met_cost(tmp_path, cli):
    """PP-OCR's direction classifier: INT8 by ORT, its two-class output judged as a decision, and the closing
    line gives the integer share and the speed against FP32 the report records."""
    import json

    import yaml

    ocr = {"channel_order": "bgr", "mean": [127.5], "std": [127.5], "resize": "none"}
    config = {"model": str(demo_model("ppocr_cls.onnx")), "inputs": {"x": [1, 3, 48, 192]}, "output_dir": "out",
              "calibration": {"source": str(CALIBRATION / "ocr_cls" / "calib"), "preprocess": ocr,
                              "max_samples": 8},
              "verify": {"max_samples": 2},
              "evaluation": {"source": str(CALIBRATION / "ocr_cls" / "eval"), "preprocess": ocr, "max_samples": 16,
                             "layers": False, "gate": {"cosine_mean": 0.5}, "min_integer_share": 0.99,
                             "latency": {"runs": 8, "warmup": 1, "rounds": 1, "seconds": 5}},
              "pipeline": [{"quantize": {"backend": "ort"}}]}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    code, out, err = cli("run", tmp_path / "c.yaml", "--force")
    assert code == 0, err
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["evaluation"]["outputs"]["save_infer_model/scale_0.tmp_1"]["kind"] == "binary"
    share, speedup = report["result"]["integer_share"], report["evaluation"]["latency"]["speedup"]
    cost = f"{share:.0%} of the multiply-adds on integers, {speedup:.2f}× FP32"
    if share < 0.99:
        assert f"qprep: warning: met, but mostly float ({cost}; under evaluation.min_integer_share 99%)" in err
    else:
        assert f"qprep: met: gate: " in out and out.rstrip().endswith(f"cost: {cost}")
