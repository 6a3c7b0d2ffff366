"""SessionRecipe: a session built after its model's proto is gone, once."""

import numpy as np
import pytest
from onnx import helper

from graphs import make_model
from qprep.model import io
from qprep.model.runtime import SessionRecipe, ort_session, run_model


@pytest.mark.parametrize("heavy", [False, True])
def test_a_recipe_builds_the_same_session_without_its_model_and_only_once(monkeypatch, heavy):
    if heavy:  # the weights travel as arrays beside the weightless graph
        monkeypatch.setattr(io, "HEAVY_BYTES", 1024)
    rng = np.random.default_rng(0)
    model = make_model([helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
                       [("x", [2, 256])], [("y", [2, 128])],
                       {"w": rng.standard_normal((256, 128)).astype(np.float32)})
    feeds = {"x": rng.standard_normal((2, 256)).astype(np.float32)}
    expected = run_model(model, [feeds])[0]["y"]
    recipe = SessionRecipe(model, extra_outputs=["h"])
    del model
    session = ort_session(recipe)
    y, h = session.run(["y", "h"], feeds)
    np.testing.assert_array_equal(y, expected)
    np.testing.assert_array_equal(np.maximum(h, 0), y)
    with pytest.raises(RuntimeError, match="one session"):
        ort_session(recipe)


def test_samples_run_side_by_side_come_back_in_their_order_and_failures_as_one_line(monkeypatch):
    """run_model runs 2 samples at once on a light model (one thread each), one at a time on a heavy one: outputs
    stay in sample order, equal to one run at a time, and a sample the model refuses is a ModelError, not a
    worker's traceback."""
    from qprep.errors import ModelError
    from qprep.model import runtime

    rng = np.random.default_rng(1)
    model = make_model([helper.make_node("MatMul", ["x", "w"], ["y"])], [("x", [1, 64])], [("y", [1, 64])],
                       {"w": rng.standard_normal((64, 64)).astype(np.float32)})
    samples = [{"x": rng.standard_normal((1, 64)).astype(np.float32)} for _ in range(9)]
    session_outputs, workers = runtime.session_outputs, []
    monkeypatch.setattr(runtime, "session_outputs", lambda session, samples, n=1: workers.append(n) or
                        session_outputs(session, samples, n))
    together = run_model(model, samples, threads=2)
    alone = session_outputs(ort_session(model, threads=1), samples)
    assert [s["y"].tobytes() for s in together] == [s["y"].tobytes() for s in alone]
    assert len({s["y"].tobytes() for s in together}) == 9
    with pytest.raises(ModelError, match="cannot run"):
        run_model(model, samples[:3] + [{"x": np.zeros((1, 3), np.float32)}], threads=2)
    monkeypatch.setattr(io, "HEAVY_BYTES", 1024)  # the same model taken for a heavy one
    run_model(model, samples, threads=2)
    assert workers == [2, 2, 1]


def test_extra_outputs_come_for_every_sample_or_for_none_past_their_byte_cap():
    """run_model's `max_extra_bytes`, judged on the first sample: h is 4×128 float32 = 2 KB a sample; 3 samples
    fit in 6 KB and not in 5 KB, where every sample has y alone, as without extra outputs."""
    rng = np.random.default_rng(2)
    model = make_model([helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
                       [("x", [4, 64])], [("y", [4, 128])], {"w": rng.standard_normal((64, 128)).astype(np.float32)})
    samples = [{"x": rng.standard_normal((4, 64)).astype(np.float32)} for _ in range(3)]
    plain = run_model(model, samples, threads=2)
    held = run_model(model, samples, threads=2, extra_outputs=["h"], max_extra_bytes=6 * 1024)
    assert all(set(s) == {"y", "h"} and np.array_equal(np.maximum(s["h"], 0), s["y"]) for s in held)
    over = run_model(model, samples, threads=2, extra_outputs=["h"], max_extra_bytes=5 * 1024)
    assert [set(s) for s in over] == [{"y"}] * 3
    assert all(np.array_equal(a["y"], b["y"]) for a, b in zip(plain, over))


def test_intermediates_run_only_the_part_that_computes_them():
    """An early tensor is read from the nodes it depends on: the Relu and the second MatMul are not in the
    session (ONNX Runtime would run them whatever a run fetches), and the value is the same."""
    from qprep.model.runtime import intermediate_values

    rng = np.random.default_rng(0)
    w1, w2 = rng.standard_normal((4, 4)).astype(np.float32), rng.standard_normal((4, 4)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["a"]), helper.make_node("Relu", ["a"], ["b"]),
             helper.make_node("MatMul", ["b", "w2"], ["y"])]
    model = make_model(nodes, [("x", [2, 4])], [("y", [2, 4])], {"w1": w1, "w2": w2})
    part = io.computing(model, ["a"])
    assert [n.op_type for n in part.graph.node] == ["MatMul"] and [o.name for o in part.graph.output] == ["a"]
    assert [t.name for t in part.graph.initializer] == ["w1"]
    sample = {"x": rng.standard_normal((2, 4)).astype(np.float32)}
    values = next(intermediate_values(model, ["a", "x"], [sample]))
    np.testing.assert_allclose(values["a"], sample["x"] @ w1, rtol=1e-5)
    np.testing.assert_array_equal(values["x"], sample["x"])


def test_a_part_keeps_the_outer_tensors_its_subgraphs_read():
    """An If's branches read `w` and `s` from the outer graph, not as node inputs: the part that computes the If's
    output keeps the nodes and initializers they come from, and computes the whole model's value; a tensor the
    part is given stops the walk there, branch reads included."""
    from qprep.model.runtime import Stepwise, ort_session

    then = helper.make_graph([helper.make_node("Mul", ["s", "w"], ["z"])], "then", [],
                             [helper.make_tensor_value_info("z", 1, [2])])
    other = helper.make_graph([helper.make_node("Neg", ["s"], ["z2"])], "else", [],
                              [helper.make_tensor_value_info("z2", 1, [2])])
    nodes = [helper.make_node("Relu", ["x"], ["s"]), helper.make_node("ReduceSum", ["x"], ["t"], keepdims=0),
             helper.make_node("Greater", ["t", "zero"], ["c"]),
             helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other),
             helper.make_node("Exp", ["x"], ["unused"])]
    model = make_model(nodes, [("x", [2])], [("y", [2]), ("unused", [2])],
                       {"w": np.array([2.0, 3.0], np.float32), "zero": np.array(0.0, np.float32)})
    part = io.computing(model, ["y"])
    assert [n.op_type for n in part.graph.node] == ["Relu", "ReduceSum", "Greater", "If"]
    assert {t.name for t in part.graph.initializer} == {"w", "zero"}
    x = np.array([1.0, -0.5], np.float32)
    np.testing.assert_allclose(ort_session(part).run(["y"], {"x": x})[0], np.maximum(x, 0) * [2.0, 3.0])
    given = io.computing(model, ["y"], given={"s": 1})
    assert [n.op_type for n in given.graph.node] == ["ReduceSum", "Greater", "If"]
    assert "s" in {i.name for i in given.graph.input}
    stepwise = Stepwise(model, [{"x": x}])
    stepwise.advance(["s"])
    assert set(stepwise.held) == {"s"}  # the If's branches read it: held until the If has run
    np.testing.assert_allclose(stepwise.advance(["y"])[0]["y"], np.maximum(x, 0) * [2.0, 3.0])


