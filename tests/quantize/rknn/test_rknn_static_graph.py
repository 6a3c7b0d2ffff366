"""What rknn-toolkit2 cannot compile, made static before it loads the model (static_graph.py), and the graph
input/output names it is given (io_names.py): tiny graphs, checked with ONNX Runtime; no toolkit needed."""

import numpy as np
import onnx
import pytest
from onnx import helper

from qprep.errors import ModelError
from qprep.model.runtime import run_model
from qprep.quantize.rknn import io_names
from qprep.quantize.rknn.limits import refuse_unsupported
from qprep.quantize.rknn.names import IRNames
from qprep.quantize.rknn.static_graph import carried, rewritten, static_graph
from graphs import gated_model, gated_samples, last_state_lstm_model, make_model, runtime_batchnorm_model


@pytest.mark.parametrize("shape", [(1, 1), (1, 3)])
def test_a_data_dependent_if_becomes_both_branches_and_a_selection(shape):
    model, samples = gated_model(shape), gated_samples()
    static, record = static_graph(model, samples)
    assert record == {"if_as_both_branches": ["if"], "verified_on": len(samples)}
    ops = [n.op_type for n in static.graph.node]
    assert "If" not in ops and ops.count("Sigmoid") == 2
    # one element: c·then + (1-c)·else (Where over one element crashes the toolkit); more: Where
    assert ("Where" in ops) == (shape != (1, 1))
    onnx.checker.check_model(static, full_check=True)
    gates = [run_model(model, [s])[0]["y"] for s in samples]
    assert len({float(np.asarray(g).ravel()[0] >= 0.5) for g in gates}) == 2  # both branches taken on these samples
    for sample in samples:
        np.testing.assert_array_equal(run_model(static, [sample])[0]["y"], run_model(model, [sample])[0]["y"])


def test_branches_of_different_shapes_are_refused_before_any_work():
    model = gated_model((1, 2))
    then = next(a.g for a in model.graph.node[-1].attribute if a.name == "then_branch")
    then.node.append(helper.make_node("Concat", ["p2", "p2"], ["p3"], axis=1, name="concat"))
    then.output[0].CopyFrom(helper.make_tensor_value_info("p3", onnx.TensorProto.FLOAT, [1, 4]))
    with pytest.raises(ModelError, match=r"node 'if' is an If whose branches give output 0 shapes \[1, 4\] and "
                                         r"\[1, 2\].*export the branch the device needs"):
        refuse_unsupported(model)


@pytest.mark.parametrize("rank", [2, 3])
def test_batchnorm_over_runtime_statistics_becomes_its_arithmetic(rank):
    model = runtime_batchnorm_model(rank)
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    samples = [{"x": np.random.default_rng(i).standard_normal(shape).astype(np.float32)} for i in range(4)]
    static, record = static_graph(model, samples)
    assert record == {"batchnorm_as_arithmetic": ["bn"], "verified_on": 4}
    ops = [n.op_type for n in static.graph.node]
    assert "BatchNormalization" not in ops and ops.count("Reshape") == (4 if rank == 3 else 0)
    for a, b in zip(run_model(model, samples), run_model(static, samples)):
        np.testing.assert_allclose(a["y"], b["y"], rtol=1e-5, atol=1e-5)


def test_batchnorm_with_constant_statistics_and_graphs_without_either_are_left_alone():
    """Statistics in initializers or Constant nodes (paddle2onnx's, before optimize folds them) are constant."""
    model = runtime_batchnorm_model()
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.ones(4, np.float32), "mean"))
    del model.graph.node[:3]
    model.graph.node.insert(0, helper.make_node("Constant", [], ["var"], name="var",
                                                value=onnx.numpy_helper.from_array(np.ones(4, np.float32))))
    assert rewritten(model) == (model, {})
    refuse_unsupported(model)  # and nothing to refuse


def test_training_mode_batchnorm_is_refused_with_the_fix():
    model = runtime_batchnorm_model()
    model.graph.node[-1].attribute.append(helper.make_attribute("training_mode", 1))
    with pytest.raises(ModelError, match=r"node 'bn' is a BatchNormalization over statistics computed at run time.*"
                                         r"export it in eval mode"):
        rewritten(model)


