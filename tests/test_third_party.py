"""The dependencies' private APIs qprep wraps in qprep/third_party.py still exist and still do what qprep relies on.

A failure here after upgrading onnx or onnxscript names the API that changed: adapt qprep/third_party.py (and
only it), or pin the dependency.
"""

import numpy as np
import onnx
import pytest
import onnx_ir as ir
from onnx import helper, numpy_helper
from onnxscript.rewriter import RewriteRuleSet

from graphs import make_graph, make_model
from qprep import third_party
from qprep.model.prepare import name_nodes


def test_onnx_all_tensors_yields_initializers_and_tensor_attributes_of_subgraphs_too():
    constant = helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.zeros(2, np.float32), "cv"))
    branch = make_graph([constant], [], [("c", [2])], name="branch")
    node = helper.make_node("If", ["cond"], ["y"], then_branch=branch, else_branch=branch)
    model = make_model([node], [("cond", [], np.bool_)], [("y", [2])], {"w": np.ones((2, 2), np.float32)},
                       infer_shapes=False)
    tensors = list(third_party.all_tensors(model))
    assert all(isinstance(t, onnx.TensorProto) for t in tensors), "onnx.external_data_helper._get_all_tensors changed"
    assert sorted(t.name for t in tensors) == ["cv", "cv", "w"], \
        "onnx.external_data_helper._get_all_tensors no longer walks initializers and subgraph attributes"


def test_onnxscript_get_numpy_value_reads_initializers_and_constant_nodes_only():
    x = ir.Value(name="x")
    init = ir.Value(name="w", const_value=ir.tensor(np.arange(3, dtype=np.float32)))
    constant = ir.node("Constant", [], attributes={"value": ir.tensor(np.float32(2.5))})
    computed = ir.node("Relu", [x])
    assert isinstance(third_party.numpy_value(init), np.ndarray), "onnxscript _ir_utils.get_numpy_value changed"
    np.testing.assert_array_equal(third_party.numpy_value(init), [0, 1, 2])
    assert float(third_party.numpy_value(constant.outputs[0])) == 2.5
    assert third_party.numpy_value(computed.outputs[0]) is None
    assert third_party.numpy_value(x) is None and third_party.numpy_value(None) is None


def test_onnxscript_materialize_reshape_shape_leaves_the_new_dims_for_its_rewrite():
    data = ir.Value(name="data", shape=ir.Shape([2, 3, 4]), type=ir.TensorType(ir.DataType.FLOAT))
    shape_of = ir.node("Shape", [data])
    reshape = ir.node("Reshape", [data, shape_of.outputs[0]], outputs=[ir.Value(name="y")])
    reshape.outputs[0].shape = ir.Shape(["n", 12])
    reshape.outputs[0].type = ir.TensorType(ir.DataType.FLOAT)
    graph = ir.Graph([data], reshape.outputs, nodes=[shape_of, reshape], opset_imports={"": 18}, name="g")
    model = ir.Model(graph, ir_version=9)

    class Probe(third_party.MaterializeReshapeShape):
        seen: list = []

        def check(self, context, data, shape):
            result = super().check(context, data, shape)
            if result:
                Probe.seen.append(third_party.materialized_dims(self))
            return result

    assert RewriteRuleSet([Probe.rule()]).apply_to_model(model) == 1, "MaterializeReshapeShape no longer matches"
    assert Probe.seen == [[-1, 12]], "MaterializeReshapeShape no longer keeps its shape in `_new_dims`"


def test_onnxruntime_quantization_internals_are_where_the_ort_backend_takes_them():
    ort = third_party.ort_quantization()
    assert {"Conv", "MatMul"} <= set(ort.QDQRegistry) and {"Conv", "MatMul"} <= set(ort.QLinearOpsRegistry), \
        "onnxruntime.quantization.registry changed: the op types ORT quantizes are read from it"
    assert hasattr(ort.QuantizationMode, "IntegerOps") and hasattr(ort.QuantizationMode, "QLinearOps")
    for cls in (ort.ONNXQuantizer, ort.QDQQuantizer):
        assert callable(getattr(cls, "quantize_model", None)), f"{cls.__name__}.quantize_model is gone"
    data = ort.TensorsData(__import__("onnxruntime").quantization.CalibrationMethod.MinMax,
                           {"x": (np.array(-1.0, np.float32), np.array(1.0, np.float32))})
    assert "x" in data, "onnxruntime.quantization.calibrate.TensorsData no longer maps tensor names to ranges"


