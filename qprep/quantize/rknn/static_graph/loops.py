"""Loop → its body inlined once per iteration.

Facts (rknn-toolkit2 2.5.0): a Loop is refused by the toolkit after a minute of work ("The Loop('Loop.0') will
cause the graph to be a dynamic graph! Remove it manually"). A Loop that runs a fixed number of times (its trip
count, the condition passed on as TorchScript writes it; or a stop computed from a counter that starts from a
constant, as tf2onnx writes a Keras LSTM/GRU) is unrolled: its body inlined once per iteration, the body's
weights shared, scan outputs concatenated. One whose stop depends on the input (SLANet's table decoder stops at
its end token) cannot be, and is refused before any work, naming the node.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qprep.errors import ModelError
from qprep.model.info import constant_tensors, default_opset, iter_nodes, unique_name
from qprep.model.io import subgraphs
from qprep.model.runtime import run_model
from qprep.quantize.rknn.io_names import all_names
from qprep.quantize.rknn.static_graph.edit import inlined, one_by_one, replace_node

MAX_UNROLLED_NODES = 20000  # the toolkit's build time grows with the graph: beyond this, export it unrolled


def is_loop(node: onnx.NodeProto) -> bool:
    return node.op_type == "Loop" and node.domain in ("", "ai.onnx")


SHAPE_OPS = ("Shape", "Size")


def _reached(nodes, sources: set[str]) -> set[str]:
    """`sources` and every value computed from them by `nodes` (in order), except through the Shape/Size of a
    value in `sources` itself (a graph input: fixed dims on the NPU; the shape of a computed value, e.g. of a
    NonZero, may follow the data); a node with a subgraph counts as reading them."""
    reached = set(sources)
    for node in nodes:
        if node.op_type in SHAPE_OPS and node.input and node.input[0] in sources:
            continue
        if any(name in reached for name in node.input) or any(True for a in node.attribute for _ in subgraphs(a)):
            reached.update(node.output)
    return reached


def _data_dependent_stop(model: onnx.ModelProto, node: onnx.NodeProto) -> bool:
    """Whether the loop's trip count or its stop condition, as its body computes it, depends on the values of
    the model's input (a decoder that stops at its end token) rather than on the iteration number, constants,
    shapes and loop-carried values that start from such values and are updated from them only (a counter)."""
    initializers = {t.name for t in model.graph.initializer}
    outer_data = _reached(model.graph.node, {v.name for v in model.graph.input if v.name not in initializers})
    if node.input and node.input[0] in outer_data:
        return True
    body = next(a.g for a in node.attribute if a.name == "body")
    carried = len(node.input) - 2
    inputs = [i.name for i in body.input]
    data = {name for inner in body.node for name in inner.input if name in outer_data}
    if len(node.input) > 1 and node.input[1] in outer_data:
        data.add(inputs[1])
    data.update(inputs[2 + j] for j in range(carried) if node.input[2 + j] in outer_data)
    while True:
        seen = _reached(body.node, data)
        grown = {inputs[2 + j] for j in range(carried) if body.output[1 + j].name in seen} - data
        if not grown:
            return body.output[0].name in seen
        data |= grown


def refuse_data_dependent_stop(model: onnx.ModelProto, node: onnx.NodeProto) -> None:
    if _data_dependent_stop(model, node):
        raise ModelError(f"quantize.rknn: node '{node.name}' is a Loop whose stop depends on the input (as a decoder "
                         "stopping at its end token), and rknn-toolkit2 compiles static graphs only (\"will cause "
                         "the graph to be a dynamic graph\"); qprep unrolls only loops that run a fixed number of "
                         "times: export the model with a fixed length, or use backend ort")


def _iterations(model: onnx.ModelProto, index: int, samples: list[dict]) -> int:
    """How many times the Loop at `index` runs: its trip count when it is a constant and the body passes the
    condition on unchanged, else counted on one sample through an added scan output of the iteration number
    (the count depends on no input value: _data_dependent_stop)."""
    node = model.graph.node[index]
    body = next(a.g for a in node.attribute if a.name == "body")
    constants = constant_tensors(model.graph)

    def value(name: str) -> np.ndarray | None:
        return numpy_helper.to_array(constants[name]) if name in constants else None

    trip = value(node.input[0]) if node.input and node.input[0] else None
    start = value(node.input[1]) if len(node.input) > 1 and node.input[1] else np.array(True)
    if start is None or not bool(start):
        raise ModelError(f"quantize.rknn: node '{node.name}' is a Loop whose first condition is not a constant "
                         "true; export the model with the loop unrolled, or use backend ort")
    passed_on = body.output[0].name == body.input[1].name
    if passed_on and not (node.input and node.input[0]):
        raise ModelError(f"quantize.rknn: node '{node.name}' is a Loop with neither a trip count nor a stop; "
                         "export the model with a fixed length, or use backend ort")
    if passed_on and trip is not None:
        return int(trip)
    if not samples:
        raise ModelError(f"quantize.rknn: node '{node.name}' is a Loop that computes its own stop, and qprep "
                         "counts its iterations on a calibration sample: give calibration samples")
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    loop = probe.graph.node[index]
    inner = next(a.g for a in loop.attribute if a.name == "body")
    taken = all_names(model)
    for position, name in enumerate(loop.output):  # ORT cannot run a '' output before the one added below
        if not name:
            loop.output[position] = unique_name(f"{node.name}/unused_{position}", taken)
    counter = unique_name(f"{node.name}/iteration", taken)
    inner.node.append(helper.make_node("Identity", [inner.input[0].name], [counter]))
    inner.output.append(helper.make_tensor_value_info(counter, onnx.TensorProto.INT64, None))
    loop.output.append(counter)
    probe.graph.output.append(helper.make_tensor_value_info(counter, onnx.TensorProto.INT64, None))
    return len(run_model(probe, samples)[0][counter])


def loops_unrolled(model: onnx.ModelProto, samples: list[dict]) -> list[str]:
    """Each Loop of the main graph → its body, inlined once per iteration: the iteration number and condition
    constants, each carried value the previous copy's, each scan output the Concat of every copy's (Unsqueezed
    on a new first axis); the body's own initializers moved out once, shared by every copy."""
    done = []
    for index in one_by_one(model, is_loop):
        graph = model.graph
        node = graph.node[index]
        refuse_data_dependent_stop(model, node)
        count = _iterations(model, index, samples)
        body = onnx.GraphProto()
        body.CopyFrom(next(a.g for a in node.attribute if a.name == "body"))
        if count < 1 or count * len(body.node) > MAX_UNROLLED_NODES:
            raise ModelError(f"quantize.rknn: node '{node.name}' is a Loop that runs {count} times, which qprep "
                             f"would unroll into {count * len(body.node)} nodes (at most {MAX_UNROLLED_NODES}); "
                             "export the model with a fixed, shorter length, or use backend ort")
        taken = all_names(model) | {n.name for n in iter_nodes(graph)}
        shared = {t.name: unique_name(f"{node.name}/{t.name}", taken) for t in body.initializer}
        for tensor in body.initializer:
            tensor.name = shared[tensor.name]
        graph.initializer.extend(body.initializer)
        del body.initializer[:]
        # the iteration number is one element: [] or [1] as declared (a symbolic dim can only be 1)
        number_shape = [1] * len(body.input[0].type.tensor_type.shape.dim)
        read = {name for inner in iter_nodes(body) for name in inner.input} | {o.name for o in body.output}
        carried = list(node.input[2:])
        scans: list[list[str]] = [[] for _ in range(len(body.output) - 1 - len(carried))]
        replacement = []
        for step in range(count):
            prefix = f"{node.name}/{step}/"
            number, condition = unique_name(prefix + "iteration", taken), unique_name(prefix + "condition", taken)
            if body.input[0].name in read:  # a body that never reads them gets no per-step constants
                graph.initializer.append(numpy_helper.from_array(np.full(number_shape, step, np.int64), number))
            if body.input[1].name in read:
                graph.initializer.append(numpy_helper.from_array(np.array(True), condition))
            bound = shared | {body.input[0].name: number, body.input[1].name: condition}
            bound |= {value.name: outer for value, outer in zip(body.input[2:], carried)}
            nodes, outputs = inlined(body, prefix, taken, graph, bound)
            replacement += nodes
            carried = outputs[1:1 + len(carried)]
            for k, name in enumerate(outputs[1 + len(carried):]):
                scans[k].append(name)
        for final, value in zip(node.output, carried):
            if final:
                replacement.append(helper.make_node("Identity", [value], [final],
                                                    name=unique_name(f"{node.name}/final", taken)))
        replacement += _stacked(node, scans, node.output[len(carried):], model, taken)
        replace_node(graph, index, replacement)
        done.append(node.name)
    return done


def _stacked(node: onnx.NodeProto, scans: list[list[str]], finals: list[str], model: onnx.ModelProto,
             taken: set[str]) -> list[onnx.NodeProto]:
    """Each scan output: its per-iteration values Unsqueezed on a new first axis and concatenated."""
    opset = default_opset(model)
    axes = unique_name(f"{node.name}/axis_0", taken)
    if opset >= 13 and any(finals):
        model.graph.initializer.append(numpy_helper.from_array(np.array([0], np.int64), axes))
    nodes = []
    for k, final in enumerate(finals):
        if not final:
            continue
        stacked = []
        for step, name in enumerate(scans[k]):
            stacked.append(unique_name(f"{name}/stacked", taken))
            inputs, attributes = ([name, axes], {}) if opset >= 13 else ([name], {"axes": [0]})
            nodes.append(helper.make_node("Unsqueeze", inputs, [stacked[-1]], **attributes,
                                          name=unique_name(f"{node.name}/{step}/stack_{k}", taken)))
        nodes.append(helper.make_node("Concat", stacked, [final], axis=0,
                                      name=unique_name(f"{node.name}/scan_{k}", taken)))
    return nodes

