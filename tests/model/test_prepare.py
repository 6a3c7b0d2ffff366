import onnx
import pytest

from qprep.errors import ConfigError
from qprep.model.prepare import fix_input_shapes, infer_shapes, name_nodes
from graphs import tiny_conv_model


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
