"""`qprep inspect` counts LayerNorms and GELUs the way `optimize` fuses them: fused ops, decomposed ones per
spelling (the optimize matchers on a copy), and refused candidates with their reason."""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import helper

from graphs import make_model
from qprep.inspection import inspect_model, render_inspection

D = 8


def _model_with_one_of_each(tmp_path) -> str:
    """x[2, 4, 8] → Flax-style LayerNorm (keepdims=0 + Reshape/Expand) → tanh GELU → a LayerNorm whose gamma is a
    graph input (refused) → ONNX LayerNormalization (fused)."""
    rows = np.array([2, 4, 1], np.int64)
    nodes = [
        helper.make_node("ReduceSum", ["x", "axes"], ["s1"], keepdims=0),
        helper.make_node("Mul", ["s1", "inv_n"], ["mean"]),
        helper.make_node("Mul", ["x", "x"], ["xx"]),
        helper.make_node("ReduceSum", ["xx", "axes"], ["s2"], keepdims=0),
        helper.make_node("Mul", ["s2", "inv_n"], ["m2"]),
        helper.make_node("Mul", ["mean", "mean"], ["msq"]),
        helper.make_node("Sub", ["m2", "msq"], ["d"]),
        helper.make_node("Max", ["zero", "d"], ["var"]),
        helper.make_node("Expand", ["var_r", "rows"], ["var_b"]),
        helper.make_node("Reshape", ["var", "rows"], ["var_r"]),
        helper.make_node("Add", ["var_b", "eps"], ["ve"]),
        helper.make_node("Sqrt", ["ve"], ["sd"]),
        helper.make_node("Reciprocal", ["sd"], ["rstd"]),
        helper.make_node("Reshape", ["mean", "rows"], ["mean_r"]),
        helper.make_node("Expand", ["mean_r", "rows"], ["mean_b"]),
        helper.make_node("Sub", ["x", "mean_b"], ["centered"]),
        helper.make_node("Mul", ["centered", "rstd"], ["ln1"]),
        # tanh GELU of ln1: 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))
        helper.make_node("Pow", ["ln1", "three"], ["cube"]),
        helper.make_node("Mul", ["cube", "c"], ["cc"]),
        helper.make_node("Add", ["ln1", "cc"], ["inner"]),
        helper.make_node("Mul", ["inner", "k"], ["u"]),
        helper.make_node("Tanh", ["u"], ["t"]),
        helper.make_node("Add", ["t", "one"], ["tp"]),
        helper.make_node("Mul", ["ln1", "tp"], ["xt"]),
        helper.make_node("Mul", ["xt", "half"], ["g"]),
        # a PyTorch-style LayerNorm whose gamma is a graph input: refused
        helper.make_node("ReduceMean", ["g"], ["m"], axes=[-1]),
        helper.make_node("Sub", ["g", "m"], ["dev"]),
        helper.make_node("Mul", ["dev", "dev"], ["sq"]),
        helper.make_node("ReduceMean", ["sq"], ["v"], axes=[-1]),
        helper.make_node("Add", ["v", "eps"], ["ve2"]),
        helper.make_node("Sqrt", ["ve2"], ["sd2"]),
        helper.make_node("Div", ["dev", "sd2"], ["n2"]),
        helper.make_node("Mul", ["n2", "gamma"], ["ln2"]),
        helper.make_node("LayerNormalization", ["ln2", "ones"], ["y"], axis=-1),
    ]
    nodes = [nodes[i] for i in (0, 1, 2, 3, 4, 5, 6, 7, 9, 8, *range(10, len(nodes)))]  # topological order
    f32 = lambda v: np.asarray(v, np.float32)  # noqa: E731
    model = make_model(nodes, [("x", [2, 4, D]), ("gamma", [D])], [("y", [2, 4, D])],
                       {"axes": np.array([-1], np.int64), "inv_n": f32(1 / D), "zero": f32(0), "eps": f32(1e-6),
                        "rows": rows, "three": f32(3), "c": f32(0.044715), "k": f32(math.sqrt(2 / math.pi)),
                        "one": f32(1), "half": f32(0.5), "ones": np.ones(D, np.float32)}, opset=17)
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    return str(path)


def test_inspect_counts_layernorms_and_gelus_fused_decomposed_and_refused(tmp_path):
    info = inspect_model(_model_with_one_of_each(tmp_path))
    assert info["layernorms"]["fused"] == 1
    assert info["layernorms"]["decomposed"] == {"jax": 1}
    assert info["layernorms"]["refused"] == {"gamma is not a constant (graph input or computed)": 1}
    assert info["gelus"] == {"fused": 0, "decomposed": {"erf": 0, "tanh": 1, "sigmoid": 0}}
    text = render_inspection(info)
    assert "LayerNorm: 1 fused, 1 decomposed (jax 1; fusable by `optimize`)" in text
    assert "refused 1: gamma is not a constant" in text
    assert "GELU: 0 fused, 1 decomposed (tanh 1; fusable by `optimize`)" in text
    assert info["ort_fused_ops"] == {} and "ONNX Runtime's fused ops" not in text