def test_an_omitted_optional_output_is_named_and_the_outputs_stay_the_same():
    """The toolkit's constant folding fails on an LSTM whose sequence output is left out (''): "Could not find
    OrtValue with name ''" (Resemblyzer). Named, the node computes it for nobody."""
    model = last_state_lstm_model()
    samples = [{"x": np.random.default_rng(i).standard_normal((1, 6, 5)).astype(np.float32)} for i in range(3)]
    static, record = static_graph(model, samples)
    assert record == {"omitted_outputs_named": ["lstm"], "verified_on": 3}
    lstm = next(n for n in static.graph.node if n.op_type == "LSTM")
    assert list(lstm.output) == ["lstm/unused_0", "h_last"] and "" in model.graph.node[1].output  # a copy
    onnx.checker.check_model(static, full_check=True)
    for a, b in zip(run_model(model, samples), run_model(static, samples)):
        np.testing.assert_array_equal(a["y"], b["y"])
    assert carried({"lstm", "head"}, static, record) == {"lstm", "head"}  # still itself: kept float if asked


JSON_NAME = '{"1": "1_minute_timer", "2": "5_minute_timer", "3": "10_minute_timer", "4": "20_minute_timer", ' \
            '"5": "30_minute_timer", "6": "1_hour_timer"}'


def test_only_names_the_toolkit_may_not_take_are_renamed_uniquely_and_everywhere():
    model = gated_model(x="x y")  # an input the If branch reads too
    model.graph.output[0].name = model.graph.node[-1].output[0] = JSON_NAME
    model.graph.node.append(helper.make_node("Identity", ["p1"], ["x_y"], name="taken"))  # the new name's clash
    model.graph.output.extend([helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, [1, 1])
                               for name in ("x_y", "onnx::Flatten_0")])
    model.graph.node.append(helper.make_node("Identity", ["p1"], ["onnx::Flatten_0"], name="kept"))
    renames = io_names.toolkit_names(model)
    assert renames == {"x y": "x_y_2", JSON_NAME: "output_0_1_1_minute_timer_2_5_minute_timer_3_10_minute_ti"}
    assert io_names.needs_new_name("a" * 128) and not io_names.needs_new_name("a" * 127)
    back = {new: old for old, new in renames.items()}  # analysis rows: the toolkit's suffixes kept, not prefixes
    assert io_names.translated("x_y_2-rs__float16", back) == "x y-rs__float16"
    assert io_names.translated("x_y_2x", back) == "x_y_2x"
    result = io_names.renamed(model, renames)
    onnx.checker.check_model(result, full_check=True)
    assert [i.name for i in result.graph.input] == ["x_y_2"]
    assert [o.name for o in result.graph.output] == [renames[JSON_NAME], "x_y", "onnx::Flatten_0"]
    assert not {"x y", JSON_NAME} & io_names.all_names(result)  # the If branch's outer read included
    samples = gated_samples(4, x="x y")
    renamed_samples = [{"x_y_2": s["x y"]} for s in samples]
    for a, b in zip(run_model(model, samples), run_model(result, renamed_samples)):
        assert [np.asarray(v).tolist() for v in a.values()] == [np.asarray(v).tolist() for v in b.values()]
    assert model.graph.input[0].name == "x y"  # the user's model is untouched


def test_ir_names_map_a_renamed_output_back_to_the_users_node(tmp_path):
    """The float-set map finds a graph output the toolkit knew under its new name by the user's output name."""
    ir = make_model([helper.make_node("Relu", ["x"], ["y_new_rs"], name="renamed_by_toolkit")], [("x", [1, 4])],
                    [("y_new_rs", [1, 4])])
    onnx.save(ir, str(tmp_path / "m.model"))
    cfg = "custom_quantize_layers: {}\nquantize_parameters:\n    y_new_rs:\n        dtype: asymmetric_affine\n"
    names = IRNames(str(tmp_path / "m.model"), cfg, {"y/original": "y_new"})
    user_node = helper.make_node("Relu", ["x"], ["y/original"], name="relu")
    assert names.map_node(user_node) == (["y_new_rs"], "output name")


