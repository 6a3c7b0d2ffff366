"""qprep evaluate: a finished run's result measured again on other samples, run directory untouched."""

import json

import numpy as np
import onnx
import pytest

from graphs import tiny_conv_model
from qprep.errors import ConfigError, ModelError
from qprep.pipeline.reevaluate import reevaluate
from qprep.model.io import sha256_file


def samples(folder, count, seed, scale=1.0):
    folder.mkdir()
    rng = np.random.default_rng(seed)
    for i in range(count):
        np.save(folder / f"{i:02d}.npy", (scale * rng.normal(size=(1, 3, 8, 8))).astype(np.float32))
    return folder


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A tiny Conv model through optimize → ORT quantize, evaluated on 6 samples with a gate."""
    import qprep

    root = tmp_path_factory.mktemp("rerun")
    onnx.save(tiny_conv_model(batch=1), str(root / "m.onnx"))
    config = {"model": str(root / "m.onnx"),
              "calibration": {"source": str(samples(root / "calib", 8, 0))},
              "evaluation": {"source": str(samples(root / "eval", 6, 1)), "gate": {"cosine_mean": 0.9},
                             "latency": {"runs": 0}},
              "pipeline": [{"optimize": {}}, {"quantize": {"backend": "ort"}}]}
    run_dir = root / "run"
    qprep.run(config, output_dir=str(run_dir), force=True)
    return root, run_dir


@pytest.mark.slow  # a real (tiny) pipeline run with ORT quantization in the fixture
def test_reevaluate_measures_the_result_on_the_new_samples_only(finished_run):
    root, run_dir = finished_run
    before = {p.name: p.stat().st_mtime_ns for p in run_dir.iterdir()}
    heldout = samples(root / "heldout", 5, 2)
    result = reevaluate(run_dir, heldout)
    assert result["samples"]["count"] == 5 and result["samples"]["source"] == str(heldout)
    assert result["status"] == "ok" and result["gate"]["checks"][0]["metric"] == "cosine_mean"
    assert 0.9 < result["outputs"]["y"]["cosine_mean"] <= 1.0
    assert "latency" not in result and "layers" not in result
    assert {p.name: p.stat().st_mtime_ns for p in run_dir.iterdir()} == before  # the run is not touched
    # samples far outside the calibrated range: the same run's gate is missed there
    far = reevaluate(run_dir, samples(root / "far", 5, 3, scale=50.0), sets={"evaluation.gate": {"cosine_mean": 0.9999}})
    assert far["status"] == "gate missed" and not far["gate"]["passed"]


@pytest.mark.slow
def test_reevaluate_refuses_what_is_not_a_finished_onnx_run(finished_run, tmp_path):
    root, run_dir = finished_run
    with pytest.raises(ConfigError, match="no readable report.json and manifest.json"):
        reevaluate(tmp_path, root / "eval")
    copy = tmp_path / "rknn_run"
    copy.mkdir()
    report = json.loads((run_dir / "report.json").read_text())
    report["result"]["deployable"] = {"path": "model.rknn"}
    (copy / "report.json").write_text(json.dumps(report))
    (copy / "manifest.json").write_text((run_dir / "manifest.json").read_text())
    (copy / "model.onnx").write_bytes((run_dir / "model.onnx").read_bytes())
    with pytest.raises(ConfigError, match="simulator runs only inside the process that built it"):
        reevaluate(copy, root / "eval")


def recorded_run(root, reference=False, external=False):
    """A finished run's folder as `qprep evaluate` reads it (its result: the input model itself), its manifest
    recording the sha256 of the input model, of its external data file and of a reference model."""
    model = root / "m.onnx"
    onnx.save_model(tiny_conv_model(batch=1), str(model), save_as_external_data=external,
                    all_tensors_to_one_file=True, location="m.data", size_threshold=0)
    run = root / "run"
    run.mkdir()
    onnx.save(tiny_conv_model(batch=1), str(run / "model.onnx"))
    config = {"model": str(model)}
    inputs = {"model": {"path": str(model), "sha256": sha256_file(model)}}
    if external:
        inputs["model"]["data_files"] = {"m.data": sha256_file(root / "m.data")}
    if reference:
        onnx.save(tiny_conv_model(batch=1), str(root / "ref.onnx"))
        config["evaluation"] = {"source": str(root), "reference_model": str(root / "ref.onnx")}
        inputs["reference_model"] = {"path": str(root / "ref.onnx"), "sha256": sha256_file(root / "ref.onnx")}
    (run / "report.json").write_text(json.dumps({"status": "ok", "result": {"path": "model.onnx"},
                                                 "model": {"kind": "float"}}))
    results = {"model.onnx": sha256_file(run / "model.onnx")}
    (run / "manifest.json").write_text(json.dumps({"config": config, "inputs": inputs, "results": results}))
    return run


def replaced(path):
    """`path` rewritten with other weights: another export of the same graph."""
    if path.suffix == ".data":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x40
        path.write_bytes(bytes(data))
        return
    model = onnx.load(str(path))
    weight = model.graph.initializer[0]
    weight.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(weight) * 2, weight.name))
    onnx.save(model, str(path))


@pytest.mark.parametrize("which", ["m.onnx", "m.data", "ref.onnx", "run/model.onnx"])
def test_reevaluate_refuses_inputs_changed_since_the_run(tmp_path, which):
    """Issue #57: the reference was loaded from the recorded path whatever it held now; a model replaced since
    the run gave wrong figures (cosine 0.39, "gate missed") without a word."""
    run = recorded_run(tmp_path, reference=which == "ref.onnx", external=which == "m.data")
    heldout = samples(tmp_path / "heldout", 3, 2)
    assert reevaluate(run, heldout)["status"] == "ok"  # unchanged: judged
    replaced(tmp_path / which)
    with pytest.raises(ModelError, match=rf"^evaluate {run}: the [^\n]* {tmp_path / which} changed since the run "
                                         r"\(sha256 [0-9a-f]+…, the run read [0-9a-f]+…\); [^\n]*$"):
        reevaluate(run, heldout)


def test_reevaluate_judges_runs_that_recorded_no_digest(tmp_path):
    run = recorded_run(tmp_path)
    manifest = json.loads((run / "manifest.json").read_text())
    del manifest["inputs"]
    (run / "manifest.json").write_text(json.dumps(manifest))
    assert reevaluate(run, samples(tmp_path / "heldout", 3, 2))["status"] == "ok"


def test_new_samples_are_held_to_the_gate_the_run_recorded_with_its_fallback_target():
    """The fallback's target is the quantize stage's, recorded by the run's evaluation beside the configured
    gate; `qprep evaluate` reads it there, not by searching the config's pipeline again."""
    from qprep.pipeline.reevaluate import recorded_gate

    config = {"evaluation": {"gate": {"cosine_mean": 0.98}}, "pipeline": [{"quantize": {"fallback": {"target": {}}}}]}
    judged = {"evaluation": {"gate": {"passed": True, "target": {"cosine_mean": 0.98, "top1_agreement": 0.97}}}}
    assert recorded_gate(judged, config) == {"cosine_mean": 0.98, "top1_agreement": 0.97}
    floor = {"evaluation": {"gate": {"passed": True, "source": "floor", "target": {"cosine_mean": 0.9}}}}
    assert recorded_gate(floor, {"evaluation": {"gate": {}}}) == {}  # the config's floor applies again
    assert recorded_gate({}, config) == {"cosine_mean": 0.98}


