"""Graph hygiene rknn-toolkit2 assumes and ONNX does not require: one rule per class, in RULES, each exact
(the same graph in ONNX's meaning) and verified with the other rewrites (static_graph/__init__.py). The list
grows by class: a toolkit error on a graph qprep did not refuse is a rule missing here, or a refusal in `refuse`.

Facts (rknn-toolkit2 2.5.0, each measured on a one-node model built and run on the simulator):
- A graph input no node reads (an exporter's leftover, or one that only shape computations read, which optimize
  folds): load_onnx fails, "The 'z' in inputs=['x', 'z'] is invalid!"; one that only nodes computing for no
  output read fails the build. It is removed from the model the toolkit loads (with those nodes); the input
  contract keeps it, marked ignored (contract.py), and the board runner skips it.
- An empty ('') optional input. Trailing: an LSTM's initial_h/initial_c fail the quantizer (`KeyError: ''` in
  its _p_adjust_lstm); dropped, ONNX's own meaning of an omitted trailing input. In the middle: an LSTM's
  initial states fail the same way and a GRU's B crashes the toolkit (SIGSEGV); filled with ONNX's default
  (zeros). An LSTM given initial_h without initial_c fails too (IndexError): zeros given. An empty
  sequence_lens builds for all three ops, while an RNN's constant one fails the build ("Type Error:
  tensor(int32)"): a constant full-length sequence_lens is emptied (the same meaning), an empty one stays.
  Other ops' empty middle inputs build (Resize's roi, Clip's min or max) and are left as they are.
- LSTM peepholes (input P), in either direction: the toolkit aborts from C++ ("SubGraphManager: not support
  yet", SIGABRT). All-zero peepholes are dropped (the same LSTM); others are refused before any work, as is
  `input_forget: 1` (the same abort) and a bidirectional LSTM whose constant initial state is not all zeros (it
  aborts: "clip_truncate < 0, plz make sure bias_scale > weight_scale * input_scale"; forward, or with the
  states as graph inputs, it builds). An LSTM whose cell state Y_c is read and its last state Y_h is not fails
  the build (`KeyError` on Y_c's name; read with Y_h it builds): refused too.
- A GRU or RNN whose last state Y_h is read and its sequence Y is not (torch's `_, h = gru(x)`): the build fails
  (`KeyError` on Y_h's name, "Should didnot run into this for ''", or "Could not find OrtValue with name ''" in
  its constant folding); an LSTM read so builds. Y_h is taken from Y instead (its last step; the first for the
  reverse direction), exact where every sequence is full length (sequence_lens empty or the full length).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from qprep.errors import ModelError
from qprep.model.info import constant_tensors, iter_nodes, node_index, tensor_shapes, unique_name
from qprep.model.io import subgraphs
from qprep.quantize.rknn.io_names import all_names

GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}  # a recurrent op's gate count: B holds 2 × gates × hidden per direction
INPUTS = ("X", "W", "R", "B", "sequence_lens", "initial_h", "initial_c", "P")


def _onnx_domain(node: onnx.NodeProto) -> bool:
    return node.domain in ("", "ai.onnx")


def _recurrent(node: onnx.NodeProto) -> bool:
    return node.op_type in GATES and _onnx_domain(node)


def _read(model: onnx.ModelProto) -> set[str]:
    """Values some node (in any subgraph too) or the graph's outputs read ('' is no value)."""
    read = {name for node in iter_nodes(model.graph) for name in node.input} | {o.name for o in model.graph.output}
    return read - {""}


def _live(model: onnx.ModelProto) -> set[str]:
    """Values the graph outputs depend on (a node with bodies reads every value its bodies read)."""
    live = {o.name for o in model.graph.output}
    for node in reversed(model.graph.node):  # topologically sorted: readers come after what they read
        if any(o in live for o in node.output):
            live.update(node.input)
            live.update(name for sub in _bodies(node) for inner in iter_nodes(sub) for name in inner.input)
    return live