def test_a_float16_output_layer_takes_the_toolkits_int8_copy_of_the_output_with_it(tmp_path):
    """rknn-toolkit2 2.5.0's IR of EfficientNet-Lite0's head: the Gemm (`logits_mm`), a Reshape to `logits_int8`
    and a convert to the output `logits`. The Gemm float16 alone leaves the output on int8's grid; its
    copies go with it. A node that computes no graph output maps to its own tensors only."""
    ir = make_model([helper.make_node("Relu", ["x"], ["h"], name="relu#1"),
                     helper.make_node("Relu", ["h"], ["logits_mm"], name="/_fc/Gemm#2"),
                     helper.make_node("Identity", ["logits_mm"], ["logits_int8"], name="logits_mm_tp_rs"),
                     helper.make_node("Identity", ["logits_int8"], ["logits"], name="logits__cvt_int8_to_float16")],
                    [("x", [1, 4])], [("logits", [1, 4])])
    onnx.save(ir, str(tmp_path / "m.model"))
    cfg = "custom_quantize_layers: {}\nquantize_parameters:\n" + "".join(
        f"    {name}:\n        dtype: int8\n" for name in ("h", "logits_mm", "logits_int8", "logits"))
    names = IRNames(str(tmp_path / "m.model"), cfg)
    gemm = helper.make_node("Gemm", ["r", "w"], ["logits"], name="/_fc/Gemm")
    assert names.map_node(gemm) == (["logits_mm", "logits_int8", "logits"], "node name")
    assert names.map_node(helper.make_node("Relu", ["x"], ["h"], name="relu")) == (["h"], "node name")


def test_a_recurrent_op_s_default_layout_is_dropped_and_the_node_stays_itself():
    model = last_state_lstm_model(layout=0)
    static, record = rewritten(model)
    assert record == {"omitted_outputs_named": ["lstm"], "default_layout_dropped": ["lstm"]}
    lstm = next(n for n in static.graph.node if n.op_type == "LSTM")
    assert "layout" not in {a.name for a in lstm.attribute}
    assert carried({"lstm"}, static, record) == {"lstm"}
    samples = [{"x": np.random.default_rng(i).standard_normal((1, 6, 5)).astype(np.float32)} for i in range(2)]
    for a, b in zip(run_model(model, samples), run_model(static, samples)):
        np.testing.assert_array_equal(a["y"], b["y"])


@pytest.mark.parametrize("equation, a_shape, b_shape", [
    ("nid,njd->nij", (2, 3, 4), (2, 5, 4)),          # attention scores
    ("nij,njd->nid", (2, 3, 5), (2, 5, 4)),          # attention-weighted values
    ("bhid,bhjd->bhij", (1, 2, 3, 4), (1, 2, 5, 4)),
    ("bid,jd->bij", (2, 3, 4), (5, 4)),              # a batch letter in one operand only: left
    ("ij,jk->ki", (3, 4), (4, 5)),                   # output transposed
    ("...id,...jd->...ij", (2, 3, 4), (2, 5, 4)),    # ellipsis: left
])
def test_a_batched_matmul_einsum_becomes_transposes_and_a_matmul(equation, a_shape, b_shape):
    """rknn-toolkit2 2.5.0's build fails on Einsum (KeyError in its shape inference); one batched matmul is
    rewritten, exactly."""
    model = make_model([helper.make_node("Einsum", ["a", "b"], ["y"], equation=equation, name="mix")],
                       [("a", list(a_shape)), ("b", list(b_shape))], [("y", None)], opset=13)
    static, record = rewritten(model)
    rewritable = "..." not in equation and equation != "bid,jd->bij"
    assert record == ({"einsum_as_matmul": ["mix"]} if rewritable else {})
    if rewritable:
        assert "Einsum" not in {n.op_type for n in static.graph.node}
        assert all(n.name.startswith("mix/") for n in static.graph.node)
        assert carried({"mix"}, static, record) == {n.name for n in static.graph.node}  # float if it was
    samples = [{"a": np.random.default_rng(1).standard_normal(a_shape).astype(np.float32),
                "b": np.random.default_rng(2).standard_normal(b_shape).astype(np.float32)}]
    np.testing.assert_allclose(run_model(static, samples)[0]["y"], run_model(model, samples)[0]["y"], rtol=1e-5,
                               atol=1e-5)


