"""ORT's quantizer failing on one node: the node is found, kept float with ORT's message, the rest quantized."""

import numpy as np
import pytest
from onnx import helper

from conftest import run_on_samples, typed
from graphs import make_model, rand
from qprep.model.prepare import name_nodes
from qprep.model.runtime import run_model
from qprep.quantize.ort.quantizer import OrtQuantizer


def _matmuls_and_a_gemm_ort_cannot_take():
    """x → MatMul → Relu → Gemm(C [1, 6]) → MatMul → y. The Gemm is valid ONNX and runs; ORT's per-channel
    quantizer fails on its 2-D bias (a tf2onnx/jax2tf export fused as is)."""
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["a"]), helper.make_node("Relu", ["a"], ["r"]),
             helper.make_node("Gemm", ["r", "w2", "c"], ["g"]), helper.make_node("MatMul", ["g", "w3"], ["y"])]
    model = make_model(nodes, [("x", [4, 8])], [("y", [4, 5])],
                       {"w1": rand(8, 8, seed=1), "w2": rand(8, 6, seed=2), "c": rand(1, 6, seed=3),
                        "w3": rand(6, 5, seed=4)}, infer_shapes=False)
    name_nodes(model.graph)
    return model


@pytest.mark.parametrize("weights", ["int8", "uint8"])
def test_the_node_the_quantizer_fails_on_is_kept_float_and_the_rest_quantized(tmp_path, weights):
    """int8 weights: ORT's quantizer raises on the Gemm; uint8: it writes a model ORT cannot run. Both times the
    Gemm is found and kept float."""
    model = _matmuls_and_a_gemm_ort_cannot_take()
    samples = [{"x": rand(4, 8, seed=s)} for s in range(8)]
    options = typed("ort", weight_type=weights)
    quantizer = OrtQuantizer(model, samples, options, tmp_path)
    quantized = quantizer.build(set())
    assert list(quantizer.unquantizable) == ["Gemm_0"]
    reason = quantizer.unquantizable["Gemm_0"]
    assert "truth value of an array" in reason if weights == "int8" else (
        "c_DequantizeLinear" in reason and "scale must be 1D" in reason)  # the node and ORT's explanation
    dequantized = {o for n in quantized.graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    inputs = {n.name: list(n.input) for n in quantized.graph.node}
    assert inputs["MatMul_0"][1] in dequantized and inputs["MatMul_1"][1] in dequantized  # int8 weights
    assert inputs["Gemm_0"][1:] == ["w2", "c"]  # float weight and bias
    expected, actual = run_model(model, samples), run_model(quantized, samples, optimize=True)
    error = max(np.abs(e["y"] - a["y"]).max() / np.abs(e["y"]).max() for e, a in zip(expected, actual))
    assert error < 0.05
    quantizer.build({"MatMul_0"})  # later builds leave it out without searching again
    assert list(quantizer.unquantizable) == ["Gemm_0"]


def test_a_model_ort_quantizes_nothing_in_says_so(tmp_path):
    """Exp only (ORT quantizes no such op; the same holds for ops inside If/Loop branches, which its quantizer
    never enters): the run is ok, and the report says the result is the float model."""
    import onnx

    import qprep

    onnx.save(make_model([helper.make_node("Exp", ["x"], ["y"])], [("x", [1, 4])], [("y", [1, 4])]),
              tmp_path / "m.onnx")
    (tmp_path / "calib").mkdir()
    for i in range(4):
        np.save(tmp_path / "calib" / f"{i}.npy", np.random.default_rng(i).random((1, 4), dtype=np.float32))
    report = qprep.run({"model": str(tmp_path / "m.onnx"), "calibration": {"source": str(tmp_path / "calib")},
                        "pipeline": [{"quantize": {}}]}, output_dir=str(tmp_path / "out"))
    assert any("ONNX Runtime quantized nothing" in w for w in report["warnings"])


def if_model(head: bool = False):
    """x[1,4], flag → If 'by_rate' with a MatMul in each branch → y[1,4] (with `head`: → MatMul → z[1,4])."""
    import onnx
    from onnx import TensorProto

    def branch(name: str, scale: float) -> onnx.GraphProto:
        weight = onnx.numpy_helper.from_array(np.full((4, 4), scale, np.float32), f"w_{name}")
        return helper.make_graph([helper.make_node("MatMul", ["x", f"w_{name}"], [f"y_{name}"])], name, [],
                                 [helper.make_tensor_value_info(f"y_{name}", TensorProto.FLOAT, [1, 4])], [weight])

    nodes = [helper.make_node("If", ["flag"], ["y"], name="by_rate", then_branch=branch("a", 0.5),
                              else_branch=branch("b", 2.0))]
    weights = []
    if head:
        nodes.append(helper.make_node("MatMul", ["y", "w_head"], ["z"], name="head"))
        weights.append(onnx.numpy_helper.from_array(np.random.default_rng(0).random((4, 4), np.float32), "w_head"))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4]),
                                           helper.make_tensor_value_info("flag", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("z" if head else "y", TensorProto.FLOAT, [1, 4])],
                              weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def if_samples(folder):
    folder.mkdir()
    for i in range(4):
        np.savez(folder / f"{i}.npz", x=np.random.default_rng(i).random((1, 4), dtype=np.float32),
                 flag=np.array(i % 2 == 0))


