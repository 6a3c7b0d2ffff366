"""What `qprep validate` and `qprep run` check and say before any stage runs (qprep/pipeline/preflight.py)."""

import numpy as np
import pytest
import onnx
import yaml
from PIL import Image

from graphs import tiny_conv_model


def test_image_preprocess_on_array_samples_is_said_to_be_ignored_by_validate_and_run(tmp_path, cli):
    """Issue #59: `preprocess: {layout: nhwc, mean: [0], std: [1]}` on .npz samples of an NCHW model passed
    validate, and the run recorded `preprocess: null`: set, it changed nothing, silently. Now one warning line
    per section that sets it; a section left at the defaults, or read as images, says nothing."""
    onnx.save(tiny_conv_model(batch=1), tmp_path / "m.onnx")
    for split in ("calib", "eval", "images"):
        (tmp_path / split).mkdir()
    for i in range(2):
        np.savez(tmp_path / "calib" / f"{i}.npz", x=np.ones((1, 3, 8, 8), np.float32))
        np.savez(tmp_path / "eval" / f"{i}.npz", x=np.ones((1, 3, 8, 8), np.float32))
        Image.new("RGB", (8, 8), (i, 2, 3)).save(tmp_path / "images" / f"{i}.png")
    preprocess = {"layout": "nhwc", "mean": [0], "std": [1]}
    config = {"model": "m.onnx", "output_dir": "run", "pipeline": [],
              "calibration": {"source": "calib", "preprocess": preprocess},
              "evaluation": {"source": "eval", "preprocess": {"channel_order": "rgb"}, "latency": {"runs": 0}}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    said = ("qprep: warning: calibration.preprocess (mean, std, layout) is ignored: the samples are not images "
            "(.npz arrays go into the model as stored); remove it, or point calibration.source at images")
    code, _, err = cli("validate", tmp_path / "c.yaml")
    assert code == 0 and [line for line in err.splitlines() if "preprocess" in line] == [said]
    code, _, err = cli("run", tmp_path / "c.yaml")
    assert code == 0 and [line for line in err.splitlines() if "preprocess" in line] == [said]
    config["calibration"]["source"] = "images"  # read as images: it applies
    config["calibration"]["preprocess"]["layout"] = "nchw"
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    code, _, err = cli("validate", tmp_path / "c.yaml")
    assert code == 0 and "is ignored" not in err


OPTIONS_NAMING_THE_GRAPH = {
    "keep_float.nodes": ({"keep_float": {"nodes": ["no_such_node"]}}, "keep_float.nodes[0]: no node named"),
    "keep_float.patterns": ({"keep_float": {"patterns": ["("]}}, "keep_float.patterns[0]: '(' is not a regular"),
    "keep_float.op_types": ({"keep_float": {"op_types": ["Bogus"]}}, "keep_float.op_types[0]: 'Bogus' is not"),
    "quantize.ort.nodes_to_exclude": ({"quantize": {"backend": "ort", "ort": {"nodes_to_exclude": ["Conv_99"]}}},
                                      "quantize.ort.nodes_to_exclude: no node named 'Conv_99'"),
}


@pytest.mark.parametrize("case", sorted(OPTIONS_NAMING_THE_GRAPH))
def test_an_option_naming_what_the_model_lacks_is_refused_before_the_run(tmp_path, cli, case):
    """Issue #57: validate passed these, then `run --force` cleared the previous good result and failed at the
    stage. Each stage's check_model refuses them on the model as loaded: validate exits 2, and a run leaves the
    previous run as it was."""
    stage, message = OPTIONS_NAMING_THE_GRAPH[case]
    onnx.save(tiny_conv_model(batch=1), tmp_path / "m.onnx")
    (tmp_path / "calib").mkdir()
    for i in range(2):
        np.save(tmp_path / "calib" / f"{i}.npy", np.ones((1, 3, 8, 8), np.float32))
    config = {"model": "m.onnx", "output_dir": "run", "calibration": {"source": "calib"},
              "pipeline": [{"quantize": {"backend": "ort"}}]}
    (tmp_path / "good.yaml").write_text(yaml.safe_dump(config))
    assert cli("run", tmp_path / "good.yaml")[0] == 0
    previous = (tmp_path / "run" / "model.onnx").read_bytes()
    pipeline = [stage] if "quantize" in stage else [stage, {"quantize": {"backend": "ort"}}]
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({**config, "pipeline": pipeline}))
    code, _, err = cli("validate", tmp_path / "bad.yaml")
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
    code, _, err = cli("run", tmp_path / "bad.yaml", "--force")
    assert code == 2 and message in err
    assert (tmp_path / "run" / "model.onnx").read_bytes() == previous


def test_evaluation_tasks_naming_an_output_the_model_lacks_is_refused(tmp_path, cli):
    """Issue #57: `evaluation.tasks: {scale_0.tmp1: tensor}` (a typo of the output's name) was taken, and the
    output judged by its shape without a word."""
    onnx.save(tiny_conv_model(batch=1), tmp_path / "m.onnx")
    (tmp_path / "calib").mkdir()
    for i in range(2):
        np.save(tmp_path / "calib" / f"{i}.npy", np.ones((1, 3, 8, 8), np.float32))
    output = onnx.load(tmp_path / "m.onnx").graph.output[0].name
    config = {"model": "m.onnx", "output_dir": "run", "calibration": {"source": "calib"}, "pipeline": [],
              "evaluation": {"source": "calib", "latency": {"runs": 0}, "tasks": {output + "x": "tensor"}}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    code, _, err = cli("validate", tmp_path / "c.yaml")
    assert code == 2 and f"evaluation.tasks: the model has no output '{output}x'; did you mean '{output}'?" in err
    config["evaluation"]["tasks"] = {output: "tensor"}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    assert cli("validate", tmp_path / "c.yaml")[0] == 0