@pytest.mark.parametrize("method", ["Percentile", "Entropy"])
def test_a_histogram_calibrator_leaves_out_the_tensors_it_is_told_to(tmp_path, method):
    """calibrate_all_but: a tensor holding -inf, kept out, reaches no histogram (which would stop on it) and
    gets no range; the tensors around it still do."""
    ort = third_party.ort_quantization()
    model = make_model([helper.make_node("Add", ["x", "fill"], ["masked"], name="add"),
                        helper.make_node("Softmax", ["masked"], ["p"], name="softmax", axis=-1),
                        helper.make_node("Mul", ["p", "x"], ["y"], name="mul")],
                       [("x", [1, 4])], [("y", [1, 4])], {"fill": np.array([[0, 0, 0, -np.inf]], np.float32)})
    onnx.save(model, str(tmp_path / "m.onnx"))
    calibrator = ort.create_calibrator(tmp_path / "m.onnx", ["Add", "Softmax", "Mul"],
                                       augmented_model_path=str(tmp_path / "augmented.onnx"),
                                       calibrate_method=getattr(ort.CalibrationMethod, method))
    third_party.calibrate_all_but(calibrator, {"masked"})

    class Reader:
        items = iter([{"x": np.random.default_rng(i).standard_normal((1, 4)).astype(np.float32)} for i in range(4)])

        def get_next(self):
            return next(self.items, None)

    calibrator.collect_data(Reader())
    ranges = calibrator.compute_data()
    assert "masked" not in ranges and {"p", "y"} <= set(ranges.keys()), \
        "onnxruntime's histogram calibrators no longer keep only `tensors_to_calibrate`"


def _matmul_initializers(weight: np.ndarray, dynamic: bool) -> dict[str, bytes]:
    """x → MatMul(w) → y quantized by ORT's own quantizer (per channel; dynamic or QDQ) → its initializers' bytes."""
    ort = third_party.ort_quantization()
    model = make_model([helper.make_node("MatMul", ["x", "w"], ["y"])], [("x", [2, 8])], [("y", [2, 6])],
                       {"w": weight}, opset=17)
    options = dict(per_channel=True, reduce_range=False, weight_qType=ort.QuantType.QInt8,
                   activation_qType=ort.QuantType.QUInt8, nodes_to_quantize=[], nodes_to_exclude=[],
                   op_types_to_quantize=["MatMul"], extra_options={})
    if dynamic:
        quantizer = ort.ONNXQuantizer(ort.save_and_reload_model_with_shape_infer(model),
                                      mode=ort.QuantizationMode.IntegerOps, static=False, tensors_range=None, **options)
    else:
        ranges = ort.TensorsData(__import__("onnxruntime").quantization.CalibrationMethod.MinMax,
                                 {n: (np.array(-4.0, np.float32), np.array(4.0, np.float32)) for n in "xy"})
        quantizer = ort.QDQQuantizer(ort.save_and_reload_model_with_shape_infer(model), tensors_range=ranges,
                                     **options)
    quantizer.quantize_model()
    return {t.name: t.SerializeToString() for t in quantizer.model.model.graph.initializer}


