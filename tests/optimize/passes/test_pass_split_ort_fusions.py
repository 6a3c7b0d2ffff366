"""split_ort_fusions: each ONNX Runtime fused op taken apart into ONNX ops computing the same numbers, the forms
it cannot take left with their reason, the GELUs ORT would run left under gelu: microsoft, and the real models
ONNX Runtime saved (FusedConv, FusedMatMul, BiasGelu, SkipLayerNormalization) optimized as their plain exports."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

from conftest import CALIBRATION, demo_model
from graphs import apply_pass, make_model, max_diff, ops, rand
from qprep.model import info as model_info
from qprep.model.load import load_model
from qprep.optimize.passes import PassSettings
from qprep.optimize.passes.split_ort_fusions import PASS

MS = "com.microsoft"
RKNN = PassSettings(backend="rknn", max_opset=19)


def contrib(op_type, inputs, outputs=("y",), **attributes):
    return helper.make_node(op_type, list(inputs), list(outputs), domain=MS, name=f"/block/{op_type}", **attributes)


def with_ms(model: onnx.ModelProto) -> onnx.ModelProto:
    model.opset_import.append(helper.make_opsetid(MS, 1))
    return model


def conv_model(activation=None, params=None, z=False):
    attributes = {"pads": [1, 1, 1, 1], "kernel_shape": [3, 3]}
    if activation:
        attributes["activation"] = activation
    if params:
        attributes["activation_params"] = params
    inputs = ["x", "w", "b"] + (["z"] if z else [])
    return with_ms(make_model([contrib("FusedConv", inputs, **attributes)],
                              [("x", [1, 3, 6, 6])] + ([("z", [1, 4, 6, 6])] if z else []), [("y", [1, 4, 6, 6])],
                              {"w": rand(4, 3, 3, 3), "b": rand(4, seed=1)}, infer_shapes=False))


def layernorm_model(op_type="SkipLayerNormalization", opset=14, bias=True, sum_output=False):
    gamma_beta = ["gamma"] + (["beta"] if op_type == "SkipLayerNormalization" else [])
    inputs = ["x", "skip", *gamma_beta] + (["bias"] if bias else [])
    outputs = ["y", "", "", "sum"] if sum_output else ["y"]
    return with_ms(make_model([contrib(op_type, inputs, outputs, epsilon=1e-5)],
                              [("x", [2, 5, 8]), ("skip", [2, 5, 8])],
                              [("y", [2, 5, 8])] + ([("sum", [2, 5, 8])] if sum_output else []),
                              {"gamma": rand(8, seed=2), "beta": rand(8, seed=3), "bias": rand(8, seed=4)},
                              opset=opset, infer_shapes=False))


def gelu_model(op_type, bias=False, **attributes):
    inputs = ["x"] + (["bias"] if bias else [])
    return with_ms(make_model([contrib(op_type, inputs, **attributes)], [("x", [2, 8])], [("y", [2, 8])],
                              {"bias": rand(8, seed=5)} if bias else {}, infer_shapes=False))


CASES = {
    "FusedConv": (conv_model(), None, {"Conv"}),
    "FusedConv+Relu": (conv_model("Relu"), None, {"Conv", "Relu"}),
    "FusedConv+Clip (ReLU6)": (conv_model("Clip", [0.0, 6.0]), None, {"Conv", "Clip"}),
    "FusedConv+HardSigmoid": (conv_model("HardSigmoid", [0.2, 0.5]), None, {"Conv", "HardSigmoid"}),
    "FusedConv+LeakyRelu": (conv_model("LeakyRelu", [0.1]), None, {"Conv", "LeakyRelu"}),
    "FusedConv+Z+Relu": (conv_model("Relu", z=True), None, {"Conv", "Add", "Relu"}),
    "FusedGemm+LeakyRelu": (with_ms(make_model(
        [contrib("FusedGemm", ["a", "w", "c"], transB=1, alpha=0.5, activation="LeakyRelu", activation_alpha=0.2)],
        [("a", [3, 8])], [("y", [3, 4])], {"w": rand(4, 8), "c": rand(4, seed=1)}, infer_shapes=False)),
        None, {"Gemm", "LeakyRelu"}),
    "FusedMatMul transA transB alpha": (with_ms(make_model(
        [contrib("FusedMatMul", ["a", "b"], transA=1, transB=1, alpha=0.125)],
        [("a", [2, 6, 5]), ("b", [2, 7, 6])], [("y", [2, 5, 7])], infer_shapes=False)),
        None, {"Transpose", "MatMul", "Mul"}),
    "BiasGelu": (gelu_model("BiasGelu", bias=True), RKNN, {"Add", "Mul", "Erf"}),
    "FastGelu with bias": (gelu_model("FastGelu", bias=True), RKNN, {"Add", "Mul", "Tanh"}),
    "Gelu": (gelu_model("Gelu"), RKNN, {"Mul", "Erf", "Add"}),
    "QuickGelu": (gelu_model("QuickGelu", alpha=1.702), RKNN, {"Mul", "Sigmoid"}),
    "SkipLayerNormalization at opset 14": (layernorm_model(), None,
                                           {"Add", "ReduceMean", "Sub", "Pow", "Sqrt", "Div", "Mul"}),
    "SkipLayerNormalization at opset 17": (layernorm_model(opset=17), None, {"Add", "LayerNormalization"}),
    "SkipLayerNormalization, its sum read": (layernorm_model(opset=17, sum_output=True), None,
                                              {"Add", "LayerNormalization"}),
    "SkipSimplifiedLayerNormalization": (layernorm_model("SkipSimplifiedLayerNormalization", opset=18), None,
                                         {"Add", "ReduceMean", "Sqrt", "Div", "Mul"}),
}


def feeds_for(model: onnx.ModelProto) -> dict:
    return {v.name: rand(*[d.dim_value for d in v.type.tensor_type.shape.dim], seed=i) * 2
            for i, v in enumerate(model.graph.input)}


@pytest.mark.parametrize("case", list(CASES))
def test_each_fused_op_becomes_onnx_ops_with_the_same_numbers(case):
    model, settings, expected_ops = CASES[case]
    split, outcome = apply_pass(PASS, model, settings)
    onnx.checker.check_model(split, full_check=True)
    assert outcome.matches == 1 and "left" not in outcome.details
    assert not [n for n in split.graph.node if n.domain == MS]
    assert set(ops(split)) == expected_ops
    assert max_diff(model, split, feeds_for(model)) < 1e-5
    assert [o.name for o in split.graph.output] == [o.name for o in model.graph.output]


@pytest.mark.parametrize("model, reason", [
    (conv_model("Gelu"), "activation Gelu has no ONNX op qprep writes"),
    (with_ms(make_model([contrib("FusedMatMul", ["a", "b"], transBatchA=1)], [("a", [2, 6, 5]), ("b", [5, 7])],
                        [("y", None)], infer_shapes=False)), "FusedMatMul with transBatchA/transBatchB"),
    (with_ms(make_model([contrib("SkipLayerNormalization", ["x", "skip", "gamma"], ["y", "mean"])],
                        [("x", [2, 8]), ("skip", [2, 8])], [("y", [2, 8]), ("mean", None)], {"gamma": rand(8)},
                        infer_shapes=False)), "SkipLayerNormalization whose mean output is read"),
], ids=["unknown activation", "transBatch", "mean read"])
def test_a_form_it_cannot_take_stays_with_its_reason(model, reason):
    split, outcome = apply_pass(PASS, model)
    assert outcome.matches == 0
    assert outcome.details["left"] == {reason: 1}
    assert [n.op_type for n in split.graph.node if n.domain == MS] == [model.graph.node[0].op_type]


def test_gelus_stay_where_the_gelu_pass_would_write_them_back_but_biasgelu_is_split():
    """gelu: microsoft (ORT backend below opset 20) fuses decomposed GELUs into com.microsoft Gelu: splitting one
    would only be fused again. BiasGelu is not what that pass writes, so it is split (its Add becomes visible)."""
    settings = PassSettings(backend="ort")
    _, kept = apply_pass(PASS, gelu_model("Gelu"), settings)
    assert kept.matches == 0
    split, outcome = apply_pass(PASS, gelu_model("BiasGelu", bias=True), settings)
    assert outcome.details["split"] == {"BiasGelu": 1} and "Add" in ops(split)


def test_a_graph_output_keeps_its_name_and_a_reader_of_it_reads_the_new_value():
    model = conv_model("Relu")
    model.graph.node.append(helper.make_node("Neg", ["y"], ["n"]))
    model.graph.output.append(helper.make_tensor_value_info("n", onnx.TensorProto.FLOAT, None))
    split, _ = apply_pass(PASS, model)
    assert [o.name for o in split.graph.output] == ["y", "n"]
    assert max_diff(model, split, feeds_for(model)) < 1e-5


# ---------------------------------------------------------------------------------------------------------
# Real models as ONNX Runtime writes them
# ---------------------------------------------------------------------------------------------------------


def _saved_by_ort(source, target, how):
    if how == "transformer optimizer":  # what ORT's docs advise for BERTs before quantizing
        from onnxruntime.transformers.optimizer import optimize_model

        optimize_model(str(source), model_type="bert", num_heads=12, hidden_size=384).save_model_to_file(str(target))
        return target
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(target)
    ort.InferenceSession(str(source), options, providers=["CPUExecutionProvider"])
    return target


@pytest.mark.slow
@pytest.mark.parametrize("name, data, how, backend", [
    ("efficientnet_lite0", "imagenet", "session", "ort"),
    ("minilm_l6_v2", "minilm", "session", "rknn"),
    ("minilm_l6_v2", "minilm", "transformer optimizer", "ort"),
])
def test_a_model_onnx_runtime_saved_optimizes_to_what_its_plain_export_does(tmp_path, name, data, how, backend):
    """EfficientNet-Lite0 saved from a session at ORT_ENABLE_EXTENDED holds 33 FusedConv (Conv + ReLU6); MiniLM
    6 FusedMatMul and 6 BiasGelu; MiniLM through the transformer optimizer 12 SkipLayerNormalization and 6
    BiasGelu. After optimize, each holds the layers its plain export optimizes to, and no fused op."""
    import qprep

    saved = _saved_by_ort(demo_model(f"{name}.onnx"), tmp_path / f"{name}.ort.onnx", how)
    assert any(n.domain == MS for n in load_model(saved).graph.node)
    counts = []
    for model in (demo_model(f"{name}.onnx"), saved):
        config = {"model": str(model), "calibration": {"source": str(CALIBRATION / data / "calib"), "max_samples": 4},
                  "pipeline": [{"optimize": {"max_opset": 19, "gelu": "off" if backend == "rknn" else "auto"}}]}
        out = tmp_path / model.stem
        report = qprep.run(config, output_dir=str(out), force=True)
        assert report["stages"][0]["rolled_back"] == []
        counts.append(model_info.op_counts(load_model(out / "model.onnx")))
    plain, from_ort = counts
    assert not {"FusedConv", "FusedMatMul", "BiasGelu", "SkipLayerNormalization"} & set(from_ort)
    for op in ("Conv", "MatMul", "Gemm", "LayerNormalization", "Gelu", "Erf", "Clip"):
        assert from_ort.get(op, 0) == plain.get(op, 0), (op, plain, from_ort)


def test_constants_take_the_model_float_type_where_the_node_has_no_typed_input():
    """A float16 model's intermediate values carry no type before inference: float32 constants beside them made
    the checker fail, and the stage rolled the whole pass back."""
    model = with_ms(make_model([helper.make_node("Mul", ["x", "w"], ["m"]), contrib("QuickGelu", ["m"], alpha=1.702)],
                               [("x", [2, 8], np.float16)], [("y", [2, 8], np.float16)],
                               {"w": rand(8).astype(np.float16)}, infer_shapes=False))
    split, outcome = apply_pass(PASS, model, RKNN)  # (gelu: microsoft would leave QuickGelu to ORT)
    assert outcome.matches == 1 and "QuickGelu" not in ops(split)
    assert {t.data_type for t in split.graph.initializer} == {onnx.TensorProto.FLOAT16}
    onnx.checker.check_model(split, full_check=True)
    feeds = {"x": rand(2, 8).astype(np.float16)}
    assert max_diff(model, split, feeds) < 1e-2


def test_a_fused_op_inside_a_model_local_function_gets_constant_nodes():
    """A function holds no initializers: the GELU's constants were lost, and the stage rolled the pass back."""
    function = helper.make_function("local", "Block", ["a", "b"], ["c"], [contrib("BiasGelu", ["a", "b"], ["c"])],
                                    [helper.make_opsetid("", 13), helper.make_opsetid(MS, 1)])
    model = with_ms(make_model([helper.make_node("Block", ["x", "bias"], ["y"], domain="local")],
                               [("x", [2, 8])], [("y", [2, 8])], {"bias": rand(8, seed=5)}, infer_shapes=False))
    model.opset_import.append(helper.make_opsetid("local", 1))
    model.functions.append(function)
    split, outcome = apply_pass(PASS, model)
    body = split.functions[0].node
    assert outcome.matches == 1 and "BiasGelu" not in {n.op_type for n in body} and "Constant" in {n.op_type for n in body}
    assert max_diff(model, split, {"x": rand(2, 8)}) < 1e-5
