"""Fault suite, the run directory: input safety under --force, checks before anything is touched, one run per
directory, signals. Each case runs the real CLI and asserts the exit code, one stderr line, the inputs
unchanged and the previous run intact (tests/pipeline/faults.py)."""

from __future__ import annotations

import fcntl
import json
import os
import signal

import numpy as np
import pytest

from faults import assert_one_line, digests, interrupt, project, qprep, start, wait_for

pytestmark = pytest.mark.slow  # real models or the CLI in subprocesses: `pytest -m "not slow"` skips them


def previous_run(out):
    """The run directory's files and their sha256 (the lock file is rewritten by every attempt: left out)."""
    return {k: v for k, v in digests(out).items() if not k.endswith(".qprep.lock")}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A project with a finished run that kept its stage models (stages/ and work/ exist)."""
    p = project(tmp_path_factory.mktemp("finished"))
    outcome = qprep("run", p.config, "--quiet", "--set", "save_stage_models=true")
    assert outcome.code == 0, outcome.err
    return p


@pytest.mark.parametrize("inside", ["stages/01_quantize.onnx", "model.onnx"])
def test_force_never_deletes_an_input_that_lies_in_the_run_directory(finished, inside):
    """Issue #18.1: the input was the previous run's file, --force deleted it, then 'model file not found'."""
    p = finished
    before = previous_run(p.out)
    outcome = qprep("run", p.config, "--model", p.out / inside, "--force")
    assert_one_line(outcome, 2, "holds the input model", "elsewhere")
    assert previous_run(p.out) == before


@pytest.mark.parametrize("key", ["calibration", "evaluation"])
def test_force_never_deletes_data_that_lies_in_the_run_directory(tmp_path, key):
    p = project(tmp_path)
    assert qprep("run", p.config, "--quiet").code == 0
    data = p.out / "work" / "data"
    data.mkdir(parents=True)
    np.save(data / "0.npy", np.zeros((1, 3, 8, 8), np.float32))
    before = previous_run(p.out)
    config = p.write_config(**{key: {"source": str(data)}})
    outcome = qprep("run", config, "--force")
    assert_one_line(outcome, 2, f"holds the {key} data")
    assert previous_run(p.out) == before


def broken(p, case: str) -> dict:
    """Config changes that make one input bad; every one is found before the run directory is touched."""
    bad = p.root / "bad"
    bad.mkdir(exist_ok=True)
    if case == "mistyped --model":
        return {"model": str(p.root / "modle.onnx")}
    if case == "missing evaluation folder":
        return {"evaluation": {"source": str(p.root / "evl")}}
    if case == "NaN in an evaluation sample":
        np.save(bad / "0.npy", np.full((1, 3, 8, 8), np.nan, np.float32))
        return {"evaluation": {"source": str(bad)}}
    if case == "NaN in a calibration sample":
        np.save(bad / "0.npy", np.full((1, 3, 8, 8), np.inf, np.float32))
        return {"calibration": {"source": str(bad)}}
    if case == "missing labels file":
        return {"evaluation": {"source": str(p.evaluation), "labels": str(p.root / "no_labels.txt")}}
    if case == "a sample without a label":
        (p.root / "labels.txt").write_text("0.npy 1\n")
        return {"evaluation": {"source": str(p.evaluation), "labels": str(p.root / "labels.txt")}}
    if case == "corrupt reference model":
        (bad / "ref.onnx").write_bytes(p.model.read_bytes()[:60])
        return {"evaluation": {"source": str(p.evaluation), "reference_model": str(bad / "ref.onnx")}}
    if case == "evaluation samples of the wrong shape":
        np.save(bad / "0.npy", np.zeros((1, 3, 9, 9), np.float32))
        return {"evaluation": {"source": str(bad)}}
    if case == "fallback without evaluation":
        return {"evaluation": None, "pipeline": [{"quantize": {"fallback": {"target": {"cosine_mean": 0.99}}}}]}
    if case == "quantize without calibration":
        return {"calibration": None}
    raise AssertionError(case)


BROKEN = {"mistyped --model": "model file not found", "missing evaluation folder": "evaluation.source",
          "NaN in an evaluation sample": "NaN/Inf", "NaN in a calibration sample": "NaN/Inf",
          "missing labels file": "evaluation.labels: file not found",
          "a sample without a label": "has no label for 1.npy", "corrupt reference model": "ref.onnx",
          "evaluation samples of the wrong shape": "dim 2 must be 8", "fallback without evaluation": "needs `evaluation:`",
          "quantize without calibration": "calibration data is required"}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_bad_inputs_are_found_before_force_clears_the_previous_run(finished, case):
    """Issue #18.2/.3: each of these failed after minutes of work, or after --force had cleared a good run."""
    p = finished
    before, inputs = previous_run(p.out), p.inputs()
    config = p.write_config(f"{case.replace(' ', '_')}.yaml", **broken(p, case))
    outcome = qprep("run", config, "--force")
    assert_one_line(outcome, 2, BROKEN[case])
    assert previous_run(p.out) == before and p.inputs() == inputs
    assert_one_line(qprep("validate", config), 2, BROKEN[case])  # validate makes the same checks


