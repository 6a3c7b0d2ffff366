"""The RKNN backend for real: rknn-toolkit2's x86 simulator on the real PP-OCR models."""

import json

import numpy as np
import onnx
import pytest

from qprep.quantize.backend import QuantizeJob
from qprep.errors import QprepError
from conftest import CALIBRATION, ROOT, demo_model, rknn_job, typed

pytestmark = pytest.mark.slow  # real models or the CLI in subprocesses: `pytest -m "not slow"` skips them

pytest.importorskip("rknn.api", reason="rknn-toolkit2 is not installed (scripts/setup.sh or `qprep setup rknn` installs it)")

OCR = {"channel_order": "bgr", "mean": [127.5], "std": [127.5], "resize": "none"}


def test_classifier_converts_evaluates_on_the_simulator_and_hands_off(tmp_path):
    import qprep

    config = {"model": str(demo_model("ppocr_cls.onnx")), "inputs": {"x": [1, 3, 48, 192]},
              "calibration": {"source": str(CALIBRATION / "ocr_cls" / "calib"), "max_samples": 16, "preprocess": OCR},
              "evaluation": {"source": str(CALIBRATION / "ocr_cls" / "eval"), "max_samples": 24, "preprocess": OCR,
                             "latency": {"runs": 0}},
              "pipeline": [{"optimize": {}}, {"quantize": {"backend": "rknn"}}]}
    report = qprep.run(config, output_dir=str(tmp_path), force=True)
    assert (tmp_path / "model.rknn").stat().st_size > 100_000
    metrics = report["evaluation"]["outputs"]["save_infer_model/scale_0.tmp_1"]
    # top-1 on all 24 on any CPU: no near tie among them (FP32's two class probabilities are 0.91 apart at the
    # nearest, the simulator's largest error 0.08)
    assert metrics["cosine_mean"] > 0.999 and metrics["top1_agreement"] == 1.0
    assert report["evaluation"]["latency"]["status"].startswith("not measured")
    layers = report["evaluation"]["layers"]
    assert layers and all("single_cosine" in r for r in layers)
    contract = json.loads((tmp_path / "input_contract.json").read_text())
    feed = contract["inputs"][0]["feed"]
    assert feed["channel_order"] == "bgr" and feed["mean"] == [127.5] * 3 and feed["dtype"] == "uint8"
    assert [output.get("class_names") for output in contract["outputs"]] == [None]  # no character list: no names
    assert (tmp_path / "run_on_board.py").read_text().startswith('"""Run model.rknn')
    stage = report["stages"][1]
    assert stage["config"]["mean_values"] == [[127.5] * 3] and stage["calibration_samples"] == 16
    assert not list(ROOT.glob("*.quantization.cfg")) and not list(ROOT.glob("check*.onnx"))  # cwd not littered


def test_layernorm_float16_islands_map_to_rknn_tensors_and_step2_builds(tmp_path):
    """Hybrid quantization on the optimized recognizer: its 5 LayerNormalization nodes become float16 layers."""
    from qprep.quantize import rknn

    job = rknn_job(tmp_path, "ppocrv4_rec")
    layernorms = [n.name for n in job.model.graph.node if n.op_type == "LayerNormalization"]
    assert len(layernorms) == 5
    job = job.but(float_set=frozenset(layernorms))
    work, calibration = job.work_dir, job.calibration
    result = rknn.quantize(job)
    islands = result.details["float16_layers"]
    assert islands["unmapped"] == [] and len(islands["mapped"]) == 5
    cfg_text = (work / "model.quantization.cfg").read_text()
    block = cfg_text.split("\nquantize_parameters:\n")[0]
    assert all(f"'{t}': float16" in block for t in islands["ir_tensors"]) and len(islands["ir_tensors"]) >= 5
    assert result.artifacts["model.rknn"].stat().st_size > 1_000_000  # step2 built and exported
    outputs = result.runner(calibration.samples[:2])
    assert outputs[0]["softmax_11.tmp_0"].shape == (1, 40, 6625)
    assert np.isfinite(outputs[0]["softmax_11.tmp_0"]).all()


