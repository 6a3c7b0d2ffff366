"""The user's own metric (`evaluation.metric: module:function`): resolved before the run, computed on FP32 and
the result (held-out too), read by the gate and the fallback's target as `metric` / `metric_drop`, and the
user's errors reported as theirs in one line."""

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import yaml

from conftest import CALIBRATION, demo_model
from graphs import outlier_model
from qprep.config import load_config
from qprep.errors import EXIT_USAGE, ConfigError
from qprep.measure.gate import check_gate
from qprep.measure.user_metric import ENTRY, MetricError, UserMetric
from qprep.model.runtime import run_model

MAE = '''import numpy as np


def mae(outputs, samples):
    """Mean absolute error of y against the FP32 values each sample's .npz keeps as `target`."""
    return float(np.mean([np.abs(o["y"] - s["target"]).mean() for o, s in zip(outputs, samples)]))


def broken(outputs, samples):
    return outputs[0]["no_such_output"]


def text(outputs, samples):
    return "0.9"


def accuracy(outputs, samples):
    return float(np.mean([o["y"].argmax() == s["label"] for o, s in zip(outputs, samples)]))


def own_table(outputs, samples):
    return {"a": 1.0}["b"]
'''


@pytest.fixture
def labelled(tmp_path):
    """The outlier model, .npz samples holding x and `target` (FP32's y: a label that is no model input), the
    metric module beside the config → (folder, config)."""
    model = outlier_model()
    onnx.save(model, str(tmp_path / "m.onnx"))
    for split, count in (("calib", 16), ("eval", 32)):
        (tmp_path / split).mkdir()
        rng = np.random.default_rng(len(split))
        for i in range(count):
            x = rng.standard_normal((1, 16)).astype(np.float32)
            np.savez(tmp_path / split / f"{i:02d}.npz", x=x, target=run_model(model, [{"x": x}], 1)[0]["y"])
    (tmp_path / "errors.py").write_text(MAE)
    config = {"model": "m.onnx", "calibration": {"source": "calib"}, "output_dir": "out",
              "evaluation": {"source": "eval", "latency": {"runs": 0}, "metric": "errors:mae",
                             "metric_direction": "lower"},
              "pipeline": [{"quantize": {"backend": "ort", "ort": {"spread_tensors": "off"}}}]}
    return tmp_path, config


def write(folder: Path, config: dict) -> Path:
    (folder / "c.yaml").write_text(yaml.safe_dump(config))
    return folder / "c.yaml"


def test_a_module_beside_the_config_is_imported_before_the_run_and_kept_as_its_file(labelled):
    folder, config = labelled
    loaded = load_config(write(folder, config))
    assert loaded["evaluation"]["metric"] == f"{folder / 'errors.py'}:mae"  # resolves again from the manifest
    assert load_config(loaded.values | {"pipeline": []})["evaluation"]["metric"] == f"{folder / 'errors.py'}:mae"


@pytest.mark.parametrize("spec, message", [
    ("errors", r"evaluation.metric: expected `module:function` \(e.g. my_metric:top1\), got 'errors'"),
    ("no_such_module:mae", r"evaluation.metric: no module 'no_such_module' beside the config nor on Python's path"),
    ("errors:mea", r"evaluation.metric: .*errors.py has no function 'mea'; did you mean 'mae'\?"),
    ("failing:mae", r"evaluation.metric: importing .*failing.py failed: RuntimeError: no GPU here; fix the module"),
    ("missing.py:mae", r"evaluation.metric: no file .*missing.py; give `file.py:function` relative to the config"),
])
def test_a_wrong_name_is_refused_before_the_run_in_one_line(labelled, cli, spec, message):
    folder, config = labelled
    (folder / "failing.py").write_text("raise RuntimeError('no GPU here')\n")
    config["evaluation"]["metric"] = spec
    with pytest.raises(ConfigError, match=message):
        load_config(write(folder, config))
    code, _, err = cli("run", folder / "c.yaml")
    assert code == EXIT_USAGE and len(err.strip().splitlines()) == 1 and not (folder / "out").exists()