def _recurrent_loop(stop: str):
    """x[4, 3] → a Loop over its rows: h = tanh(h·W + x[i]) (W a body initializer), scanning every h → (h, hs).
    `stop`: "passed" (trip count 4, the condition passed on: TorchScript's), "counter" (no usable trip count; a
    carried counter from 0 and `counter + 1 < 4` as the condition: tf2onnx's while loops), "input" (a sum of h
    under a bound: a decoder's end token)."""
    from graphs import make_graph

    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Gather", ["x", "i"], ["row"], axis=0),
             helper.make_node("MatMul", ["h_in", "w"], ["hw"]), helper.make_node("Add", ["hw", "row"], ["pre"]),
             helper.make_node("Tanh", ["pre"], ["h_out"]), helper.make_node("Identity", ["h_out"], ["h_scan"])]
    inputs = [("i", [], np.int64), ("cond_in", [], np.bool_), ("h_in", [3])]
    outputs = [("cond_out", [], np.bool_), ("h_out", [3])]
    constants = {"w": rng.standard_normal((3, 3)).astype(np.float32)}
    loop_inputs, trips = ["trips", "cond", "h0"], np.int64(4)
    if stop == "passed":
        nodes.append(helper.make_node("Identity", ["cond_in"], ["cond_out"]))
    elif stop == "counter":
        nodes += [helper.make_node("Add", ["c_in", "one"], ["c_out"]),
                  helper.make_node("Less", ["c_out", "four"], ["cond_out"])]
        inputs.append(("c_in", [], np.int64))
        outputs.append(("c_out", [], np.int64))
        constants |= {"one": np.int64(1), "four": np.int64(4)}
        loop_inputs.append("c0")
        trips = np.int64(np.iinfo(np.int64).max)
    else:
        nodes += [helper.make_node("ReduceSum", ["h_out"], ["total"], keepdims=0),
                  helper.make_node("Less", ["total", "bound"], ["cond_out"])]
        constants["bound"] = np.float32(1.0)
    outputs.append(("h_scan", [3]))
    body = make_graph(nodes, inputs, outputs, constants, name="body")
    loop_outputs = ["h", "c"][:len(loop_inputs) - 2] + ["hs"]
    return make_model([helper.make_node("Loop", loop_inputs, loop_outputs, name="loop", body=body)],
                      [("x", [4, 3])], [("h", [3]), ("hs", [4, 3])],
                      {"trips": trips, "cond": np.bool_(True), "h0": np.zeros(3, np.float32), "c0": np.int64(0)},
                      infer_shapes=False)


@pytest.mark.parametrize("stop", ["passed", "counter"])
def test_a_loop_that_runs_a_fixed_number_of_times_is_unrolled(stop):
    """rknn-toolkit2 refuses every Loop ("will cause the graph to be a dynamic graph"): a Keras LSTM exported by
    tf2onnx, or a scripted torch loop, could not reach the NPU."""
    model = _recurrent_loop(stop)
    samples = [{"x": np.random.default_rng(i).standard_normal((4, 3)).astype(np.float32)} for i in range(3)]
    refuse_unsupported(model)  # passes the checks before any work
    static, record = static_graph(model, samples)
    assert record == {"loops_unrolled": ["loop"], "verified_on": 3}
    ops = [n.op_type for n in static.graph.node]
    assert "Loop" not in ops and ops.count("Tanh") == 4 and ops.count("Concat") == 1
    assert sum(t.name.endswith("/w") for t in static.graph.initializer) == 1  # the weight shared, not copied 4 times
    onnx.checker.check_model(static, full_check=True)
    for a, b in zip(run_model(model, samples), run_model(static, samples)):
        for name in ("h", "hs"):
            np.testing.assert_allclose(b[name], a[name], rtol=1e-6, atol=1e-6)


def test_a_loop_that_stops_on_its_data_is_refused_at_the_build_too():
    with pytest.raises(ModelError, match="node 'loop' is a Loop whose stop depends on the input"):
        rewritten(_recurrent_loop("input"))


