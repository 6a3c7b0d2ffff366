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
from qprep.model.noise import as_inputs, restore, taken_out, with_noise
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


def test_random_ops_it_cannot_feed_are_still_refused(tmp_path):
    """Multinomial draws class indices from probabilities the graph computes: refused in one line naming it."""
    from qprep.errors import ModelError

    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Multinomial", ["x"], ["pick"], name="pick", sample_size=1),
             helper.make_node("Cast", ["pick"], ["picked"], to=onnx.TensorProto.FLOAT, name="cast"),
             helper.make_node("Add", ["x", "picked"], ["y"], name="add")]
    onnx.save(make_model(nodes, [("x", [1, 8])], [("y", [1, 8])], opset=17), str(tmp_path / "m.onnx"))
    (tmp_path / "calib").mkdir()
    np.save(tmp_path / "calib" / "0.npy", rng.standard_normal((1, 8)).astype(np.float32))
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