@pytest.mark.parametrize("where, thresholds, message", [
    ("gate", {"metric_drop": 0.01}, r"evaluation.gate.metric_drop: needs evaluation.metric"),
    ("gate", {"y.metric": 0.5}, r"evaluation.gate.y.metric: your metric judges the whole model, not one output"),
    ("target", {"metric_drop": 0.01}, r"fallback.target.metric_drop: needs evaluation.metric"),
    ("gate", {"metric_drops": 0.01}, r"unknown metric 'metric_drops'; did you mean 'metric_drop'\?"),
])
def test_gate_and_target_keys_need_the_function_and_judge_the_whole_model(where, thresholds, message):
    evaluation = {"source": "d", **({"gate": thresholds} if where == "gate" else {})}
    pipeline = [{"quantize": {"fallback": {"target": thresholds}}}] if where == "target" else []
    with pytest.raises(ConfigError, match=message):
        load_config({"model": "m.onnx", "evaluation": evaluation, "pipeline": pipeline})


def figures(reference: float, result: float, direction: str = "higher") -> dict:
    drop = reference - result if direction == "higher" else result - reference
    return {"function": "m.py:f", "direction": direction, "samples": 48, "reference_metric": reference,
            "metric": result, "metric_drop": drop}


def test_the_gate_reads_the_metric_in_its_direction_and_names_the_function():
    outputs = {"y": {"cosine_mean": 0.999, "judged_by": ["cosine_mean"]}}
    higher = {**outputs, ENTRY: figures(0.90, 0.88)}
    gate = check_gate({"metric_drop": 0.01, "metric": 0.85, "cosine_mean": 0.99}, higher)
    drop, minimum, _ = gate["checks"][:3]
    assert not gate["passed"] and not drop["passed"] and drop["kind"] == "maximum"
    assert drop["value"] == pytest.approx(0.02) and "worst_output" not in drop
    assert minimum["passed"] and minimum["kind"] == "minimum"
    assert drop["stands_for"] == "m.py:f: FP32 0.9, result 0.88 on 48 samples"
    lower = {**outputs, ENTRY: figures(0.10, 0.105, "lower")}  # an error rate: `metric` is a maximum
    gate = check_gate({"metric_drop": 0.01, "metric": 0.12}, lower)
    assert gate["passed"] and [c["kind"] for c in gate["checks"]] == ["maximum", "maximum"]
    assert check_gate({"metric": 0.2}, lower)["passed"] and not check_gate({"metric": 0.1}, lower)["passed"]
    assert not check_gate({"metric_drop": 0.01}, outputs)["passed"]  # not measured: a gate fails
    assert check_gate({"metric_drop": 0.01}, outputs, floor=True)["checks"] == []  # the floor skips it


def test_the_function_sees_the_npz_labels_and_the_file_and_errors_are_the_users(labelled):
    from qprep.data import load_samples
    from qprep.model.info import graph_inputs

    folder, _ = labelled
    samples = load_samples({"source": str(folder / "eval"), "format": "auto", "max_samples": 64, "seed": 0,
                            "preprocess": None}, graph_inputs(outlier_model()))
    metric = UserMetric(f"{folder / 'errors.py'}:mae", "lower")
    seen = metric.samples_of(samples)
    assert set(seen[0]) == {"x", "target", "file"} and seen[0]["file"] == str(folder / "eval" / "00.npz")
    expected = [{"y": s["target"]} for s in seen]
    off = [{"y": s["target"] + 0.5} for s in seen]
    assert metric.figures(expected, off, seen, "the evaluation samples") == {
        "function": "errors.py:mae", "spec": f"{folder / 'errors.py'}:mae", "direction": "lower", "samples": 32,
        "reference_metric": 0.0, "metric": pytest.approx(0.5), "metric_drop": pytest.approx(0.5),
        "metric_ci95": pytest.approx([0.5, 0.5]), "metric_drop_ci95": pytest.approx([0.5, 0.5])}
    for name, said in (("broken", "raised KeyError: 'no_such_output' on the FP32 reference's outputs on the "
                                  r"evaluation samples: the outputs are y \(no 'no_such_output'\); fix the function"),
                       ("text", "returned str on the FP32 reference's outputs on the evaluation samples; return "
                                "one number")):
        with pytest.raises(MetricError, match=f"evaluation.metric errors.py:{name} {said}") as raised:
            UserMetric(f"{folder / 'errors.py'}:{name}").figures(expected, off, seen, "the evaluation samples")
        assert raised.value.exit_code == EXIT_USAGE and "\n" not in str(raised.value)


