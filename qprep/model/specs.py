"""A graph input or output as qprep reads it (name, numpy dtype, dims), and samples cast to a model's input types.

Why apart from info.py: running a model (runtime.py) needs these, and info.py's multiply-adds run the model when
shape inference cannot tell a layer's shape; below both, neither needs the other's module.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper


@dataclass
class TensorSpec:
    """A graph input or output: name, element type and dims (int, or str for a symbolic/unknown dim)."""

    name: str
    dtype: str  # numpy dtype name, e.g. "float32", "int64"
    shape: list  # ints, symbolic names, or "?" for unknown dims; None when the rank is unknown

    def as_dict(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": self.shape}

    @property
    def numpy_dtype(self) -> np.dtype:
        return np.dtype(self.dtype)


def tensor_spec(value: onnx.ValueInfoProto) -> TensorSpec:
    ttype = value.type.tensor_type
    try:
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(ttype.elem_type)).name
    except (KeyError, TypeError):
        dtype = onnx.TensorProto.DataType.Name(ttype.elem_type).lower()
    if not ttype.HasField("shape"):
        return TensorSpec(value.name, dtype, None)
    dims = []
    for d in ttype.shape.dim:
        if d.HasField("dim_value") and d.dim_value >= 0:  # some exporters write -1 for "dynamic"
            dims.append(int(d.dim_value))
        else:
            dims.append(d.dim_param or "?")
    return TensorSpec(value.name, dtype, dims)


def cast_to_inputs(samples: list[dict], model: onnx.ModelProto) -> list[dict]:
    """Samples cast to the model's input element types (an FP16 model with keep_io_types: false takes
    float16): the same values another model saw, in the form this one accepts."""
    types = input_types(model)
    return [cast_to(sample, types) for sample in samples]


def input_types(model: onnx.ModelProto) -> dict[str, np.dtype]:
    """Input name → numpy dtype (inputs of an element type numpy has no name for, bfloat16 …, left out)."""
    types = {}
    for spec in graph_inputs(model):
        try:
            types[spec.name] = spec.numpy_dtype
        except TypeError:  # left as the sample has it
            pass
    return types


def cast_to(sample: dict, types: dict) -> dict:
    return {name: value.astype(types[name]) if name in types and value.dtype != types[name] else value
            for name, value in sample.items()}


def graph_inputs(model: onnx.ModelProto) -> list[TensorSpec]:
    """Real inputs: graph inputs that are not initializers (old exporters list weights as inputs too)."""
    initializers = {t.name for t in model.graph.initializer}
    return [tensor_spec(v) for v in model.graph.input if v.name not in initializers]


def graph_outputs(model: onnx.ModelProto) -> list[TensorSpec]:
    return [tensor_spec(v) for v in model.graph.output]
