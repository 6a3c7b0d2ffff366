"""qprep/graph/rules.py, the infrastructure every rule shares: names, the opset upgrade, per-channel constants."""

import numpy as np
import onnx_ir as ir
import pytest
from onnx import helper

from graphs import make_graph, make_model
from qprep.graph.names import duplicate_names
from qprep.graph.rules import NewNames, OpsetUpgrade, names_in_use, per_channel, unique_node_name, unique_value_name

UPGRADE = OpsetUpgrade(17, forbidden="{found} at opset {opset}: max_opset {max_opset} < {target}",
                       failed="converting {opset} → {target} failed")


def _model(opset: int = 13) -> ir.Model:
    """Relu → If whose branch holds a node `inner` with output `branch_out` and initializer `branch_w`."""
    branch = make_graph([helper.make_node("Add", ["r", "branch_w"], ["branch_out"], name="inner")], [],
                        [("branch_out", [2])], {"branch_w": np.ones(1, np.float32)}, name="b")
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("If", ["cond"], ["y"], name="if", then_branch=branch, else_branch=branch)]
    return ir.from_proto(make_model(nodes, [("x", [2]), ("cond", [], np.bool_)], [("y", [2])], opset=opset,
                                    infer_shapes=False))


def test_names_in_use_cover_subgraphs_and_hand_out_each_free_name_once():
    model = _model()
    names = names_in_use(model)
    assert {"relu", "if", "inner"} <= names.nodes
    assert {"x", "cond", "r", "y", "branch_out", "branch_w"} <= names.values
    assert [names.node("relu"), names.node("relu"), names.value("branch_w")] == ["relu_1", "relu_2", "branch_w_1"]
    assert unique_node_name(model.graph, "inner") == "inner_1"
    assert unique_value_name(model.graph, "fresh") == "fresh"


@pytest.mark.parametrize("max_opset, found, expected", [
    (21, 0, (False, {})),  # nothing matches: the model is not converted
    (16, 2, (False, {"skipped": "2 at opset 13: max_opset 16 < 17"})),
    (21, 1, (True, {"opset_upgraded_from": 13})),
])
def test_opset_upgrade_converts_only_for_a_match_and_within_max_opset(max_opset, found, expected):
    model = _model(13)
    assert UPGRADE.prepare(model, max_opset, lambda: found) == expected
    assert model.opset_imports[""] == (17 if expected[0] else 13)


def test_opset_upgrade_skips_the_dry_run_when_the_model_is_recent_enough():
    def dry_run():
        raise AssertionError("no dry run needed at opset 17")
    assert UPGRADE.prepare(_model(17), 21, dry_run) == (True, {})


@pytest.mark.parametrize("array, expected", [
    (np.arange(3, dtype=np.float32).reshape(1, 3, 1, 1), [0, 1, 2]),
    (np.arange(3, dtype=np.float32).reshape(3, 1, 1), [0, 1, 2]),
    (np.float32(2), [2, 2, 2]),
    (None, "not a constant"),
    (np.zeros((1, 1, 1, 1, 1), np.float32), "constant of rank 5 on a rank-4 output"),
    (np.zeros((1, 3, 2, 1), np.float32), "constant shape (1, 3, 2, 1) is not per-channel for 3 channels"),
    (np.zeros((2,), np.float32), "constant shape (2,) is not per-channel for 3 channels"),
])
def test_per_channel_reads_one_value_per_channel_or_says_why_not(array, expected):
    result = per_channel(array, 3, 4)
    if isinstance(expected, str):
        assert result == expected
    else:
        np.testing.assert_array_equal(result, expected)
        assert result.dtype == np.float32


def test_new_names_renames_what_onnx_ir_named_inside_a_body_after_an_outer_value():
    """onnx_ir's name authority of an If body knows the body's names only: a node added there unnamed gets
    `val_0`, which the main graph (a dynamo export) already has and the body reads."""
    branch = lambda op, out: make_graph([helper.make_node(op, ["val_0"], [out])], [], [(out, [2])], name=out)  # noqa: E731
    model = ir.from_proto(make_model(
        [helper.make_node("Relu", ["x"], ["val_0"]),
         helper.make_node("If", ["c"], ["y"], then_branch=branch("Neg", "val_1"), else_branch=branch("Abs", "val_2"))],
        [("x", [2]), ("c", [], np.bool_)], [("y", [2])], infer_shapes=False))
    body = next(n for n in model.graph if n.op_type == "If").attributes["then_branch"].as_graph()
    names = NewNames(model)
    added = ir.node("Sigmoid", [body[0].inputs[0]])
    body.insert_before(body[0], added)
    assert added.outputs[0].name == "val_0"  # onnx_ir's choice: the outer value's name
    assert names.settle() == {"val_0": "val_0_1"}
    assert duplicate_names(ir.to_proto(model)) == []
