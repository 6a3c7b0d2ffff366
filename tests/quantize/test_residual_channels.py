"""Residual channels: a residual sum whose few channels are far larger than the rest is scaled down per channel
(in the weights that compute it where they can take it) and the LayerNorm reading it is computed from the scaled
sum, exactly (a LayerNorm kept float keeps its computation float); nothing changes where the channels are even or
the sum has other readers."""

import numpy as np
from onnx import helper

from graphs import make_model, ops
from qprep.model.runtime import intermediate_values, run_model
from qprep.quantize import residual_channels

SEQ, DIM, HIDDEN = 6, 8, 12


def _post_ln_ffn(huge: float = 40.0, residual_through_mul: bool = False, sum_read_twice: bool = False):
    """x → LayerNorm → n; n → MatMul w1 → MatMul w2 → + b2 → f; z = f + n (or n·s); z → LayerNorm → y.
    Column 2 of w2 is `huge` times the others: channel 2 of f and z towers over the rest (BERT's FFN output)."""
    rng = np.random.default_rng(0)
    w2 = rng.standard_normal((HIDDEN, DIM)).astype(np.float32) * 0.3
    w2[:, 2] *= huge
    weights = {"g0": np.ones(DIM, np.float32), "b0": np.zeros(DIM, np.float32),
               "w1": rng.standard_normal((DIM, HIDDEN)).astype(np.float32), "w2": w2,
               "b2": rng.standard_normal(DIM).astype(np.float32),
               "gamma": rng.uniform(0.5, 1.5, DIM).astype(np.float32),
               "beta": rng.standard_normal(DIM).astype(np.float32)}
    residual = "n"
    nodes = [helper.make_node("LayerNormalization", ["x", "g0", "b0"], ["n"], name="first_norm", axis=-1),
             helper.make_node("MatMul", ["n", "w1"], ["h"], name="up"),
             helper.make_node("MatMul", ["h", "w2"], ["f0"], name="down"),
             helper.make_node("Add", ["f0", "b2"], ["f"], name="down_bias")]
    if residual_through_mul:  # smooth_layernorm.py's restoring Mul in front of the residual
        weights["s"] = rng.uniform(1, 3, DIM).astype(np.float32)
        nodes.append(helper.make_node("Mul", ["n", "s"], ["ns"], name="restore"))
        residual = "ns"
    nodes += [helper.make_node("Add", ["f", residual], ["z"], name="residual"),
              helper.make_node("LayerNormalization", ["z", "gamma", "beta"], ["y"], name="norm", axis=-1)]
    outputs = [("y", [1, SEQ, DIM])]
    if sum_read_twice:
        nodes.append(helper.make_node("Relu", ["z"], ["side"], name="side"))
        outputs.append(("side", [1, SEQ, DIM]))
    return make_model(nodes, [("x", [1, SEQ, DIM])], outputs, weights, opset=17)


def _samples(count=4):
    rng = np.random.default_rng(1)
    return [{"x": rng.standard_normal((1, SEQ, DIM)).astype(np.float32)} for _ in range(count)]


def _spread(model, name, samples):
    peak = np.max([np.abs(v[name]).reshape(-1, DIM).max(axis=0) for v in intermediate_values(model, [name], samples)],
                  axis=0)
    return peak.max() / np.median(peak)


def _same_outputs(a, b, samples):
    for before, after in zip(run_model(a, samples), run_model(b, samples)):
        for name in before:
            np.testing.assert_allclose(before[name], after[name], rtol=1e-4, atol=1e-4)


def test_a_huge_channel_is_scaled_down_and_the_layernorm_computed_from_the_scaled_sum():
    model, samples = _post_ln_ffn(), _samples()
    result = residual_channels.rescale(model, samples)
    entry, = result.record["layernorms"]
    assert entry["layernorm"] == "norm" and entry["channels"] >= 1 and entry["spread_before"] >= residual_channels.RATIO
    # the MatMul and its bias take the scale; the LayerNorm output feeds `up` too, so it gets a Mul
    assert entry["inputs"] == ["weights", "constant", "added mul"]
    assert _spread(model, "z", samples) > 20 and _spread(result.model, "z", samples) <= 2 * residual_channels.HEADROOM
    names = {n.name for n in result.model.graph.node}
    assert "norm" not in names and "first_norm" in names and ops(result.model)["LayerNormalization"] == 1
    assert {"gamma", "beta"}.isdisjoint(t.name for t in result.model.graph.initializer)  # read by the LayerNorm only
    _same_outputs(model, result.model, samples)