@pytest.mark.parametrize("dynamic", [False, True])
def test_the_weight_quantization_memo_answers_what_onnxruntime_computes(dynamic):
    """Built twice inside `weight_quantization_memo`, a per-channel MatMul weight is quantized by ORT's own
    function once (QDQ: compute_data_quant_params, dynamic: quantize_data, once per channel; the second build takes
    the whole weight's scales and integers, or initializers, from the memo), and both models hold the same bytes
    as one built without the memo. A failure means ORT moved or renamed those functions:
    the fallback's builds would then quantize every weight again (slower, not wrong)."""
    from onnxruntime.quantization import base_quantizer, qdq_quantizer

    weight = np.random.default_rng(0).standard_normal((8, 6)).astype(np.float32)

    def build():
        return _matmul_initializers(weight, dynamic)

    module, name = (base_quantizer, "quantize_data") if dynamic else (qdq_quantizer, "compute_data_quant_params")
    original, calls = getattr(module, name), []

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    plain = build()
    memo = {}
    setattr(module, name, counted)
    try:
        with third_party.weight_quantization_memo(memo):
            first, second = build(), build()
    finally:
        setattr(module, name, original)
    assert first == plain and second == plain
    assert len(calls) == 6  # one per output channel, the second build from the memo
    assert sum(key[0] == "weight" for key in memo) == (1 if dynamic else 0)  # one whole-weight entry, hit again
    assert sum(key[0] == "initializer" for key in memo) == (0 if dynamic else 1)  # QDQ: the integers, whole
    assert sum(key[0] == "params" for key in memo) == (0 if dynamic else 1)  # QDQ: its scales, whole


def test_the_scale_memo_gives_the_model_onnxruntime_writes_with_biases_and_a_tensor_left_float():
    """Two Convs with biases (ORT may widen a weight's scale for its bias, after the memo handed it out), built
    again with the first Conv float and then all quantized: each build's bytes are the ones ORT writes alone."""
    ort = third_party.ort_quantization()
    rng = np.random.default_rng(1)
    model = make_model([helper.make_node("Conv", ["x", "w1", "b1"], ["h"]),
                        helper.make_node("Conv", ["h", "w2", "b2"], ["y"])], [("x", [1, 3, 6, 6])],
                       [("y", [1, 4, 4, 4])],
                       {"w1": rng.standard_normal((5, 3, 3, 1)).astype(np.float32) * 1e-4,
                        "b1": rng.standard_normal(5).astype(np.float32) * 1e4,  # beyond int32 on w1's scales
                        "w2": rng.standard_normal((4, 5, 1, 3)).astype(np.float32),
                        "b2": rng.standard_normal(4).astype(np.float32)}, opset=17)
    name_nodes(model.graph)
    ranges = ort.TensorsData(__import__("onnxruntime").quantization.CalibrationMethod.MinMax,
                             {n: (np.array(-4.0, np.float32), np.array(4.0, np.float32)) for n in "xhy"})

    def build(exclude):
        quantizer = ort.QDQQuantizer(
            ort.save_and_reload_model_with_shape_infer(model), per_channel=True, reduce_range=False,
            weight_qType=ort.QuantType.QInt8, activation_qType=ort.QuantType.QUInt8, tensors_range=ranges,
            nodes_to_quantize=[], nodes_to_exclude=exclude, op_types_to_quantize=["Conv"], extra_options={})
        quantizer.quantize_model()
        return quantizer.model.model.SerializeToString()

    first = model.graph.node[0].name
    plain = [build([]), build([first]), build([])]
    memo = {}
    with third_party.weight_quantization_memo(memo):
        memoized = [build([]), build([first]), build([])]
    assert memoized == plain and plain[0] != plain[1]
    assert sum(key[0] == "params" for key in memo) == 2


@pytest.mark.parametrize("dynamic", [False, True])
def test_the_weight_quantization_memo_quantizes_a_changed_weight_of_the_same_name_again(dynamic):
    """The memo knows a weight by its name and settings, then compares its bytes: a weight changed under the same
    name (GPTQ or bias correction in one build, say) is quantized again, not answered from the memo with the old
    weight's integers (dynamic builds: the whole weight's initializers; QDQ builds: its integers)."""
    rng = np.random.default_rng(0)

    def build(weight):
        return _matmul_initializers(weight, dynamic)

    old, new = rng.standard_normal((8, 6)).astype(np.float32), rng.standard_normal((8, 6)).astype(np.float32)
    memo = {}
    with third_party.weight_quantization_memo(memo):
        with_memo = build(old), build(new)
    assert with_memo == (build(old), build(new))
    assert with_memo[0] != with_memo[1]


