"""The optimize stage: verification and rollback, records, and the acceptance numbers on the real models."""

import json

import numpy as np
import onnx
import pytest

import qprep
from onnx import helper

from qprep.config import load_config
from qprep.errors import ConfigError
from qprep.optimize import stage as optimize_module
from qprep.optimize.passes import GraphPass, PassOutcome, all_passes
from qprep.optimize.passes.layernorm import count_decomposed_layernorms
from qprep.model.load import load_model
from qprep.model import info as model_info
from conftest import CALIBRATION, demo_model
from graphs import make_model, tiny_conv_model


def perturb_weights(model, settings):
    """A deliberately wrong 'rewrite': scales the Conv weights by 1.01."""
    for value in model.graph.initializers.values():
        if value.name == "w":
            import onnx_ir as ir

            value.const_value = ir.tensor(value.const_value.numpy() * 1.01, name="w")
            return PassOutcome(1, {"note": "broken on purpose"})
    return PassOutcome(0)


def test_a_pass_that_changes_numbers_is_rolled_back_and_the_run_goes_on(tmp_path, save, cli, monkeypatch):
    passes = {"broken": GraphPass("broken", perturb_weights, "test"), **all_passes()}
    monkeypatch.setattr(optimize_module, "all_passes", lambda: passes)
    model = save(tiny_conv_model())
    config = tmp_path / "c.yaml"
    config.write_text(f"model: {model}\noutput_dir: {tmp_path / 'run'}\n"
                      "pipeline: [{optimize: {passes: [cleanup]}}]\n")
    # pass names are validated with the config; the broken one is injected after validation
    monkeypatch.setattr(optimize_module, "selected_passes", lambda options: ["broken", "cleanup"])
    code, _, err = cli("run", config, "--quiet")
    assert code == 0, err
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    stage = report["stages"][0]
    assert stage["status"] == "ok"
    assert [r["pass"] for r in stage["rolled_back"]] == ["broken"]
    assert "output 'y'" in stage["rolled_back"][0]["reason"]
    assert {p["pass"]: p["status"] for p in stage["passes"]}["broken"] == "rolled back"
    saved = onnx.load(str(tmp_path / "run" / "model.onnx"))
    original = {t.name: t for t in onnx.load(str(model)).graph.initializer}
    assert {t.name: t for t in saved.graph.initializer}["w"].raw_data == original["w"].raw_data
    code, _, err = cli("run", config, "--quiet", "--force", "--strict")
    assert code == 2 and "rolled back in optimize" in err


def identity_named_like_its_input(model, settings):
    """A rewrite that adds an Identity between the Conv and the Relu whose output takes the Conv output's name:
    what onnx_ir's own naming does when a rewrite leaves an output unnamed in a graph whose names it does not know."""
    import onnx_ir as ir

    relu = next(n for n in model.graph if n.op_type == "Relu")
    conv_out = relu.inputs[0]
    identity = ir.Node("", "Identity", [conv_out], num_outputs=1)
    identity.outputs[0].name = conv_out.name
    model.graph.insert_after(conv_out.producer(), identity)
    relu.replace_input_with(0, identity.outputs[0])
    return PassOutcome(1)


def test_a_name_a_pass_repeats_is_made_unique_not_rolled_back(tmp_path, save, cli, monkeypatch):
    from qprep.graph.names import duplicate_names

    passes = {"renaming": GraphPass("renaming", identity_named_like_its_input, "test"), **all_passes()}
    monkeypatch.setattr(optimize_module, "all_passes", lambda: passes)
    config = tmp_path / "c.yaml"
    config.write_text(f"model: {save(tiny_conv_model())}\noutput_dir: {tmp_path / 'run'}\n"
                      "pipeline: [{optimize: {passes: [cleanup]}}]\n")
    monkeypatch.setattr(optimize_module, "selected_passes", lambda options: ["renaming"])
    code, _, err = cli("run", config, "--quiet")
    assert code == 0, err
    stage = json.loads((tmp_path / "run" / "report.json").read_text())["stages"][0]
    assert stage["rolled_back"] == [] and {p["pass"]: p["status"] for p in stage["passes"]}["renaming"] != "rolled back"
    saved = onnx.load(str(tmp_path / "run" / "model.onnx"))
    assert "Identity" in {n.op_type for n in saved.graph.node} and duplicate_names(saved) == []