def _skip_chain():
    """x → MatMul a → Relu b → MatMul c → Add(c, a) y: `a` is read again after `b`'s part (a skip connection)."""
    rng = np.random.default_rng(1)
    w1, w2 = rng.standard_normal((4, 4)).astype(np.float32), rng.standard_normal((4, 4)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["a"]), helper.make_node("Relu", ["a"], ["b"]),
             helper.make_node("MatMul", ["b", "w2"], ["c"]), helper.make_node("Add", ["c", "a"], ["y"])]
    return make_model(nodes, [("x", [2, 4])], [("y", [2, 4])], {"w1": w1, "w2": w2}), w1, w2


def test_stepwise_parts_give_the_whole_model_values_and_hold_only_what_later_nodes_read():
    from qprep.model.runtime import Stepwise, intermediate_values

    model, _, _ = _skip_chain()
    rng = np.random.default_rng(2)
    samples = [{"x": rng.standard_normal((2, 4)).astype(np.float32)} for _ in range(3)]
    whole = list(intermediate_values(model, ["a", "b", "y"], samples))
    stepwise = Stepwise(model, samples)
    first = stepwise.advance(["b"])
    assert set(stepwise.held) == {"a", "b"}  # `a` waits for the Add, `b` for the second MatMul
    last = stepwise.advance(["y"])
    assert stepwise.held == {} and stepwise.ran == {0, 1, 2, 3}
    for index in range(3):
        np.testing.assert_array_equal(first[index]["b"], whole[index]["b"])
        np.testing.assert_array_equal(last[index]["y"], whole[index]["y"])


