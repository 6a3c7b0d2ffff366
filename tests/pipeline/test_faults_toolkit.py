"""Issue #18 item 4 (and part of 11): a third-party toolkit that crashes, or gets a model it cannot take.

rknn-toolkit2 aborts the whole process (SIGABRT from C++, "Can not find quantize information!") on a model
with no float tensor; qprep runs it in a worker process, so a crash becomes one line, a failed report and a
manifest. Models with nothing to quantize are refused (rknn) or passed through (ort) before any toolkit runs.
"""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import numpy as np
import onnx
import pytest
import yaml
from onnx import helper, numpy_helper

from graphs import make_model
from faults import Outcome, assert_one_line, digests, interrupt, project, qprep, start, wait_for

pytestmark = pytest.mark.slow  # real models or the CLI in subprocesses: `pytest -m "not slow"` skips them

WORKER_LINE = re.compile(r"rknn-toolkit2 worker started \(pid (\d+)\)")


def integer_project(root: Path, backend: str) -> tuple[Path, Path]:
    """ids:int64[N,4] → Add(3) → Mul(itself) → y:int64: nothing float anywhere; .npy calibration/evaluation,
    `inputs:` fixed. → (config path, model path)."""
    root.mkdir(parents=True, exist_ok=True)
    model = root / "int.onnx"
    onnx.save(make_model([helper.make_node("Add", ["ids", "three"], ["a"], name="add"),
                          helper.make_node("Mul", ["a", "a"], ["y"], name="mul")],
                         [("ids", ["N", 4], np.int64)], [("y", ["N", 4], np.int64)],
                         {"three": np.array([[3]], np.int64)}, name="integers", infer_shapes=False), str(model))
    for name in ("calib", "eval"):
        (root / name).mkdir(exist_ok=True)
        for i in range(4):
            np.save(root / name / f"{i}.npy", np.arange(4, dtype=np.int64).reshape(1, 4) + i)
    config = root / "config.yaml"
    config.write_text(yaml.safe_dump({
        "model": "int.onnx", "output_dir": "out", "inputs": {"ids": [1, 4]}, "calibration": {"source": "calib"},
        "evaluation": {"source": "eval", "latency": {"runs": 0}},
        "pipeline": [{"quantize": {"backend": backend}}]}, sort_keys=False))
    return config, model


def rknn_project(tmp_path: Path):
    pytest.importorskip("rknn.api", reason="rknn-toolkit2 is not installed (scripts/setup.sh or `qprep setup rknn` installs it)")
    tiny = project(tmp_path / "p")
    config = tiny.write_config(pipeline=[{"quantize": {"backend": "rknn"}}], inputs={"x": [1, 3, 8, 8]})
    return tiny, config


def worker_pid(run_log: Path, timeout: float = 120) -> int:
    """The pid of the rknn-toolkit2 worker, as qprep.log records it when it starts."""
    found = []

    def started() -> bool:
        match = WORKER_LINE.search(run_log.read_text(errors="replace")) if run_log.exists() else None
        if match:
            found.append(int(match.group(1)))
        return bool(match)

    assert wait_for(started, timeout=timeout), f"no worker started ({run_log})"
    return found[0]


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_integer_only_model_on_rknn_is_refused_before_the_toolkit(tmp_path):
    pytest.importorskip("rknn.api", reason="rknn-toolkit2 is not installed (scripts/setup.sh or `qprep setup rknn` installs it)")
    config, model = integer_project(tmp_path, "rknn")
    before = digests(model, tmp_path / "calib", config)
    outcome = qprep("run", config, "--quiet", cwd=tmp_path)
    assert_one_line(outcome, 2, "computes no float tensors", "nothing to quantize", "drop the quantize stage")
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["status"] == "failed" and "computes no float tensors" in report["error"]
    assert (tmp_path / "out" / "manifest.json").is_file()
    assert not (tmp_path / "out" / "work" / "rknn" / "rknn-toolkit.log").exists()  # the toolkit never ran
    assert digests(model, tmp_path / "calib", config) == before


@pytest.mark.parametrize("backend", ["ort", "fp16"])
def test_integer_only_model_through_ort_or_fp16_is_skipped_with_a_warning_and_nothing_on_stderr(tmp_path, backend):
    config, model = integer_project(tmp_path, backend)
    outcome = qprep("run", config, cwd=tmp_path)
    assert outcome.code == 0 and only_qprep_warnings(outcome.err), outcome.err  # no ORT line leaking from C++
    assert outcome.out.startswith("qprep: ok:")
    assert "qprep: warning: quantize: nothing to quantize" in outcome.err or "nothing to quantize" in outcome.err
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    stage = report["stages"][0]
    assert stage["status"] == "skipped" and stage["reason"] == "nothing to quantize (the model computes no float tensors)"
    assert any("nothing to quantize" in w for w in report["warnings"])
    written = onnx.load(str(tmp_path / "out" / "model.onnx"))
    assert [n.op_type for n in written.graph.node] == ["Add", "Mul"]  # passed through unchanged