def test_validate_accepts_a_dataset_list_that_run_accepts(tmp_path):
    p = project(tmp_path)
    (p.root / "dataset.txt").write_text("calib/0.npy\ncalib/1.npy\n")
    config = p.write_config(calibration={"source": "dataset.txt"})
    outcome = qprep("validate", config)
    assert outcome.code == 0, outcome.err
    assert qprep("run", config, "--quiet").code == 0


def test_validate_refuses_rknn_when_the_toolkit_is_missing(tmp_path, cli, monkeypatch):
    import importlib.util

    p = project(tmp_path)
    config = p.write_config(pipeline=[{"quantize": {"backend": "rknn"}}])
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "rknn" else real(name, *a))
    code, _, err = cli("validate", config)
    assert code == 2 and err.count("\n") == 1 and "rknn-toolkit2, which is not installed" in err and "`qprep setup rknn`" in err


def test_force_refuses_a_folder_that_holds_no_qprep_run(tmp_path):
    p = project(tmp_path)
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    (folder / "report.json").write_text("{}")
    before = digests(folder)
    outcome = qprep("run", p.config, "--out", folder, "--force")
    assert_one_line(outcome, 2, "no qprep run wrote")
    assert previous_run(folder) == before


def test_force_after_a_corrupt_manifest_removes_nothing(tmp_path):
    """Ownership is proven by the manifest, never inferred from names (issue #57): a folder whose manifest is
    unreadable is not known to be a run, so --force refuses it and everything in it stays."""
    p = project(tmp_path)
    assert qprep("run", p.config, "--quiet", "--set", "save_stage_models=true").code == 0
    (p.out / "manifest.json").write_text("{")
    before = previous_run(p.out)
    outcome = qprep("run", p.config, "--force")
    assert_one_line(outcome, 2, "no qprep run wrote")
    assert previous_run(p.out) == before


def test_force_after_a_killed_run_replaces_it(tmp_path):
    """A run killed outright wrote no final manifest; its first one (written before anything else) lists what it
    may write, so --force still replaces it, stage models included."""
    p = project(tmp_path)
    assert qprep("run", p.config, "--quiet", "--set", "save_stage_models=true").code == 0
    manifest = json.loads((p.out / "manifest.json").read_text())
    (p.out / "manifest.json").write_text(json.dumps({**manifest, "status": "running", "files": [
        "model.onnx", "model.onnx.data", "report.json", "report.md", "report.html", "manifest.json", "qprep.log",
        "work", "stages"]}))
    outcome = qprep("run", p.config, "--quiet", "--force")
    assert outcome.code == 0, outcome.err
    assert not (p.out / "stages").exists()


def test_force_after_a_stage_models_run_leaves_no_empty_stages_folder(tmp_path):
    p = project(tmp_path)
    assert qprep("run", p.config, "--quiet", "--set", "save_stage_models=true").code == 0
    outcome = qprep("run", p.config, "--quiet", "--force")
    assert outcome.code == 0, outcome.err
    assert not (p.out / "stages").exists()
    files = json.loads((p.out / "manifest.json").read_text())["files"]
    assert sorted({name.split("/")[0] for name in files}) == [  # work/: what the run wrote there, never the folder
        "manifest.json", "model.onnx", "qprep.log", "report.html", "report.json", "report.md", "work"]
    assert "work" not in files and not any(name.startswith("stages") for name in files)


@pytest.mark.parametrize("force", [False, True])
def test_a_run_directory_in_use_is_refused(tmp_path, force):
    """Issue #18.5: a second run on the same --out (with or without --force) waits for no one and clears
    nothing: exit 2, 'in use by pid N'."""
    p = project(tmp_path)
    assert qprep("run", p.config, "--quiet").code == 0
    before = previous_run(p.out)
    manifest = json.loads((p.out / "manifest.json").read_text())
    (p.out / "manifest.json").write_text(json.dumps({**manifest, "pid": 4242}))  # as a running run's says
    before = previous_run(p.out)
    holder = os.open(p.out, os.O_RDONLY | os.O_DIRECTORY)  # a run locks its folder itself (qprep/disk/owned.py)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        outcome = qprep("run", p.config, *(["--force"] if force else []))
    finally:
        os.close(holder)
    assert_one_line(outcome, 2, "in use by pid 4242")
    assert previous_run(p.out) == before


def slow(p):
    """The project's config with an evaluation that times 10⁶ runs of each model: a run that stays in its
    evaluation (model.onnx written, report not) for as long as a test needs to signal it."""
    return p.write_config("slow.yaml", evaluation={"source": "eval",
                                                   "latency": {"runs": 1_000_000, "rounds": 1, "within": 0}})