def test_a_restoring_mul_takes_the_scale_in_its_constant():
    model, samples = _post_ln_ffn(residual_through_mul=True), _samples()
    result = residual_channels.rescale(model, samples)
    entry, = result.record["layernorms"]
    assert entry["inputs"] == ["weights", "constant", "constant"]
    assert ops(result.model)["Mul"] == ops(model)["Mul"] + 2  # the LayerNorm's square and γ; no Mul in front
    _same_outputs(model, result.model, samples)


def test_even_channels_are_left_alone():
    model = _post_ln_ffn(huge=1.0)
    assert residual_channels.rescale(model, _samples()).model is model


def test_a_layernorm_kept_float_is_rewritten_and_the_nodes_computing_it_stay_float():
    """float16 on the LayerNorm alone leaves the int8 sum with its huge channel: the sum is scaled all the same,
    and the float set gets the LayerNorm's new computation in its place."""
    model = _post_ln_ffn()
    samples = _samples()
    result = residual_channels.rescale(model, samples, keep={"norm", "other"})
    assert result.record["layernorms"][0]["float"] is True
    computing = result.float_nodes["norm"]
    names = {n.name for n in result.model.graph.node}
    assert "norm" not in names and set(computing) <= names
    assert {n.op_type for n in result.model.graph.node if n.name in computing} >= {"MatMul", "Sqrt", "Div"}
    assert result.carried({"norm", "other"}) == {"other", *computing}
    assert not residual_channels.rescale(model, samples).float_nodes  # not kept float: nothing carried
    _same_outputs(model, result.model, samples)


def test_a_kept_layernorm_float16_could_not_compute_stays_as_it_is():
    """A sum whose variance float16 could not hold (channel 2 near 1e3): its float16 LayerNorm is left alone,
    while without the float set the same sum is rewritten (int8 paths, float32 checks)."""
    model = _post_ln_ffn(huge=4000.0)
    samples = _samples()
    assert residual_channels.rescale(model, samples, keep={"norm"}).model is model
    assert residual_channels.rescale(model, samples).record["layernorms"][0]["layernorm"] == "norm"


def test_a_sum_that_other_nodes_read_is_left_alone():
    model = _post_ln_ffn(sum_read_twice=True)  # scaling it would change what the Relu reads
    assert residual_channels.rescale(model, _samples()).model is model


def test_a_rewrite_that_changes_the_outputs_is_dropped(monkeypatch):
    model = _post_ln_ffn()
    wrong = residual_channels._replace_layernorm

    def forgetting_beta(model, links, layernorm, divisor, taken):
        wrong(model, links, layernorm, divisor, taken)
        final = next(n for n in model.graph.node if n.output[0] == "y")
        final.op_type = "Sub"  # y = γ·x̂ − β instead of + β

    monkeypatch.setattr(residual_channels, "_replace_layernorm", forgetting_beta)
    result = residual_channels.rescale(model, _samples())
    assert result.model is model and not result.record


def test_embedding_tables_and_a_constant_summand_take_the_scale():
    """BERT's embeddings: word + token-type lookups (Gather) + a constant position table → LayerNorm."""
    rng = np.random.default_rng(2)
    words = rng.standard_normal((20, DIM)).astype(np.float32)
    words[:, 5] *= 30.0
    weights = {"words": words, "types": rng.standard_normal((2, DIM)).astype(np.float32),
               "positions": rng.standard_normal((1, SEQ, DIM)).astype(np.float32),
               "gamma": rng.uniform(0.5, 1.5, DIM).astype(np.float32),
               "beta": rng.standard_normal(DIM).astype(np.float32)}
    nodes = [helper.make_node("Gather", ["words", "ids"], ["w"], name="word_lookup"),
             helper.make_node("Gather", ["types", "type_ids"], ["t"], name="type_lookup"),
             helper.make_node("Add", ["w", "t"], ["wt"], name="word_type"),
             helper.make_node("Add", ["wt", "positions"], ["z"], name="with_positions"),
             helper.make_node("LayerNormalization", ["z", "gamma", "beta"], ["y"], name="norm", axis=-1)]
    model = make_model(nodes, [("ids", [1, SEQ], np.int64), ("type_ids", [1, SEQ], np.int64)], [("y", [1, SEQ, DIM])],
                       weights, opset=17)
    samples = [{"ids": rng.integers(0, 20, (1, SEQ)).astype(np.int64),
                "type_ids": rng.integers(0, 2, (1, SEQ)).astype(np.int64)} for _ in range(4)]
    result = residual_channels.rescale(model, samples)
    entry, = result.record["layernorms"]
    assert entry["inputs"] == ["weights", "weights", "constant"]
    assert ops(result.model).get("LayerNormalization", 0) == 0 and ops(result.model)["Mul"] == 2  # square, γ
    _same_outputs(model, result.model, samples)
