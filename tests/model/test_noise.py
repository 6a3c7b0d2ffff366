"""Random ops measured on the same noise (qprep/model/noise.py): taken out as inputs, drawn once per sample,
fed alike to the float model and the result, and drawn again by the deployable."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import helper

import qprep
from graphs import make_model, rand
from qprep.model.noise import as_inputs, drawn_ops, restore, taken_out, with_noise
from qprep.model.runtime import ort_session


def _noisy_conv(op: str = "RandomNormalLike", **attributes):
    """x[1,3,8,8] → Conv → h; y = Relu(h + draw(h) · s): the draw's shape is h's, as a VITS prior's noise."""
    rng = np.random.default_rng(0)
    inputs = ["h"] if op.endswith("Like") else []
    if not op.endswith("Like"):
        attributes.setdefault("shape", [1, 4, 8, 8])
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["h"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node(op, inputs, ["noise"], name="draw", **attributes),
             helper.make_node("Mul", ["noise", "s"], ["scaled"], name="scale"),
             helper.make_node("Add", ["h", "scaled"], ["sum"], name="add"),
             helper.make_node("Relu", ["sum"], ["y"], name="relu")]
    return make_model(nodes, [("x", [1, 3, 8, 8])], [("y", [1, 4, 8, 8])],
                      {"w": rng.standard_normal((4, 3, 3, 3)).astype(np.float32),
                       "b": rng.standard_normal(4).astype(np.float32), "s": np.float32(0.5)}, opset=17)


@pytest.mark.parametrize("op, attributes, check", [
    ("RandomNormalLike", {"mean": 2.0, "scale": 0.1}, lambda v: abs(v.mean() - 2.0) < 0.1 and v.std() < 0.2),
    ("RandomUniformLike", {"low": -1.0, "high": 0.0}, lambda v: v.min() >= -1.0 and v.max() <= 0.0),
    ("RandomNormal", {}, lambda v: abs(v.mean()) < 0.5),
])
def test_a_draw_becomes_an_input_fed_the_same_values_per_sample(op, attributes, check):
    model = _noisy_conv(op, **attributes)
    fed, sources = as_inputs(model)
    assert op not in {n.op_type for n in fed.graph.node}
    assert [i.name for i in fed.graph.input] == ["x", "noise"]
    samples = [{"x": rand(1, 3, 8, 8, seed=i)} for i in range(3)]
    first, again = with_noise(samples, sources, model), with_noise(samples, sources, model)
    assert all(s["noise"].shape == (1, 4, 8, 8) and s["noise"].dtype == np.float32 for s in first)
    assert all(np.array_equal(a["noise"], b["noise"]) for a, b in zip(first, again))  # a rerun draws the same
    assert not np.array_equal(first[0]["noise"], first[1]["noise"])  # each sample its own draw
    assert check(np.concatenate([s["noise"].ravel() for s in first]))
    session = ort_session(fed)
    assert session.run(None, first[0])[0].shape == (1, 4, 8, 8)


def test_the_deployable_draws_again_and_takes_no_noise_input():
    model = _noisy_conv()
    fed, sources = as_inputs(model)
    drawn, left = restore(fed, sources)
    assert left == [] and [i.name for i in drawn.graph.input] == ["x"]
    assert [n.op_type for n in drawn.graph.node].count("RandomNormalLike") == 1
    onnx.checker.check_model(drawn)
    x = {"x": rand(1, 3, 8, 8)}
    session = ort_session(drawn)
    assert not np.array_equal(session.run(None, x)[0], session.run(None, x)[0])  # random again


def test_a_draw_whose_shape_tensor_is_gone_stays_an_input():
    model = _noisy_conv()
    fed, sources = as_inputs(model)
    for node in fed.graph.node:  # the result computes the Conv output under another name
        node.output[:] = ["h2" if o == "h" else o for o in node.output]
        node.input[:] = ["h2" if i == "h" else i for i in node.input]
    drawn, left = restore(fed, sources)
    assert left == ["noise"] and "noise" in [i.name for i in drawn.graph.input]