def test_a_list_appended_to_in_a_scripted_loop_becomes_a_concat():
    """torch.jit.script of `outs.append(h)` in a loop, then torch.stack(outs, 1): a sequence carried through the
    Loop (SequenceEmpty, SequenceInsert) and ConcatFromSequence(new_axis=1). Unrolled, the toolkit still failed
    on the sequence ("initializer '/SequenceEmpty_output_0' has element type tensor(double)"): now a Concat."""
    from graphs import make_graph

    body = make_graph([helper.make_node("Gather", ["x", "i"], ["row"], axis=1),
                       helper.make_node("Tanh", ["row"], ["t"]),
                       helper.make_node("SequenceInsert", ["seq_in", "t"], ["seq_out"]),
                       helper.make_node("Identity", ["cond_in"], ["cond_out"])],
                      [("i", [], np.int64), ("cond_in", [], np.bool_),
                       helper.make_tensor_sequence_value_info("seq_in", onnx.TensorProto.FLOAT, None)],
                      [("cond_out", [], np.bool_),
                       helper.make_tensor_sequence_value_info("seq_out", onnx.TensorProto.FLOAT, None)], name="body")
    model = make_model([helper.make_node("SequenceEmpty", [], ["empty"], dtype=onnx.TensorProto.FLOAT),
                        helper.make_node("Loop", ["trips", "cond", "empty"], ["seq"], name="loop", body=body),
                        helper.make_node("ConcatFromSequence", ["seq"], ["y"], axis=1, new_axis=1, name="stack")],
                       [("x", [2, 5, 3])], [("y", [2, 5, 3])], {"trips": np.int64(5), "cond": np.bool_(True)},
                       infer_shapes=False)
    samples = [{"x": np.random.default_rng(i).standard_normal((2, 5, 3)).astype(np.float32)} for i in range(2)]
    static, record = static_graph(model, samples)
    assert record == {"loops_unrolled": ["loop"], "sequence_as_concat": ["stack"], "verified_on": 2}
    left = {n.op_type for n in static.graph.node}
    assert not {"Loop", "SequenceEmpty", "SequenceInsert", "ConcatFromSequence"} & left
    for a, b in zip(run_model(model, samples), run_model(static, samples)):
        np.testing.assert_array_equal(b["y"], a["y"])


def test_a_sequence_read_otherwise_and_a_scan_are_refused_naming_them():
    """The toolkit has no sequence type (it failed on a SequenceEmpty with a traceback from its own constant
    folding) and compiles static graphs only: named before the build instead."""
    from graphs import make_graph

    sequence = make_model([helper.make_node("SequenceConstruct", ["x", "x"], ["s"], name="pair"),
                           helper.make_node("SequenceAt", ["s", "one"], ["y"], name="second")],
                          [("x", [2, 3])], [("y", [2, 3])], {"one": np.int64(1)}, infer_shapes=False)
    with pytest.raises(ModelError, match="node 'pair' is SequenceConstruct, and rknn-toolkit2 takes no sequence ops"):
        rewritten(sequence)
    body = make_graph([helper.make_node("Add", ["acc_in", "row"], ["acc_out"]),
                       helper.make_node("Identity", ["acc_out"], ["scan_out"])],
                      [("acc_in", [3]), ("row", [3])], [("acc_out", [3]), ("scan_out", [3])], name="body")
    scan = make_model([helper.make_node("Scan", ["zero", "x"], ["total", "sums"], num_scan_inputs=1, body=body,
                                        name="cumsum")],
                      [("x", [4, 3])], [("total", [3]), ("sums", [4, 3])], {"zero": np.zeros(3, np.float32)},
                      infer_shapes=False)
    with pytest.raises(ModelError, match="node 'cumsum' is a Scan, and rknn-toolkit2 compiles static graphs only"):
        refuse_unsupported(scan)


@pytest.mark.parametrize("source", ["shape", "values", "nonzero"])
def test_a_trip_count_read_from_a_shape_is_counted_and_one_read_from_the_values_refused(source):
    model = _recurrent_loop("passed")
    graph = model.graph
    if source == "shape":  # Shape(x)[0]: fixed, as the NPU model's dims are
        computed = [helper.make_node("Shape", ["x"], ["dims"]),
                    helper.make_node("Gather", ["dims", "zero"], ["trips_x"])]
        graph.initializer.append(onnx.numpy_helper.from_array(np.int64(0), "zero"))
    elif source == "values":  # a count read from the input's values
        computed = [helper.make_node("ReduceMax", ["x"], ["top"], keepdims=0),
                    helper.make_node("Cast", ["top"], ["trips_x"], to=onnx.TensorProto.INT64)]
    else:  # the size of something the values decide: Size(NonZero(x > 0)) (the review's counterexample)
        graph.initializer.append(onnx.numpy_helper.from_array(np.float32(0), "zero_f"))
        computed = [helper.make_node("Greater", ["x", "zero_f"], ["positive"]),
                    helper.make_node("NonZero", ["positive"], ["where"]),
                    helper.make_node("Size", ["where"], ["trips_x"])]
    for offset, node in enumerate(computed):
        graph.node.insert(offset, node)
    graph.node[-1].input[0] = "trips_x"
    samples = [{"x": np.random.default_rng(i).standard_normal((4, 3)).astype(np.float32)} for i in range(2)]
    if source != "shape":
        with pytest.raises(ModelError, match="node 'loop' is a Loop whose stop depends on the input"):
            refuse_unsupported(model)
        return
    refuse_unsupported(model)
    static, record = static_graph(model, samples)
    assert record["loops_unrolled"] == ["loop"] and [n.op_type for n in static.graph.node].count("Tanh") == 4


