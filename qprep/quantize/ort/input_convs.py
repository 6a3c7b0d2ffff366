"""Convolutions reading the model's input over too few channels for ONNX Runtime's fast int8 kernels stay float.

Why: ORT's x86 int8 Conv takes its fast (symmetric, VNNI) kernels only for input channels in multiples of 4;
channel_padding.py pads the channel counts inside the model, but an image model's first Conv reads the model's
input (3 channels, or 1), which it cannot pad. There the generic int8 kernel loses to ORT's float one by far,
enough to be the largest single cost of an INT8 model (BENCHMARKS.md: "Convs reading the model's input kept
float"). Kept float it costs one QuantizeLinear of its output, and no accuracy: it is the one layer whose input
is the raw image. Only while such Convs are a small share of the model's multiply-adds (MAX_SHARE): an INT8 model
should compute most of its work on integers, whatever one kernel costs.
"""

from __future__ import annotations

import onnx

from qprep.model.info import Links, constant_names, multiply_adds, tensor_shapes

ALIGNMENT = 4  # input channels per group that MLAS's symmetric int8 convolution needs
MAX_SHARE = 0.1  # of the model's multiply-adds, at most, kept float this way
# ops a model may apply to its input before the first Conv (normalization) that keep its channel axis
_ELEMENTWISE = frozenset({"Add", "Sub", "Mul", "Div", "Cast", "Identity", "Clip"})


def narrow_input_convs(model: onnx.ModelProto) -> list[str]:
    """Names of the Convs whose data input is a model input (through element-wise ops only) of static shape, with
    a channel count per group that is not a multiple of ALIGNMENT; none if they hold more than MAX_SHARE of the
    model's multiply-adds (or their share is unknown)."""
    links = Links(model)
    inputs = {i.name for i in model.graph.input} - set(links.initializers)
    shapes, constants = tensor_shapes(model), constant_names(model.graph)
    found = []
    for node in model.graph.node:
        if node.op_type != "Conv" or not node.name or node.input[1] not in links.initializers:
            continue
        weight = links.initializers[node.input[1]]
        if len(weight.dims) < 3 or weight.dims[1] % ALIGNMENT == 0 or not _from_input(node.input[0], links, inputs,
                                                                                       constants):
            continue
        dims = shapes.get(node.input[0], (0, None))[1]
        if not dims or None in dims:  # symbolic dims count as 1 in the multiply-adds: its share would be wrong
            continue
        if dims[1] % ALIGNMENT == 0:
            continue
        found.append(node.name)
    if not found:
        return []
    macs = multiply_adds(model)
    total = sum(macs.values())
    if not total or sum(macs.get(name, total) for name in found) > MAX_SHARE * total:
        return []
    return found


def _from_input(name: str, links: Links, inputs: set[str], constants: set[str]) -> bool:
    """`name` is a model input, or computed from exactly one by element-wise ops with constant operands."""
    for _ in range(8):
        if name in inputs:
            return True
        producer = links.producers.get(name)
        if producer is None or producer.op_type not in _ELEMENTWISE:
            return False
        variable = [i for i in producer.input if i and i not in constants]
        if len(variable) != 1:
            return False
        name = variable[0]
    return False

