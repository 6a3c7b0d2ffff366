"""Graph input/output names rknn-toolkit2 accepts, in the ONNX file it loads only; the user's names everywhere else.

Measured with rknn-toolkit2 2.5.0 (a tiny Gemm/Softmax graph and oww_timer): a graph input or output name of 128
characters or more fails the build (`KeyError: <name>` in Quantizer._set_fp16_hybrid, oww_timer's output is a
139-character JSON string); 127 characters build. Spaces, quotes, braces, ':', ',', '.' and '/' in such names
built and ran on the simulator, and an intermediate tensor name of 140 characters built. So a name is renamed
when it is too long, and also when it holds characters the exporters themselves do not write (only the
characters of `x.1`, `onnx::Flatten_0`, `model/dense:0` are kept): they were not tried through hybrid
quantization's YAML cfg or accuracy_analysis' dump files, and a new name costs nothing, because qprep feeds and
reads the toolkit by position (runner.py), keeps the user's names in the contract and the report, and records
the renames.
"""

from __future__ import annotations

import re

import onnx

from qprep.model.info import graph_inputs, graph_outputs
from qprep.model.io import subgraphs
from qprep.quantize.rknn.names import base_name

MAX_LENGTH = 127
_KEPT = re.compile(r"[A-Za-z0-9_.:/-]+")
_STEM_LENGTH = 48


def needs_new_name(name: str) -> bool:
    return len(name) > MAX_LENGTH or not _KEPT.fullmatch(name)


def toolkit_names(model: onnx.ModelProto) -> dict[str, str]:
    """{user's name: toolkit name} for the graph inputs and outputs that need a new one (none: {}). A new name
    is the old one's letters, digits and '_' (short, starting with a letter), unique in the whole model."""
    taken = all_names(model)
    renames: dict[str, str] = {}
    for kind, specs in (("input", graph_inputs(model)), ("output", graph_outputs(model))):
        for index, spec in enumerate(specs):
            if spec.name in renames or not needs_new_name(spec.name):
                continue
            stem = re.sub(r"[^A-Za-z0-9_]+", "_", spec.name).strip("_")[:_STEM_LENGTH].rstrip("_")
            if not stem or not stem[0].isalpha():
                stem = f"{kind}_{index}" + (f"_{stem}" if stem else "")
            new, count = stem, 1
            while new in taken:
                count += 1
                new = f"{stem}_{count}"
            taken.add(new)
            renames[spec.name] = new
    return renames


def translated(tensor: str, renames: dict[str, str]) -> str:
    """An IR tensor name with a renamed value's name replaced (the toolkit's suffixes kept: `<name>-rs__float16`);
    `renames` either way round."""
    base = base_name(tensor)
    return renames[base] + tensor[len(base):] if base in renames else tensor


def renamed(model: onnx.ModelProto, renames: dict[str, str]) -> onnx.ModelProto:
    """A copy of `model` with every use of the renamed values renamed: graph inputs/outputs, node inputs and
    outputs, initializers and value infos, in the graph and every subgraph (a branch may read an outer value)."""
    result = onnx.ModelProto()
    result.CopyFrom(model)
    if renames:
        rename_values(result.graph, renames)
    return result


def rename_values(graph: onnx.GraphProto, renames: dict[str, str]) -> None:
    """Every use of the renamed values in `graph` and its subgraphs, in place."""
    for value in [*graph.input, *graph.output, *graph.value_info]:
        value.name = renames.get(value.name, value.name)
    for tensor in graph.initializer:
        tensor.name = renames.get(tensor.name, tensor.name)
    for node in graph.node:
        node.input[:] = [renames.get(name, name) for name in node.input]
        node.output[:] = [renames.get(name, name) for name in node.output]
        for attribute in node.attribute:
            for sub in subgraphs(attribute):
                rename_values(sub, renames)


def all_names(model: onnx.ModelProto) -> set[str]:
    """Every value name of the model, its subgraphs included."""
    names: set[str] = set()

    def visit(graph: onnx.GraphProto) -> None:
        names.update(v.name for v in [*graph.input, *graph.output, *graph.value_info])
        names.update(t.name for t in graph.initializer)
        for node in graph.node:
            names.update(node.input)
            names.update(node.output)
            for attribute in node.attribute:
                for sub in subgraphs(attribute):
                    visit(sub)

    visit(model.graph)
    return names
