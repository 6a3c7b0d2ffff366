"""Are a model's tensors stored with as many bytes as their shape and type need? Checked at load, before any byte
of external data is read.

Why: a weight cut short (a truncated download of the data file, an inline raw_data cut, an external `length`
that lies) loads without a word in onnx and fails later as "cannot reshape array of size 4 into shape (4,4)",
an internal error after the run directory exists. Sizes only are compared (the proto's own byte counts, the
data file's size against each tensor's offset and length), so a 2 GB model is not read twice to check it.
"""

from __future__ import annotations

import math
import os
import stat
from pathlib import Path

import onnx
from onnx import TensorProto

from qprep.errors import ModelError
from qprep.third_party import all_tensors

_T = TensorProto
BITS = {  # bits one element takes in raw_data; STRING has no raw form
    _T.FLOAT: 32, _T.UINT8: 8, _T.INT8: 8, _T.UINT16: 16, _T.INT16: 16, _T.INT32: 32, _T.INT64: 64, _T.BOOL: 8,
    _T.FLOAT16: 16, _T.DOUBLE: 64, _T.UINT32: 32, _T.UINT64: 64, _T.COMPLEX64: 64, _T.COMPLEX128: 128,
    _T.BFLOAT16: 16, _T.FLOAT8E4M3FN: 8, _T.FLOAT8E4M3FNUZ: 8, _T.FLOAT8E5M2: 8, _T.FLOAT8E5M2FNUZ: 8,
    _T.UINT4: 4, _T.INT4: 4, _T.FLOAT4E2M1: 4,
}
PACKED = {_T.UINT4, _T.INT4, _T.FLOAT4E2M1}  # two elements per int32_data entry, as raw_data


def _typed_field(dtype: int, count: int) -> tuple[str, int] | None:
    """(the typed field a tensor without raw_data keeps its values in, how many entries `count` elements take)."""
    if dtype in PACKED:
        return "int32_data", math.ceil(count / 2)
    fields = {_T.FLOAT: ("float_data", 1), _T.COMPLEX64: ("float_data", 2), _T.DOUBLE: ("double_data", 1),
              _T.COMPLEX128: ("double_data", 2), _T.INT64: ("int64_data", 1), _T.UINT32: ("uint64_data", 1),
              _T.UINT64: ("uint64_data", 1), _T.STRING: ("string_data", 1)}
    if dtype in fields:
        name, per = fields[dtype]
        return name, count * per
    return ("int32_data", count) if dtype in BITS else None


def check_stored_sizes(model: onnx.ModelProto, model_path: str | os.PathLike) -> None:
    """Raise a one-line ModelError naming the tensor and the file when a tensor's stored bytes (inline, or its
    external data's length, offset and file size) do not match its shape and type. A data file that is missing
    or no regular file is left to the external-data checks that refuse it."""
    model_path = Path(model_path)
    file_sizes: dict[str, int | None] = {}
    for tensor in all_tensors(model):
        if tensor.HasField("segment") or any(d < 0 for d in tensor.dims) or tensor.data_type == _T.UNDEFINED:
            continue  # no size to hold it to: the checker refuses these on its own
        count = math.prod(tensor.dims)
        if tensor.data_location == _T.EXTERNAL:
            _check_external(tensor, count, model_path, file_sizes)
        else:
            _check_inline(tensor, count, model_path)


def _what(tensor: TensorProto, count: int) -> str:
    dtype = TensorProto.DataType.Name(tensor.data_type).lower()
    return f"tensor '{tensor.name}' of shape {list(tensor.dims)} ({dtype}, {count} values)"


def _check_inline(tensor: TensorProto, count: int, model_path: Path) -> None:
    if tensor.raw_data:
        if tensor.data_type in BITS and len(tensor.raw_data) != _bytes(tensor, count):
            raise ModelError(f"{model_path}: {_what(tensor, count)} stores {len(tensor.raw_data)} bytes where it "
                             f"needs {_bytes(tensor, count)}; the model file is truncated or corrupt: re-export or "
                             "re-download it")
        return
    typed = _typed_field(tensor.data_type, count)
    if typed is not None and len(getattr(tensor, typed[0])) != typed[1]:
        raise ModelError(f"{model_path}: {_what(tensor, count)} stores {len(getattr(tensor, typed[0]))} entries in "
                         f"{typed[0]} where it needs {typed[1]}; the model file is corrupt: re-export it")


def _check_external(tensor: TensorProto, count: int, model_path: Path, file_sizes: dict[str, int | None]) -> None:
    if tensor.data_type not in BITS:
        return
    info = {entry.key: entry.value for entry in tensor.external_data}
    location = info.get("location", "")
    if location not in file_sizes:
        file_sizes[location] = _regular_size(model_path.parent / location)
    size = file_sizes[location]
    if size is None:
        return
    try:
        offset, length = int(info.get("offset") or 0), int(info.get("length") or 0)
    except ValueError:
        raise ModelError(f"{model_path}: {_what(tensor, count)} has an external offset/length that is no number "
                         f"({info.get('offset')!r}, {info.get('length')!r}); re-export the model") from None
    need, where = _bytes(tensor, count), f"'{location}' at offset {offset}"
    if length and length != need:
        raise ModelError(f"{model_path}: {_what(tensor, count)} is stored as {length} bytes in {where} where it "
                         f"needs {need}; the model or its data file is corrupt: re-export or re-download both")
    if offset + need > size:
        raise ModelError(f"{model_path}: {_what(tensor, count)} needs {need} bytes in {where}, but "
                         f"{model_path.parent / location} holds {size} bytes; the data file is truncated: "
                         "re-download or re-export it")
    if not length and size - offset != need:  # no length: onnx reads to the end of the file
        raise ModelError(f"{model_path}: {_what(tensor, count)} is stored from {where} to the end of the file, "
                         f"{size - offset} bytes where it needs {need}; give its length or re-export the model")


def _bytes(tensor: TensorProto, count: int) -> int:
    return math.ceil(count * BITS[tensor.data_type] / 8)


def _regular_size(path: Path) -> int | None:
    """The file's size without opening it (a FIFO is not waited on); None when it is no regular file."""
    try:
        status = os.stat(path)
    except (OSError, ValueError):
        return None
    return status.st_size if stat.S_ISREG(status.st_mode) else None
