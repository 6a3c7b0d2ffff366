"""The command line as users meet it: exit codes, one-line errors, run directories, inspect."""

import argparse
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from graphs import tiny_conv_model


def write_config(tmp_path, model, calibration=None, extra=""):
    lines = [f"model: {model}", f"output_dir: {tmp_path / 'run'}"]
    if calibration:
        lines.append(f"calibration: {{source: {calibration}}}")
    path = tmp_path / "config.yaml"
    path.write_text("\n".join(lines) + "\n" + extra)
    return path


def one_line_error(code, err, expected_code=2):
    assert code == expected_code
    assert err.count("\n") == 1 and err.startswith("qprep: error: "), err
    assert "Traceback" not in err


def test_help(cli):
    with pytest.raises(SystemExit) as exit_info:
        cli("--help")
    assert exit_info.value.code == 0
    with pytest.raises(SystemExit) as exit_info:
        cli("run", "--help")
    assert exit_info.value.code == 0


def test_run_writes_run_directory_and_refuses_to_overwrite(tmp_path, save, cli):
    model = save(tiny_conv_model())
    before = model.read_bytes()
    config = write_config(tmp_path, model)
    code, out, err = cli("run", config, "--quiet")
    assert code == 0, err
    run = tmp_path / "run"
    assert sorted(p.name for p in run.iterdir()) == ["manifest.json", "model.onnx", "qprep.log", "report.html",
                                                     "report.json", "report.md"]
    report = json.loads((run / "report.json").read_text())
    assert report["status"] == "ok" and report["stages"] == [] and report["result"]["nodes"] == 2
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["inputs"]["model"]["sha256"] == report["model"]["sha256"]
    assert manifest["versions"]["onnx"] and "model.onnx" in manifest["files"]
    assert manifest["kind"] == "run" and manifest["run_id"] and manifest["status"] == "ok"
    assert model.read_bytes() == before  # the input model is never written to
    one_line_error(*cli("run", config, "--quiet")[::2])  # non-empty run dir without --force
    first = (run / "model.onnx").read_bytes()
    code, _, err = cli("run", config, "--quiet", "--force")
    assert code == 0, err
    assert (run / "model.onnx").read_bytes() == first  # same config + data → same bytes


def test_out_and_model_flags_override_config(tmp_path, save, cli, monkeypatch):
    model = save(tiny_conv_model(), "other.onnx")
    config = write_config(tmp_path, tmp_path / "missing.onnx")
    monkeypatch.chdir(tmp_path)
    code, _, err = cli("run", config, "--model", "other.onnx", "--out", "elsewhere", "--quiet")
    assert code == 0, err
    report = json.loads((tmp_path / "elsewhere" / "report.json").read_text())
    assert report["model"]["path"] == str(model)


def test_user_errors_are_one_line_with_exit_2(tmp_path, save, cli):
    model = save(tiny_conv_model())
    bad_key = tmp_path / "bad.yaml"
    bad_key.write_text(f"model: {model}\noutput_dir: {tmp_path / 'r1'}\ncalibraton: {{source: x}}\n")
    code, _, err = cli("run", bad_key)
    one_line_error(code, err)
    assert "calibraton: unknown key; did you mean 'calibration'?" in err

    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(model.read_bytes()[:100])
    code, _, err = cli("run", write_config(tmp_path, truncated))
    one_line_error(code, err)
    assert "truncated or corrupt" in err

    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = cli("run", write_config(tmp_path, model, empty), "--force")
    one_line_error(code, err)
    assert "holds no samples" in err

    mismatch = tmp_path / "mismatch"
    mismatch.mkdir()
    np.savez(mismatch / "0.npz", x=np.zeros((1, 3, 9, 9), np.float32))
    code, _, err = cli("run", write_config(tmp_path, model, mismatch), "--force")
    one_line_error(code, err)
    assert "input 'x' has shape [1, 3, 9, 9]" in err


