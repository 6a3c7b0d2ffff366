"""Sample values the model cannot take, refused before the run: ids beyond the table a Gather looks them up in,
masks that are not 0 and 1.

Why: the shape and dtype checks pass token ids up to 300 for an embedding table of 32 rows; ONNX Runtime then
refuses them in the first stage that runs the model, as a kernel error that advises keeping a node float, after
the run directory was claimed. A mask of 2s runs without a word and measures another input than deployment sees.
Both bounds are read from the graph, never assumed: an integer input whose values reach a Gather's indices
(through ops that pass values on unchanged) is bounded by the size of the gathered axis of that Gather's constant
table (ONNX Gather takes -size..size-1); an integer input named like a mask of rank ≤ 2 (an attention mask,
[batch, sequence]; an image mask may hold 0..255), or one the graph casts to bool, must hold 0 and 1. A float
image input has no such bound in the graph (x/255 takes any value): its range is a preprocessing question, warned
of in qprep/data/pitfalls.py, not refused here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from qprep.data.samples import SampleSet
from qprep.errors import DataError
from qprep.model.info import attribute, constant_tensors, graph_inputs

# Ops whose first input reaches their output with the same values (an id stays the id it was).
PASS_THROUGH = {"Cast", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity"}
# Ops a table passes unchanged in its row count on its way to a Gather's data input.
TABLE_THROUGH = {"DequantizeLinear", "Cast", "Identity"}


@dataclass(frozen=True)
class Bound:
    """The values an input may hold (inclusive), and why, worded for the refusal."""

    low: int
    high: int
    outside: str  # completes "… holds 299, outside <outside>"
    detail: str  # where the bound comes from
    fix: str
    kind: str  # "id" or "mask"


def input_bounds(model: onnx.ModelProto) -> dict[str, Bound]:
    """Input name → its bound, for the inputs the graph bounds (the tightest table where several read one)."""
    graph, bounds = model.graph, {}
    consumers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in graph.node:
        for index, name in enumerate(node.input):
            consumers.setdefault(name, []).append((node, index))
    tables = constant_tensors(graph)
    producers = {out: node for node in graph.node for out in node.output}
    for spec in graph_inputs(model):
        try:
            dtype = spec.numpy_dtype
        except TypeError:  # an element type numpy has no name for (bfloat16 …): no sample of it reaches here
            continue
        if dtype.kind == "b":
            continue
        gathers, casts_to_bool = _reached(spec.name, consumers)
        if dtype.kind in "iu":
            for gather in gathers:
                bound = _table_bound(gather, tables, producers)
                if bound and (spec.name not in bounds or bound.high < bounds[spec.name].high):
                    bounds[spec.name] = bound
        if spec.name in bounds:
            continue
        if casts_to_bool:
            cast = casts_to_bool[0].name
            bounds[spec.name] = Bound(0, 1, "the mask values 0 and 1", f"node '{cast}' casts it to bool",
                                      "give 1 for what counts and 0 for padding", "mask")
        elif dtype.kind in "iu" and "mask" in spec.name.lower() and len(spec.shape or []) <= 2:  # [batch, seq]
            bounds[spec.name] = Bound(0, 1, "the mask values 0 and 1", "its name says it is a mask",
                                      "give 1 for real tokens and 0 for padding", "mask")
    return bounds


def _reached(name: str, consumers: dict) -> tuple[list[onnx.NodeProto], list[onnx.NodeProto]]:
    """The Gathers whose indices hold `name`'s values and the Casts to bool of them, through PASS_THROUGH ops."""
    gathers, casts, todo, seen = [], [], [name], {name}
    while todo:
        for node, index in consumers.get(todo.pop(), []):
            if node.domain not in ("", "ai.onnx"):
                continue
            if node.op_type == "Gather" and index == 1:
                gathers.append(node)
            elif node.op_type == "Cast" and attribute(node, "to", None) == onnx.TensorProto.BOOL:
                casts.append(node)
            elif node.op_type in PASS_THROUGH and index == 0 and node.output[0] not in seen:
                seen.add(node.output[0])
                todo.append(node.output[0])
    return gathers, casts


def _table_bound(gather: onnx.NodeProto, tables: dict, producers: dict) -> Bound | None:
    """The ids `gather` takes: -size..size-1 of its constant table's gathered axis; None for a computed table."""
    table = gather.input[0]
    while table not in tables and table in producers and producers[table].op_type in TABLE_THROUGH:
        table = producers[table].input[0]
    if table not in tables or not tables[table].dims:
        return None
    dims = list(tables[table].dims)
    axis = attribute(gather, "axis", 0)
    if not -len(dims) <= axis < len(dims):
        return None
    size = int(dims[axis])
    rows = "rows" if axis in (0, -len(dims)) else f"entries on axis {axis}"
    return Bound(-size, size - 1, f"the {size} {rows} of table '{table}'",
                 f"node '{gather.name}' takes ids {-size}..{size - 1}",
                 "give ids the model's table holds (its own tokenizer's vocabulary)", "id")


def check_values(model: onnx.ModelProto, samples: SampleSet | None, role: str) -> None:
    """Refuse, in one line, values beyond an input's bound: the value farthest out and its sample file, the input,
    the bound, and how many samples hold such values."""
    if samples is None:
        return
    for name, bound in input_bounds(model).items():
        bad = []
        for index, sample in enumerate(samples.samples):
            array = sample.get(name)
            if array is None or array.size == 0:
                continue
            low, high = array.min(), array.max()
            if bound.kind == "mask":
                outside = array[(array != 0) & (array != 1)]
                if outside.size:
                    value = outside.flat[int(np.argmax(np.abs(outside.astype(np.float64) - 0.5)))]
                    bad.append((abs(float(value) - 0.5), index, value))
            elif low < bound.low or high > bound.high:
                value = high if high > bound.high else low
                bad.append((float(value - bound.high if value > bound.high else bound.low - value), index, value))
        if bad:
            _, index, value = max(bad, key=lambda found: (found[0], -found[1]))  # farthest out, first sample
            file = _file(samples, index, name, [spec.name for spec in graph_inputs(model)])
            what = "id" if bound.kind == "id" else "value"
            raise DataError(f"{role} sample {file}: input '{name}' holds {what} {_number(value)}, outside "
                            f"{bound.outside} ({bound.detail}; {len(bad)} of {len(samples)} samples hold such "
                            f"{what}s); {bound.fix}")


def _file(samples: SampleSet, index: int, name: str, inputs: list[str]) -> str:
    """The file the sample's `name` came from: a list's line names one file per input, in input order."""
    per_line = len(inputs)
    if samples.format == "list" and name in inputs and len(samples.every_file) == per_line * len(samples):
        return Path(samples.every_file[index * per_line + inputs.index(name)]).name
    return Path(samples.files[index]).name if index < len(samples.files) else f"#{index}"


def _number(value) -> str:
    return str(int(value)) if float(value).is_integer() else f"{float(value):g}"
