"""Every private (underscore) API of a dependency qprep relies on, in one place.

A dependency may change or drop these in any release without notice. Keeping them here means one module to
read when upgrading onnx, onnxscript or onnxruntime, and tests/test_third_party.py calls each one on a tiny
input and checks the result qprep relies on, so an upgrade that breaks one fails there, by name, instead of
deep inside a pipeline run. Callers import the names below from here, never the private paths.

It sits at the top of the package, not in model/ or optimize/, because its users are spread over the tree:
model/io.py (onnx), optimize/ (onnxscript), quantize/ort.py (onnxruntime).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import onnx
import onnx_ir as ir
from onnx.external_data_helper import _get_all_tensors
from onnxscript.rewriter._ir_utils import get_numpy_value
from onnxscript.rewriter.rules.common._materialize_reshape_shape import MaterializeReshapeShape

# ---------------------------------------------------------------------------------------------------------
# onnx
# ---------------------------------------------------------------------------------------------------------


def all_tensors(model: onnx.ModelProto) -> Iterable[onnx.TensorProto]:
    """Every TensorProto of the model: initializers and tensor attributes, subgraphs included (the tensors
    that may live in external data). onnx's `external_data_helper._get_all_tensors`."""
    return _get_all_tensors(model)


# ---------------------------------------------------------------------------------------------------------
# onnxscript (the rewriter)
# ---------------------------------------------------------------------------------------------------------


def numpy_value(value: ir.Value | None) -> np.ndarray | None:
    """The value's array when it is an initializer or the output of a Constant node, else None.
    onnxscript's `rewriter._ir_utils.get_numpy_value`."""
    return get_numpy_value(value)


def materialized_dims(rule: MaterializeReshapeShape) -> list[int]:
    """The constant shape `MaterializeReshapeShape.check` computed for the match it just accepted (the rule
    keeps it in its private `_new_dims` for its `rewrite`)."""
    return rule._new_dims


# ---------------------------------------------------------------------------------------------------------
# onnxruntime (quantization internals used by qprep/quantize/ort.py)
# ---------------------------------------------------------------------------------------------------------
# The ORT names go here, imported inside a function each (importing onnxruntime.quantization is slow and only
# the ort backend needs it): onnxruntime.quantization.onnx_quantizer.ONNXQuantizer,
# onnxruntime.quantization.qdq_quantizer.QDQQuantizer, onnxruntime.quantization.calibrate.create_calibrator.
