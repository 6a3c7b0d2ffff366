"""Sample values the model cannot take are refused before the run (qprep/data/bounds.py): ids beyond the table a
Gather looks them up in, masks that are not 0 and 1."""

import numpy as np
import onnx
import pytest
from onnx import helper

from graphs import make_model, masked_attention_model, two_input_model
from qprep.data import SampleSet
from qprep.data.bounds import check_values, input_bounds
from qprep.errors import DataError


def ids_samples(*highest: int, name: str = "ids", dtype=np.int64) -> SampleSet:
    """One sample per `highest`: ids 0..highest."""
    return SampleSet(samples=[{name: np.arange(top + 1, dtype=dtype).reshape(1, -1)} for top in highest],
                     files=[f"/data/{i:02d}.npz" for i in range(len(highest))])


def test_ids_beyond_the_table_are_refused_naming_the_sample_the_largest_id_and_the_table():
    model = two_input_model()  # Gather over a 10-row table
    check_values(model, ids_samples(9, 3), "calibration")  # -10..9 is what Gather takes
    with pytest.raises(DataError) as refused:
        check_values(model, ids_samples(9, 300, 40), "calibration")
    message = str(refused.value)
    assert message.startswith("calibration sample 01.npz: input 'ids' holds id 300")
    assert "10 rows of table 'emb'" in message and "-10..9" in message and "2 of 3 samples" in message
    negative = SampleSet(samples=[{"ids": np.array([[-11, 0]], np.int64)}], files=["/data/n.npz"])
    with pytest.raises(DataError, match="holds id -11"):
        check_values(model, negative, "evaluation")


def test_the_ids_reach_the_gather_through_ops_that_pass_them_on():
    nodes = [helper.make_node("Cast", ["ids"], ["ids64"], to=onnx.TensorProto.INT64),
             helper.make_node("Reshape", ["ids64", "shape"], ["flat"]),
             helper.make_node("Unsqueeze", ["flat", "axes"], ["rows"]),
             helper.make_node("Gather", ["table", "rows"], ["y"], axis=1)]
    model = make_model(nodes, [("ids", [1, 4], np.int32)], [("y", None)],
                       {"table": np.zeros((3, 7), np.float32), "shape": np.array([-1], np.int64),
                        "axes": np.array([0], np.int64)}, infer_shapes=False)
    bound = input_bounds(model)["ids"]
    assert (bound.low, bound.high) == (-7, 6)  # the gathered axis (1), not the rows
    with pytest.raises(DataError, match="holds id 7"):
        check_values(model, ids_samples(7, dtype=np.int32), "calibration")


def test_ids_that_are_gathered_from_or_index_a_computed_table_have_no_bound():
    as_data = make_model([helper.make_node("Gather", ["ids", "index"], ["y"])], [("ids", [1, 4], np.int64)],
                         [("y", None)], {"index": np.array([0], np.int64)}, infer_shapes=False)
    computed = make_model([helper.make_node("Relu", ["x"], ["table"]),
                           helper.make_node("Gather", ["table", "ids"], ["y"])],
                          [("x", [5, 2]), ("ids", [1, 4], np.int64)], [("y", None)], infer_shapes=False)
    assert input_bounds(as_data) == {} and input_bounds(computed) == {}


def test_a_mask_the_graph_casts_to_bool_or_named_mask_must_hold_zero_and_one():
    attention = masked_attention_model()  # float mask → Cast(bool) → Not → Where
    x = np.zeros((1, 6, 8), np.float32)
    good = SampleSet(samples=[{"x": x, "mask": np.array([[1, 1, 1, 0, 0, 0]], np.float32)}], files=["/d/a.npz"])
    check_values(attention, good, "calibration")
    bad = SampleSet(samples=[{"x": x, "mask": np.array([[1, 2, 1, 0, 0, 0]], np.float32)}], files=["/d/a.npz"])
    with pytest.raises(DataError, match=r"sample a.npz: input 'mask' holds value 2, outside the mask values 0 and 1 "
                                        r"\(node 'mask_cast' casts it to bool"):
        check_values(attention, bad, "evaluation")
    named = make_model([helper.make_node("Cast", ["attention_mask"], ["y"], to=onnx.TensorProto.FLOAT)],
                       [("attention_mask", [1, 3], np.int64)], [("y", None)], infer_shapes=False)
    with pytest.raises(DataError, match="its name says it is a mask"):
        check_values(named, SampleSet(samples=[{"attention_mask": np.array([[1, 1, 3]])}], files=["/d/b.npz"]),
                     "calibration")
    image_mask = make_model([helper.make_node("Cast", ["mask"], ["y"], to=onnx.TensorProto.FLOAT)],
                            [("mask", [1, 1, 8, 8], np.uint8)], [("y", None)], infer_shapes=False)
    assert input_bounds(image_mask) == {}  # an inpainting mask may hold 0..255


def test_a_list_names_the_file_of_the_input_that_holds_the_id():
    model = make_model([helper.make_node("Gather", ["table", "ids"], ["g"]),
                        helper.make_node("Add", ["g", "x"], ["y"])],
                       [("x", [1, 1, 2]), ("ids", [1, 1], np.int64)], [("y", None)],
                       {"table": np.zeros((4, 2), np.float32)}, infer_shapes=False)
    samples = SampleSet(samples=[{"x": np.zeros((1, 1, 2), np.float32), "ids": np.array([[12]], np.int64)}],
                        files=["/d/x0.npy"], format="list", every_file=["/d/x0.npy", "/d/ids0.npy"])
    with pytest.raises(DataError, match="sample ids0.npy: input 'ids' holds id 12"):
        check_values(model, samples, "calibration")