@pytest.mark.slow
def test_console_script_shows_no_traceback_and_debug_does(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("model: m.onnx\nthreads: many\n")
    qprep = [sys.executable, "-m", "qprep"]
    plain = subprocess.run([*qprep, "validate", str(config)], capture_output=True, text=True, cwd=tmp_path)
    assert plain.returncode == 2 and plain.stderr == "qprep: error: threads: expected an integer, got str 'many'\n"
    debug = subprocess.run([*qprep, "validate", str(config), "--debug"], capture_output=True, text=True)
    assert debug.returncode == 2 and "Traceback" in debug.stderr
    assert os.listdir(tmp_path) == ["c.yaml"]  # nothing written to the caller's directory


def test_validate_checks_files(tmp_path, save, cli):
    model = save(tiny_conv_model())
    code, out, _ = cli("validate", write_config(tmp_path, model))
    assert code == 0 and "is valid" in out
    code, _, err = cli("validate", write_config(tmp_path, model, tmp_path / "nodata"))
    one_line_error(code, err)


def test_inspect_json_and_text(tmp_path, save, cli):
    model = save(tiny_conv_model())
    code, out, _ = cli("inspect", model, "--json")
    info = json.loads(out)
    assert code == 0 and info["kind"] == "float" and info["op_counts"] == {"Conv": 1, "Relu": 1}
    assert info["inputs"] == [{"name": "x", "dtype": "float32", "shape": ["N", 3, 8, 8]}]
    code, out, _ = cli("inspect", model)
    assert "kind:     float" in out and "x: float32 [N, 3, 8, 8]" in out


def test_python_api_mirrors_cli(tmp_path, save):
    import qprep

    model = save(tiny_conv_model())
    report = qprep.run({"model": str(model)}, output_dir=str(tmp_path / "api"), inputs__x=[1, 3, 8, 8])
    assert report["status"] == "ok"
    assert report["load"]["inputs"][0]["shape"] == [1, 3, 8, 8]
    assert (tmp_path / "api" / "model.onnx").is_file()


def test_an_output_dir_that_would_overwrite_the_input_model_is_refused(tmp_path, cli):
    import onnx

    folder = tmp_path / "m"
    folder.mkdir()
    onnx.save(tiny_conv_model(), str(folder / "model.onnx"))
    before = (folder / "model.onnx").read_bytes()
    code, _, err = cli("run", write_config(tmp_path, folder / "model.onnx"), "--out", folder, "--force")
    one_line_error(code, err)
    assert "holds the input model" in err and (folder / "model.onnx").read_bytes() == before


def test_same_config_and_data_give_the_same_bytes_through_optimize_and_quantize(tmp_path, save, cli):
    model = save(tiny_conv_model())
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    for i in range(4):
        np.save(data / f"{i}.npy", rng.standard_normal((1, 3, 8, 8)).astype(np.float32))
    config = write_config(tmp_path, model, data, "pipeline: [optimize, quantize]\n")
    outputs = []
    for run in ("a", "b"):
        code, _, err = cli("run", config, "--out", tmp_path / run, "--quiet")
        assert code == 0, err
        outputs.append((tmp_path / run / "model.onnx").read_bytes())
    assert outputs[0] == outputs[1]
    mode = (tmp_path / "a" / "report.json").stat().st_mode
    assert mode & 0o644 == 0o644  # owner writes, everyone reads (mkstemp's 0600 undone)


def test_duplicate_node_names_in_the_input_do_not_break_the_evaluation(tmp_path, save, cli):
    """ORT refuses duplicate node names; the loader renames, and the evaluation's reference is that model."""
    model = tiny_conv_model()
    for node in model.graph.node:
        node.name = "same"
    path = save(model)
    data = tmp_path / "data"
    data.mkdir()
    for i in range(3):
        np.save(data / f"{i}.npy", np.random.default_rng(i).standard_normal((1, 3, 8, 8)).astype(np.float32))
    extra = (f"evaluation: {{source: {data}, latency: {{runs: 0}}}}\npipeline: [optimize, quantize]\n")
    code, _, err = cli("run", write_config(tmp_path, path, data, extra), "--quiet")
    assert code == 0, err
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["evaluation"]["outputs"]["y"]["cosine_mean"] > 0.99


def test_run_log_keeps_toolkit_warnings_but_not_library_chatter(tmp_path):
    """onnx_ir/onnxscript log an INFO line per pass over the graph (90% of a run's log), ORT's quantizer one per
    tensor: only their warnings reach the log."""
    import logging

    from qprep.run_log import attach_log, detach_log, toolkit_logging_to_run_log

    handler = attach_log(tmp_path)
    try:
        with toolkit_logging_to_run_log():
            logging.getLogger("onnx_ir.passes.common").info("pass ran")
            logging.getLogger("onnxscript.rewriter").warning("rule failed")
            logging.info("Quantization parameters for tensor:\"t\" not specified")
            logging.warning("calibration data has one sample")
    finally:
        detach_log(handler)
    log = (tmp_path / "qprep.log").read_text()
    assert "pass ran" not in log and "rule failed" in log
    assert "Quantization parameters" not in log and "calibration data has one sample" in log
    assert logging.getLogger("onnx_ir").level == logging.NOTSET  # restored after the toolkit call


def test_validate_lists_every_independent_problem_and_run_stops_at_the_first(tmp_path, cli):
    import onnx

    from graphs import tiny_conv_model

    onnx.save(tiny_conv_model(batch=1), tmp_path / "m.onnx")
    (tmp_path / "c.yaml").write_text(
        "model: m.onnx\ncalibration: {source: nowhere/calib}\n"
        "evaluation: {source: nowhere/eval, heldout: {source: nowhere/heldout}}\npipeline: [{quantize: {}}]\n")
    code, _, err = cli("validate", str(tmp_path / "c.yaml"))
    assert code == 2
    assert [line.split(":")[2].strip() for line in err.splitlines()] == [
        "calibration.source", "evaluation.source", "evaluation.heldout.source"]
    code, _, err = cli("run", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "run"))
    assert code == 2 and len(err.splitlines()) == 1 and "calibration.source" in err