def test_a_reader_placed_before_the_shape_tensor_is_reordered():
    """A quantizer may place the noise's reader anywhere once the noise is an input: the draw goes after the
    tensor it copies and the graph is in order again."""
    model = _noisy_conv()
    fed, sources = as_inputs(model)
    nodes = list(fed.graph.node)
    scale = next(n for n in nodes if n.name == "scale")
    reordered = [scale, *[n for n in nodes if n.name != "scale"]]
    del fed.graph.node[:]
    fed.graph.node.extend(reordered)
    drawn, _ = restore(fed, sources)
    onnx.checker.check_model(drawn)
    order = [n.name for n in drawn.graph.node]
    assert order.index("conv") < order.index("draw") < order.index("scale") < order.index("add")


def _noisy_run_config(tmp_path, backend: str = "ort") -> dict:
    onnx.save(_noisy_conv(), str(tmp_path / "m.onnx"))
    for split, seed in (("calib", 0), ("eval", 100)):
        (tmp_path / split).mkdir()
        for i in range(8):
            np.save(tmp_path / split / f"{i}.npy", rand(1, 3, 8, 8, seed=seed + i))
    return {"model": str(tmp_path / "m.onnx"), "calibration": {"source": str(tmp_path / "calib")},
            "evaluation": {"source": str(tmp_path / "eval"), "layers": False, "latency": {"runs": 0}},
            "pipeline": [{"optimize": {}}, {"quantize": {"backend": backend}}]}


def test_a_model_with_a_random_op_runs_judged_on_the_same_noise(tmp_path):
    """Refused before (the outputs differ call to call); now the float model and the result get the same draw,
    so a close INT8 result reads close, and model.onnx draws its noise itself again."""
    report = qprep.run(_noisy_run_config(tmp_path), output_dir=str(tmp_path / "out"))
    assert report["status"] == "ok"
    assert report["evaluation"]["outputs"]["y"]["cosine_mean"] > 0.99  # different noise: about 0.9 here
    assert report["load"]["noise"][0]["op"] == "RandomNormalLike"
    saved = onnx.load(str(tmp_path / "out" / "model.onnx"))
    assert [i.name for i in saved.graph.input] == ["x"] and "RandomNormalLike" in {n.op_type for n in saved.graph.node}
    assert report["result"]["noise"]["inputs"] == []
    markdown = (tmp_path / "out" / "report.md").read_text()
    assert "drawn once per sample" in markdown


def test_evaluate_on_new_samples_feeds_the_result_the_same_noise(tmp_path, cli):
    qprep.run(_noisy_run_config(tmp_path), output_dir=str(tmp_path / "out"))
    (tmp_path / "new").mkdir()
    for i in range(4):
        np.save(tmp_path / "new" / f"{i}.npy", rand(1, 3, 8, 8, seed=500 + i))
    code, out, err = cli("evaluate", str(tmp_path / "out"), "--samples", str(tmp_path / "new"),
                         "--json", str(tmp_path / "e.json"), "--quiet")
    assert code == 0, err
    figures = json.loads((tmp_path / "e.json").read_text())
    assert figures["outputs"]["y"]["cosine_mean"] > 0.99


def test_different_noise_would_read_far_apart():
    """What the comparison would say without feeding the same values: the test above can fail."""
    model = _noisy_conv()
    fed, sources = as_inputs(model)
    sample = {"x": rand(1, 3, 8, 8)}
    a, b = with_noise([sample], sources, model)[0], with_noise([sample, sample], sources, model)[1]
    session = ort_session(fed)
    ya, yb = (session.run(None, s)[0].ravel() for s in (a, b))
    assert float(ya @ yb / np.linalg.norm(ya) / np.linalg.norm(yb)) < 0.99


