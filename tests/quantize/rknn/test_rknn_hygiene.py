"""Graph hygiene rknn-toolkit2 assumes (static_graph/hygiene.py): tiny graphs rewritten and checked with ONNX
Runtime, or refused in one line; the board files keep an input the toolkit does not get. No toolkit needed (the
builds themselves: test_rknn_hygiene_builds.py)."""

import json

import numpy as np
import onnx
import pytest
from onnx import helper

from qprep.errors import ModelError
from qprep.model.info import graph_inputs
from qprep.model.runtime import run_model
from qprep.quantize.rknn.contract import write_board_files
from qprep.quantize.rknn.limits import refuse_unsupported
from qprep.quantize.rknn.static_graph import static_graph
from conftest import typed
from graphs import make_model

STEPS, FEATURES, HIDDEN = 6, 5, 8


def _samples(model: onnx.ModelProto, count: int = 3) -> list[dict]:
    return [{spec.name: np.random.default_rng(i).standard_normal(spec.shape).astype(np.float32)
             for spec in graph_inputs(model)} for i in range(count)]


def _same_outputs(model: onnx.ModelProto, result: onnx.ModelProto, samples: list[dict]) -> None:
    for a, b in zip(run_model(model, samples), run_model(result, samples)):
        assert a.keys() == b.keys()
        for name in a:
            np.testing.assert_allclose(a[name], b[name], rtol=1e-6, atol=1e-6)


def unread_input_model(dead: bool = False) -> onnx.ModelProto:
    """x[1,3,4,4] → Conv → y; z, another input, read by no node (an exporter's leftover), or with `dead` only by
    nodes whose results no output reads (the toolkit prunes them, then fails its build on z)."""
    weight = np.random.default_rng(0).standard_normal((2, 3, 1, 1)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], name="conv")]
    if dead:
        nodes += [helper.make_node("Relu", ["z"], ["r"], name="dead"),
                  helper.make_node("Add", ["r", "x"], ["s"], name="dead_too")]
    return make_model(nodes, [("x", [1, 3, 4, 4]), ("z", [1, 3, 4, 4] if dead else [1, 2])], [("y", [1, 2, 4, 4])],
                      {"w": weight})


def recurrent_model(op: str, inputs: list[str], outputs: list[str], direction: str = "forward",
                    peepholes: float | None = None) -> onnx.ModelProto:
    """One `op` node over x [steps, 1, features] with `inputs` after X from W,
    R, B, h0, c0, P (named so; '' for an empty one) and `outputs` among Y, Y_h ('' left out), each a graph
    output unless its name starts with '_' (computed, read by nobody)."""
    rng = np.random.default_rng(1)
    directions, gates = (2 if direction == "bidirectional" else 1), {"RNN": 1, "GRU": 3, "LSTM": 4}[op]
    weights = {"W": rng.standard_normal((directions, gates * HIDDEN, FEATURES)) * 0.4,
               "R": rng.standard_normal((directions, gates * HIDDEN, HIDDEN)) * 0.4,
               "B": rng.standard_normal((directions, 2 * gates * HIDDEN)) * 0.1,
               "h0": rng.standard_normal((directions, 1, HIDDEN)) * 0.5,
               "c0": rng.standard_normal((directions, 1, HIDDEN)) * 0.5,
               "P": np.full((directions, 3 * HIDDEN), peepholes or 0.0)}
    used = {name: weights[name].astype(np.float32) for name in inputs if name}
    node = helper.make_node(op, ["x", *inputs], outputs, hidden_size=HIDDEN, direction=direction, name=op.lower())
    shapes = {"Y": [STEPS, directions, 1, HIDDEN], "Y_h": [directions, 1, HIDDEN]}
    graph_outputs = [(name, shapes[name]) for name in outputs if name and not name.startswith("_")]
    return make_model([node], [("x", [STEPS, 1, FEATURES])], graph_outputs, used)


@pytest.mark.parametrize("dead", [False, True])
def test_an_input_no_node_reads_is_removed_and_kept_in_the_board_files_marked_ignored(tmp_path, dead):
    """rknn-toolkit2's load_onnx: "The 'z' in inputs=['x', 'z'] is invalid!" (exit 3 before)."""
    model = unread_input_model(dead)
    samples = _samples(model)  # they hold z: the verification and the evaluation feed what the model declares
    static, record = static_graph(model, samples)
    assert record == {"unread_inputs_removed": ["z"], "verified_on": 3}
    assert [i.name for i in static.graph.input] == ["x"] and [i.name for i in model.graph.input] == ["x", "z"]
    assert [n.name for n in static.graph.node] == ["conv"]
    _same_outputs(model, static, samples)
    write_board_files(tmp_path, graph_inputs(model), None, typed("rknn"), static,
                      ignored=record["unread_inputs_removed"])
    contract = json.loads((tmp_path / "input_contract.json").read_text())
    assert [(i["name"], i.get("ignored", False)) for i in contract["inputs"]] == [("x", False), ("z", True)]
    assert "not fed" in contract["inputs"][1]["feed"]


def test_a_model_whose_inputs_no_node_reads_is_refused_in_one_line():
    model = make_model([helper.make_node("Identity", ["c"], ["y"], name="id")], [("x", [1, 2])], [("y", [2])],
                       {"c": np.ones(2, np.float32)})
    with pytest.raises(ModelError, match=r"no node reads the model's inputs \(x\): its outputs are constants"):
        static_graph(model, [])