def test_stepwise_later_parts_read_what_add_changed():
    """A change to a held tensor reaches every later reader (here the second MatMul and the skip Add), as a
    changed bias reaches the layers after it."""
    from qprep.model.runtime import Stepwise

    model, w1, w2 = _skip_chain()
    sample = {"x": np.random.default_rng(3).standard_normal((2, 4)).astype(np.float32)}
    stepwise = Stepwise(model, [sample])
    stepwise.advance(["a"])
    delta = np.arange(4, dtype=np.float32)
    stepwise.add("a", delta, axis=-1)
    a = sample["x"] @ w1 + delta
    np.testing.assert_allclose(stepwise.advance(["y"])[0]["y"], np.maximum(a, 0) @ w2 + a, rtol=1e-5, atol=1e-6)


def test_stepwise_a_node_with_an_unnamed_optional_output_is_not_taken_for_another():
    """Two Dropouts whose mask output is left unnamed (""): the second part runs the second one, not neither."""
    from qprep.model.runtime import Stepwise

    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Dropout", ["a"], ["d1", ""]),
             helper.make_node("Dropout", ["d1"], ["d2", ""]), helper.make_node("Neg", ["d2"], ["y"])]
    model = make_model(nodes, [("x", [2, 3])], [("y", [2, 3])])
    x = np.random.default_rng(4).standard_normal((2, 3)).astype(np.float32)
    stepwise = Stepwise(model, [{"x": x}])
    np.testing.assert_array_equal(stepwise.advance(["d1"])[0]["d1"], np.maximum(x, 0))
    np.testing.assert_array_equal(stepwise.advance(["y"])[0]["y"], -np.maximum(x, 0))


def test_stepwise_declines_a_part_boundary_it_cannot_hold():
    """A sequence crossing from one part to the next is not a tensor it can feed again, and a target whose node
    ran in an earlier part without anything later reading it was let go: advance says None (the caller then
    runs the whole model) rather than recomputing it from the samples."""
    from qprep.model.runtime import Stepwise

    nodes = [helper.make_node("SequenceConstruct", ["x", "x"], ["s"]),
             helper.make_node("SequenceAt", ["s", "zero"], ["first"]),
             helper.make_node("ConcatFromSequence", ["s"], ["y"], axis=0)]
    model = make_model(nodes, [("x", [2])], [("y", [4])], {"zero": np.array(0, np.int64)})
    sample = {"x": np.array([1.0, 2.0], np.float32)}
    assert Stepwise(model, [sample]).advance(["first"]) is None
    model, _, _ = _skip_chain()
    stepwise = Stepwise(model, [{"x": np.ones((2, 4), np.float32)}])
    assert stepwise.advance(["c"]) is not None
    assert stepwise.advance(["b"]) is None  # `b` ran for `c` and nothing unrun reads it any more


def test_a_kernel_refusal_is_advised_with_keep_float_naming_the_node_whatever_the_backend():
    """The advice named the ORT backend's nodes_to_exclude for every backend's model (an FP16 model included);
    keep_float holds for every backend, with the node the message names."""
    from qprep.model.runtime import model_error

    typed = ("[ONNXRuntimeError] : 1 : FAIL : Type Error: Type (tensor(float16)) of output arg (_to_copy) of node "
             "(node__to_copy) does not match expected type (tensor(float)).")
    said = str(model_error(RuntimeError(typed)))
    assert "keep_float: {nodes: [node__to_copy]}" in said and "quantize.ort" not in said