def _coin_model():
    """y = MatMul(x, w) · Bernoulli(Sigmoid(x)): each feature kept with the probability the graph computes."""
    nodes = [helper.make_node("Sigmoid", ["x"], ["p"], name="p"),
             helper.make_node("Bernoulli", ["p"], ["coin"], name="coin"),
             helper.make_node("MatMul", ["x", "w"], ["h"], name="matmul"),
             helper.make_node("Mul", ["h", "coin"], ["y"], name="mul")]
    return make_model(nodes, [("x", [1, 8])], [("y", [1, 8])], {"w": rand(8, 8)}, opset=17)


def test_a_bernoulli_is_measured_as_a_uniform_draw_below_its_probability(tmp_path):
    """Bernoulli(p) = 1 where u < p, u ~ U(0, 1): the uniform u is fed per sample alike to both models, and the
    deployable draws u with RandomUniformLike (refused before: the probabilities are computed by the graph)."""
    model = _coin_model()
    fed, sources = as_inputs(model)
    assert "Bernoulli" not in {n.op_type for n in fed.graph.node} and {"Less", "Cast"} <= {n.op_type for n in fed.graph.node}
    assert sources[0].describe()["op"] == "Bernoulli" and sources[0].like == "p"
    x = rand(1, 8)
    sample = with_noise([{"x": x}], sources, model)[0]
    u = sample[sources[0].output]
    expected = (x @ rand(8, 8)) * (u < 1 / (1 + np.exp(-x)))
    np.testing.assert_allclose(ort_session(fed).run(None, sample)[0], expected, rtol=1e-5, atol=1e-5)
    drawn, left = restore(fed, sources)
    assert left == [] and [i.name for i in drawn.graph.input] == ["x"]
    assert "RandomUniformLike" in {n.op_type for n in drawn.graph.node}
    onnx.checker.check_model(drawn)
    (tmp_path / "calib").mkdir()
    for i in range(8):
        np.save(tmp_path / "calib" / f"{i}.npy", rand(1, 8, seed=i))
    onnx.save(model, str(tmp_path / "m.onnx"))
    report = qprep.run({"model": str(tmp_path / "m.onnx"), "calibration": {"source": str(tmp_path / "calib")},
                        "evaluation": {"source": str(tmp_path / "calib"), "layers": False, "latency": {"runs": 0}},
                        "pipeline": [{"quantize": {"backend": "ort"}}]}, output_dir=str(tmp_path / "out"))
    assert report["status"] == "ok" and report["load"]["noise"][0]["op"] == "Bernoulli"


def _multinomial_model(opset: int = 17, batch="N", size: int = 3, dtype: int | None = None):
    """logits = MatMul(x, w)[N, 5] → Multinomial(sample_size) → Cast float → y[N, size]; logits an output too."""
    attributes = {"sample_size": size, **({"dtype": dtype} if dtype is not None else {})}
    nodes = [helper.make_node("MatMul", ["x", "w"], ["logits"], name="matmul"),
             helper.make_node("Multinomial", ["logits"], ["pick"], name="pick", **attributes),
             helper.make_node("Cast", ["pick"], ["y"], to=onnx.TensorProto.FLOAT, name="cast")]
    return make_model(nodes, [("x", [batch, 4])], [("y", [batch, size]), ("logits", [batch, 5])], {"w": rand(4, 5)},
                      opset=opset)


