"""A model qprep's graph library cannot read (a ZipMap's map output) is refused alike by every command that would
read its graph: inspect and init reached onnx-ir and crashed (exit 3) while validate and run refused it in one
line."""

from __future__ import annotations

import numpy as np
import onnx
import yaml
from onnx import TensorProto, helper

from graphs import rand

REFUSAL = "'probabilities' is a map or a sequence of maps (a ZipMap's output)"


def zipmap_model() -> onnx.ModelProto:
    """x[1, 2] → Softmax → p (a tensor output) and ZipMap(p) → probabilities (a sequence of maps)."""
    zipmap = helper.make_node("ZipMap", ["p"], ["probabilities"], domain="ai.onnx.ml", classlabels_int64s=[0, 1])
    seq_map = helper.make_sequence_type_proto(
        helper.make_map_type_proto(TensorProto.INT64, helper.make_tensor_type_proto(TensorProto.FLOAT, [])))
    graph = helper.make_graph([helper.make_node("Softmax", ["x"], ["p"]), zipmap], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
                              [helper.make_tensor_value_info("p", TensorProto.FLOAT, [1, 2]),
                               helper.make_value_info("probabilities", seq_map)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid("ai.onnx.ml", 1)])


def _config(tmp_path, stages: list, out: str) -> str:
    config = {"model": str(tmp_path / "m.onnx"), "calibration": {"source": str(tmp_path / "data" / "calib")},
              "evaluation": {"source": str(tmp_path / "data" / "eval"), "layers": False, "latency": {"runs": 0}},
              "output_dir": str(tmp_path / out), "pipeline": stages}
    path = tmp_path / f"{out}.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_every_command_refuses_a_map_output_in_the_same_line_and_inspect_describes_it(tmp_path, cli):
    onnx.save(zipmap_model(), tmp_path / "m.onnx")
    for split in ("calib", "eval"):
        (tmp_path / "data" / split).mkdir(parents=True)
        for i in range(4):
            np.save(tmp_path / "data" / split / f"{i}.npy", rand(1, 2, seed=i))
    stages = [{"optimize": {}}, {"quantize": {"backend": "ort"}}]
    refusals = {
        "init": cli("init", tmp_path / "m.onnx", "--data", tmp_path / "data", "--out", tmp_path / "c.yaml"),
        "validate": cli("validate", _config(tmp_path, stages, "staged")),
        "run": cli("run", _config(tmp_path, stages, "staged"), "--quiet"),
    }
    for command, (code, _, err) in refusals.items():
        assert code == 2 and REFUSAL in err and len(err.strip().splitlines()) == 1, (command, code, err)
    code, out, err = cli("inspect", tmp_path / "m.onnx")
    assert code == 0, err
    assert "Softmax" in out and "ZipMap" in out and REFUSAL in out  # described, and the refusal named
    # a run with no stages only runs the model (ONNX Runtime reads maps): neither it nor its evaluation refuse
    plain = _config(tmp_path, [], "plain")
    assert cli("run", plain, "--quiet")[0] == 0
    code, _, err = cli("evaluate", tmp_path / "plain", "--samples", tmp_path / "data" / "calib")
    assert code == 0, err
