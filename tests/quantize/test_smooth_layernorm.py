"""LayerNorm smoothing: a LayerNorm output whose γ makes a few channels far larger than the rest is divided by a
per-channel scale that the following MatMul's weight rows take back, exactly; the residual reader gets the
original values through one Mul; nothing is touched where the channels are even or a constant is shared."""

import numpy as np
import onnx
from onnx import helper

from graphs import make_model, ops
from qprep.model.runtime import intermediate_values, run_model
from qprep.quantize import smooth_layernorm

SEQ, DIM, OUT = 6, 8, 5


def _post_ln_block(gamma=None, shared_weight: bool = False, ln_is_output: bool = False, beta_is_gamma: bool = False,
                   constant_output: bool = False):
    """x[1,6,8] → LayerNorm(γ, β) → n; n → MatMul w → q (output); n + q' → residual output r (post-LN BERT)."""
    rng = np.random.default_rng(0)
    gamma = np.ones(DIM, np.float32) if gamma is None else gamma
    nodes = [helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["n"], name="norm", axis=-1),
             helper.make_node("MatMul", ["n", "w"], ["q"], name="query"),
             helper.make_node("MatMul", ["q", "w2"], ["back"], name="back_proj"),
             helper.make_node("Add", ["n", "back"], ["r"], name="residual")]
    weights = {"gamma": gamma, "beta": rng.standard_normal(DIM).astype(np.float32),
               "w": rng.standard_normal((DIM, OUT)).astype(np.float32),
               "w2": rng.standard_normal((OUT, DIM)).astype(np.float32)}
    if shared_weight:  # `w` read by a second MatMul on another tensor: scaling its rows would change that one
        nodes.append(helper.make_node("MatMul", ["x", "w"], ["other"], name="other"))
    outputs = [("q", [1, SEQ, OUT]), ("r", [1, SEQ, DIM])]
    outputs += [("other", [1, SEQ, OUT])] if shared_weight else []
    outputs += [("n", [1, SEQ, DIM])] if ln_is_output else []
    if beta_is_gamma:  # one constant as both: an exporter's dedup of equal initializers
        nodes[0].input[2] = "gamma"
        del weights["beta"]
    if constant_output:  # a graph output no node computes (an intermediates run does not return it)
        outputs.append(("w2", [OUT, DIM]))
    return make_model(nodes, [("x", [1, SEQ, DIM])], outputs, weights, opset=17)


def _spread_gamma():
    gamma = np.ones(DIM, np.float32)
    gamma[[2, 5]] = [20.0, -12.0]  # two channels 12–20× the others, as a transformer's LayerNorm γ makes them
    return gamma


def _samples(count=4):
    rng = np.random.default_rng(1)
    return [{"x": rng.standard_normal((1, SEQ, DIM)).astype(np.float32)} for _ in range(count)]


def _channel_spread(model, samples):
    peak = np.max([np.abs(v["n"]).reshape(-1, DIM).max(axis=0) for v in intermediate_values(model, ["n"], samples)],
                  axis=0)
    return peak.max() / np.median(peak)


def test_spread_channels_move_into_the_weights_and_the_outputs_stay():
    model, samples = _post_ln_block(_spread_gamma()), _samples()
    result = smooth_layernorm.smooth(model, samples)
    entry, = result.record["layernorms"]
    assert entry["layernorm"] == "norm" and entry["matmuls"] == 1
    assert _channel_spread(model, samples) > 10 and _channel_spread(result.model, samples) < 4
    assert ops(result.model)["Mul"] == 1  # the residual reads the LayerNorm's values back through one Mul
    residual = next(n for n in result.model.graph.node if n.name == "residual")
    assert "n" not in residual.input
    for before, after in zip(run_model(model, samples), run_model(result.model, samples)):
        for name in before:
            np.testing.assert_allclose(before[name], after[name], rtol=1e-4, atol=1e-4)


def test_even_channels_are_left_alone():
    model = _post_ln_block()
    assert smooth_layernorm.smooth(model, _samples()).model is model


def test_a_weight_another_node_reads_is_not_scaled():
    model = _post_ln_block(_spread_gamma(), shared_weight=True)
    result = smooth_layernorm.smooth(model, _samples())
    assert result.model is model and not result.record