@pytest.mark.parametrize("opset, dtype", [(12, None), (17, onnx.TensorProto.INT64)])
def test_a_multinomial_samples_its_softmax_by_inverse_cdf_on_a_fed_uniform(opset, dtype):
    """Taken out: u[N, sample_size] is fed and the index is where u falls in the cumulative softmax, so the
    picks follow softmax(logits) (6000 draws a row, loose bounds, fixed seed); restored: the Multinomial again."""
    model = _multinomial_model(opset, dtype=dtype)
    fed, sources = as_inputs(model)
    assert "Multinomial" not in {n.op_type for n in fed.graph.node}
    assert [i.name for i in fed.graph.input] == ["x", "pick_uniform"] and sources[0].describe()["op"] == "Multinomial"
    onnx.checker.check_model(fed, full_check=True)
    x = np.tile(rand(2, 4), (1000, 1))  # two rows of logits, 1000 times each: one sample, one run
    sample = with_noise([{"x": x}], sources, model)[0]
    assert sample["pick_uniform"].shape == (2000, 3)
    pick = ort_session(fed).run(None, sample)[0]  # the float model's Cast of the index
    logits = x[:2] @ rand(4, 5)
    probability = np.exp(logits - logits.max(1, keepdims=True))
    probability /= probability.sum(1, keepdims=True)
    for row in range(2):
        frequency = np.bincount(pick[row::2].ravel().astype(int), minlength=5) / pick[row::2].size
        np.testing.assert_allclose(frequency, probability[row], atol=0.03)
    index = next(n for n in fed.graph.node if n.output[0] == "pick")
    assert index.op_type == "Sub"  # the Multinomial's output keeps its name and, with dtype, its type
    drawn, left = restore(fed, sources)
    assert left == [] and [i.name for i in drawn.graph.input] == ["x"]
    assert [n.op_type for n in drawn.graph.node] == ["MatMul", "Multinomial", "Cast"]
    assert [t.name for t in drawn.graph.initializer] == ["w"]
    onnx.checker.check_model(drawn, full_check=True)
    assert ort_session(drawn).run(None, {"x": x[:2]})[0].shape == (2, 3)


def test_a_multinomial_is_fed_from_opset_12_and_refused_below():
    """The sampling compares with LessOrEqual (opset 12); an older graph's Multinomial stays refused."""
    assert [n.name for n in drawn_ops(_multinomial_model(opset=12))[0]] == ["pick"]
    fed, refused = drawn_ops(_multinomial_model(opset=11))
    assert fed == [] and [(n.name, why) for n, why in refused] == [("pick", "Multinomial")]


def test_a_multinomial_whose_output_is_gone_keeps_its_uniform_as_an_input():
    model = _multinomial_model()
    fed, sources = as_inputs(model)
    for node in fed.graph.node:  # the result computes the index under another name
        node.output[:] = ["pick2" if o == "pick" else o for o in node.output]
        node.input[:] = ["pick2" if i == "pick" else i for i in node.input]
    drawn, left = restore(fed, sources)
    assert left == ["pick_uniform"] and "Multinomial" not in {n.op_type for n in drawn.graph.node}


def test_a_multinomial_goes_back_after_its_logits_wherever_the_result_placed_them():
    model = _multinomial_model()
    fed, sources = as_inputs(model)
    nodes = list(fed.graph.node)
    matmul = next(n for n in nodes if n.name == "matmul")
    del fed.graph.node[:]
    fed.graph.node.extend([*[n for n in nodes if n.name != "matmul"], matmul])  # out of order, as a quantizer may
    drawn, _ = restore(fed, sources)
    onnx.checker.check_model(drawn)
    assert [n.op_type for n in drawn.graph.node] == ["MatMul", "Multinomial", "Cast"]


def _multinomial_run(tmp_path, backend: str) -> dict:
    onnx.save(_multinomial_model(batch=1, size=1), str(tmp_path / "m.onnx"))
    (tmp_path / "calib").mkdir()
    for i in range(8):
        np.save(tmp_path / "calib" / f"{i}.npy", rand(1, 4, seed=i))
    quantize = {"backend": backend, **({"rknn": {"weight_rounding": "nearest", "analysis_samples": 0}}
                                      if backend == "rknn" else {})}
    return qprep.run({"model": str(tmp_path / "m.onnx"), "calibration": {"source": str(tmp_path / "calib")},
                      "evaluation": {"source": str(tmp_path / "calib"), "layers": False, "latency": {"runs": 0}},
                      "pipeline": [{"optimize": {}}, {"quantize": quantize}]}, output_dir=str(tmp_path / "out"))


