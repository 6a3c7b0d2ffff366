import numpy as np
import onnx
import pytest
from onnx import helper

from qprep.errors import ConfigError
from qprep.model.prepare import fix_input_dims_ort_accepts, fix_input_shapes, infer_shapes, name_nodes
from qprep.model.runtime import ort_session, run_model
from graphs import make_graph, make_model, tiny_conv_model


def test_unnamed_and_duplicate_nodes_get_stable_unique_names():
    model = tiny_conv_model()
    model.graph.node.append(onnx.helper.make_node("Relu", ["y"], ["z"], name="dup"))
    model.graph.node.append(onnx.helper.make_node("Relu", ["z"], ["w"], name="dup"))
    assert name_nodes(model.graph) == 3
    names = [n.name for n in model.graph.node]
    assert names == ["Conv_0", "Relu_0", "dup", "dup_0"]
    again = tiny_conv_model()
    name_nodes(again.graph)
    assert [n.name for n in again.graph.node] == names[:2]  # same model → same names


def test_fix_input_shapes_sets_dynamic_dims_and_refuses_changing_static_ones():
    model = tiny_conv_model()
    assert fix_input_shapes(model, {"x": [1, 3, 8, 8]}) == ["x"]
    dims = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    assert dims == [1, 3, 8, 8]
    with pytest.raises(ConfigError, match=r"inputs\.x\[2\]: the model fixes this dim to 8"):
        fix_input_shapes(tiny_conv_model(), {"x": [1, 3, 16, 16]})
    with pytest.raises(ConfigError, match=r"inputs\.y: the model has no input 'y'"):
        fix_input_shapes(tiny_conv_model(), {"y": [1]})
    with pytest.raises(ConfigError, match="rank 4"):
        fix_input_shapes(tiny_conv_model(), {"x": [1, 3]})


def test_shape_inference_never_fatal(monkeypatch):
    def broken(model, **_):
        raise onnx.shape_inference.InferenceError("[ShapeInferenceError] unsupported op")

    model = tiny_conv_model()
    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", broken)
    same, warning = infer_shapes(model)
    assert same is model
    assert warning.startswith("shape inference failed ([ShapeInferenceError] unsupported op)")


def if_model_with_state() -> onnx.ModelProto:
    """x[N,4], state[2,N,8], sr → If(sr == 16000) whose branch holds the `if state.shape[1] == 1: squeeze`
    torch exports: with N fixed to 2 the squeeze branch never runs, but ORT infers its shapes and refuses it."""
    one = np.array([1], np.int64)
    squeeze = make_graph([helper.make_node("Squeeze", ["state", "one"], ["s_sq"]),
                          helper.make_node("Unsqueeze", ["s_sq", "one"], ["s_out"])], [], [("s_out", [2, "N", 8])],
                         {"one": one})
    keep = make_graph([helper.make_node("Identity", ["state"], ["s_id"])], [], [("s_id", [2, "N", 8])])
    rate_16k = make_graph([helper.make_node("Shape", ["state"], ["shape"]),
                           helper.make_node("Gather", ["shape", "index"], ["batch"], axis=0),
                           helper.make_node("Equal", ["batch", "single"], ["is_one"]),
                           helper.make_node("If", ["is_one"], ["s"], then_branch=squeeze, else_branch=keep),
                           helper.make_node("Mul", ["s", "two"], ["state_out"]),
                           helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=1)],
                          [], [("y", ["N", 1]), ("state_out", [2, "N", 8])],
                          {"index": np.array(1, np.int64), "single": np.array(1, np.int64),
                           "two": np.array(2, np.float32), "axes": one})
    other = make_graph([helper.make_node("Identity", ["x"], ["y2"]), helper.make_node("Identity", ["state"], ["st2"])],
                       [], [("y2", ["N", None]), ("st2", [2, "N", 8])])
    return make_model([helper.make_node("Equal", ["sr", "sr16k"], ["c"]),
                       helper.make_node("If", ["c"], ["y", "stateN"], then_branch=rate_16k, else_branch=other)],
                      [("x", ["N", 4]), ("state", [2, "N", 8]), ("sr", [], np.int64)],
                      [("y", ["N", None]), ("stateN", [2, "N", 8])],
                      {"sr16k": np.array(16000, np.int64)}, infer_shapes=False)


def test_dims_that_make_ort_refuse_a_model_with_if_branches_are_left_symbolic_and_the_rest_fixed():
    shapes = {"x": [2, 4], "state": [2, 2, 8]}
    refused = if_model_with_state()
    fix_input_shapes(refused, shapes)
    with pytest.raises(Exception, match="inferencing failed"):  # what main wrote into the model
        ort_session(refused)
    model = if_model_with_state()
    fixed, refused = fix_input_dims_ort_accepts(model, shapes)
    assert fixed == ["x"] and list(refused) == ["state"] and "inferencing failed" in refused["state"]
    assert [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim] == [2, 4]
    feeds = {"x": np.ones((2, 4), np.float32), "state": np.ones((2, 2, 8), np.float32), "sr": np.array(16000)}
    y, state = run_model(model, [feeds], optimize=True)[0].values()
    assert y.tolist() == [[4.0], [4.0]] and float(state.sum()) == 64.0


def test_models_without_control_flow_get_every_dim_fixed_without_an_ort_check():
    model = tiny_conv_model()
    assert fix_input_dims_ort_accepts(model, {"x": [1, 3, 8, 8]}) == (["x"], {})


def test_input_dims_are_fixed_in_place_without_copying_the_model():
    """A copied-back proto keeps the old copy in its memory (protobuf frees a message's memory only with the whole
    message): a big model held twice from load on. In place, a part of the model read before sees the new dims;
    with no dims to fix nothing is touched; a bad entry is refused before any dim changes."""
    model = tiny_conv_model()
    dim = model.graph.input[0].type.tensor_type.shape.dim[0]
    weight = model.graph.initializer[0]
    assert fix_input_dims_ort_accepts(model, {}) == ([], {})
    assert fix_input_dims_ort_accepts(model, {"x": [1, 3, 8, 8]}) == (["x"], {})
    assert dim.dim_value == 1 and weight.name == "w"
    with pytest.raises(ConfigError, match="rank"):
        fix_input_dims_ort_accepts(tiny_conv_model(), {"x": [1, 3, 8]})
    model = tiny_conv_model()
    with pytest.raises(ConfigError):
        fix_input_dims_ort_accepts(model, {"x": [2, 3, 8, 8], "nope": [1]})
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "N"  # not half-fixed
