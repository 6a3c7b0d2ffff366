"""What the rewrites share: the next node a rewrite wants, found again after each rewrite (an inlined body may
hold more); a node replaced in place, keeping the graph sorted; a subgraph's nodes inlined under a prefix; the
shapes onnx's shape inference gives the main graph's values."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import onnx

from qprep.model.info import unique_name
from qprep.quantize.rknn.io_names import rename_values


def one_by_one(model: onnx.ModelProto, wanted: Callable[[onnx.NodeProto], bool]) -> Iterator[int]:
    """The index of the first main-graph node `wanted` holds for, found again after each rewrite (an inlined
    body may hold more)."""
    while True:
        index = next((i for i, n in enumerate(model.graph.node) if wanted(n)), None)
        if index is None:
            return
        yield index


def replace_node(graph: onnx.GraphProto, index: int, replacement: list[onnx.NodeProto]) -> None:
    """The node at `index` replaced by `replacement`, in its place (the graph stays topologically sorted)."""
    del graph.node[index]
    for offset, new in enumerate(replacement):
        graph.node.insert(index + offset, new)


def value_shapes(inferred: onnx.ModelProto) -> dict[str, list | None]:
    """Main-graph value → its shape in a model onnx's shape inference has run on (dims None where unknown)."""
    graph = inferred.graph
    shapes: dict[str, list | None] = {}
    for value in [*graph.input, *graph.value_info, *graph.output]:
        tensor = value.type.tensor_type
        shapes[value.name] = ([d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
                              if tensor.HasField("shape") else None)
    for tensor in graph.initializer:
        shapes[tensor.name] = list(tensor.dims)
    return shapes


def inlined(branch: onnx.GraphProto, prefix: str, taken: set[str], graph: onnx.GraphProto,
             bound: dict[str, str] | None = None) -> tuple[list[onnx.NodeProto], list[str]]:
    """The branch's nodes with its own values renamed under `prefix` (outer values keep their names; `bound`
    names what its inputs become: a loop body's), its initializers moved into `graph` → (nodes, the branch's
    output names after renaming)."""
    local = [t.name for t in branch.initializer] + [o for n in branch.node for o in n.output if o]
    renames = {name: unique_name(prefix + name, taken) for name in local} | (bound or {})
    copy = onnx.GraphProto()
    copy.CopyFrom(branch)
    rename_values(copy, renames)
    graph.initializer.extend(copy.initializer)
    nodes = []
    for node in copy.node:
        node.name = unique_name(prefix + (node.name or node.op_type), taken)
        nodes.append(node)
    return nodes, [o.name for o in copy.output]