def test_a_model_with_a_multinomial_runs_judged_on_the_same_noise(tmp_path, cli):
    """Refused before; the float model and the result now pick from the same uniform, and model.onnx samples
    with its Multinomial again (qprep evaluate takes it out again)."""
    report = _multinomial_run(tmp_path, "ort")
    assert report["status"] == "ok" and report["load"]["noise"][0]["op"] == "Multinomial"
    assert report["result"]["noise"]["inputs"] == [] and set(report["evaluation"]["outputs"]) == {"y", "logits"}
    assert "fails on node" not in (tmp_path / "out" / "qprep.log").read_text()  # the sampling is left float
    saved = onnx.load(str(tmp_path / "out" / "model.onnx"))
    assert [i.name for i in saved.graph.input] == ["x"] and "Multinomial" in {n.op_type for n in saved.graph.node}
    assert "random op `pick` (Multinomial, U(0, 1))" in (tmp_path / "out" / "report.md").read_text()
    code, _, err = cli("evaluate", str(tmp_path / "out"), "--samples", str(tmp_path / "calib"), "--quiet")
    assert code == 0, err


@pytest.mark.slow
def test_a_multinomial_builds_for_rknn_with_its_uniform_as_an_input(tmp_path):
    """The toolkit takes the inverse-CDF sampling (its double sums as float32); the .rknn reads u."""
    report = _multinomial_run(tmp_path, "rknn")
    assert report["status"] == "ok" and report["result"]["noise"]["inputs"] == ["pick_uniform"]
    assert report["evaluation"]["outputs"]["y"]["samples"] == 8
    assert "takes its values as input `pick_uniform`" in (tmp_path / "out" / "report.md").read_text()


def test_random_ops_it_cannot_feed_are_still_refused(tmp_path):
    """A random op inside an If branch (here a Multinomial) has no graph input to be fed through: refused in one
    line naming it."""
    from graphs import make_graph
    from qprep.errors import ModelError

    branch = make_graph([helper.make_node("Multinomial", ["x"], ["pick"], name="pick", sample_size=1),
                         helper.make_node("Cast", ["pick"], ["t"], to=onnx.TensorProto.FLOAT, name="cast")],
                        [], [("t", [1, 1])], name="then")
    other = make_graph([helper.make_node("ReduceMax", ["x"], ["e"], name="max", axes=[1])], [], [("e", [1, 1])],
                       name="else")
    nodes = [helper.make_node("ReduceMax", ["x"], ["top"], name="top", keepdims=0),
             helper.make_node("Greater", ["top", "zero"], ["flag"], name="flag"),
             helper.make_node("Squeeze", ["flag"], ["cond"], name="cond"),
             helper.make_node("If", ["cond"], ["y"], name="if", then_branch=branch, else_branch=other)]
    onnx.save(make_model(nodes, [("x", [1, 8])], [("y", [1, 1])], {"zero": np.float32(0)}, opset=17),
              str(tmp_path / "m.onnx"))
    (tmp_path / "calib").mkdir()
    np.save(tmp_path / "calib" / "0.npy", rand(1, 8))
    with pytest.raises(ModelError, match=r"node 'pick' \(Multinomial\) draws random values"):
        qprep.run({"model": str(tmp_path / "m.onnx"), "calibration": {"source": str(tmp_path / "calib")},
                   "pipeline": [{"quantize": {}}]}, output_dir=str(tmp_path / "out"))


def test_taken_out_keeps_the_model_to_draw_from():
    model = _noisy_conv()
    fed, noise = taken_out(model)
    assert noise.inputs() == {"noise"}
    samples = [{"x": rand(1, 3, 8, 8, seed=i)} for i in range(2)]
    for once, again in zip(noise.samples(samples), with_noise(samples, noise.sources, model)):
        assert once["noise"].shape == (1, 4, 8, 8) and np.array_equal(once["noise"], again["noise"])
    assert taken_out(_noisy_conv_free())[1].sources == ()


def _noisy_conv_free():
    rng = np.random.default_rng(0)
    return make_model([helper.make_node("Conv", ["x", "w"], ["y"], name="conv")], [("x", [1, 3, 8, 8])],
                      [("y", [1, 4, 6, 6])], {"w": rng.standard_normal((4, 3, 3, 3)).astype(np.float32)}, opset=17)