def test_a_target_on_the_metric_drives_the_fallback_and_the_gate_judges_it_again(labelled, cli):
    """The all-int8 result's error against the stored FP32 values misses the target: the search keeps nodes
    float until it holds; the evaluation reports FP32's figure and the result's; a gate it cannot meet exits 1."""
    import json

    folder, config = labelled
    config["pipeline"][0]["quantize"]["fallback"] = {"target": {"metric_drop": 1.0}}
    code, _, err = cli("run", write(folder, config), "--quiet")
    report = json.loads((folder / "out" / "report.json").read_text())
    record = report["stages"][-1]["fallback"]
    assert code == 0, err
    assert record["base"]["metrics"]["metric_drop"] > 1.0 and record["passed"] and record["float_nodes"]
    metric = report["evaluation"]["metric"]
    assert metric["reference_metric"] < 1e-5 and metric["metric_drop"] <= 1.0 and metric["samples"] == 32
    assert [c["metric"] for c in report["evaluation"]["gate"]["checks"]] == ["metric_drop"]
    assert "Target metric_drop ≤ 1.0: **met**" in (folder / "out" / "report.md").read_text()
    config["evaluation"]["gate"] = {"metric": -1.0}  # an error below zero: no result meets it
    code, _, err = cli("run", write(folder, config), "--quiet", "--force")
    assert code == 1 and "gate missed" in err


def test_a_function_that_raises_in_the_run_is_the_users_error_in_one_line(labelled, cli):
    folder, config = labelled
    config["evaluation"]["metric"] = "errors:broken"
    code, _, err = cli("run", write(folder, config), "--quiet")
    assert code == EXIT_USAGE and len(err.strip().splitlines()) == 1
    assert "evaluation.metric errors.py:broken raised KeyError: 'no_such_output'" in err


def test_a_key_the_samples_lack_is_said_to_be_the_datas_not_the_functions(labelled):
    """Issue #59: `sample["label"]` on samples without `label` said "raised KeyError: 'label' … fix the function";
    the function is fine, the .npz files lack the key. A KeyError of the function's own is still its own."""
    from qprep.data import load_samples
    from qprep.model.info import graph_inputs

    folder, _ = labelled
    samples = load_samples({"source": str(folder / "eval"), "format": "auto", "max_samples": 64, "seed": 0,
                            "preprocess": None}, graph_inputs(outlier_model()))
    for name, said in (("accuracy", "raised KeyError: 'label' on the FP32 reference's outputs on the evaluation "
                                    "samples: the samples carry target, x, file (no 'label'): add it to each .npz, "
                                    "or fix the function"),
                       ("own_table", "raised KeyError: 'b' on the FP32 reference's outputs on the evaluation "
                                     "samples; fix the function")):
        metric = UserMetric(f"{folder / 'errors.py'}:{name}")
        seen = metric.samples_of(samples)
        outputs = [{"y": s["target"]} for s in seen]
        with pytest.raises(MetricError) as raised:
            metric.figures(outputs, outputs, seen, "the evaluation samples")
        assert str(raised.value).startswith(f"evaluation.metric errors.py:{name} {said}")


def readme_metric() -> str:
    """The metric module of README's walkthrough ("Judge it by your own metric"), as a user copies it."""
    import re
    import textwrap

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = re.search(r"```python\n(   # direction\.py.*?)```", readme, re.S)
    assert block, "README's walkthrough lost its metric function"
    return textwrap.dedent(block.group(1))