@pytest.mark.parametrize("op, direction, sequence", [("GRU", "forward", "_Y"), ("GRU", "reverse", "_Y"),
                                                     ("GRU", "bidirectional", "_Y"), ("RNN", "forward", "_Y"),
                                                     ("GRU", "forward", "")])
def test_a_gru_whose_last_state_alone_is_read_takes_it_from_its_sequence(op, direction, sequence):
    """torch's `_, h = gru(x)`: Y computed for nobody (or left out), sequence_lens empty, Y_h read. The toolkit's
    build fails on it (KeyError on Y_h's name, or "Could not find OrtValue with name ''")."""
    model = recurrent_model(op, ["W", "R", "B", "", "h0"], [sequence, "Y_h"], direction)  # (ORT runs no layout 1)
    samples = _samples(model)
    static, record = static_graph(model, samples)
    assert record == {"last_state_from_sequence": [op.lower()], "verified_on": 3}
    recurrent = next(n for n in static.graph.node if n.op_type == op)
    assert list(recurrent.input) == ["x", "W", "R", "B", "", "h0"]
    assert list(recurrent.output) == [sequence or f"{op.lower()}/Y"]
    onnx.checker.check_model(static, full_check=True)
    _same_outputs(model, static, samples)


def test_an_lstm_s_empty_inputs_are_dropped_at_the_end_and_filled_in_the_middle():
    """An LSTM's '' initial states fail the toolkit's quantizer (KeyError: ''); initial_h without initial_c
    fails its build (IndexError)."""
    trailing = recurrent_model("LSTM", ["W", "R", "B", "", "", ""], ["Y"], "bidirectional")
    static, record = static_graph(trailing, _samples(trailing))
    assert record == {"trailing_empty_inputs_dropped": ["lstm"], "verified_on": 3}
    assert list(static.graph.node[0].input) == ["x", "W", "R", "B"]
    middle = recurrent_model("LSTM", ["W", "R", "", "", "h0"], ["Y", "Y_h"])
    samples = _samples(middle)
    static, record = static_graph(middle, samples)
    assert record == {"recurrent_defaults_filled": ["lstm"], "verified_on": 3}
    lstm = static.graph.node[0]
    assert list(lstm.input) == ["x", "W", "R", "lstm/B", "", "h0", "lstm/initial_c"]  # sequence_lens left empty
    defaults = {t.name: onnx.numpy_helper.to_array(t) for t in static.graph.initializer}
    assert not defaults[lstm.input[3]].any() and not defaults[lstm.input[6]].any()
    _same_outputs(middle, static, samples)
    assert static_graph(static, samples)[1] == {}  # nothing left to do: not copied again


def test_a_constant_full_length_sequence_lens_is_emptied():
    """An RNN's constant sequence_lens fails the toolkit's build ("Type Error: tensor(int32)"); left empty, the
    same RNN builds."""
    model = recurrent_model("RNN", ["W", "R", "B", "", "h0"], ["Y"], "bidirectional")
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.array([STEPS], np.int32), "lengths"))
    model.graph.node[0].input[4] = "lengths"
    samples = _samples(model)
    static, record = static_graph(model, samples)
    assert record == {"full_lengths_emptied": ["rnn"], "verified_on": 3}
    assert list(static.graph.node[0].input) == ["x", "W", "R", "B", "", "h0"]
    _same_outputs(model, static, samples)


@pytest.mark.parametrize("attribute, inputs, outputs, refusal", [
    ({}, ["W", "R", "B", "", "", "", "P"], ["Y"], r"an LSTM with peephole weights \(input P\).*SubGraphManager: not "
                                                  r"support yet.*export the LSTM without peepholes"),
    ({"input_forget": 1}, ["W", "R", "B"], ["Y"], r"an LSTM with input_forget 1.*export the LSTM with input_forget 0"),
    ({}, ["W", "R", "B", "", "h0", "c0"], ["Y"], r"a bidirectional LSTM whose constant initial state is not all "
                                                 r"zeros.*clip_truncate < 0.*with its initial states as graph inputs, or zeros"),
    ({}, ["W", "R", "B"], ["Y", "", "Y_h"], r"an LSTM whose cell state Y_c is read and its last state Y_h is not.*"
                                            r"KeyError: 'Y_h'.*with its last state read too \(an output of the model\)"),
])
def test_lstms_the_toolkit_fails_on_are_refused_up_front_naming_the_node(attribute, inputs, outputs, refusal):
    """SIGABRT (the first three) or an error in the toolkit's build (exit 3 before): refused before any work, in
    one line. (The cell state is named Y_h here only for the test builder's output shapes.)"""
    model = recurrent_model("LSTM", inputs, outputs, "bidirectional", peepholes=0.3)
    model.graph.node[0].attribute.extend(helper.make_attribute(k, v) for k, v in attribute.items())
    with pytest.raises(ModelError, match=rf"^quantize.rknn: node 'lstm' is {refusal}, or use backend ort$"):
        refuse_unsupported(model, at_load=True)


def test_zero_peepholes_are_dropped():
    """The toolkit aborts on any peephole LSTM (SIGABRT, "SubGraphManager: not support yet"), zeros too."""
    zero = recurrent_model("LSTM", ["W", "R", "B", "", "", "", "P"], ["Y"], "bidirectional", peepholes=0.0)
    refuse_unsupported(zero)
    static, record = static_graph(zero, _samples(zero))
    assert record == {"zero_peepholes_dropped": ["lstm"], "trailing_empty_inputs_dropped": ["lstm"],
                      "verified_on": 3}
    assert list(static.graph.node[0].input) == ["x", "W", "R", "B"]