def _bodies(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    return [sub for attribute in node.attribute for sub in subgraphs(attribute)]


def unread_inputs(model: onnx.ModelProto) -> list[str]:
    """Graph inputs (not initializers) that nothing the graph outputs depend on reads."""
    live, constants = _live(model), {t.name for t in model.graph.initializer}
    return [v.name for v in model.graph.input if v.name not in live and v.name not in constants]


def unread_inputs_removed(model: onnx.ModelProto) -> list[str]:
    """Each unread graph input removed (what the toolkit loads), with the nodes computing from it for no output
    (the toolkit prunes those and then fails on the input they leave: "argument of type 'NoneType' is not
    iterable"); ModelError when no input is read at all."""
    unread = unread_inputs(model)
    if not unread:
        return []
    constants = {t.name for t in model.graph.initializer}
    kept = [v for v in model.graph.input if v.name not in unread]
    if not [v for v in kept if v.name not in constants]:
        raise ModelError(f"quantize.rknn: no node reads the model's inputs ({', '.join(unread)}): its outputs are "
                         "constants, with nothing to quantize; check the export")
    del model.graph.input[:]
    model.graph.input.extend(kept)
    gone = set(unread)
    for node in list(model.graph.node):  # in order: a dead node's readers come after it
        reads = set(node.input) | {n for sub in _bodies(node) for inner in iter_nodes(sub) for n in inner.input}
        if reads & gone:
            gone.update(node.output)
            model.graph.node.remove(node)
    return unread


def _zero_peepholes(node: onnx.NodeProto, constants: dict[str, onnx.TensorProto]) -> bool | None:
    """An LSTM's peepholes: None without, True when they are constant zeros, False otherwise."""
    if node.op_type != "LSTM" or len(node.input) < 8 or node.input[7] == "":
        return None
    tensor = constants.get(node.input[7])
    return tensor is not None and not np.any(numpy_helper.to_array(tensor))


def _refused(node: onnx.NodeProto, constants: dict[str, onnx.TensorProto], read: set[str]) -> tuple | None:
    """(what, the toolkit's error, the way out) of an LSTM the toolkit fails on, or None."""
    if node.op_type != "LSTM" or not _onnx_domain(node):
        return None
    if len(node.output) > 2 and node.output[2] and node.output[2] in read and node.output[1] not in read:
        return ("an LSTM whose cell state Y_c is read and its last state Y_h is not",
                f"KeyError: '{node.output[2]}'", "with its last state read too (an output of the model)")
    if _zero_peepholes(node, constants) is False:
        return "an LSTM with peephole weights (input P)", "SubGraphManager: not support yet", "without peepholes"
    attributes = {a.name: a for a in node.attribute}
    if "input_forget" in attributes and attributes["input_forget"].i:
        return "an LSTM with input_forget 1", "SubGraphManager: not support yet", "with input_forget 0"
    states = [name for name in node.input[5:7] if name]
    if attributes.get("direction") and attributes["direction"].s == b"bidirectional" and any(
            name in constants and np.any(numpy_helper.to_array(constants[name])) for name in states):
        return ("a bidirectional LSTM whose constant initial state is not all zeros", "clip_truncate < 0",
                "with its initial states as graph inputs, or zeros")
    return None


def refuse(model: onnx.ModelProto) -> None:
    """An LSTM the toolkit fails on (most abort: SIGABRT) and no rule here computes otherwise, named in one
    line."""
    constants, read = constant_tensors(model.graph), _read(model)
    for node in model.graph.node:
        found = _refused(node, constants, read)
        if found:
            what, line, way_out = found
            raise ModelError(f"quantize.rknn: node '{node.name or node.output[0]}' is {what}, which rknn-toolkit2 "
                             f"cannot compile (it fails: \"{line}\"); export the LSTM {way_out}, or use backend ort")


def zero_peepholes_dropped(model: onnx.ModelProto) -> list[str]:
    """Each LSTM's all-zero peepholes left out (the same LSTM: P's default is zeros)."""
    constants = constant_tensors(model.graph)
    done = []
    for node in model.graph.node:
        if _recurrent(node) and _zero_peepholes(node, constants):
            node.input[7] = ""
            done.append(node.name)
    return done


def trailing_empty_inputs_dropped(model: onnx.ModelProto) -> list[str]:
    """Each ONNX-domain node's trailing '' inputs removed: an omitted trailing input means the same."""
    done = []
    for node in model.graph.node:
        if _onnx_domain(node) and node.input and node.input[-1] == "":
            while node.input and node.input[-1] == "":
                del node.input[-1]
            done.append(node.name)
    return done


def _recurrent_dims(node: onnx.NodeProto, shapes: dict) -> tuple[int, int, int, int, int]:
    """(directions, hidden size, sequence length, batch, element type) of a recurrent node whose input's dims
    are known; ModelError naming the node where they are not."""
    attributes = {a.name: a for a in node.attribute}
    directions = 2 if attributes.get("direction") and attributes["direction"].s == b"bidirectional" else 1
    layout = attributes["layout"].i if "layout" in attributes else 0
    elem_type, dims = shapes.get(node.input[0], (onnx.TensorProto.FLOAT, None))
    if not dims or len(dims) != 3 or None in dims[:2] or "hidden_size" not in attributes:
        raise ModelError(f"quantize.rknn: node '{node.name}' is a {node.op_type} whose input's sequence and batch "
                         "dims are unknown, which qprep needs to prepare it for rknn-toolkit2; fix the input dims "
                         "(`inputs:` in the config)")
    steps, batch = (dims[1], dims[0]) if layout else (dims[0], dims[1])
    return directions, attributes["hidden_size"].i, steps, batch, elem_type


DEFAULTED = (3, 5, 6)  # B, initial_h, initial_c: zeros by ONNX's definition (sequence_lens: full_lengths_emptied)


def _lacks_defaults(node: onnx.NodeProto) -> bool:
    """A recurrent node with an empty B or initial state before its last input, or an LSTM with initial_h and
    without initial_c."""
    return _recurrent(node) and (any(i < len(node.input) and node.input[i] == "" for i in DEFAULTED)
                                 or node.op_type == "LSTM" and len(node.input) == 6)


def full_lengths_emptied(model: onnx.ModelProto) -> list[str]:
    """Each recurrent node's constant sequence_lens that is the full length everywhere left out (the same)."""
    constants, done = constant_tensors(model.graph), []
    nodes = [n for n in model.graph.node if _recurrent(n) and len(n.input) > 4 and n.input[4] in constants]
    shapes = tensor_shapes(model) if nodes else {}
    for node in nodes:
        try:
            _, _, steps, _, _ = _recurrent_dims(node, shapes)
        except ModelError:  # unknown: left as it is
            continue
        if np.all(numpy_helper.to_array(constants[node.input[4]]) == steps):
            node.input[4] = ""
            done.append(node.name)
    return done


def recurrent_defaults_filled(model: onnx.ModelProto) -> list[str]:
    """Each empty B or initial state of an LSTM/GRU/RNN before its last input, and an LSTM's initial_c where
    only initial_h is given, given as the zeros ONNX defines for it."""
    nodes = [n for n in model.graph.node if _lacks_defaults(n)]
    if not nodes:
        return []
    shapes, taken = tensor_shapes(model), all_names(model)
    for node in nodes:
        if node.op_type == "LSTM" and len(node.input) == 6:
            node.input.append("")
        directions, hidden, _, batch, elem_type = _recurrent_dims(node, shapes)
        layout = next((a.i for a in node.attribute if a.name == "layout"), 0)
        dtype = helper.tensor_dtype_to_np_dtype(elem_type)
        state = (batch, directions, hidden) if layout else (directions, batch, hidden)
        defaults = {3: np.zeros((directions, 2 * GATES[node.op_type] * hidden), dtype), 5: np.zeros(state, dtype),
                    6: np.zeros(state, dtype)}
        for index, name in enumerate(node.input):
            if name == "" and index in defaults:
                value = unique_name(f"{node.name}/{INPUTS[index]}", taken)
                model.graph.initializer.append(numpy_helper.from_array(defaults[index], value))
                node.input[index] = value
    return [n.name for n in nodes]


def _last_state_unread_sequence(node: onnx.NodeProto, read: set[str]) -> bool:
    """A GRU/RNN whose Y_h is read and whose Y is not."""
    return (node.op_type in ("GRU", "RNN") and _onnx_domain(node) and len(node.output) >= 2
            and node.output[1] in read and node.output[1] != "" and node.output[0] not in read)


def last_state_from_sequence(model: onnx.ModelProto) -> list[str]:
    """Each GRU/RNN whose Y_h is read and Y is not: Y_h computed from Y by Gathers (its last step per
    direction), the node's Y_h output left out. A node whose sequence_lens is not the full length is refused."""
    read = _read(model)
    nodes = [n for n in model.graph.node if _last_state_unread_sequence(n, read)]
    if not nodes:
        return []
    shapes, constants, taken = tensor_shapes(model), constant_tensors(model.graph), all_names(model)
    taken |= {n.name for n in iter_nodes(model.graph)}
    for node in nodes:
        directions, _, steps, _, _ = _recurrent_dims(node, shapes)
        lengths = node.input[4] if len(node.input) > 4 else ""
        if lengths and not (lengths in constants and np.all(numpy_helper.to_array(constants[lengths]) == steps)):
            raise ModelError(f"quantize.rknn: node '{node.name}' is a {node.op_type} whose last state is read and "
                             "its sequence output is not, with sequence lengths set at run time, which "
                             "rknn-toolkit2 cannot compile; read the state from the sequence output, or use "
                             "backend ort")
        sequence = node.output[0] or unique_name(f"{node.name}/Y", taken)
        state = node.output[1]
        del node.output[:]
        node.output.append(sequence)
        index = node_index(model.graph, node)
        for offset, new in enumerate(_gathers(node, steps, directions, state, taken, model)):
            model.graph.node.insert(index + 1 + offset, new)
    return [n.name for n in nodes]


def _gathers(recurrent: onnx.NodeProto, steps: int, directions: int, state: str, taken: set[str],
             model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """Nodes computing `state` (Y_h) from the node's Y ([steps, directions, batch, hidden], or [batch, steps,
    directions, hidden] with layout 1): the forward direction's last step, the reverse direction's first.
    Gather and Concat only, so any opset takes them."""
    name, sequence = recurrent.name, recurrent.output[0]
    attributes = {a.name: a for a in recurrent.attribute}
    axis = attributes["layout"].i if "layout" in attributes else 0  # the steps; then the directions are there too

    def constant(label: str, array: np.ndarray) -> str:
        value = unique_name(f"{name}/{label}", taken)
        model.graph.initializer.append(numpy_helper.from_array(array, value))
        return value

    def node(op: str, inputs: list[str], output: str, label: str, **attributes) -> onnx.NodeProto:
        return helper.make_node(op, inputs, [output], name=unique_name(f"{name}/{label}", taken), **attributes)

    if directions == 1:
        reverse = "direction" in attributes and attributes["direction"].s == b"reverse"
        return [node("Gather", [sequence, constant("step", np.array(0 if reverse else steps - 1, np.int64))],
                     state, "last_state", axis=axis)]
    last, first = (unique_name(f"{name}/{label}", taken) for label in ("last_step", "first_step"))
    forward, backward = (unique_name(f"{name}/{label}", taken) for label in ("forward_state", "backward_state"))
    return [node("Gather", [sequence, constant("last", np.array(steps - 1, np.int64))], last, "gather_last", axis=axis),
            node("Gather", [last, constant("forward", np.array([0], np.int64))], forward, "forward", axis=axis),
            node("Gather", [sequence, constant("first", np.array(0, np.int64))], first, "gather_first", axis=axis),
            node("Gather", [first, constant("backward", np.array([1], np.int64))], backward, "backward", axis=axis),
            node("Concat", [forward, backward], state, "last_state", axis=axis)]


def needed(model: onnx.ModelProto) -> bool:
    """Would any rule change `model`? (cheap: the common model is not copied)"""
    if unread_inputs(model):
        return True
    read = _read(model)
    return any(_onnx_domain(n) and n.input and n.input[-1] == "" or _lacks_defaults(n)
               or _recurrent(n) and (len(n.input) >= 8 or len(n.input) > 4 and n.input[4] != "")
               or _last_state_unread_sequence(n, read) for n in model.graph.node)


# In the order they run: peepholes dropped leave a trailing '', trailing ones dropped leave only the middle ones
RULES = (("unread_inputs_removed", unread_inputs_removed),
         ("zero_peepholes_dropped", zero_peepholes_dropped),
         ("full_lengths_emptied", full_lengths_emptied),
         ("trailing_empty_inputs_dropped", trailing_empty_inputs_dropped),
         ("recurrent_defaults_filled", recurrent_defaults_filled),
         ("last_state_from_sequence", last_state_from_sequence))