def with_heldout(run, root):
    """The recorded run's config given evaluation and held-out folders and a gate, as a run with them records it."""
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["config"]["evaluation"] = {"source": str(samples(root / "eval", 3, 1)), "gate": {"cosine_mean": 0.9},
                                        "heldout": {"source": str(samples(root / "heldout", 3, 2))}}
    (run / "manifest.json").write_text(json.dumps(manifest))
    return run


def test_the_runs_own_heldout_folder_is_measured_and_said_to_repeat_the_report(tmp_path, cli):
    """Issue #59: `evaluate RUN --samples` on the run's held-out folder was refused with a line about
    evaluation.heldout and evaluation.source, keys the command did not take."""
    run = with_heldout(recorded_run(tmp_path), tmp_path)
    result = reevaluate(run, tmp_path / "heldout")
    assert result["status"] == "ok" and result["samples"]["count"] == 3
    assert "held-out samples (evaluation.heldout): the figures repeat the report's" in result["repeats"]
    assert "flatter" in reevaluate(run, tmp_path / "eval")["repeats"]
    code, out, err = cli("evaluate", run, "--samples", tmp_path / "heldout")
    assert code == 0 and "qprep: note: these are the run's held-out samples" in out, err


def test_the_samples_given_decide_the_gate_not_the_runs_heldout(tmp_path):
    """With the run's evaluation.heldout kept, the gate of `evaluate --samples NEW` was judged on the run's
    held-out samples while the command printed NEW's figures."""
    run = with_heldout(recorded_run(tmp_path), tmp_path)
    new = samples(tmp_path / "new", 4, 3)
    result = reevaluate(run, new)
    assert result["gate"]["judged_on"] == "evaluation" and "heldout" not in result
    assert result["samples"]["source"] == str(new) and "repeats" not in result