def in_evaluation(p) -> bool:
    """The run's own checkpoint says it reached its evaluation (model.onnx alone is written just before that
    checkpoint: a signal in between finds the run still in its last stage)."""
    try:
        return json.loads((p.out / "report.json").read_text()).get("step") == "evaluation"
    except (OSError, ValueError):
        return False


def test_two_runs_at_once_on_one_directory(tmp_path):
    p = project(tmp_path)
    first = start("run", slow(p), "--quiet")
    try:
        assert wait_for(lambda: in_evaluation(p)), "the first run never reached its evaluation"
        second = qprep("run", p.config, "--force")
        assert_one_line(second, 2, f"in use by pid {first.pid}")
    finally:
        outcome = interrupt(first, signal.SIGTERM)
    assert outcome.code == 128 + signal.SIGTERM
    log = (p.out / "qprep.log").read_text()
    assert log.count("run started") == 1 and (p.out / "model.onnx").exists()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_leaves_a_report_and_manifest(tmp_path, sig):
    """Issue #18.6: SIGTERM (timeout, kill, process managers) left nothing and printed nothing."""
    p = project(tmp_path)
    inputs = p.inputs()
    run = start("run", slow(p))
    assert wait_for(lambda: in_evaluation(p))
    outcome = interrupt(run, sig)
    assert_one_line(outcome, 128 + sig, f"interrupted by {signal.Signals(sig).name}")
    report = json.loads((p.out / "report.json").read_text())
    assert report["status"] == "interrupted" and signal.Signals(sig).name in report["error"]
    assert "model.onnx" in json.loads((p.out / "manifest.json").read_text())["files"]
    assert p.inputs() == inputs


def test_sigkill_then_force_starts_clean(tmp_path):
    """A run killed outright leaves the report of the stage it was in; --force then replaces it."""
    p = project(tmp_path)
    run = start("run", slow(p), "--quiet", "--set", "save_stage_models=true")
    assert wait_for(lambda: in_evaluation(p))
    os.kill(run.pid, signal.SIGKILL)
    run.wait(timeout=60)
    report = json.loads((p.out / "report.json").read_text())
    assert report["status"] == "running" and report["step"] == "evaluation"
    outcome = qprep("run", p.config, "--quiet", "--force")
    assert outcome.code == 0, outcome.err
    assert json.loads((p.out / "report.json").read_text())["status"] == "ok"
    assert not (p.out / "stages").exists()
    assert (p.out / "qprep.log").read_text().count("run started") == 1


def test_a_batch_timeout_lets_the_model_write_its_report(tmp_path):
    """A timed-out model gets SIGTERM first, so its run directory says it was interrupted and where."""
    p = project(tmp_path)
    models = tmp_path / "models"
    models.mkdir()
    p.model.rename(models / "tiny.onnx")
    outcome = qprep("batch", slow(p), models, "--out", tmp_path / "batch", "--timeout", 8)
    assert outcome.code == 2
    row, = json.loads((tmp_path / "batch" / "summary.json").read_text())["models"]
    assert row["status"] == "failed" and "timed out after 8 s" in row["error"]
    report = json.loads((tmp_path / "batch" / "tiny" / "report.json").read_text())
    assert report["status"] == "interrupted" and report["error"] == "interrupted by SIGTERM"
    assert report["step"] in ("stage 0 optimize", "stage 1 quantize", "evaluation")  # a loaded machine is slower


def test_force_never_deletes_external_data_that_lies_in_the_run_directory(tmp_path):
    """The model file is outside --out, but the weights it reads are inside: refused like the model itself."""
    import onnx
    from onnx.external_data_helper import convert_model_to_external_data

    p = project(tmp_path)
    model = onnx.load(str(p.model))
    convert_model_to_external_data(model, location="out/weights.bin", size_threshold=0)
    (p.out).mkdir()
    onnx.save(model, str(p.model))
    before = p.inputs()
    outcome = qprep("run", p.config, "--force")
    assert_one_line(outcome, 2, "holds the input model's external data weights.bin")
    assert p.inputs() == before and (p.out / "weights.bin").is_file()


def test_force_replaces_a_run_interrupted_right_after_its_claim(tmp_path):
    """A run interrupted before its first stage had cleared the previous run's work/ort/ but left work/ empty and
    unlisted: every later --force was refused ("holds work, which its previous qprep run did not write"). Empty
    folders are pruned as the previous run is cleared, and a run's manifest lists its folders from the start."""
    from qprep.pipeline import run_dir

    p = project(tmp_path)
    assert qprep("run", p.config, "--quiet").code == 0
    run_dir.claim(p.out, force=True).release()  # what a Ctrl-C right after the claim leaves
    outcome = qprep("run", p.config, "--quiet", "--force")
    assert outcome.code == 0, outcome.err