def test_ort_warnings_from_its_calibration_sessions_stay_off_the_terminal(tmp_path):
    """A float model with an unused weight: ORT's calibrator session logs "Removing initializer ..." from C++."""
    tiny = project(tmp_path / "p", pipeline=("quantize",))
    model = onnx.load(str(tiny.model))
    model.graph.initializer.append(numpy_helper.from_array(np.zeros(3, np.float32), "unused"))
    onnx.save(model, str(tiny.model))
    outcome = qprep("run", tiny.write_config(inputs={"x": [1, 3, 8, 8]}), cwd=tiny.root)
    assert outcome.code == 0 and only_qprep_warnings(outcome.err), outcome.err
    assert outcome.out.startswith("qprep: ok:")


def only_qprep_warnings(stderr: str) -> bool:
    """stderr holds qprep's own warning lines (the report's warnings, echoed) and nothing a toolkit wrote."""
    return all(line.startswith("qprep: warning: ") or line.startswith("qprep: ") and "more warnings" in line
               for line in stderr.splitlines())


def test_real_toolkit_abort_becomes_a_toolkit_error_naming_step_signal_and_its_error(tmp_path):
    """The crash itself, not refused first: rknn.quantize called directly on the integer-only model makes
    rknn-toolkit2 abort in build. The test process survives and gets one line."""
    pytest.importorskip("rknn.api", reason="rknn-toolkit2 is not installed (scripts/setup.sh or `qprep setup rknn` installs it)")
    from conftest import typed
    from qprep.quantize.backend import QuantizeJob
    from qprep.quantize import rknn
    from qprep.data import load_samples
    from qprep.errors import EXIT_INTERNAL, ToolkitError
    from qprep.model.info import graph_inputs

    _, path = integer_project(tmp_path, "rknn")
    model = onnx.load(str(path))
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 1
    calibration = load_samples({"source": str(tmp_path / "calib"), "format": "auto", "max_samples": 4, "seed": 0,
                                "preprocess": {}}, graph_inputs(model))
    (tmp_path / "work").mkdir()
    options = typed("rknn", analysis_samples=0, weight_rounding="nearest")
    job = QuantizeJob(model=model, calibration=calibration, max_samples=4, float_set=frozenset(), options=options,
                      work_dir=tmp_path / "work")
    with pytest.raises(ToolkitError) as caught:
        rknn.quantize(job)
    message = str(caught.value)
    assert caught.value.exit_code == EXIT_INTERNAL and caught.value.crashed and "\n" not in message
    assert message.startswith("rknn-toolkit2 crashed (SIGABRT) in build: Can not find quantize information!")
    assert f"(toolkit log: {tmp_path / 'work' / 'rknn-toolkit.log'})" in message


def test_toolkit_worker_killed_mid_run_gives_one_line_a_failed_report_and_a_manifest(tmp_path):
    tiny, config = rknn_project(tmp_path)
    before = tiny.inputs()
    process = start("run", config, "--quiet", cwd=tiny.root)
    os.kill(worker_pid(tiny.out / "qprep.log"), signal.SIGABRT)
    out, err = process.communicate(timeout=300)
    outcome = Outcome(process.returncode, out, err)
    assert_one_line(outcome, 3, "rknn-toolkit2 crashed (SIGABRT) in ", "toolkit log: ")
    report = json.loads((tiny.out / "report.json").read_text())
    assert report["status"] == "failed" and report["error"] in outcome.err
    assert report["stages"][0]["status"] == "failed"
    assert (tiny.out / "manifest.json").is_file()
    assert tiny.inputs() == before


def test_toolkit_worker_does_not_outlive_its_parent(tmp_path):
    """Killed outright (no chance to clean up), qprep's worker goes with it (PR_SET_PDEATHSIG); interrupted,
    qprep stops its worker and reports the interruption."""
    tiny, config = rknn_project(tmp_path)
    process = start("run", config, "--quiet", cwd=tiny.root)
    pid = worker_pid(tiny.out / "qprep.log")
    process.kill()
    process.communicate(timeout=60)
    assert wait_for(lambda: not alive(pid), timeout=30), f"worker {pid} outlived its killed parent"

    process = start("run", config, "--quiet", "--out", "again", cwd=tiny.root)
    pid = worker_pid(tiny.root / "again" / "qprep.log")
    # once the toolkit is at work: a Ctrl-C while the parent still imports a C extension surfaces as an
    # ImportError ("initialization failed"), a different fault from the one tested here
    toolkit_log = tiny.root / "again" / "work" / "rknn" / "rknn-toolkit.log"
    assert wait_for(lambda: toolkit_log.exists() and toolkit_log.stat().st_size > 0, timeout=120)
    outcome = interrupt(process, signal.SIGINT)
    assert outcome.code == 130, outcome.err
    assert wait_for(lambda: not alive(pid), timeout=30), f"worker {pid} outlived an interrupted run"
    assert json.loads((tiny.root / "again" / "report.json").read_text())["status"] == "interrupted"