def test_layers_only_inside_an_if_are_refused_not_returned_float(tmp_path):
    """A MatMul in each branch of an If on a data input (Silero VAD v4/v5: LSTMs in an If on the sample rate):
    ORT's quantizer does not enter the branches, so the run would return the float model as its INT8 result
    (it said `ok`, cosine 1.0000). Refused in one line naming the If."""
    import onnx

    import qprep
    from qprep.errors import QprepError

    onnx.save(if_model(), tmp_path / "m.onnx")
    if_samples(tmp_path / "calib")
    with pytest.raises(QprepError, match="inside control flow \\(If 'by_rate'\\).*backend fp16"):
        qprep.run({"model": str(tmp_path / "m.onnx"), "calibration": {"source": str(tmp_path / "calib")},
                   "pipeline": [{"quantize": {}}]}, output_dir=str(tmp_path / "out"))


def test_layers_left_float_inside_control_flow_are_counted_in_the_result(tmp_path):
    """With a layer outside the If quantized, the report said "100% of the multiply-adds run on integers" of a
    Keras LSTM exported as a Loop (tf2onnx): the share cannot count the bodies, so the report says they run float."""
    import onnx

    import qprep

    onnx.save(if_model(head=True), tmp_path / "m.onnx")
    if_samples(tmp_path / "calib")
    report = qprep.run({"model": str(tmp_path / "m.onnx"), "calibration": {"source": str(tmp_path / "calib")},
                        "pipeline": [{"quantize": {}}]}, output_dir=str(tmp_path / "out"))
    assert report["result"]["float_layers_in_bodies"] == 2
    assert "2 layers inside If/Loop/Scan bodies run float" in (tmp_path / "out" / "report.md").read_text()


def test_a_model_with_only_integer_outputs_quantizes(tmp_path):
    """Conv → ArgMax: no float output to measure bias correction by (it crashed: `by_waves` unbound)."""
    rng = np.random.default_rng(0)
    model = make_model([helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
                        helper.make_node("ArgMax", ["c"], ["label"], axis=1, keepdims=0)],
                       [("x", [1, 3, 8, 8])], [("label", [1, 8, 8], np.int64)],
                       {"w": rng.standard_normal((4, 3, 3, 3)).astype(np.float32)})
    report = run_on_samples(tmp_path, model, [{"x": rand(1, 3, 8, 8, seed=i)} for i in range(4)],
                            [{"quantize": {"backend": "ort", "ort": {"activations": "static"}}}], evaluate=False)
    stage = next(s for s in report["stages"] if s["name"] == "quantize")
    assert stage["op_counts_after"].get("QuantizeLinear", 0) >= 1
    assert report["status"] == "ok"


def test_a_zipmap_output_is_refused_in_one_line_naming_it(tmp_path):
    """sklearn's ZipMap output (a sequence of maps): onnx-ir cannot read the model; it crashed in the optimize
    stage with a SerdeError."""
    import onnx
    from onnx import TensorProto

    import qprep
    from qprep.errors import ModelError

    zipmap = helper.make_node("ZipMap", ["p"], ["probabilities"], domain="ai.onnx.ml", classlabels_int64s=[0, 1])
    seq_map = helper.make_sequence_type_proto(helper.make_map_type_proto(TensorProto.INT64, helper.make_tensor_type_proto(TensorProto.FLOAT, [])))
    graph = helper.make_graph([helper.make_node("Softmax", ["x"], ["p"]), zipmap], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
                              [helper.make_value_info("probabilities", seq_map)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid("ai.onnx.ml", 1)])
    onnx.save(model, tmp_path / "m.onnx")
    (tmp_path / "calib").mkdir()
    np.save(tmp_path / "calib" / "0.npy", rand(1, 2))
    with pytest.raises(ModelError, match="'probabilities' is a map or a sequence of maps.*zipmap"):
        qprep.run({"model": str(tmp_path / "m.onnx"), "calibration": {"source": str(tmp_path / "calib")},
                   "pipeline": [{"optimize": {}}, {"quantize": {}}]}, output_dir=str(tmp_path / "out"))


def test_a_sequence_output_quantizes(tmp_path):
    """A SequenceConstruct output beside a tensor one: the extreme-value scan read every value as an array and
    crashed on the sequence (a list)."""
    import onnx
    from onnx import TensorProto

    rng = np.random.default_rng(0)
    sequence = helper.make_sequence_type_proto(helper.make_tensor_type_proto(TensorProto.FLOAT, None))
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c"], ["r"]),
         helper.make_node("SequenceConstruct", ["c", "r"], ["seq"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_value_info("seq", sequence), helper.make_tensor_value_info("r", TensorProto.FLOAT, [1, 4, 8, 8])],
        [onnx.numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    report = run_on_samples(tmp_path, model, [{"x": rand(1, 3, 8, 8, seed=i)} for i in range(4)],
                            [{"optimize": {}}, {"quantize": {"backend": "ort"}}])
    assert report["evaluation"]["outputs"]["r"]["cosine_mean"] > 0.99