def test_renaming_inputs_only_in_their_readers_writes_the_model_onnxruntime_writes():
    """ORT's QDQ quantizer renames each quantized tensor in every node (`replace_input_of_all_nodes`); within
    `input_renaming_by_readers` only readers are visited. The model is the same, and ORT's method is back after."""
    from onnxruntime.quantization.onnx_model import ONNXModel

    ort = third_party.ort_quantization()
    rng = np.random.default_rng(0)
    model = make_model([helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
                        helper.make_node("Add", ["r", "h"], ["a"]), helper.make_node("MatMul", ["a", "w"], ["y"])],
                       [("x", [2, 8])], [("y", [2, 8])], {"w": rng.standard_normal((8, 8)).astype(np.float32)},
                       opset=17)

    def build():
        ranges = ort.TensorsData(__import__("onnxruntime").quantization.CalibrationMethod.MinMax,
                                 {n: (np.array(-4.0, np.float32), np.array(4.0, np.float32)) for n in "xhray"})
        quantizer = ort.QDQQuantizer(ort.save_and_reload_model_with_shape_infer(model), tensors_range=ranges,
                                     per_channel=True, reduce_range=False, weight_qType=ort.QuantType.QInt8,
                                     activation_qType=ort.QuantType.QUInt8, nodes_to_quantize=[], nodes_to_exclude=[],
                                     op_types_to_quantize=["MatMul", "Relu", "Add"], extra_options={})
        quantizer.quantize_model()
        return quantizer.model.model.SerializeToString()

    original = ONNXModel.replace_input_of_all_nodes
    plain = build()
    with third_party.input_renaming_by_readers():
        assert ONNXModel.replace_input_of_all_nodes is not original
        renamed = build()
    assert renamed == plain and ONNXModel.replace_input_of_all_nodes is original


def test_a_dynamic_build_skips_onnxruntimes_second_shape_inference_with_the_same_result():
    """ORT's dynamic quantizer replaces Gemms with MatMuls and infers shapes again in its constructor, through
    `onnx_quantizer.save_and_reload_model_with_shape_infer` (a failure of the first assert means it no longer
    does, and `shapes_inferred_already` saves nothing). Done once beforehand (quantize/ort/raw_build.py), the
    build without that second inference writes the same model."""
    from onnxruntime.quantization import onnx_quantizer

    ort = third_party.ort_quantization()
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["h"], transB=1), helper.make_node("MatMul", ["h", "v"], ["y"])]
    model = make_model(nodes, [("x", [2, 8])], [("y", [2, 4])],
                       {"w": rng.standard_normal((6, 8)).astype(np.float32),
                        "b": rng.standard_normal(6).astype(np.float32),
                        "v": rng.standard_normal((6, 4)).astype(np.float32)}, opset=17)

    def build(given):
        quantizer = ort.ONNXQuantizer(given, per_channel=True, reduce_range=False, mode=ort.QuantizationMode.IntegerOps,
                                      static=False, weight_qType=ort.QuantType.QInt8,
                                      activation_qType=ort.QuantType.QUInt8, tensors_range=None, nodes_to_quantize=[],
                                      nodes_to_exclude=[], op_types_to_quantize=["MatMul", "Gemm"],
                                      extra_options={"MatMulConstBOnly": True})
        quantizer.quantize_model()
        quantizer.model.topological_sort()
        return quantizer.model.model

    original, calls = onnx_quantizer.save_and_reload_model_with_shape_infer, []

    def counted(given):
        calls.append(1)
        return original(given)

    onnx_quantizer.save_and_reload_model_with_shape_infer = counted
    try:
        plain = build(ort.save_and_reload_model_with_shape_infer(model))
        assert len(calls) == 1, "ORT's dynamic quantizer no longer infers shapes again through this name"
        prepared = onnx.ModelProto()
        prepared.CopyFrom(model)
        ort.ONNXModel(prepared).replace_gemm_with_matmul()
        prepared = ort.save_and_reload_model_with_shape_infer(prepared)
        with third_party.shapes_inferred_already():
            skipped = build(prepared)
        assert len(calls) == 1
    finally:
        onnx_quantizer.save_and_reload_model_with_shape_infer = original
    assert skipped.graph.SerializeToString() == plain.graph.SerializeToString()


