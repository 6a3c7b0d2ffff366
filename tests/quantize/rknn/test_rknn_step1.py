"""step1.py: hybrid step1 once per setting, its outputs kept and copied back, and reused ranges written into them
(a scripted toolkit writes step1's outputs; the real toolkit's are in test_rknn_ranges.py)."""

import argparse
import pickle
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from qprep.errors import QprepError
from qprep.quantize.rknn.step1 import Step1

CFG = """custom_quantize_layers: {}
quantize_parameters:
    y:
        qtype: asym
        qmethod: layer
        dtype: int8
        min:
        -   -1.0
        max:
        -   1.0
        scale:
        -   0.00784
        zero_point:
        -   0
        ori_min:
        -   -1.0
        ori_max:
        -   1.0
"""


def entry(qmethod: str, low: float, high: float) -> dict:
    return {"qmethod": qmethod, "dtype": "int8", "qtype": "asym", "min": str([low]), "max": str([high]),
            "scale": str([(high - low) / 255]), "zero_point": "[-128]", "ori_min": str([low]), "ori_max": str([high])}


class ScriptedToolkit:
    """hybrid_quantization_step1 writes `<stem>.model` (a Relu), `<stem>.data` and the cfg, as the toolkit does."""

    def __init__(self, work_dir: Path):
        self.work_dir, self.algorithms, self.discarded = work_dir, [], []

    def loaded(self, algorithm: str) -> int:
        self.algorithms.append(algorithm)
        return len(self.algorithms)

    def call(self, step, rknn, method, **kwargs):
        assert method == "hybrid_quantization_step1" and kwargs["dataset"].endswith("dataset.txt")
        stem = self.work_dir / "model"
        graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="relu")], "g",
                                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
        onnx.save(helper.make_model(graph), f"{stem}.model")
        algorithm = self.algorithms[rknn - 1]
        with open(f"{stem}.data", "wb") as f:
            pickle.dump({"quant_tab": {"w": entry("channel", -1.0, 1.0), "y": entry("layer", -1.0, 1.0)},
                         "quantizer.param": {"qalgorithm": algorithm},
                         "args": argparse.Namespace(quantized_algorithm=algorithm)}, f)
        Path(f"{stem}.quantization.cfg").write_text(CFG + f"# {algorithm}\n")

    def discard(self, rknn: int) -> None:
        self.discarded.append(rknn)


class Built:
    """A kept build's runner, as far as Step1.reuse reads it."""

    def __init__(self, table):
        self.table = table

    def quantization_table(self):
        if isinstance(self.table, Exception):
            raise self.table
        return self.table


def make_step1(tmp_path, details=None):
    toolkit = ScriptedToolkit(tmp_path)
    return Step1(toolkit, tmp_path / "dataset.txt", {}, toolkit.loaded, lambda step: step(),
                 {} if details is None else details), toolkit


def test_step1_runs_once_per_setting_and_its_kept_outputs_come_back(tmp_path):
    step1, toolkit = make_step1(tmp_path)
    names = step1.ir_names("normal", "gptq", None)
    assert names.accepted("y") and step1.ir_names("normal", "gptq", None) is names
    assert toolkit.algorithms == ["normal"] and step1.seconds("normal", "gptq") == 0.0
    assert step1.seconds("normal", "prepared") == step1.seconds("kl_divergence", "gptq") > 0.0
    step1.forget()  # another setting: step1 again
    step1.ir_names("kl_divergence", "gptq", None)
    assert toolkit.algorithms == ["normal", "kl_divergence"]
    step1.forget()  # back: the kept outputs are copied over whatever is there now
    (tmp_path / "model.data").write_bytes(b"edited in place")
    step1.ir_names("normal", "gptq", None)
    assert toolkit.algorithms == ["normal", "kl_divergence"]
    assert pickle.loads((tmp_path / "model.data").read_bytes())["quantizer.param"]["qalgorithm"] == "normal"
    step2 = step1.step2_inputs(["y"])
    assert step2["model_input"] == f"{tmp_path / 'model'}.model"
    assert "'y': float16" in Path(step2["model_quantization_cfg"]).read_text().split("quantize_parameters")[0]
    step1.forget_outputs()  # a toolkit rule went off: nothing kept is used
    step1.ir_names("normal", "gptq", None)
    assert toolkit.algorithms == ["normal", "kl_divergence", "normal"] and toolkit.discarded == [1, 2, 3]
    assert len(list(tmp_path.glob("step1_*"))) == 2
    step1.clean()
    assert not list(tmp_path.glob("step1_*"))


def test_reused_ranges_go_into_step1_with_the_normal_algorithm(tmp_path):
    """A build's table is written into a `normal` step1's outputs; a table that cannot be read or does not fit
    leaves the builds searching their own ranges, and mmse's weight ranges that do not fit stop the build."""
    details = {}
    step1, toolkit = make_step1(tmp_path, details)
    assert not step1.reuse(Built(ValueError("no quantization table")), "mmse", 2)
    assert step1.table(None) is None and "ranges_reused" not in details
    table = {"w": entry("channel", -2.0, 2.0), "y": entry("layer", -3.0, 3.0)}
    assert step1.reuse(Built(table), "mmse", 2) and step1.table({"other": {}}) is table
    step1.ir_names("mmse", "prepared", None)
    assert toolkit.algorithms == ["normal"]
    assert details["ranges_reused"] == {"algorithm": "mmse", "from_float16_nodes": 2, "activations": 1, "weights": 1}
    written = pickle.loads((tmp_path / "model.data").read_bytes())
    assert written["quant_tab"]["y"]["min"] == "[-3.0]" and written["quantizer.param"]["qalgorithm"] == "normal"
    cfg = Path(step1.step2_inputs([])["model_quantization_cfg"]).read_text()  # step2 is given the cfg with them
    assert np.isclose(float(cfg.split("min:\n        -   ")[1].split()[0]), -3.0)
    step1.forget_ranges()
    assert step1.table(None) is None and "ranges_reused" not in details
    step1.forget()
    assert step1.reuse(Built({"z": entry("layer", 0.0, 1.0)}), "mmse", 1)  # fits nothing in step1's outputs
    step1.ir_names("mmse", "prepared", None)
    assert toolkit.algorithms == ["normal", "mmse"] and "ranges_reused" not in details  # normal's step1 kept
    step1.forget()
    with pytest.raises(QprepError, match="mmse's weight ranges do not fit"):
        step1.ir_names("normal", "prepared", {"z": entry("channel", 0.0, 1.0)})