# Options that are not paths (values, choices, flags); every other argument of every command names a path and must
# say whether the command reads or writes it, so the CLI's guard sees it (qprep/disk/guard.py).
NOT_PATHS = {"help", "version", "command", "sets", "force", "strict", "json", "backend", "jobs", "executor", "address",
             "recursive", "resume", "timeout", "fail_on_regression", "torch", "torch_index", "dry_run", "shell",
             "schema", "debug", "quiet"}


def test_every_path_argument_of_every_command_is_typed_input_or_output():
    from qprep.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    untyped = [f"{name} {action.dest}" for name, sub in commands.items() for action in sub._actions
               if action.dest not in NOT_PATHS and getattr(action.type, "role", None) is None]
    assert untyped == []


def test_validate_names_a_run_directory_problem_once(tmp_path, cli):
    """The run directory is checked before the model is read and again with what reading finds (external data,
    listed samples); `validate` lists every problem, so the same one must not come twice."""
    import onnx

    onnx.save(tiny_conv_model(), str(tmp_path / "model.onnx"))
    config = tmp_path / "c.yaml"
    config.write_text(f"model: {tmp_path / 'model.onnx'}\noutput_dir: {tmp_path}\n")
    code, _, err = cli("validate", config)
    assert code == 2 and err.count("holds the input model") == 1, err


def test_the_run_line_names_the_deployed_file(tmp_path, save, cli, monkeypatch):
    """Issue #59: an RKNN run's closing line ("gate missed: model.onnx in …") named the float model the .rknn
    was built from, not the file to deploy."""
    import qprep.pipeline.runner

    config = write_config(tmp_path, save(tiny_conv_model()))
    gate = {"passed": False, "source": "config", "checks": [{"metric": "cosine_mean", "value": 0.9, "threshold": 0.99,
                                                             "passed": False}]}
    report = {"status": "gate missed", "run_dir": str(tmp_path / "run"), "seconds": 1.0, "stages": [],
              "warnings": [], "model": {"nodes": 2}, "evaluation": {"gate": gate},
              "result": {"path": "model.onnx", "nodes": 3, "deployable": {"path": "model.rknn"}}}
    monkeypatch.setattr(qprep.pipeline.runner, "execute", lambda *args, **kwargs: report)
    code, out, err = cli("run", config)
    assert code == 1 and out.startswith("qprep: gate missed: model.rknn in "), out
