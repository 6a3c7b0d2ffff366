"""Constructs rknn-toolkit2 cannot compile, rewritten into ones it compiles before it loads the model: exact in
math, verified with ONNX Runtime on calibration samples; what cannot be rewritten is refused in one line.

Facts (rknn-toolkit2 2.5.0, measured on tiny graphs and on the zoo models named):
- BatchNormalization whose mean/variance are computed at run time (tf2onnx writes a Keras LayerNormalization as
  FusedBatchNormV3 over statistics it computes: magika): the build dies with SIGSEGV after "I rknn building ..."
  (at optimization_level 0 too, and without quantization); with constant statistics the same graph builds.
  Rewritten as (x - mean) / sqrt(var + eps) * scale + bias, the per-channel inputs reshaped to [C, 1, ...].
- If whose condition is computed from the inputs (openWakeWord's verifier gate): refused by the toolkit ("The If
  will cause the graph to be a dynamic graph! Remove it manually"), and a branch reading a value of the outer graph
  fails earlier in its If converter ("input 'x.1' of node Flatten_33 is not output of any previous nodes").
  Rewritten as both branches inlined and Where(condition, then, else) (c·then + (1-c)·else for a one-element
  output: Where over one element crashes the build too): the NPU computes both branches and keeps the one ONNX
  Runtime would have run. Branches whose outputs differ in shape cannot be, and are refused.
- An optional output left out ('' among a node's outputs: torch's LSTM export when only the last hidden state is
  used, Resemblyzer): the toolkit's constant folding fails in ONNX Runtime ("Could not find OrtValue with name
  ''"). Named, the node computes that output for nobody, and the model builds.
- An LSTM/GRU/RNN with its `layout` attribute written out at the default 0 (torch's dynamo exporter): the
  toolkit's recurrent-op shape inference writes the node into an older-opset model that the onnx checker then
  rejects ("Unrecognized attribute: layout for operator GRU"). The attribute is dropped (0 is the default).
- Einsum (a batched matmul written as `nid,njd->nij`): the build fails in the toolkit's own shape inference
  (KeyError on a value its Einsum conversion made, then in every rule disabled after it). A two-operand Einsum
  that is one batched matmul (one contracted letter, one free letter per operand, the rest shared batch letters)
  is rewritten as Transposes and a MatMul; other equations are left to the toolkit.
- Loop: refused by the toolkit after a minute of work ("The Loop('Loop.0') will cause the graph to be a dynamic
  graph! Remove it manually"). A Loop that runs a fixed number of times (its trip count, the condition passed on
  as TorchScript writes it; or a stop computed from a counter that starts from a constant, as tf2onnx writes a
  Keras LSTM/GRU) is unrolled: its body inlined once per iteration, the body's weights shared, scan outputs
  concatenated. One whose stop depends on the input (SLANet's table decoder stops at its end token) cannot be,
  and is refused before any work, naming the node.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qprep.errors import ModelError
from qprep.model.info import constant_names, constant_tensors, default_opset, iter_nodes, node_index, unique_name
from qprep.model.io import inferred_shapes, subgraphs
from qprep.model.runtime import run_model
from qprep.quantize.rknn.io_names import all_names, rename_values
from qprep.verify import Tolerance, compare


def refuse_unrewritable(model: onnx.ModelProto) -> None:
    """ModelError for a Loop whose stop depends on the input, or an If whose branches give outputs of different
    shapes: checked on the input model, before any work (BatchNormalization is judged at quantize time: on the
    input model its statistics may still be computed from constants that optimize folds)."""
    for node in model.graph.node:
        if _is_loop(node):
            _refuse_data_dependent_stop(model, node)
        if node.op_type == "Scan" and node.domain in ("", "ai.onnx"):
            raise ModelError(f"quantize.rknn: node '{node.name}' is a Scan, and rknn-toolkit2 compiles static graphs "
                             "only; export the model with the recurrence unrolled (or as an LSTM/GRU op), or use "
                             "backend ort")
    ifs = [i for i, node in enumerate(model.graph.node) if _is_if(node)]
    if ifs:
        inferred = inferred_shapes(model, shapes_only=True)
        for index in ifs:
            branches = {a.name: a.g for a in inferred.graph.node[index].attribute}
            _branch_outputs(model.graph.node[index], branches["then_branch"], branches["else_branch"])


def rewritten(model: onnx.ModelProto, samples: list[dict] = ()) -> tuple[onnx.ModelProto, dict]:
    """A copy of `model` with its Loops unrolled, its If nodes and run-time BatchNormalization statistics
    rewritten and its omitted optional outputs named → (model, record {rewrite: [node names]}), unverified;
    ModelError for what cannot be. `samples`: a Loop whose stop is computed in its body runs once on the first
    to count its iterations."""
    constants = constant_names(model.graph)
    if not any(_is_loop(n) or "Sequence" in n.op_type or _is_if(n) or _is_runtime_batchnorm(n, constants)
               or "" in n.output or _default_layout(n) or _matmul_plan(n) for n in model.graph.node):
        return model, {}  # the common case, without copying the model
    result = onnx.ModelProto()
    result.CopyFrom(model)
    record = {"loops_unrolled": [], "sequence_as_concat": [], "if_as_both_branches": []}
    before = len(result.graph.node)
    while True:  # an inlined branch may hold a Loop, an unrolled body an If: until neither is left
        rounds = {"loops_unrolled": _loops_unrolled(result, samples[:1]),
                  "sequence_as_concat": _sequences_as_concat(result),
                  "if_as_both_branches": _ifs_as_both_branches(result)}
        if not any(rounds.values()):
            break
        if len(result.graph.node) - before > MAX_UNROLLED_NODES:  # nested Loops multiply: bound them all
            raise ModelError(f"quantize.rknn: unrolling the Loops {', '.join(rounds['loops_unrolled'][:3])} "
                             f"(nested) made {len(result.graph.node) - before} more nodes (at most "
                             f"{MAX_UNROLLED_NODES}); export the model with fixed, shorter lengths, or use backend ort")
        for key, nodes in rounds.items():
            record[key] += nodes
    refuse_unrewritable(result)  # a Scan an inlined branch brought into the main graph
    record.update({"batchnorm_as_arithmetic": _batchnorms_as_arithmetic(result),
              "omitted_outputs_named": _omitted_outputs_named(result),
              "default_layout_dropped": _default_layouts_dropped(result),
              "einsum_as_matmul": _einsums_as_matmul(result)})
    _refuse_sequences(result)
    return result, {name: nodes for name, nodes in record.items() if nodes}


def static_graph(model: onnx.ModelProto, samples: list[dict], threads: int = 2) -> tuple[onnx.ModelProto, dict]:
    """`rewritten(model)`, verified on `samples` with ONNX Runtime: refused in one line when the outputs change."""
    result, record = rewritten(model, samples)
    if not record:
        return model, {}
    if samples:
        verdict = compare(run_model(model, samples, threads), run_model(result, samples, threads), Tolerance())
        if not verdict.ok:
            raise ModelError(f"quantize.rknn: rewriting {', '.join(record)} for rknn-toolkit2 changed the outputs "
                             f"({verdict.reason}); export the model without them")
    record["verified_on"] = len(samples)
    return result, record


# rewrites that replace a node (a named omitted output or a dropped default layout leaves the node itself)
REPLACED = ("loops_unrolled", "sequence_as_concat", "if_as_both_branches", "batchnorm_as_arithmetic",
            "einsum_as_matmul")


def carried(float_set: set[str], model: onnx.ModelProto, record: dict) -> set[str]:
    """`float_set` in the rewritten `model`: a rewritten node's replacement nodes (named under `<node>/`) stay
    float where it was (keep_float puts a LayerNorm's BatchNormalization there: magika)."""
    replaced = {name for key in REPLACED for name in record.get(key, ())} & float_set
    if not replaced:
        return float_set
    prefixes = tuple(f"{name}/" for name in replaced)
    return (float_set - replaced) | {n.name for n in model.graph.node if n.name.startswith(prefixes)}


# ------------------------------------------------------------------------- If → both branches + a selection


def _ifs_as_both_branches(model: onnx.ModelProto) -> list[str]:
    """Every If of the main graph (an inlined branch's own If included) → its branches' nodes + a selection."""
    done = []
    for index in _one_by_one(model, _is_if):
        graph = model.graph
        node = graph.node[index]
        inferred = onnx.shape_inference.infer_shapes(model)  # node order kept: the same If at `index`
        branches = {a.name: a.g for a in node.attribute}
        inferred_branches = {a.name: a.g for a in inferred.graph.node[index].attribute}
        outputs = _branch_outputs(node, inferred_branches["then_branch"], inferred_branches["else_branch"])
        taken = all_names(model) | {n.name for n in iter_nodes(graph)}
        replacement, then_names = _inlined(branches["then_branch"], f"{node.name}/then/", taken, graph)
        more, else_names = _inlined(branches["else_branch"], f"{node.name}/else/", taken, graph)
        replacement += more
        condition_shape = _value_shapes(inferred).get(node.input[0])
        for position, output in enumerate(node.output):
            if output:
                shape, elem_type = outputs[position]
                replacement += _selection(node, node.input[0], condition_shape, then_names[position],
                                          else_names[position], output, shape, elem_type, taken, graph)
        _replace_node(graph, index, replacement)
        done.append(node.name)
    return done


def _branch_outputs(node: onnx.NodeProto, then: onnx.GraphProto, other: onnx.GraphProto) -> list[tuple[list, int]]:
    """The branches' (output shape, element type), checked: both must give one fixed shape to select from."""
    def outputs(branch):
        return [([d.dim_value if d.HasField("dim_value") else None for d in o.type.tensor_type.shape.dim]
                 if o.type.tensor_type.HasField("shape") else None, o.type.tensor_type.elem_type)
                for o in branch.output]

    then_outputs, else_outputs = outputs(then), outputs(other)
    for position, ((a, _), (b, _)) in enumerate(zip(then_outputs, else_outputs)):
        if a is None or b is None or a != b or None in a:
            raise ModelError(f"quantize.rknn: node '{node.name}' is an If whose branches give output {position} "
                             f"shapes {a} and {b}; rknn-toolkit2 compiles static graphs only, and qprep can run both "
                             "branches only when they give one fixed shape: export the branch the device needs")
    return then_outputs


def _selection(node: onnx.NodeProto, condition: str, condition_shape: list | None, then: str, other: str,
               output: str, shape: list[int], elem_type: int, taken: set[str],
               graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """`output` = the `then` value where the one-element condition holds, else `other`: Where; for a one-element
    output c·then + (1-c)·other instead (exact for 0/1 and finite values), since Where over one element crashes
    the toolkit's build (SIGSEGV, measured on [1,1]; [1,8] builds). The condition is reshaped to the output's
    rank when its own is higher or unknown, so broadcasting keeps the output's shape."""
    def name(what: str) -> str:
        return unique_name(f"{node.name}/{what}", taken)

    nodes = []
    if condition_shape is None or len(condition_shape) > len(shape):
        reshaped, target = name("condition"), name("condition_shape")
        graph.initializer.append(numpy_helper.from_array(np.ones(len(shape), np.int64), target))
        nodes.append(helper.make_node("Reshape", [condition, target], [reshaped], name=name("reshape_condition")))
        condition = reshaped
    if int(np.prod(shape)) != 1:
        return nodes + [helper.make_node("Where", [condition, then, other], [output], name=name("where"))]
    one, taken_then, taken_else = name("one"), name("then_weight"), name("else_weight")
    chosen_then, chosen_else = name("then_selected"), name("else_selected")
    graph.initializer.append(numpy_helper.from_array(
        np.ones((), helper.tensor_dtype_to_np_dtype(elem_type)), one))
    return nodes + [helper.make_node("Cast", [condition], [taken_then], to=elem_type, name=name("cast_condition")),
                    helper.make_node("Sub", [one, taken_then], [taken_else], name=name("not_condition")),
                    helper.make_node("Mul", [then, taken_then], [chosen_then], name=name("select_then")),
                    helper.make_node("Mul", [other, taken_else], [chosen_else], name=name("select_else")),
                    helper.make_node("Add", [chosen_then, chosen_else], [output], name=name("selected"))]


def _inlined(branch: onnx.GraphProto, prefix: str, taken: set[str], graph: onnx.GraphProto,
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


# ----------------------------------------------------------------------------------- Loop → its body n times


MAX_UNROLLED_NODES = 20000  # the toolkit's build time grows with the graph: beyond this, export it unrolled


def _is_loop(node: onnx.NodeProto) -> bool:
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


def _refuse_data_dependent_stop(model: onnx.ModelProto, node: onnx.NodeProto) -> None:
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


def _loops_unrolled(model: onnx.ModelProto, samples: list[dict]) -> list[str]:
    """Each Loop of the main graph → its body, inlined once per iteration: the iteration number and condition
    constants, each carried value the previous copy's, each scan output the Concat of every copy's (Unsqueezed
    on a new first axis); the body's own initializers moved out once, shared by every copy."""
    done = []
    for index in _one_by_one(model, _is_loop):
        graph = model.graph
        node = graph.node[index]
        _refuse_data_dependent_stop(model, node)
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
            nodes, outputs = _inlined(body, prefix, taken, graph, bound)
            replacement += nodes
            carried = outputs[1:1 + len(carried)]
            for k, name in enumerate(outputs[1 + len(carried):]):
                scans[k].append(name)
        for final, value in zip(node.output, carried):
            if final:
                replacement.append(helper.make_node("Identity", [value], [final],
                                                    name=unique_name(f"{node.name}/final", taken)))
        replacement += _stacked(node, scans, node.output[len(carried):], model, taken)
        _replace_node(graph, index, replacement)
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


# ------------------------------------------------------- a sequence appended to, then concatenated → Concat


def _sequence_chain(graph: onnx.GraphProto, concat: onnx.NodeProto) -> tuple[list[str], list[onnx.NodeProto]] | None:
    """(the tensors in order, the nodes that built the sequence) when `concat`'s sequence was built only by
    SequenceEmpty/SequenceConstruct and appending SequenceInserts (through Identities), each step read by the
    next alone: a torch list appended to in a loop, once the loop is unrolled."""
    producers = {o: node for node in graph.node for o in node.output}
    readers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    outputs = {o.name for o in graph.output}
    tensors, chain, value = [], [], concat.input[0]
    while True:
        node = producers.get(value)
        if node is None or value in outputs or readers.get(value, 0) != 1:
            return None
        chain.append(node)
        if node.op_type == "SequenceEmpty":
            return tensors[::-1], chain
        if node.op_type == "SequenceConstruct":
            return list(node.input) + tensors[::-1], chain
        if node.op_type == "SequenceInsert" and len(node.input) == 2:
            tensors.append(node.input[1])
        elif node.op_type != "Identity":
            return None
        value = node.input[0]


def _sequences_as_concat(model: onnx.ModelProto) -> list[str]:
    """Each ConcatFromSequence over such a chain → Concat of its tensors (each Unsqueezed first for new_axis)."""
    graph, done = model.graph, []
    taken = all_names(model) | {n.name for n in iter_nodes(graph)}
    opset = default_opset(model)
    for concat in [n for n in graph.node if n.op_type == "ConcatFromSequence" and n.domain in ("", "ai.onnx")]:
        found = _sequence_chain(graph, concat)
        if not found or not found[0]:
            continue
        tensors, chain = found
        attributes = {a.name: a.i for a in concat.attribute}
        axis, replacement = attributes.get("axis", 0), []
        if attributes.get("new_axis", 0):
            axes = unique_name(f"{concat.name}/axes", taken)
            if opset >= 13:
                graph.initializer.append(numpy_helper.from_array(np.array([axis], np.int64), axes))
            stacked = []
            for k, tensor in enumerate(tensors):
                stacked.append(unique_name(f"{concat.name}/{k}", taken))
                inputs, extra = ([tensor, axes], {}) if opset >= 13 else ([tensor], {"axes": [axis]})
                replacement.append(helper.make_node("Unsqueeze", inputs, [stacked[-1]], **extra,
                                                    name=unique_name(f"{concat.name}/unsqueeze_{k}", taken)))
            tensors = stacked
        replacement.append(helper.make_node("Concat", tensors, [concat.output[0]], axis=axis,
                                            name=unique_name(f"{concat.name}/concat", taken)))
        _replace_node(graph, node_index(graph, concat), replacement)
        for node in chain:
            graph.node.remove(node)
        done.append(concat.name)
    return done


def _refuse_sequences(model: onnx.ModelProto) -> None:
    """A sequence op left after the rewrites (one read other than by a concatenation of appends): the toolkit
    has no sequence type and fails inside its own constant folding."""
    node = next((n for n in model.graph.node if "Sequence" in n.op_type), None)
    if node is not None:
        raise ModelError(f"quantize.rknn: node '{node.name or node.output[0]}' is {node.op_type}, and rknn-toolkit2 "
                         "takes no sequence ops (qprep rewrites only a list appended to and then concatenated or "
                         "stacked); export the model with tensors instead of a list, or use backend ort")


# -------------------------------------------------------- BatchNormalization over run-time statistics


def _is_if(node: onnx.NodeProto) -> bool:
    return node.op_type == "If" and node.domain in ("", "ai.onnx")


def _is_runtime_batchnorm(node: onnx.NodeProto, constants: set[str]) -> bool:
    """A BatchNormalization with an input computed at run time (constant ones the toolkit folds)."""
    return (node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx")
            and not all(name in constants for name in node.input[1:5]))


def _batchnorms_as_arithmetic(model: onnx.ModelProto) -> list[str]:
    graph = model.graph
    constants = constant_names(graph)
    if not any(_is_runtime_batchnorm(n, constants) for n in graph.node):
        return []
    shapes = _value_shapes(inferred_shapes(model, shapes_only=True))
    taken = all_names(model) | {n.name for n in iter_nodes(graph)}
    done = []
    for index in reversed(range(len(graph.node))):
        node = graph.node[index]
        if not _is_runtime_batchnorm(node, constants):
            continue
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        rank = len(shapes[node.input[0]]) if shapes.get(node.input[0]) is not None else None
        if attributes.get("training_mode", 0) or len([o for o in node.output if o]) > 1 or not rank or rank < 2:
            raise ModelError(f"quantize.rknn: node '{node.name}' is a BatchNormalization over statistics computed "
                             "at run time, which crashes rknn-toolkit2, and qprep cannot rewrite this one (training "
                             "mode, running-statistics outputs or an input of unknown rank): export it in eval mode")
        replacement = _arithmetic(node, rank, attributes.get("epsilon", 1e-5), taken, graph)
        _replace_node(graph, index, replacement)
        done.append(node.name)
    return done[::-1]


def _arithmetic(node: onnx.NodeProto, rank: int, epsilon: float, taken: set[str],
                graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """(x - mean) / sqrt(var + eps) * scale + bias, the [C] inputs reshaped to [C, 1, ...] against x's axis 1."""
    x, scale, bias, mean, var = node.input[:5]

    def name(what: str) -> str:
        return unique_name(f"{node.name}/{what}", taken)

    nodes = []
    if rank > 2:
        shape = name("channel_shape")
        graph.initializer.append(numpy_helper.from_array(np.array([-1] + [1] * (rank - 2), np.int64), shape))
        channels = {}
        for key, value in (("scale", scale), ("bias", bias), ("mean", mean), ("var", var)):
            channels[key] = name(f"{key}_per_channel")
            nodes.append(helper.make_node("Reshape", [value, shape], [channels[key]], name=name(f"reshape_{key}")))
        scale, bias, mean, var = channels["scale"], channels["bias"], channels["mean"], channels["var"]
    eps = name("epsilon")
    graph.initializer.append(numpy_helper.from_array(np.array(epsilon, np.float32), eps))
    centered, shifted, deviation, normalized, scaled = (name(w) for w in ("centered", "var_eps", "std", "normalized",
                                                                          "scaled"))
    nodes += [helper.make_node("Sub", [x, mean], [centered], name=name("sub_mean")),
              helper.make_node("Add", [var, eps], [shifted], name=name("add_epsilon")),
              helper.make_node("Sqrt", [shifted], [deviation], name=name("sqrt")),
              helper.make_node("Div", [centered, deviation], [normalized], name=name("div_std")),
              helper.make_node("Mul", [normalized, scale], [scaled], name=name("mul_scale")),
              helper.make_node("Add", [scaled, bias], [node.output[0]], name=name("add_bias"))]
    return nodes


# ------------------------------------------------------------------------------- omitted optional outputs


def _omitted_outputs_named(model: onnx.ModelProto) -> list[str]:
    """Each '' output of a node of the main graph named `<node>/unused_<index>` (a value nobody reads)."""
    taken = all_names(model) | {n.name for n in iter_nodes(model.graph)}
    named = []
    for node in model.graph.node:
        for index, output in enumerate(node.output):
            if output == "":
                node.output[index] = unique_name(f"{node.name or node.op_type}/unused_{index}", taken)
                named.append(node.name)
    return list(dict.fromkeys(named))


# ------------------------------------------------------------------------------------- Einsum → MatMul


def _matmul_plan(node: onnx.NodeProto) -> tuple[list[int], list[int], list[int]] | None:
    """(perm of A to [batch…, i, k], perm of B to [batch…, k, j], perm of [batch…, i, j] to the output) when the
    Einsum is one batched matmul; else None."""
    if node.op_type != "Einsum" or node.domain not in ("", "ai.onnx") or len(node.input) != 2:
        return None
    equation = next((a.s.decode() for a in node.attribute if a.name == "equation"), "").replace(" ", "")
    if "..." in equation or equation.count("->") != 1:
        return None
    terms, out = equation.split("->")
    if terms.count(",") != 1:
        return None
    a, b = terms.split(",")
    if any(len(set(t)) != len(t) for t in (a, b, out)):
        return None
    batch = [c for c in out if c in a and c in b]
    contracted = [c for c in a if c in b and c not in out]
    free_a, free_b = [c for c in a if c not in b], [c for c in b if c not in a]
    if len(contracted) != 1 or len(free_a) != 1 or len(free_b) != 1 or sorted(out) != sorted(batch + free_a + free_b):
        return None
    product = batch + free_a + free_b
    return ([a.index(c) for c in batch + free_a + contracted], [b.index(c) for c in batch + contracted + free_b],
            [product.index(c) for c in out])


def _einsums_as_matmul(model: onnx.ModelProto) -> list[str]:
    """Each batched-matmul Einsum of the main graph → Transpose(A), Transpose(B), MatMul, Transpose (identity
    Transposes left out), in its place."""
    graph, done = model.graph, []
    taken = all_names(model) | {n.name for n in iter_nodes(graph)}
    plans = [(i, plan) for i, plan in enumerate(map(_matmul_plan, graph.node)) if plan]
    for index, (perm_a, perm_b, perm_out) in reversed(plans):  # later ones first: earlier indices stay valid
        node = graph.node[index]
        prefix, replacement, operands = f"{node.name}/", [], []
        for operand, perm, label in ((node.input[0], perm_a, "a"), (node.input[1], perm_b, "b")):
            if perm != sorted(perm):
                moved = unique_name(f"{prefix}{label}", taken)
                replacement.append(helper.make_node("Transpose", [operand], [moved], perm=perm, name=moved))
                operand = moved
            operands.append(operand)
        product = node.output[0] if perm_out == sorted(perm_out) else unique_name(f"{prefix}product", taken)
        replacement.append(helper.make_node("MatMul", operands, [product], name=unique_name(f"{prefix}matmul", taken)))
        if product != node.output[0]:
            replacement.append(helper.make_node("Transpose", [product], [node.output[0]], perm=perm_out,
                                                name=unique_name(f"{prefix}out", taken)))
        _replace_node(graph, index, replacement)
        done.insert(0, node.name)
    return done


# ------------------------------------------------------------------------------ recurrent ops' layout


RECURRENT = {"LSTM", "GRU", "RNN"}


def _default_layout(node: onnx.NodeProto) -> bool:
    return node.op_type in RECURRENT and any(a.name == "layout" and a.i == 0 for a in node.attribute)


def _default_layouts_dropped(model: onnx.ModelProto) -> list[str]:
    """Each LSTM/GRU/RNN's `layout: 0` attribute removed (the same node: 0 is the default)."""
    dropped = []
    for node in model.graph.node:
        if _default_layout(node):
            kept = [a for a in node.attribute if a.name != "layout"]
            del node.attribute[:]
            node.attribute.extend(kept)
            dropped.append(node.name)
    return dropped


# ------------------------------------------------------------------------------------------------ helpers


def _one_by_one(model: onnx.ModelProto, wanted: Callable[[onnx.NodeProto], bool]) -> Iterator[int]:
    """The index of the first main-graph node `wanted` holds for, found again after each rewrite (an inlined
    body may hold more)."""
    while True:
        index = next((i for i, n in enumerate(model.graph.node) if wanted(n)), None)
        if index is None:
            return
        yield index


def _replace_node(graph: onnx.GraphProto, index: int, replacement: list[onnx.NodeProto]) -> None:
    """The node at `index` replaced by `replacement`, in its place (the graph stays topologically sorted)."""
    del graph.node[index]
    for offset, new in enumerate(replacement):
        graph.node.insert(index + offset, new)


def _value_shapes(inferred: onnx.ModelProto) -> dict[str, list | None]:
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
