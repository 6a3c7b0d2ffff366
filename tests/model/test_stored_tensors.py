"""A tensor stored with fewer (or more) bytes than its shape and type need is refused in one line naming the
tensor and the file, from sizes alone: an inline raw_data cut short, typed values missing, an external `length`
that lies, a data file cut short. Before: onnx loaded them and qprep failed later on "cannot reshape array of
size 4 into shape (4,4)" (exit 3)."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphs import make_model
from qprep.errors import EXIT_USAGE, ModelError
from qprep.model.stored_tensors import check_stored_sizes


def matmul(weights=None) -> onnx.ModelProto:
    """x[N,4] @ W[4,4] → y: the probe's model."""
    W = weights if weights is not None else numpy_helper.from_array(np.arange(16, dtype=np.float32).reshape(4, 4), "W")
    return make_model([helper.make_node("MatMul", ["x", "W"], ["y"])], [("x", ["N", 4])], [("y", ["N", 4])],
                      [W], infer_shapes=False)


def every_kind() -> onnx.ModelProto:
    """Tensors of many types, as raw_data and as typed values, and one in a Constant node's attribute."""
    tensors = [numpy_helper.from_array(np.ones((2, 3), dtype), f"raw_{np.dtype(dtype).name}")
               for dtype in (np.float32, np.float16, np.int64, np.int8, np.uint8, np.bool_, np.float64)]
    tensors += [helper.make_tensor("typed_float", TensorProto.FLOAT, [2, 2], [1.0, 2.0, 3.0, 4.0]),
                helper.make_tensor("typed_half", TensorProto.FLOAT16, [3], np.ones(3, np.float16)),
                helper.make_tensor("typed_int4", TensorProto.INT4, [3], [1, -2, 3]),
                helper.make_tensor("raw_int4", TensorProto.INT4, [3], b"\x21\x03", raw=True),
                helper.make_tensor("typed_bf16", TensorProto.BFLOAT16, [2], [1.0, 2.0]),
                numpy_helper.from_array(np.array([1 + 2j, 3 + 4j], np.complex64), "raw_c64"),
                helper.make_tensor("text", TensorProto.STRING, [2], [b"a", b"b"]),
                helper.make_tensor("empty", TensorProto.FLOAT, [0, 4], [])]
    constant = helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.ones(5, np.float32)))
    graph = helper.make_graph([constant, helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
                              [matmul().graph.initializer[0], *tensors])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def external(tmp_path, model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` saved with every tensor in w.bin, read back without its data (as qprep's loader reads it)."""
    onnx.save(model, tmp_path / "m.onnx", save_as_external_data=True, all_tensors_to_one_file=True,
              location="w.bin", size_threshold=0)
    return onnx.load(tmp_path / "m.onnx", load_external_data=False)


def set_external(model: onnx.ModelProto, name: str, key: str, value: str | None) -> None:
    tensor = next(t for t in model.graph.initializer if t.name == name)
    entries = {e.key: e.value for e in tensor.external_data}
    if value is None:
        entries.pop(key)
    else:
        entries[key] = value
    del tensor.external_data[:]
    for k, v in entries.items():
        tensor.external_data.add(key=k, value=v)


def test_models_whose_tensors_are_whole_pass_inline_and_external(tmp_path):
    check_stored_sizes(every_kind(), tmp_path / "m.onnx")
    check_stored_sizes(external(tmp_path, every_kind()), tmp_path / "m.onnx")
    model = external(tmp_path, matmul())
    set_external(model, "W", "length", None)  # no length: read to the end of the file, which is exactly W
    check_stored_sizes(model, tmp_path / "m.onnx")


def test_inline_bytes_cut_short_are_refused_naming_tensor_and_file(tmp_path):
    model = matmul()
    model.graph.initializer[0].raw_data = model.graph.initializer[0].raw_data[:16]
    with pytest.raises(ModelError) as raised:
        check_stored_sizes(model, tmp_path / "m.onnx")
    assert str(raised.value) == (
        f"{tmp_path / 'm.onnx'}: tensor 'W' of shape [4, 4] (float, 16 values) stores 16 bytes where it needs 64; "
        "the model file is truncated or corrupt: re-export or re-download it")
    assert raised.value.exit_code == EXIT_USAGE
    typed = helper.make_tensor("W", TensorProto.FLOAT, [4, 4], np.ones(16, np.float32))
    del typed.float_data[4:]
    with pytest.raises(ModelError, match=r"tensor 'W' of shape \[4, 4\] .* stores 4 entries in float_data where "
                                         r"it needs 16"):
        check_stored_sizes(matmul(typed), tmp_path / "m.onnx")


def test_a_constant_nodes_tensor_is_checked_too(tmp_path):
    model = every_kind()
    model.graph.node[0].attribute[0].t.raw_data = b"\0" * 8
    with pytest.raises(ModelError, match=r"tensor '' of shape \[5\] \(float, 5 values\) stores 8 bytes where it "
                                         r"needs 20"):
        check_stored_sizes(model, tmp_path / "m.onnx")


def test_an_external_length_that_lies_is_refused_naming_the_data_file(tmp_path):
    model = external(tmp_path, matmul())
    set_external(model, "W", "length", "16")
    with pytest.raises(ModelError, match=r"^[^\n]*m.onnx: tensor 'W' of shape \[4, 4\] \(float, 16 values\) is "
                                         r"stored as 16 bytes in 'w.bin' at offset 0 where it needs 64;[^\n]*$"):
        check_stored_sizes(model, tmp_path / "m.onnx")


@pytest.mark.parametrize("length", ["64", None])
def test_a_data_file_cut_short_is_refused_without_reading_it(tmp_path, length):
    model = external(tmp_path, matmul())
    set_external(model, "W", "length", length)
    (tmp_path / "w.bin").write_bytes((tmp_path / "w.bin").read_bytes()[:16])
    with pytest.raises(ModelError, match=r"tensor 'W' .* needs 64 bytes in 'w.bin' at offset 0, but "
                                         r".*w.bin holds 16 bytes; the data file is truncated"):
        check_stored_sizes(model, tmp_path / "m.onnx")


def test_without_a_length_the_rest_of_the_file_must_be_the_tensor(tmp_path):
    model = external(tmp_path, matmul())
    set_external(model, "W", "length", None)
    with open(tmp_path / "w.bin", "ab") as f:
        f.write(b"\0" * 8)
    with pytest.raises(ModelError, match=r"stored from 'w.bin' at offset 0 to the end of the file, 72 bytes where "
                                         r"it needs 64"):
        check_stored_sizes(model, tmp_path / "m.onnx")


def test_a_missing_data_file_is_left_to_the_loaders_own_refusal(tmp_path):
    model = external(tmp_path, matmul())
    (tmp_path / "w.bin").unlink()
    check_stored_sizes(model, tmp_path / "m.onnx")


def test_the_loader_refuses_a_model_whose_external_data_is_short(tmp_path):
    """Wired where every command loads a model: the probe's model had run to exit 3 ("cannot reshape")."""
    from qprep.model.load import load_model_and_data_files

    model = external(tmp_path, matmul())
    set_external(model, "W", "length", "16")
    onnx.save(model, tmp_path / "m.onnx")
    with pytest.raises(ModelError, match="is stored as 16 bytes in 'w.bin'"):
        load_model_and_data_files(tmp_path / "m.onnx")