def test_gptq_weights_sit_on_the_grid_the_toolkit_quantizes_them_to(tmp_path):
    """rknn_weights' model of the toolkit's weight quantization (per output channel, asymmetric over
    [min(w, 0), max(w, 0)]) checked against the toolkit's own quantization table (rknn-toolkit2 2.5.0, a private
    attribute read in the toolkit worker): every Conv weight it was handed gets the predicted scale and zero point
    and lies on that grid, so the toolkit's rounding keeps GPTQ's integers."""
    from qprep.quantize import rknn
    from qprep.quantize.rknn import weights as rknn_weights

    job = rknn_job(tmp_path, "ppocr_cls", weight_rounding="gptq")
    result = rknn.quantize(job)
    record = result.details["weight_rounding"]
    # 53 Conv + the classifier (Gemm, transB 0); the late layers' few positions leave 18 to nearest rounding
    assert (record["layers"], record["underdetermined"]) == (36, 18)
    handed = onnx.load(str(job.work_dir / "model.onnx"))
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in handed.graph.initializer}
    given = {t.name: onnx.numpy_helper.to_array(t) for t in job.model.graph.initializer}
    table = result.runner.quantization_table()  # rknn_ranges.table_of in the toolkit worker
    layers = rknn_weights.layers(handed)
    assert len(layers) == 54 and {layer.kind for layer in layers} == {"conv", "matmul"}
    rounded = {layer.node for layer in layers if not np.array_equal(weights[layer.quantized], given[layer.quantized])}
    assert len(rounded) == 36
    for layer in layers:
        weight = weights[layer.quantized]
        scale, zero = rknn_weights.grid(weight, layer.axis)
        np.testing.assert_allclose(np.asarray(json.loads(str(table[layer.quantized]["scale"]))), scale, rtol=1e-5)
        np.testing.assert_array_equal(np.asarray(json.loads(str(table[layer.quantized]["zero_point"]))), zero)
        if layer.node in rounded:  # on the grid: the toolkit's rounding keeps GPTQ's integers
            steps = np.moveaxis(weight, layer.axis, 0).reshape(len(scale), -1) / scale[:, None] + zero[:, None]
            assert np.abs(steps - np.round(steps)).max() < 1e-3


def test_dynamic_input_dims_are_refused_with_the_fix(tmp_path):
    from qprep.quantize import rknn

    model = onnx.load(str(demo_model("ppocr_cls.onnx")))
    with pytest.raises(QprepError, match=r"input 'x' has dynamic dims .*add `inputs: \{x: \[\.\.\.\]\}`"):
        rknn.quantize(QuantizeJob(model=model, calibration=None, max_samples=1, float_set=frozenset(),
                                  options=typed("rknn"), work_dir=tmp_path))


def test_error_analysis_parser_reads_glued_columns_and_fused_rows():
    from qprep.quantize.rknn.names import parse_error_analysis, with_custom_layers

    text = ("[exNorm] p2o.Add.235_tp-rs     0.93095 | 13.11623  0.99988 | 0.54064\n"
            "[Conv] p2o.Add.3\n"
            "[Conv] big                     0.99000 | 1398.533940.99998 | 0.00100\n")
    rows = parse_error_analysis(text)
    assert rows[0]["entire_cosine"] == 0.93095 and rows[0]["single_euclidean"] == 0.54064
    assert "entire_cosine" not in rows[1]
    assert rows[2]["entire_euclidean"] == 1398.53394 and rows[2]["single_cosine"] == 0.99998
    cfg = "custom_quantize_layers: {}\nquantize_parameters:\n    x:\n        dtype: int8\n"
    edited = with_custom_layers(cfg, ["a-rs"])
    assert edited == "custom_quantize_layers:\n    'a-rs': float16\nquantize_parameters:\n    x:\n        dtype: int8\n"


def test_toolkit_traceback_in_the_log_becomes_one_line(tmp_path):
    from qprep.quantize.rknn.toolkit import Toolkit

    toolkit = Toolkit(tmp_path)
    toolkit.log_path.write_text("E RKNN: [11:03] Unkown op target: 0\n"
                                "\x1b[1;31mE\x1b[0m \x1b[1;31minference: Traceback (most recent call last):\n"
                                '  File "rknn/api/rknn_base.py", line 2776, in inference\n'
                                "AttributeError: 'NoneType' object has no attribute 'lower'\n\x1b[0m\n")
    assert toolkit.error_line(0) == "inference: AttributeError: 'NoneType' object has no attribute 'lower'"