@pytest.mark.slow
def test_accuracy_against_labels_on_a_real_model_gates_the_run_and_is_the_fallbacks_target(tmp_path, cli):
    """The README's walkthrough: PP-OCR's direction classifier, its labels.txt, a metric module beside the
    config; FP32 gets 127 of 128 evaluation images and all 128 held-out ones right (checked when the sets were
    built)."""
    import json

    (tmp_path / "direction.py").write_text(readme_metric())
    ocr = {"channel_order": "bgr", "mean": [127.5] * 3, "std": [127.5] * 3, "resize": "none"}
    data = CALIBRATION / "ocr_cls"
    config = {"model": str(demo_model("ppocr_cls.onnx")), "inputs": {"x": [1, 3, 48, 192]}, "output_dir": "out",
              "calibration": {"source": str(data / "calib"), "preprocess": ocr},
              "evaluation": {"source": str(data / "eval"), "preprocess": ocr, "heldout": {"source": str(data / "heldout")},
                             "metric": "direction:accuracy", "gate": {"metric_drop": 0.02}, "latency": {"runs": 0},
                             "layers": False},
              "pipeline": [{"quantize": {"backend": "ort", "fallback": {"target": {"metric_drop": 0.01}}}}]}
    code, _, err = cli("run", write(tmp_path, config), "--quiet")
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    evaluation = report["evaluation"]
    assert code == 0, err
    assert evaluation["metric"]["reference_metric"] == 127 / 128 and evaluation["metric"]["samples"] == 128
    assert evaluation["heldout"]["metric"]["reference_metric"] == 1.0
    assert evaluation["gate"]["judged_on"] == "heldout" and evaluation["gate"]["target"] == {"metric_drop": 0.02}
    assert [c["metric"] for c in evaluation["gate"]["checks"]] == ["metric_drop"]
    assert evaluation["gate"]["checks"][0]["value"] == evaluation["heldout"]["metric"]["metric_drop"] <= 0.02
    record = report["stages"][-1]["fallback"]
    assert record["target"] == {"metric_drop": 0.01} and "metric_drop" in record["best"]["metrics"]
    assert record["best"]["unseen"]["metrics"]["metric_drop"] <= 0.01  # accepted on the samples kept apart too
    text = (tmp_path / "out" / "report.md").read_text()
    assert "your metric direction.py:accuracy (higher is better) on 128 samples: FP32 0.9922" in text


def test_an_overlays_metric_is_found_beside_the_overlay(labelled):
    """A batch model's sidecar names its own metric: the module lies beside the sidecar, not the shared config."""
    folder, config = labelled
    (folder / "model_a").mkdir()
    (folder / "errors.py").rename(folder / "model_a" / "errors.py")
    (folder / "model_a" / "m.qprep.yaml").write_text("evaluation: {metric: errors:mae}\n")
    del config["evaluation"]["metric"]
    loaded = load_config(write(folder, config), overlay=folder / "model_a" / "m.qprep.yaml")
    assert loaded["evaluation"]["metric"] == f"{folder / 'model_a' / 'errors.py'}:mae"


def test_an_npz_whose_labels_need_pickle_is_the_users_error_in_one_line(labelled):
    """Ragged labels saved as an object array cannot be read without pickle: one line naming the file, exit 2,
    not an internal error."""
    from qprep.data import load_samples
    from qprep.model.info import graph_inputs

    folder, _ = labelled
    np.savez(folder / "eval" / "00.npz", x=np.zeros((1, 16), np.float32),
             boxes=np.array([np.zeros(4), np.zeros(8)], dtype=object))
    samples = load_samples({"source": str(folder / "eval"), "format": "auto", "max_samples": 64, "seed": 0,
                            "preprocess": None}, graph_inputs(outlier_model()))
    with pytest.raises(MetricError, match="00.npz: its arrays beside the inputs cannot be read without pickle") as raised:
        UserMetric(f"{folder / 'errors.py'}:mae", "lower").samples_of(samples)
    assert raised.value.exit_code == EXIT_USAGE and "\n" not in str(raised.value)


def test_a_module_that_imports_a_missing_one_is_named_for_what_it_lacks(tmp_path):
    """mymetrics.py exists but imports `mym`, which does not: the message is the import that failed, not "no
    module 'mymetrics'"."""
    (tmp_path / "mymetrics.py").write_text("import mym\n\ndef f(outputs, samples):\n    return 1.0\n")
    with pytest.raises(ConfigError, match="importing .*mymetrics.* failed: ModuleNotFoundError: No module named 'mym'"):
        UserMetric(f"{tmp_path / 'mymetrics.py'}:f")


@pytest.mark.parametrize("direction, sign", [("higher", "≥"), ("lower", "≤")])
def test_the_fallback_line_reads_a_metric_target_in_its_direction(direction, sign):
    from qprep.report.fallback import fallback_tables

    figures = {"metric": 0.95}
    record = {"target": {"metric": 0.9, "metric_drop": 0.01}, "metric_direction": direction, "passed": True,
              "float_nodes": [], "stopped": "target met", "rank_trials": 0, "ranked": 0, "candidates": 0,
              "seconds": 1.0, "best": {"metrics": figures}, "base": {"metrics": figures}, "trials": []}
    line, _ = fallback_tables({"fallback": record})
    assert line.startswith(f"Target metric {sign} 0.9, metric_drop ≤ 0.01:")