def test_inspect_counts_onnx_runtimes_fused_ops_that_optimize_takes_apart(tmp_path):
    from onnx import helper

    from graphs import rand

    model = make_model([helper.make_node("FusedConv", ["x", "w"], ["c"], domain="com.microsoft", activation="Relu"),
                        helper.make_node("BiasGelu", ["c", "b"], ["y"], domain="com.microsoft")],
                       [("x", [1, 3, 4, 4])], [("y", [1, 2, 4, 4])], {"w": rand(2, 3, 1, 1), "b": rand(1)}, opset=17,
                       infer_shapes=False)
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    onnx.save(model, tmp_path / "m.onnx")
    info = inspect_model(str(tmp_path / "m.onnx"))
    assert info["ort_fused_ops"] == {"BiasGelu": 1, "FusedConv": 1}
    text = render_inspection(info)
    assert "ONNX Runtime's fused ops: 2 (BiasGelu 1, FusedConv 1; `optimize` takes them apart)" in text


def test_integer_share_counts_the_multiply_adds_fed_by_dequantize_or_replaced_by_integer_ops():
    import numpy as np
    from onnx import helper

    from graphs import make_model
    from qprep.model.info import integer_share

    weights = {"w": np.ones((4, 4, 1, 1), np.float32), "v": np.ones((4, 4, 3, 3), np.float32)}
    float_model = make_model([helper.make_node("Conv", ["x", "w"], ["a"], name="small"),
                              helper.make_node("Conv", ["a", "v"], ["y"], name="big", pads=[1, 1, 1, 1])],
                             [("x", [1, 4, 8, 8])], [("y", [1, 4, 8, 8])], weights)
    small, big = 4 * 4 * 64, 4 * 4 * 9 * 64
    qdq = make_model([helper.make_node("DequantizeLinear", ["xq", "s"], ["xd"], name="dq"),
                      helper.make_node("DequantizeLinear", ["wq", "s"], ["wd"], name="dqw"),
                      helper.make_node("Conv", ["xd", "wd"], ["a"], name="small"),
                      helper.make_node("Conv", ["a", "v"], ["y"], name="big", pads=[1, 1, 1, 1])],
                     [("xq", [1, 4, 8, 8], np.uint8)], [("y", [1, 4, 8, 8])],
                     {**weights, "s": np.float32(0.1), "wq": np.ones((4, 4, 1, 1), np.int8)},
                     infer_shapes=False)
    assert integer_share(float_model, qdq) == small / (small + big)  # "big" reads a float weight: float
    replaced = make_model([helper.make_node("Conv", ["x", "w"], ["a"], name="small")], [("x", [1, 4, 8, 8])],
                          [("a", [1, 4, 8, 8])], weights, infer_shapes=False)
    assert integer_share(float_model, replaced) == big / (small + big)  # "big" became an integer op


def test_inspect_init_and_optimize_count_the_same_layernorms(tmp_path, cli):
    """A LayerNorm (ReduceMean/Sub/Pow/ReduceMean/Add/Sqrt/Div/Mul/Add) whose epsilon is a Cast of a float64
    constant: inspect ran the matcher on the graph as exported and refused it ("epsilon is not a positive scalar
    constant"), init kept no LayerNorm float, and optimize, which folds constants first, fused it. Both now
    count on the graph as optimize hands it to the fusion."""
    import json

    import yaml

    nodes = [helper.make_node("Cast", ["eps64"], ["eps"], to=onnx.TensorProto.FLOAT),
             helper.make_node("ReduceMean", ["x"], ["m"], axes=[-1]),
             helper.make_node("Sub", ["x", "m"], ["d"]),
             helper.make_node("Pow", ["d", "two"], ["p"]),
             helper.make_node("ReduceMean", ["p"], ["v"], axes=[-1]),
             helper.make_node("Add", ["v", "eps"], ["ve"]),
             helper.make_node("Sqrt", ["ve"], ["s"]),
             helper.make_node("Div", ["d", "s"], ["n"]),
             helper.make_node("Mul", ["n", "g"], ["ng"]),
             helper.make_node("Add", ["ng", "b"], ["y"])]
    onnx.save(make_model(nodes, [("x", [1, 4, D])], [("y", [1, 4, D])],
                         {"eps64": np.float64(1e-5), "two": np.float32(2), "g": np.ones(D, np.float32),
                          "b": np.zeros(D, np.float32)}), tmp_path / "ln.onnx")
    found = inspect_model(str(tmp_path / "ln.onnx"))["layernorms"]
    assert found["decomposed"] == {"pytorch": 1} and "refused" not in found
    assert cli("init", tmp_path / "ln.onnx", "--out", tmp_path / "ln.yaml")[0] == 0
    assert {"keep_float": {}} in yaml.safe_load((tmp_path / "ln.yaml").read_text())["pipeline"]
    config = {"model": str(tmp_path / "ln.onnx"), "output_dir": str(tmp_path / "out"), "pipeline": ["optimize"]}
    (tmp_path / "o.yaml").write_text(yaml.safe_dump(config))
    assert cli("run", tmp_path / "o.yaml")[0] == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    fused = [p["details"]["fused"] for p in report["stages"][0]["passes"] if p["pass"] == "fuse_layernorm"]
    assert fused == [1]