def test_an_rknn_run_is_refused_with_the_command_that_measures_it(tmp_path):
    """The refusal advised `evaluation.source`, which `qprep evaluate` does not take."""
    run = recorded_run(tmp_path)
    report = json.loads((run / "report.json").read_text())
    report["result"]["deployable"] = {"path": "model.rknn"}
    (run / "report.json").write_text(json.dumps(report))
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["inputs"]["config"] = {"path": "configs/rknn_int8.yaml"}
    (run / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError) as refused:
        reevaluate(run, "data/new")
    assert "evaluation.source" not in str(refused.value)
    assert "`qprep run configs/rknn_int8.yaml --set evaluation.heldout.source=data/new`" in str(refused.value)


def test_the_runs_calibration_folder_is_said_to_flatter_the_result(tmp_path, cli):
    """Issue #59: `evaluate RUN --samples <its calibration folder>` gave no note, while its evaluation folder did."""
    run = recorded_run(tmp_path)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["config"]["calibration"] = {"source": str(samples(tmp_path / "calib", 3, 0))}
    (run / "manifest.json").write_text(json.dumps(manifest))
    code, out, err = cli("evaluate", run, "--samples", tmp_path / "calib", "--json", tmp_path / "ev.json")
    note = "qprep: note: these samples are the run's calibration samples, on which the quantizer set its ranges"
    assert code == 0 and note in out, err
    assert "flatter the result" in json.loads((tmp_path / "ev.json").read_text())["notes"][0]
    code, out, err = cli("evaluate", run, "--samples", samples(tmp_path / "new", 3, 5))
    assert code == 0 and "calibration samples" not in out, err


def test_labels_print_top1_accuracy_on_the_terminal(tmp_path, cli):
    """Issue #59: `evaluate --labels F` printed the same lines as without; the accuracy was in --json only."""
    from onnx import helper

    from graphs import make_model

    run = recorded_run(tmp_path)
    classifier = make_model([helper.make_node("ReduceMean", ["x"], ["y"], axes=[2, 3], keepdims=0)],
                            [("x", [1, 3, 8, 8])], [("y", [1, 3])])
    for path in (tmp_path / "m.onnx", run / "model.onnx"):
        onnx.save(classifier, str(path))
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["inputs"]["model"]["sha256"] = sha256_file(tmp_path / "m.onnx")
    manifest["results"]["model.onnx"] = sha256_file(run / "model.onnx")
    (run / "manifest.json").write_text(json.dumps(manifest))
    folder = samples(tmp_path / "new", 3, 5)
    (folder / "labels.txt").write_text("".join(f"{i:02d}.npy {i % 3}\n" for i in range(3)))
    code, out, err = cli("evaluate", run, "--samples", folder, "--labels", folder / "labels.txt")
    assert code == 0 and "y: top-1 accuracy against labels: FP32 " in out and "(3 labelled)" in out, err


def test_an_rknn_refusal_never_offers_the_calibration_folder_as_held_out(tmp_path):
    """Issue #59: the refusal suggested `--set evaluation.heldout.source=data/calib`, which the run then warned
    about (the calibration samples)."""
    run = recorded_run(tmp_path)
    report = json.loads((run / "report.json").read_text())
    report["result"]["deployable"] = {"path": "model.rknn"}
    (run / "report.json").write_text(json.dumps(report))
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["config"]["calibration"] = {"source": str(tmp_path / "calib")}
    (run / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError) as refused:
        reevaluate(run, tmp_path / "calib")
    assert f"heldout.source={tmp_path / 'calib'}" not in str(refused.value)
    assert "holds the run's calibration samples" in str(refused.value)
    assert "--set evaluation.heldout.source=DIR`" in str(refused.value)


@pytest.mark.slow
@pytest.mark.parametrize("key", ["evaluation.source", "evaluation.heldout.source", "evaluation.labels", "output_dir",
                                 "evaluation"])
def test_a_set_of_what_evaluates_own_options_decide_is_refused(finished_run, key):
    """Issue #57: `evaluate RUN --samples data/eval --set evaluation.source=data/calib` measured the calibration
    samples and labelled the figures with data/eval."""
    root, run_dir = finished_run
    with pytest.raises(ConfigError, match=f"--set {key} is what evaluate's"):
        reevaluate(run_dir, root / "eval", sets={key: str(root / "calib")})