def conv_bn_identity_model():
    """Conv → BatchNorm (fold_into_conv) → Identity (cleanup) → Mul by Add(2 constants) (fold_constants): three
    passes match in the first round."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", "s", "b", "m", "v"], ["n"]),
             helper.make_node("Identity", ["n"], ["i"]),
             helper.make_node("Add", ["k1", "k2"], ["k"]),
             helper.make_node("Mul", ["i", "k"], ["y"])]
    return make_model(nodes, [("x", [1, 3, 8, 8])], [("y", [1, 4, 8, 8])],
                      {"w": rng.standard_normal((4, 3, 3, 3)).astype(np.float32),
                       "s": rng.uniform(0.5, 1.5, 4).astype(np.float32), "b": rng.standard_normal(4).astype(np.float32),
                       "m": rng.standard_normal(4).astype(np.float32), "v": rng.uniform(0.5, 1.5, 4).astype(np.float32),
                       "k1": np.float32([1.5]), "k2": np.float32([0.25])})


def count_checks(monkeypatch):
    from qprep.graph.verify import Verifier

    calls = []
    check = Verifier.check
    monkeypatch.setattr(Verifier, "check", lambda self, model: calls.append(1) or check(self, model))
    return calls


def test_a_round_is_verified_once_when_its_passes_keep_the_numbers(tmp_path, save, monkeypatch):
    """One ORT check per round, not one per pass (optimize's main cost on big models); every pass still has the
    verdict that accepted it."""
    calls = count_checks(monkeypatch)
    report = qprep.run({"model": str(save(conv_bn_identity_model())), "pipeline": [{"optimize": {}}]},
                       output_dir=str(tmp_path / "run"), force=True)
    stage = report["stages"][0]
    applied = [p for p in stage["passes"] if p["status"] == "applied"]
    assert len(applied) >= 3, [p["pass"] for p in applied]
    assert stage["checks"] == {"rounds_checked_at_once": 1, "rounds_replayed": 0} and len(calls) == 1
    assert all(p["verification"]["ok"] and p["pass"] in p["verification"]["checked_with"] for p in applied)
    assert stage["nodes_after"] == 1  # Conv with the BatchNorm and the constant factor folded in
    assert sum(p["nodes_removed"] for p in applied) == 4


def test_a_failing_round_is_replayed_pass_by_pass_and_only_the_culprit_rolled_back(tmp_path, save, monkeypatch):
    passes = {"broken": GraphPass("broken", perturb_weights, "test"), **all_passes()}
    monkeypatch.setattr(optimize_module, "all_passes", lambda: passes)
    monkeypatch.setattr(optimize_module, "selected_passes",
                        lambda options: ["fold_into_conv", "broken", "cleanup", "fold_constants"])
    calls = count_checks(monkeypatch)
    model = conv_bn_identity_model()
    model.graph.initializer[0].name = "w"  # perturb_weights changes the initializer named w
    report = qprep.run({"model": str(save(model)), "pipeline": [{"optimize": {}}]},
                       output_dir=str(tmp_path / "run"), force=True)
    stage = report["stages"][0]
    assert [r["pass"] for r in stage["rolled_back"]] == ["broken"]
    assert stage["checks"]["rounds_replayed"] == 1
    assert {p["pass"]: p["status"] for p in stage["passes"]} == {
        "fold_into_conv": "applied", "broken": "rolled back", "cleanup": "applied", "fold_constants": "applied"}
    # round 1: the joint check fails, then one check per changing pass (4, the broken one included); round 2
    # (fold_into_conv takes the now-constant factor into the Conv) is checked as a whole, round 3 changes nothing
    assert stage["checks"] == {"rounds_checked_at_once": 1, "rounds_replayed": 1} and stage["rounds"] == 3
    assert len(calls) == 1 + 4 + 1
    assert stage["nodes_after"] == 1


def test_a_layernorm_left_unfused_is_in_the_report_with_its_reason(tmp_path, save, cli):
    """LayerNorm whose gamma is a graph input (LayerNormalization's scale must be a constant to be fused here):
    refused, and the report says so — never a silent leftover."""
    shape = [2, 8, 16]
    nodes = [helper.make_node("ReduceMean", ["x"], ["m"], axes=[-1]), helper.make_node("Sub", ["x", "m"], ["d"]),
             helper.make_node("Mul", ["d", "d"], ["sq"]), helper.make_node("ReduceMean", ["sq"], ["v"], axes=[-1]),
             helper.make_node("Add", ["v", "eps"], ["ve"]), helper.make_node("Sqrt", ["ve"], ["s"]),
             helper.make_node("Div", ["d", "s"], ["n"]), helper.make_node("Mul", ["n", "gamma"], ["y"])]
    model = save(make_model(nodes, [("x", shape), ("gamma", [16])], [("y", shape)], {"eps": np.float32(1e-5)},
                            opset=17))
    config = tmp_path / "c.yaml"
    config.write_text(f"model: {model}\noutput_dir: {tmp_path / 'run'}\npipeline: [optimize]\n")
    code, _, err = cli("run", config, "--quiet")
    assert code == 0, err
    stage = json.loads((tmp_path / "run" / "report.json").read_text())["stages"][0]
    record = {p["pass"]: p for p in stage["passes"]}["fuse_layernorm"]
    assert "gamma is not a constant" in next(iter(record["details"]["refused"]))
    text = (tmp_path / "run" / "report.md").read_text()
    assert "Left unfused by **fuse_layernorm**: 1× gamma is not a constant" in text


def test_unknown_pass_name_is_a_config_error_with_a_suggestion(tmp_path):
    with pytest.raises(ConfigError, match=r"pipeline\[0\]\.optimize\.passes\[0\]: 'fold_constant' is not allowed; "
                                          r"did you mean 'fold_constants'\?"):
        load_config({"model": "m.onnx", "pipeline": [{"optimize": {"passes": ["fold_constant"]}}]})


# --- the real models: every BatchNorm folded, node counts at or below onnxslim 0.1.98's, numbers kept ----
REAL = {
    # model: calibration set, input-shape fixes, preprocessing, onnxslim 0.1.98 node count, BatchNorms, LayerNorms
    "efficientnet_lite0": ("imagenet", None, {"mean": [127.0], "std": [128.0]}, 94, 49, 0),
    "ppocr_cls": ("ocr_cls", {"x": [1, 3, 48, 192]}, {"mean": [127.5], "std": [127.5], "channel_order": "bgr"},
                  179, 35, 0),
    "ppocrv4_rec": ("ocr_rec", {"x": [1, 3, 48, 320]},
                    {"mean": [127.5], "std": [127.5], "channel_order": "bgr"}, 393, 6, 5),
    "minilm_l6_v2": ("minilm", None, None, 384, 0, 13),
}


@pytest.fixture(scope="module")
def optimized(tmp_path_factory):
    """Run the optimize stage once per real model (module-scoped: the runs take seconds)."""
    import qprep

    runs = {}
    for name, (data, shapes, preprocess, *_) in REAL.items():
        config = {"model": str(demo_model(f"{name}.onnx")),
                  "calibration": {"source": str(CALIBRATION / data / "calib"), "max_samples": 8},
                  "pipeline": [{"optimize": {}}]}
        if preprocess:
            config["calibration"]["preprocess"] = preprocess
        if shapes:
            config["inputs"] = shapes
        out = tmp_path_factory.mktemp(name)
        report = qprep.run(config, output_dir=str(out), force=True)
        runs[name] = (report, load_model(out / "model.onnx"))
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("name", list(REAL))
def test_real_model_optimized_within_tolerance_and_no_bigger_than_onnxslim(optimized, name):
    report, model = optimized[name]
    stage = report["stages"][0]
    onnxslim_nodes, batchnorms, layernorms = REAL[name][3:]
    assert report["model"]["op_counts"].get("BatchNormalization", 0) == batchnorms
    assert model_info.op_counts(model).get("BatchNormalization", 0) == 0
    assert count_decomposed_layernorms(load_model(report["model"]["path"])) == layernorms
    assert model_info.op_counts(model).get("LayerNormalization", 0) == layernorms
    assert count_decomposed_layernorms(model) == 0
    assert stage["rolled_back"] == []
    assert stage["verified_on"].startswith("calibration")
    for record in stage["passes"]:
        if record["status"] == "applied":
            assert record["verification"]["ok"], record
    assert stage["nodes_after"] <= onnxslim_nodes, (stage["nodes_after"], onnxslim_nodes)


@pytest.mark.slow
def test_dynamic_dims_stay_dynamic(optimized):
    _, model = optimized["minilm_l6_v2"]
    dims = [[d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input]
    assert dims == [["batch", "sequence"]] * 3
    _, model = optimized["efficientnet_lite0"]
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"


# --- dynamic dims: rewrites are verified at another batch size / sequence length too ----------------------


def _dynamic_flatten_model():
    """x[B, S, 4] → Reshape(x, [Shape(x)[0], -1]) → y[B, S*4]: right at every B, S."""
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Gather", ["s", "zero"], ["b"], axis=0),
             helper.make_node("Unsqueeze", ["b", "axes"], ["b1"]),
             helper.make_node("Concat", ["b1", "minus1"], ["shape"], axis=0),
             helper.make_node("Reshape", ["x", "shape"], ["y"])]
    return make_model(nodes, [("x", ["B", "S", 4])], [("y", ["B", None])],
                      {"zero": np.array(0, np.int64), "axes": np.array([0], np.int64),
                       "minus1": np.array([-1], np.int64)}, opset=14)


def hardcode_calibration_shape(model, settings):
    """A wrong 'shape rewrite': the computed Reshape target replaced by the calibration sample's [1, 12]."""
    import onnx_ir as ir

    for node in model.graph:
        if node.op_type == "Reshape" and node.inputs[1].const_value is None:
            node.replace_input_with(1, model.graph.initializers.setdefault(
                "fixed", ir.Value(name="fixed", const_value=ir.tensor(np.array([1, 12], np.int64)))))
            return PassOutcome(1, {})
    return PassOutcome(0)


def test_a_rewrite_right_only_at_the_calibration_shape_is_rolled_back(tmp_path, save, cli, monkeypatch):
    model = save(_dynamic_flatten_model())
    data = tmp_path / "calib"
    data.mkdir()
    np.save(data / "0.npy", np.random.default_rng(0).standard_normal((1, 3, 4)).astype(np.float32))
    config = tmp_path / "c.yaml"
    config.write_text(f"model: {model}\ncalibration: {{source: {data}}}\noutput_dir: {tmp_path / 'run'}\n"
                      "pipeline: [{optimize: {passes: [cleanup]}}]\n")
    passes = {"hardcode": GraphPass("hardcode", hardcode_calibration_shape, "test"), **all_passes()}
    monkeypatch.setattr(optimize_module, "all_passes", lambda: passes)
    monkeypatch.setattr(optimize_module, "selected_passes", lambda options: ["hardcode"])
    code, _, err = cli("run", config, "--quiet")
    assert code == 0, err
    stage = json.loads((tmp_path / "run" / "report.json").read_text())["stages"][0]
    assert stage["dynamic_dims_verified"] == {"B": [1, 2], "S": [3, 6]}
    assert stage["verified_on"].endswith("+ 1 at other dynamic dims")
    assert [r["pass"] for r in stage["rolled_back"]] == ["hardcode"]


def test_other_sizes_keep_strides_and_inputs_sharing_a_dim_change_together():
    from qprep.optimize.dynamic_samples import dynamic_variant, other_size

    assert [other_size(n) for n in (1, 2, 3, 128, 320, 48)] == [2, 4, 6, 96, 224, 32]
    model = make_model([helper.make_node("Add", ["a", "b"], ["y"])], [("a", ["N", "T"]), ("b", ["N", "T"])],
                       [("y", ["N", "T"])], opset=14)
    sample = {"a": np.arange(12, dtype=np.float32).reshape(1, 12), "b": np.ones((1, 12), np.float32)}
    variant, sizes = dynamic_variant(model, sample)
    assert sizes == {"N": (1, 2), "T": (12, 8)}
    assert variant["a"].shape == variant["b"].shape == (2, 8)
    np.testing.assert_array_equal(variant["a"][1], np.arange(8))
