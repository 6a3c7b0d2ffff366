"""Outlier positions: a LayerNorm chain whose first sequence position stands far above the rest is computed as
two copies (that position, the others) between Slices and a Concat, exactly; nothing else is touched."""

import numpy as np
import onnx
import pytest
from onnx import helper

from graphs import make_model, ops
from qprep.model.runtime import run_model
from qprep.quantize import outlier_positions

SEQ, DIM = 8, 4


def _block_model(extra_output: str | None = None, norm_axis: int = -1):
    """x[1,8,4] → MatMul w → Add b → Add x (residual) → LayerNorm → y: a transformer's FFN/attention output."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="proj"),
             helper.make_node("Add", ["h", "b"], ["hb"], name="bias"),
             helper.make_node("Add", ["hb", "x"], ["r"], name="residual"),
             helper.make_node("LayerNormalization", ["r", "gamma", "beta"], ["y"], name="norm", axis=norm_axis)]
    outputs = [("y", [1, SEQ, DIM])] + ([(extra_output, [1, SEQ, DIM])] if extra_output else [])
    return make_model(nodes, [("x", [1, SEQ, DIM])], outputs,
                      {"w": rng.standard_normal((DIM, DIM)).astype(np.float32),
                       "b": rng.standard_normal(DIM).astype(np.float32),
                       "gamma": np.ones(DIM, np.float32), "beta": np.zeros(DIM, np.float32)}, opset=17)


def _samples(count: int = 4, position=0, factor: float = 100.0, seed: int = 0) -> list[dict]:
    """Token `position` (an int, or per sample a list) `factor` times larger than the others."""
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(count):
        x = rng.standard_normal((1, SEQ, DIM)).astype(np.float32)
        x[:, position[i] if isinstance(position, list) else position] *= factor
        samples.append({"x": x})
    return samples


def test_the_outlier_position_gets_its_own_copy_of_the_chain_and_the_outputs_stay_exact():
    model, samples = _block_model(), _samples()
    split = outlier_positions.split(model, samples)
    assert split.record["chains"] == [{"layernorm": "norm", "nodes": 4, "segments": [[0, 1], [1, SEQ]],
                                       "outliers": [[0, 1]]}]
    counts = ops(split.model)
    assert counts["MatMul"] == 2 and counts["LayerNormalization"] == 2 and counts["Concat"] == 1
    assert split.copies["proj"] == ["proj/positions_0_1", "proj/positions_1_8"]
    weights = {n.name: n.input[1] for n in split.model.graph.node if n.op_type == "MatMul"}
    assert weights["proj/positions_0_1"] == "w" != weights["proj/positions_1_8"]  # GPTQ rounds a weight read once
    assert {n.op_type for n in split.model.graph.node if n.name in split.added} == {"Slice", "Concat"}
    fresh = _samples(2, seed=5)
    for want, got in zip(run_model(model, fresh), run_model(split.model, fresh)):
        np.testing.assert_allclose(got["y"], want["y"], rtol=1e-5, atol=1e-5)


def test_two_split_chains_in_a_row_get_distinct_names():
    """The second block reads the first one's LayerNorm output and, as its residual, the input both slice: no
    two nodes may define one name (ONNX Runtime refused such a model: "Duplicate definition of name")."""
    rng = np.random.default_rng(1)
    nodes, weights = [], {"gamma": np.ones(DIM, np.float32), "beta": np.zeros(DIM, np.float32)}
    source = "x"
    for block in ("a", "b"):
        weights[f"w{block}"] = rng.standard_normal((DIM, DIM)).astype(np.float32)
        nodes += [helper.make_node("MatMul", [source, f"w{block}"], [f"h{block}"], name=f"proj_{block}"),
                  helper.make_node("Add", [f"h{block}", "x"], [f"r{block}"], name=f"residual_{block}"),
                  helper.make_node("LayerNormalization", [f"r{block}", "gamma", "beta"], [f"y{block}"],
                                   name=f"norm_{block}")]
        source = f"y{block}"
    model = make_model(nodes, [("x", [1, SEQ, DIM])], [("yb", [1, SEQ, DIM])], weights, opset=17)
    samples = _samples()
    split = outlier_positions.split(model, samples)
    assert [c["layernorm"] for c in split.record["chains"]] == ["norm_a", "norm_b"]
    outputs = [o for n in split.model.graph.node for o in n.output]
    assert len(outputs) == len(set(outputs))
    for want, got in zip(run_model(model, samples), run_model(split.model, samples)):
        np.testing.assert_allclose(got["yb"], want["yb"], rtol=1e-5, atol=1e-5)


def test_a_middle_outlier_gives_three_segments():
    record = outlier_positions.split(_block_model(), _samples(position=3)).record
    assert record["chains"][0]["segments"] == [[0, 3], [3, 4], [4, SEQ]] and record["chains"][0]["outliers"] == [[3, 4]]


def test_nothing_is_split_without_an_outlier_or_when_it_moves_between_samples():
    model = _block_model()
    for samples in (_samples(factor=1.0), _samples(position=[0, 2, 5, 7])):
        split = outlier_positions.split(model, samples)
        assert split.model is model and split.record == {} and split.copies == {}


def test_a_tensor_read_outside_the_chain_keeps_its_producers_out_of_it():
    """`hb` is also a graph output: proj and bias stay whole, the chain is residual → norm (still split)."""
    split = outlier_positions.split(_block_model(extra_output="hb"), _samples())
    assert split.record["chains"][0]["nodes"] == 2
    assert "proj" not in split.copies and [n.name for n in split.model.graph.node].count("proj") == 1


def test_a_layernorm_over_another_axis_is_not_a_chain():
    model = _block_model(norm_axis=1)
    assert outlier_positions.layernorm_chains(model) == []
    assert outlier_positions.split(model, _samples()).model is model


def test_carried_names_the_copies_of_split_nodes():
    split = outlier_positions.Split(None, copies={"proj": ["proj/a", "proj/b"]})
    assert split.carried({"proj", "other"}) == {"proj/a", "proj/b", "other"}


@pytest.mark.slow
def test_on_rknn_the_split_block_keeps_the_other_positions_accurate(tmp_path):
    """All int8 on the toolkit's simulator: token 0 is 3× the others at the input, 27× after the cube the chain
    computes first; one per-tensor scale there leaves the other tokens a few levels, split each copy has its own."""
    pytest.importorskip("rknn.api")
    import qprep

    seq, dim = 16, 32
    rng = np.random.default_rng(0)
    model = make_model([helper.make_node("Mul", ["x", "x"], ["x2"], name="square"),
                        helper.make_node("Mul", ["x2", "x"], ["x3"], name="cube"),
                        helper.make_node("MatMul", ["x3", "w"], ["h"], name="proj"),
                        helper.make_node("Add", ["h", "x"], ["r"], name="residual"),
                        helper.make_node("LayerNormalization", ["r", "gamma", "beta"], ["y"], name="norm", axis=-1,
                                         epsilon=1e-5)],
                       [("x", [1, seq, dim])], [("y", [1, seq, dim])],
                       {"w": (rng.standard_normal((dim, dim)) / np.sqrt(dim)).astype(np.float32),
                        "gamma": np.ones(dim, np.float32), "beta": np.zeros(dim, np.float32)}, opset=17)
    samples = []
    for i in range(8):
        x = np.random.default_rng(i).standard_normal((1, seq, dim)).astype(np.float32)
        x[:, 0] *= 3
        samples.append({"x": x})
    onnx.save(model, str(tmp_path / "m.onnx"))
    (tmp_path / "data").mkdir()
    for i, sample in enumerate(samples):
        np.savez(tmp_path / "data" / f"{i:04d}.npz", **sample)
    cosine = {}
    for split in (False, True):
        config = {"model": str(tmp_path / "m.onnx"), "calibration": {"source": str(tmp_path / "data")},
                  "evaluation": {"source": str(tmp_path / "data"), "layers": False, "latency": {"runs": 0}},
                  "pipeline": [{"quantize": {"backend": "rknn", "rknn": {"analysis_samples": 0,
                                                                          "split_outlier_positions": split}}}]}
        report = qprep.run(config, output_dir=str(tmp_path / f"out_{split}"))
        assert bool(report["stages"][0].get("outlier_positions")) == split
        cosine[split] = report["evaluation"]["outputs"]["y"]["cosine_mean"]
    assert cosine[False] < 0.95 and cosine[True] > 0.99  # measured 0.876 and 0.9988


def test_a_constant_that_varies_along_the_sequence_ends_the_chain():
    """A positional embedding added as a [seq, features] constant is not position-wise: the chain starts after it."""
    rng = np.random.default_rng(2)
    model = make_model([helper.make_node("Add", ["x", "positional"], ["p"], name="position"),
                        helper.make_node("MatMul", ["p", "w"], ["h"], name="proj"),
                        helper.make_node("Add", ["h", "p"], ["r"], name="residual"),
                        helper.make_node("LayerNormalization", ["r", "gamma", "beta"], ["y"], name="norm")],
                       [("x", [1, SEQ, DIM])], [("y", [1, SEQ, DIM])],
                       {"positional": rng.standard_normal((SEQ, DIM)).astype(np.float32),
                        "w": rng.standard_normal((DIM, DIM)).astype(np.float32),
                        "gamma": np.ones(DIM, np.float32), "beta": np.zeros(DIM, np.float32)}, opset=17)
    split = outlier_positions.split(model, _samples())
    assert split.record["chains"][0]["nodes"] == 3 and "position" not in split.copies
    fresh = _samples(2, seed=3)
    for want, got in zip(run_model(model, fresh), run_model(split.model, fresh)):
        np.testing.assert_allclose(got["y"], want["y"], rtol=1e-5, atol=1e-5)


def test_layernorm_chains_name_the_nodes_before_each_layernorm():
    assert outlier_positions.layernorm_chains(_block_model()) == [["proj", "bias", "residual", "norm"]]
    assert outlier_positions.layernorm_chains(_block_model(extra_output="hb")) == [["residual", "norm"]]