def test_a_loop_inside_an_if_branch_is_unrolled_once_the_branch_is_inlined():
    """Each rewrite ran once: the If's inlined branch brought its Loop into the main graph after the Loops had been
    unrolled, and the toolkit got a Loop."""
    from graphs import make_graph

    looped = _recurrent_loop("passed")
    loop = looped.graph.node[0]
    loop.output[:] = ["h", "hs"]  # hs read by nobody
    then = make_graph([loop], [], [("h", [3])], name="then")
    other = make_graph([helper.make_node("ReduceMean", ["x"], ["m"], axes=[0], keepdims=0)], [], [("m", [3])],
                       name="else")
    nodes = [helper.make_node("ReduceSum", ["x"], ["total"], keepdims=0),
             helper.make_node("Greater", ["total", "zero"], ["flag"]),
             helper.make_node("If", ["flag"], ["y"], name="if", then_branch=then, else_branch=other)]
    initializers = [*looped.graph.initializer, onnx.numpy_helper.from_array(np.float32(0), "zero")]
    model = make_model(nodes, [("x", [4, 3])], [("y", [3])], initializers, infer_shapes=False)
    samples = [{"x": np.random.default_rng(i).standard_normal((4, 3)).astype(np.float32) + shift}
               for i, shift in enumerate((-2, 2, 2))]
    static, record = static_graph(model, samples)
    assert record["if_as_both_branches"] == ["if"] and len(record["loops_unrolled"]) == 1
    ops = [n.op_type for n in static.graph.node]
    assert "If" not in ops and "Loop" not in ops and ops.count("Tanh") == 4
    for a, b in zip(run_model(model, samples), run_model(static, samples)):
        np.testing.assert_allclose(b["y"], a["y"], rtol=1e-6, atol=1e-6)


def test_nested_loops_are_bounded_together(monkeypatch):
    """A Loop (3 times) whose body's If holds a Loop (10 times): each within the limit alone, 73 nodes together."""
    from graphs import make_graph
    from qprep.quantize.rknn.static_graph import loops

    monkeypatch.setattr(loops, "MAX_UNROLLED_NODES", 30)
    inner = make_graph([helper.make_node("Add", ["w", "one"], ["w2"], name="inc"),
                        helper.make_node("Identity", ["ci"], ["co"], name="ic")],
                       [("j", [], np.int64), ("ci", [], np.bool_), ("w", [4])], [("co", [], np.bool_), ("w2", [4])],
                       name="inner")
    then = make_graph([helper.make_node("Loop", ["ten", "", "v"], ["t"], body=inner, name="inner_loop")], [],
                      [("t", [4])], name="then")
    other = make_graph([helper.make_node("Identity", ["v"], ["e"], name="same")], [], [("e", [4])], name="else")
    body = make_graph([helper.make_node("If", ["yes"], ["v2"], then_branch=then, else_branch=other, name="if"),
                       helper.make_node("Identity", ["c"], ["c2"], name="pass_on")],
                      [("i", [], np.int64), ("c", [], np.bool_), ("v", [4])], [("c2", [], np.bool_), ("v2", [4])],
                      name="body")
    model = make_model([helper.make_node("Loop", ["n", "", "x"], ["y"], body=body, name="loop")], [("x", [4])],
                       [("y", [4])], {"n": np.int64(3), "ten": np.int64(10), "one": np.float32(1),
                                      "yes": np.array(True)}, infer_shapes=False)
    with pytest.raises(ModelError, match=r"unrolling the Loops .*\(nested\) made \d+ more nodes \(at most 30\)"):
        static_graph(model, [{"x": np.zeros(4, np.float32)}])