def test_fallback_ranks_by_accuracy_analysis_and_builds_float16_layers(tmp_path):
    """cls on RKNN with an unreachable target: ranked by the toolkit's analysis, promoted as float16 layers
    through hybrid step2 (step1 once) up to max_float_nodes, the best model written and the run's gate missed.
    The layers the spread phase made float16 count against the cap (float16 layers, as the toolkit builds them)."""
    import qprep

    config = {"model": str(demo_model("ppocr_cls.onnx")), "inputs": {"x": [1, 3, 48, 192]},
              "calibration": {"source": str(CALIBRATION / "ocr_cls" / "calib"), "max_samples": 8, "preprocess": OCR},
              "evaluation": {"source": str(CALIBRATION / "ocr_cls" / "eval"), "max_samples": 12, "preprocess": OCR,
                             "latency": {"runs": 0}, "layers": False,
                             # judged by its cosine, which no build reaches (as a two-class decision it is met)
                             "tasks": {"save_infer_model/scale_0.tmp_1": "classification"}},
              "pipeline": [{"optimize": {}}, {"quantize": {"backend": "rknn", "fallback": {
                  "target": {"cosine_mean": 0.9999999}, "max_float_nodes": 3, "time_budget_s": 90}}}]}
    report = qprep.run(config, output_dir=str(tmp_path), force=True)
    stage = report["stages"][1]
    record = stage["fallback"]
    assert record["ranked_by"] == "analysis" and record["ranking"] and record["rank_trials"] == 0
    assert not record["passed"] and report["status"] == "gate missed"
    promotions = [t for t in record["trials"] if t["phase"] == "promote"]
    spread = record["spread_tensors"]
    assert spread["nodes"] <= 3 and spread["over_max_float_nodes"]  # larger spread sets were not tried
    assert promotions  # the cap counts the RKNN model's float16 layers, the spread set's included:
    layers = (stage.get("float16_layers") or {}).get("ir_tensors", [])
    assert len(layers) <= 3 and bool(layers) == bool(record["float_nodes"] or spread["nodes"])
    # 90 s: with 60, a machine busy with other work spent the budget on the base trial and the search stopped
    # before ranking (CI); unbounded, the search runs minutes
    assert record["seconds"] < 90 + 60  # the budget stops the search (one trial may run over)
    if record["float_nodes"]:  # the best build had float16 layers: they are what model.rknn was built with
        assert stage["float16_layers"]["mapped"]
    assert record["best"]["score"] >= record["base"]["score"]
    assert (tmp_path / "model.rknn").is_file()
    assert report["evaluation"]["gate"]["checks"][0]["metric"] == "cosine_mean"


def test_dynamic_input_dims_are_refused_by_validate_before_any_work(tmp_path, cli):
    from graphs import tiny_conv_model

    onnx.save(tiny_conv_model(batch="N"), tmp_path / "m.onnx")
    (tmp_path / "c.yaml").write_text("model: m.onnx\npipeline: [{quantize: {backend: rknn}}]\n")
    code, _, err = cli("validate", str(tmp_path / "c.yaml"))
    assert code == 2 and "input 'x' has dynamic dims ['N', 3, 8, 8]" in err.splitlines()[-1]
    assert "calibration data is required" in err.splitlines()[0]  # validate names every problem


def test_dynamic_dims_are_fixed_from_samples_that_all_share_one_shape(tmp_path, cli):
    """keras/torch exports leave the batch dim (or the sequence) open; RKNN compiles one size, and when every
    sample has the same shape that is the deployment's: fixed from them, said in a warning. Samples of two
    shapes leave the dim open, and the refusal with its fix stands."""
    from graphs import tiny_conv_model

    onnx.save(tiny_conv_model(batch="N"), tmp_path / "m.onnx")
    for folder, batches in (("same", (1, 1, 1)), ("mixed", (1, 2, 1))):
        (tmp_path / folder).mkdir()
        for i, batch in enumerate(batches):
            np.save(tmp_path / folder / f"{i}.npy", np.ones((batch, 3, 8, 8), np.float32))
    for folder, expected in (("same", 0), ("mixed", 2)):
        (tmp_path / f"{folder}.yaml").write_text(f"model: m.onnx\ncalibration: {{source: {folder}}}\n"
                                                 "pipeline: [{quantize: {backend: rknn}}]\n")
        code, out, err = cli("validate", str(tmp_path / f"{folder}.yaml"))
        assert code == expected, err
    assert "input 'x' has dynamic dims ['N', 3, 8, 8]" in err


def test_dims_ort_refuses_fixed_are_refused_with_that_reason_not_with_add_inputs(tmp_path, cli):
    """silero-vad: `inputs:` fixes the state input, ONNX Runtime then refuses the model (it infers a branch
    that does not run at these dims), the input stays symbolic: RKNN's refusal says why, not "add inputs:"."""
    from model.test_prepare import if_model_with_state

    onnx.save(if_model_with_state(), tmp_path / "m.onnx")
    (tmp_path / "c.yaml").write_text("model: m.onnx\ninputs: {x: [2, 4], state: [2, 2, 8]}\n"
                                     "pipeline: [{quantize: {backend: rknn}}]\n")
    code, _, err = cli("validate", str(tmp_path / "c.yaml"))
    last = err.splitlines()[-1]
    assert code == 2 and "input 'state' must have fixed dims, and with them ONNX Runtime refuses the model" in last
    assert "inferencing failed" in last and "add `inputs:" not in err