def test_the_ort_backend_does_not_import_torch():
    """onnxruntime.quantization imports torch when it finds it (3.7 s of a small model's run): the backend's
    import hides it. In a fresh interpreter, since torch may be imported in this one already; fails if the
    hiding is dropped while torch is installed, and the interpreter can still import torch afterwards."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed here: nothing to hide (setup.sh installs it beside rknn-toolkit2)")
    code = ("import sys; import qprep.quantize.ort.quantizer; print('torch' in sys.modules); "
            "import importlib.util; print(importlib.util.find_spec('torch') is not None)")
    lines = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert lines[0] == "False", "importing the ORT backend imported torch"
    assert lines[1] == "True", "torch left marked absent"


@pytest.mark.parametrize("dtype", [np.float32, np.int8])
def test_onnxruntime_copies_the_initializers_handed_to_a_session(dtype):
    """model/runtime.py frees the arrays it hands to `add_external_initializers` once the session is built (kept,
    a heavy model's session held its weights twice): ORT must have copied them by then. Zeroing them afterwards
    must not change the outputs."""
    import onnxruntime as ort

    from qprep.model.io import weightless

    rng = np.random.default_rng(0)
    weight = rng.integers(-100, 100, (256, 512)).astype(dtype)  # 128 KB as int8: over io.SMALL_TENSOR
    nodes = [helper.make_node("MatMul", ["x", "wf"], ["y"])]
    if dtype == np.int8:
        nodes.insert(0, helper.make_node("DequantizeLinear", ["w", "s"], ["wf"]))
    else:
        nodes.insert(0, helper.make_node("Identity", ["w"], ["wf"]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 256])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 512])],
                              [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(np.float32(0.5), "s")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    skeleton, big = weightless(model)
    assert [t.name for t in big] == ["w"]
    feeds = {"x": rng.standard_normal((2, 256)).astype(np.float32)}
    for level in (ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
        options = ort.SessionOptions()
        options.graph_optimization_level = level
        expected = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(
            None, feeds)[0]
        array = numpy_helper.to_array(big[0]).copy()
        value = ort.OrtValue.ortvalue_from_numpy(array)
        assert value.data_ptr() == array.ctypes.data  # the OrtValue wraps the array: zeroing it is a real test
        options.add_external_initializers(["w"], [value])
        session = ort.InferenceSession(skeleton.SerializeToString(), options, providers=["CPUExecutionProvider"])
        array[...] = 0  # before the first run too
        np.testing.assert_array_equal(session.run(None, feeds)[0], expected,
                                      err_msg=f"ORT reads add_external_initializers' arrays in place ({level}): "
                                              "model/runtime.ort_session must keep them alive with the session")


def test_onnxscript_matchers_forget_the_graph_of_their_last_match():
    """onnxscript's module-level rules keep the graph they last matched on, and through its tensors the proto the
    IR was read from (the input model, freed by the run before the per-layer error): after
    forget_rewrite_matches nothing of that proto is left."""
    import gc

    from onnxscript.rewriter.rules.common import no_op_transpose_rule

    weight = np.ones((4, 4), np.float32)
    model = make_model([helper.make_node("Transpose", ["x"], ["t"], perm=[0, 1]),
                        helper.make_node("MatMul", ["t", "qprep_forgotten_w"], ["y"])],
                       [("x", [4, 4])], [("y", [4, 4])], {"qprep_forgotten_w": weight})
    ir_model = ir.from_proto(model)
    assert RewriteRuleSet([no_op_transpose_rule]).apply_to_model(ir_model) == 1
    del model, ir_model
    third_party.forget_rewrite_matches()
    gc.collect()
    left = [o for o in gc.get_objects() if isinstance(o, onnx.TensorProto) and o.name == "qprep_forgotten_w"]
    assert not left, "a rewrite rule still holds the graph of its last match (and the proto it was read from)"