def test_a_layernorm_output_the_graph_returns_is_not_changed():
    model = _post_ln_block(_spread_gamma(), ln_is_output=True)
    assert smooth_layernorm.smooth(model, _samples()).model is model


def test_the_scales_shrink_only_the_large_channels():
    peak = np.array([1.0, 1.0, 1.0, 16.0, 0.5])
    scale = smooth_layernorm._scales(peak, [np.ones((5, 3))], alpha=0.75)
    assert scale[3] == np.float32(16.0 ** 0.75) and (scale[[0, 1, 2, 4]] == 1.0).all()


def test_a_rewrite_that_changes_the_outputs_is_not_kept(monkeypatch):
    rewrite = smooth_layernorm._rewrite

    def wrong(model, constants, site, scale, taken):  # γ left as it was: the MatMul's rows scaled alone
        rewrite(model, constants, site, scale, taken)
        gamma = constants[site.layernorm.input[1]]
        gamma.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(gamma) * scale, gamma.name))

    monkeypatch.setattr(smooth_layernorm, "_rewrite", wrong)
    model = _post_ln_block(_spread_gamma())
    result = smooth_layernorm.smooth(model, _samples())
    assert result.model is model and not result.record


def test_a_pre_ln_block_needs_no_mul():
    """A pre-LN transformer's LayerNorm feeds only its MatMuls (the residual reads the LayerNorm's input)."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["n"], name="norm", axis=-1),
             helper.make_node("MatMul", ["n", "wq"], ["q"], name="query"),
             helper.make_node("MatMul", ["n", "wv"], ["v"], name="value"),
             helper.make_node("Add", ["q", "v"], ["y"], name="mix")]
    model = make_model(nodes, [("x", [1, SEQ, DIM])], [("y", [1, SEQ, OUT])],
                       {"gamma": _spread_gamma(), "beta": np.zeros(DIM, np.float32),
                        "wq": rng.standard_normal((DIM, OUT)).astype(np.float32),
                        "wv": rng.standard_normal((DIM, OUT)).astype(np.float32)}, opset=17)
    result = smooth_layernorm.smooth(model, _samples())
    assert result.record["layernorms"][0]["matmuls"] == 2 and "Mul" not in ops(result.model)
    np.testing.assert_allclose(run_model(model, _samples())[0]["y"], run_model(result.model, _samples())[0]["y"],
                               rtol=1e-4, atol=1e-4)


def test_a_constant_graph_output_does_not_stop_the_check():
    model, samples = _post_ln_block(_spread_gamma(), constant_output=True), _samples()
    result = smooth_layernorm.smooth(model, samples)
    assert result.model is not model and result.record["verified_on"] == len(samples)


def test_gamma_shared_with_beta_is_divided_once():
    model, samples = _post_ln_block(_spread_gamma(), beta_is_gamma=True), _samples()
    result = smooth_layernorm.smooth(model, samples)
    assert result.model is not model  # a twice-divided constant would fail the check and leave the model as it was
    for before, after in zip(run_model(model, samples), run_model(result.model, samples)):
        np.testing.assert_allclose(before["r"], after["r"], rtol=1e-4, atol=1e-4)


def test_ort_static_keeps_the_restoring_mul_float(tmp_path):
    """A per-tensor int8 scale on s would round the even channels' 1s: the Mul the rewrite added reads and
    writes float in ORT's QDQ model, while the MatMul is quantized."""
    from qprep.data import SampleSet
    from qprep.quantize import ort
    from qprep.quantize.backend import QuantizeJob
    from conftest import typed

    job = QuantizeJob(model=_post_ln_block(_spread_gamma()), calibration=SampleSet(samples=_samples(8)),
                      max_samples=8, float_set=frozenset(), options=typed("ort", activations="static"),
                      work_dir=tmp_path)
    result = ort.quantize(job)
    mul, = [entry["restoring_mul"] for entry in result.details["smoothed_layernorms"]["layernorms"]]
    assert mul in result.details["excluded_nodes"]
    graph = result.model.graph
    producers = {o: n for n in graph.node for o in n.output}
    node = next(n for n in graph.node if n.name == mul)
    assert node.input[1] not in producers  # the scale s stays a float constant, no DequantizeLinear
    assert any(n.op_type == "DequantizeLinear" for n in graph.node)  # and the rest is quantized