def test_a_metric_gate_the_sample_count_cannot_decide_says_so_in_the_verdict(tmp_path):
    """Accuracy against labels on 48 samples, 46 right (0.958) against a gate of 0.97: one sample is 2.1%, so the
    miss is within the figure's noise and the verdict says the sample count cannot decide, as it does for an
    agreement; 48 of 48 is decided."""
    from qprep.report.verdict import check_text

    (tmp_path / "acc.py").write_text(MAE)
    metric = UserMetric(f"{tmp_path / 'acc.py'}:accuracy")
    samples = [{"x": np.zeros(1, np.float32), "label": np.int64(i % 4)} for i in range(48)]
    expected = [{"y": np.eye(4, dtype=np.float32)[i % 4]} for i in range(48)]
    actual = [{"y": np.eye(4, dtype=np.float32)[(i + (i < 2)) % 4]} for i in range(48)]  # two samples wrong
    figures = metric.figures(expected, actual, samples, "the evaluation samples")
    assert figures["metric"] == pytest.approx(46 / 48) and figures["metric_drop"] == pytest.approx(2 / 48)
    low, high = figures["metric_ci95"]
    assert low < 0.97 < high
    check, = check_gate({"metric": 0.97}, {ENTRY: figures})["checks"]
    assert not check["passed"] and check["undecided"].startswith("48 samples: 95% interval ")
    assert "(too few to decide: 48 samples: 95% interval" in check_text(check)
    drop, = check_gate({"metric_drop": 0.01}, {ENTRY: figures})["checks"]
    assert "undecided" in drop
    assert check_gate({"metric": 0.97}, {ENTRY: figures}, undecided_passes=True)["passed"]  # as for agreements
    exact = metric.figures(expected, expected, samples, "the evaluation samples")
    check, = check_gate({"metric": 0.97}, {ENTRY: exact})["checks"]
    assert check["passed"] and "undecided" not in check and exact["metric_drop_ci95"] == [0.0, 0.0]


def test_the_labels_are_read_once_by_the_sample_loader(labelled):
    """The loader keeps each .npz's arrays beside the inputs on the SampleSet and the metric reads them there: the
    files are not read a second time (here they are gone once loaded, and the labels are still seen)."""
    from qprep.data import load_samples
    from qprep.model.info import graph_inputs

    folder, _ = labelled
    samples = load_samples({"source": str(folder / "eval"), "format": "auto", "max_samples": 64, "seed": 0,
                            "preprocess": None}, graph_inputs(outlier_model()))
    assert set(samples.extras[0]) == {"target"} and set(samples.samples[0]) == {"x"}  # the model is fed x only
    kept = samples.extras[3]["target"].copy()
    for path in (folder / "eval").iterdir():
        path.unlink()
    seen = UserMetric(f"{folder / 'errors.py'}:mae", "lower").samples_of(samples)
    assert np.array_equal(seen[3]["target"], kept) and seen[3]["file"].endswith("03.npz")


@pytest.mark.parametrize("by_name", [False, True])
def test_importing_the_users_metric_writes_no_bytecode_beside_it(tmp_path, monkeypatch, by_name):
    """The config's folder is the user's: importing their module (and the helper it imports) leaves no
    __pycache__ there, by file or by name on Python's path, and Python's own setting is restored after."""
    from qprep.measure import user_metric

    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    module = f"agree_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"helper_{module}.py").write_text("SCALE = 1.0\n")
    (tmp_path / f"{module}.py").write_text(f"from helper_{module} import SCALE\n\n"
                                           "def agree(outputs, samples):\n    return SCALE\n")
    if by_name:
        monkeypatch.syspath_prepend(str(tmp_path))
        spec = user_metric.resolve(f"{module}:agree", tmp_path / "elsewhere")
    else:
        spec = user_metric.resolve(f"{module}:agree", tmp_path)
    assert user_metric.load(spec)([], []) == 1.0
    assert not list(tmp_path.rglob("__pycache__"))
    assert sys.dont_write_bytecode is False
