"""duplicate_names / require_unique: what ONNX Runtime refuses as a name defined twice, and only that."""

import numpy as np
import onnx
import pytest
from onnx import helper

from graphs import make_graph, make_model
from qprep.graph.names import DuplicateNames, duplicate_names, require_unique, value_names


def relu_chain(*outputs: str, names=("a", "b")):
    nodes = [helper.make_node("Relu", ["x"], [outputs[0]], name=names[0]),
             helper.make_node("Relu", [outputs[0]], [outputs[1]], name=names[1])]
    return make_model(nodes, [("x", [2])], [(outputs[1], [2])], infer_shapes=False)


def test_each_kind_of_second_definition_is_found():
    assert duplicate_names(relu_chain("t", "y")) == []
    assert duplicate_names(relu_chain("y", "y")) == ["value 'y'"]  # two node outputs
    assert duplicate_names(relu_chain("t", "y", names=("n", "n"))) == ["node 'n'"]
    assert duplicate_names(relu_chain("x", "y")) == ["value 'x'"]  # a node output that is a graph input
    with_weight = relu_chain("w", "y")
    with_weight.graph.initializer.append(onnx.numpy_helper.from_array(np.ones(2, np.float32), "w"))
    assert duplicate_names(with_weight) == ["value 'w'"]  # an initializer and a node output (issue #61)


def test_an_initializer_listed_as_a_graph_input_is_one_definition():
    """IR < 4 writes every initializer as a graph input too: valid, not a duplicate."""
    model = make_model([helper.make_node("Add", ["x", "w"], ["y"])], [("x", [2]), ("w", [2])], [("y", [2])],
                       {"w": np.ones(2, np.float32)}, infer_shapes=False)
    assert duplicate_names(model) == []


def test_a_branch_output_that_an_enclosing_graph_defines_is_a_duplicate():
    branch = lambda name: make_graph([helper.make_node("Neg", ["x"], [name])], [], [(name, [2])], name="b")  # noqa: E731
    nodes = [helper.make_node("Relu", ["x"], ["a"]),
             helper.make_node("If", ["c"], ["y"], then_branch=branch("t"), else_branch=branch("e"))]
    model = make_model(nodes, [("x", [2]), ("c", [], np.bool_)], [("y", [2]), ("a", [2])], infer_shapes=False)
    assert duplicate_names(model) == []
    model.graph.node[1].attribute[0].g.CopyFrom(branch("a"))
    assert duplicate_names(model) == ["value 'a'"]
    assert {"a", "t"} <= value_names(model)  # the branches' names too


def test_require_unique_names_the_step_that_broke_the_model():
    with pytest.raises(DuplicateNames, match=r"^smooth_layernorm left a model that defines a name twice "
                                             r"\(value 'y'\).*qprep's bug"):
        require_unique(relu_chain("y", "y"), "smooth_layernorm")
    require_unique(relu_chain("t", "y"), "smooth_layernorm")
