"""What rknn-toolkit2 cannot take: refused before any work with the op named, or (an opset above 19) converted
down and verified before the toolkit sees it; a toolkit error whose reason sits on the next log line."""

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from qprep.errors import ModelError
from qprep.model.prepare import convert_down, ops_newer_than
from qprep.quantize import nonfinite
from qprep.quantize.rknn.limits import float16_safe, refuse_unsupported, within_opset, without_float16_overflow
from graphs import (gated_model, gated_samples, last_state_lstm_model, log_power_model, make_model,
                    masked_attention_model, masked_attention_samples, power_samples, runtime_batchnorm_model)


def _conv_model(opset: int, extra=()):
    """x[1,8,4,4] → Conv 1x1 → Relu → (extra nodes reading `r`) → Reshape → y[1,128]."""
    weight = np.random.default_rng(0).standard_normal((8, 8, 1, 1)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
             helper.make_node("Relu", ["c"], ["r"], name="relu"), *extra,
             helper.make_node("Reshape", ["r", "s"], ["y"], name="flatten")]
    return make_model(nodes, [("x", [1, 8, 4, 4])], [("y", [1, 128])],
                      {"w": weight, "s": np.array([1, 128], np.int64)}, opset=opset)


def _write(tmp_path, model, samples):
    onnx.save(model, str(tmp_path / "m.onnx"))
    (tmp_path / "data").mkdir()
    for i, sample in enumerate(samples):
        np.savez(tmp_path / "data" / f"{i:04d}.npz", **sample)
    return {"model": str(tmp_path / "m.onnx"), "calibration": {"source": str(tmp_path / "data")},
            "evaluation": {"source": str(tmp_path / "data"), "layers": False, "latency": {"runs": 0}},
            "pipeline": [{"quantize": {"backend": "rknn", "rknn": {"weight_rounding": "nearest",
                                                                    "analysis_samples": 0}}}]}


def _conv_samples(count=4):
    return [{"x": np.random.default_rng(i).standard_normal((1, 8, 4, 4)).astype(np.float32)} for i in range(count)]


def test_an_op_opset_19_lacks_blocks_the_conversion_by_name():
    model = make_model([helper.make_node("RMSNormalization", ["x", "scale"], ["y"], name="norm")], [("x", [1, 4])],
                       ["y"], {"scale": np.ones(4, np.float32)}, opset=23)
    assert ops_newer_than(model, 19) == ["RMSNormalization"] and ops_newer_than(model, 23) == []
    with pytest.raises(ModelError, match=r"opset 19 at most, and the model is opset 23 and uses RMSNormalization, "
                                         r"which opset 19"):
        refuse_unsupported(model)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_is_written_out_for_opset_19_and_keeps_the_numbers(approximate):
    """torch's dynamo exporter writes Gelu (opset 20); the toolkit takes 19: Gelu becomes its definition
    (Erf or Tanh form), verified by within_opset; its constants take x's type (float16 here)."""
    for dtype, elem in ((np.float32, onnx.TensorProto.FLOAT), (np.float16, onnx.TensorProto.FLOAT16)):
        gelu = helper.make_node("Gelu", ["x"], ["y"], name="gelu", approximate=approximate)
        graph = helper.make_graph([gelu], "g", [helper.make_tensor_value_info("x", elem, [2, 64])],
                                  [helper.make_tensor_value_info("y", elem, [2, 64])])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
        assert ops_newer_than(model, 19) == ["Gelu"]
        converted = convert_down(model, 19)
        assert "Gelu" not in {n.op_type for n in converted.graph.node}
        assert ("Tanh" if approximate == "tanh" else "Erf") in {n.op_type for n in converted.graph.node}
        assert {t.data_type for t in converted.graph.initializer} == {elem}
        assert [n.op_type for n in model.graph.node] == ["Gelu"]  # the caller's model is left as it was
    samples = [{"x": np.linspace(-6, 6, 128, dtype=np.float32).reshape(2, 64)}]  # float16 rounds each op: 32 only
    gelu = make_model([helper.make_node("Gelu", ["x"], ["y"], approximate=approximate)], [("x", [2, 64])],
                      [("y", [2, 64])], opset=21)
    assert within_opset(gelu, samples)[1] == {"from": 21, "to": 19, "verified_on": 1}


def test_ops_outside_the_onnx_domain_are_refused_by_name():
    gelu = helper.make_node("Gelu", ["x"], ["y"], name="ffn_gelu", domain="com.microsoft")
    graph = helper.make_graph([gelu], "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    with pytest.raises(ModelError, match=r"runs only standard ONNX ops, and the model has com.microsoft Gelu "
                                         r"\(1× e.g. 'ffn_gelu'\)"):
        refuse_unsupported(model)


def test_the_way_out_follows_the_ops_domain_classic_ml_ops_are_not_from_onnx_runtimes_optimizer():
    """skl2onnx's Scaler (ai.onnx.ml) is no ORT-optimized export: the fix is backend ort or an export without the
    classic-ML steps; a library's custom op is named as such; each domain gets its own fix."""
    nodes = [helper.make_node("Scaler", ["x"], ["s"], name="Scaler", domain="ai.onnx.ml", offset=[0.0] * 4,
                              scale=[1.0] * 4),
             helper.make_node("Inverse", ["s"], ["y"], name="inv", domain="ai.onnx.contrib")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 3),
                                                    helper.make_opsetid("ai.onnx.contrib", 1)])
    with pytest.raises(ModelError) as refused:
        refuse_unsupported(model)
    message = str(refused.value)
    assert "ai.onnx.ml Scaler (1× e.g. 'Scaler')" in message and "graph optimizations" not in message
    assert ("rknn-toolkit2 takes only ai.onnx ops: use backend ort (ONNX Runtime runs them), or export the model "
            "without its classic-ML pre/post-processing") in message
    assert "ai.onnx.contrib ops are another library's custom ops" in message
    del model.graph.node[1]
    model.graph.node[0].output[0] = "y"
    with pytest.raises(ModelError, match=r"\(1× e.g. 'Scaler'\); ai.onnx.ml ops come from a classic-ML converter"):
        refuse_unsupported(model)


def test_fused_ops_the_optimize_stage_splits_pass_at_load_and_are_named_with_the_way_out_at_the_build():
    nodes = [helper.make_node("FusedConv", ["x", "w"], ["c"], name="conv", domain="com.microsoft", activation="Relu"),
             helper.make_node("Attention", ["c"], ["y"], name="attn", domain="com.microsoft")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 3, 4, 4])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(np.ones((2, 3, 1, 1), np.float32), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    with pytest.raises(ModelError, match=r"has com.microsoft Attention \(1× e.g. 'attn'\); export it without"):
        refuse_unsupported(model, at_load=True)  # FusedConv is not named: optimize splits it
    del model.graph.node[1]
    model.graph.node[0].output[0] = "y"
    refuse_unsupported(model, at_load=True)
    with pytest.raises(ModelError, match=r"com.microsoft FusedConv \(1× e.g. 'conv'\); run the optimize stage "
                                         r"before quantize \(its split_ort_fusions pass takes FusedConv apart"):
        refuse_unsupported(model)


def test_opset_21_is_converted_down_and_verified():
    model = _conv_model(21)
    converted, record = within_opset(model, _conv_samples(2))
    assert record == {"from": 21, "to": 19, "verified_on": 2}
    assert [o.version for o in converted.opset_import if o.domain in ("", "ai.onnx")] == [19]
    assert within_opset(convert_down(model, 19), [])[1] == {}  # at 19 already: untouched


def test_mask_constants_are_clipped_for_float16_only_when_the_outputs_stay():
    model, samples = masked_attention_model(-1e9, "scale"), masked_attention_samples(4)
    clipped, record = float16_safe(model, nonfinite.find(model, samples), samples)
    bound = record["mask_bound"]["bound"]  # the mask's own fill: what its scores need (test_nonfinite.py)
    assert record["clipped"] and nonfinite.MASK_MARGIN < bound < 100 and record["mask_bound"]["constants"] == ["fill"]
    fill = next(t for t in clipped.graph.initializer if t.name == "fill")
    assert onnx.numpy_helper.to_array(fill) == pytest.approx(-bound, abs=1e-3)
    assert record["constants"] == {"fill": f"[-1e+09, -1e+09] → [{-bound:.3g}, {-bound:.3g}]"}
    offset = make_model([helper.make_node("Add", ["x", "big"], ["y"], name="add")], [("x", [1, 4])], [("y", [1, 4])],
                        {"big": np.array(1e5, np.float32)})  # a constant that is the output itself
    samples = [{"x": np.ones((1, 4), np.float32)}]
    kept, record = float16_safe(offset, nonfinite.find(offset, samples), samples)
    assert kept is offset and record["clipped"] is False and "max |a-b|" in record["reason"]


def test_a_mask_is_clipped_although_a_clip_ceiling_beside_it_must_stay():
    """A -inf mask and the +inf ceiling of Clip(x, 1e-10, inf) before a Log: at ±10000 the ceiling would cap
    the log, so clipping both changes the outputs; the mask alone is clipped to its bound, the ceiling left
    with its reason (before: neither, and the mask reached float16 as -inf)."""
    model, samples = log_power_model(with_mask=True), power_samples(4, with_mask=True)
    clipped, record = float16_safe(model, nonfinite.find(model, samples), samples)
    assert record["clipped"] and set(record["constants"]) == {"fill"} and list(record["left"]) == ["ceiling"]
    arrays = {t.name: onnx.numpy_helper.to_array(t) for t in clipped.graph.initializer}
    assert arrays["ceiling"] == np.inf and -100 < arrays["fill"].min() < -nonfinite.MASK_MARGIN


def test_a_later_attention_gets_its_own_lower_fill_verified():
    model, samples = masked_attention_model(-1e9, "scale", layers=2), masked_attention_samples(6)
    clipped, record = float16_safe(model, nonfinite.find(model, samples), samples)
    fills = record["mask_bound"]["own_fills"]
    assert record["clipped"] and list(fills) == ["mask_add_2"] and fills["mask_add_2"] < record["mask_bound"]["bound"]
    scale = next(t for t in clipped.graph.initializer if t.name == "mask_add_2/own_fill_scale")
    assert onnx.numpy_helper.to_array(scale) == pytest.approx(fills["mask_add_2"] / record["mask_bound"]["bound"],
                                                              rel=1e-3)


def test_an_older_hf_mask_filled_with_minus_10000_is_clipped_too():
    """float16 holds -10000, so nothing is extreme, but RKNN's int8 attention still spreads its grid over it
    (MiniLM: -10000 0.494, -60 0.831)."""
    model, samples = masked_attention_model(-1e4, "scale"), masked_attention_samples(4)
    extremes = nonfinite.find(model, samples)
    assert not extremes.tensors
    clipped, record = float16_safe(model, extremes, samples)
    fill = onnx.numpy_helper.to_array(next(t for t in clipped.graph.initializer if t.name == "fill"))
    assert record["clipped"] and fill == pytest.approx(-record["mask_bound"]["bound"], abs=1e-3) and fill > -100


def test_a_nan_fill_constant_becomes_zero_for_the_toolkit_when_no_sample_selects_it():
    """jax2tf's jnp.take: Where(ids in range, gathered, NaN fill). The toolkit took a range over the NaN fill
    (step1: "cannot convert float NaN to integer"); valid ids never select it, so 0 changes no output."""
    nodes = [helper.make_node("Greater", ["x", "zero"], ["ok"], name="check"),
             helper.make_node("Where", ["ok", "x", "fill"], ["y"], name="select")]
    model = make_model(nodes, [("x", [1, 4])], [("y", [1, 4])],
                       {"zero": np.float32(0), "fill": np.full((1, 4), np.nan, np.float32)})
    samples = [{"x": np.random.default_rng(i).uniform(0.1, 1, (1, 4)).astype(np.float32)} for i in range(3)]
    safe, record = float16_safe(model, nonfinite.find(model, samples), samples)
    assert record["clipped"] and "fill" in record["constants"]
    fill = next(t for t in safe.graph.initializer if t.name == "fill")
    assert (onnx.numpy_helper.to_array(fill) == 0).all()


@pytest.mark.parametrize("op", ["RandomNormalLike", "RandomUniformLike"])
def test_random_ops_are_refused_before_any_work(tmp_path, op):
    pytest.importorskip("rknn.api")  # without the toolkit the run is refused for that first
    import qprep

    config = _write(tmp_path, _conv_model(13, [helper.make_node(op, ["r"], ["noise"], name="noise")]), _conv_samples())
    with pytest.raises(ModelError, match=rf"node 'noise' is {op}, and rknn-toolkit2 refuses random ops"):
        qprep.run(config, output_dir=str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()  # refused by the checks, before the run directory was touched


def test_an_empty_toolkit_error_takes_its_reason_from_the_next_line(tmp_path):
    from qprep.quantize.rknn.toolkit import Toolkit

    toolkit = Toolkit(tmp_path)
    toolkit.log_path.write_text("\x1b[1;31mE\x1b[0m \x1b[1;31mbuild: \n"
                                "Found Random node 'noise', which is not supported, please remove it!\x1b[0m\n"
                                "\x1b[1;33mW\x1b[0m \x1b[1;33mbuild: ===================== WARN(3) =====\x1b[0m\n")
    assert toolkit.error_line(0) == "build: Found Random node 'noise', which is not supported, please remove it!"
    toolkit.log_path.write_text("E build: \nW build: a warning\n")
    assert toolkit.error_line(0) == "build:"  # no reason given: nothing borrowed from the next log line


@pytest.mark.slow
def test_opset_21_model_builds_with_the_toolkit(tmp_path):
    """Before: `load_onnx: Unsupport onnx opset 21, need <= 19!` (exit 2); after: converted, built, evaluated."""
    pytest.importorskip("rknn.api")
    import qprep

    report = qprep.run(_write(tmp_path, _conv_model(21), _conv_samples()), output_dir=str(tmp_path / "out"))
    assert report["status"] == "ok" and report["stages"][0]["opset_converted"]["from"] == 21
    assert report["evaluation"]["outputs"]["y"]["cosine_mean"] > 0.999


@pytest.mark.slow
def test_an_lstm_whose_sequence_output_is_left_out_builds_with_the_toolkit(tmp_path):
    """Before: `rknn-toolkit2 build failed: build: Traceback` (its constant folding: "Could not find OrtValue with
    name ''"); after: the output named (static_graph.py), built and evaluated."""
    pytest.importorskip("rknn.api")
    import qprep

    samples = [{"x": np.random.default_rng(i).standard_normal((1, 6, 5)).astype(np.float32)} for i in range(4)]
    report = qprep.run(_write(tmp_path, last_state_lstm_model(), samples), output_dir=str(tmp_path / "out"))
    assert report["status"] == "ok" and report["stages"][0]["static_graph"]["omitted_outputs_named"] == ["lstm"]
    assert report["evaluation"]["outputs"]["y"]["cosine_mean"] > 0.99


@pytest.mark.slow
def test_an_lstm_with_its_default_layout_written_out_builds_with_the_toolkit(tmp_path):
    """torch's dynamo exporter writes `layout: 0` on LSTM/GRU; the toolkit's recurrent shape inference then fails
    the onnx checker ("Unrecognized attribute: layout for operator GRU"). Dropped (static_graph.py), it builds."""
    pytest.importorskip("rknn.api")
    import qprep

    samples = [{"x": np.random.default_rng(i).standard_normal((1, 6, 5)).astype(np.float32)} for i in range(4)]
    report = qprep.run(_write(tmp_path, last_state_lstm_model(layout=0), samples), output_dir=str(tmp_path / "out"))
    assert report["status"] == "ok" and report["stages"][0]["static_graph"]["default_layout_dropped"] == ["lstm"]
    assert report["evaluation"]["outputs"]["y"]["cosine_mean"] > 0.99


@pytest.mark.slow
def test_an_attention_written_with_einsum_builds_with_the_toolkit(tmp_path):
    """Before: `build: KeyError` in the toolkit's shape inference, and again in each rule disabled after it; after:
    the two Einsums rewritten as MatMuls (static_graph.py), built and evaluated."""
    pytest.importorskip("rknn.api")
    import qprep

    weight = np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32) * 0.3
    model = make_model([helper.make_node("MatMul", ["x", "w"], ["q"]),
                        helper.make_node("Einsum", ["q", "x"], ["scores"], equation="nid,njd->nij"),
                        helper.make_node("Softmax", ["scores"], ["attention"], axis=-1),
                        helper.make_node("Einsum", ["attention", "x"], ["y"], equation="nij,njd->nid")],
                       [("x", [1, 6, 8])], [("y", [1, 6, 8])], {"w": weight})
    samples = [{"x": np.random.default_rng(i).standard_normal((1, 6, 8)).astype(np.float32)} for i in range(4)]
    report = qprep.run(_write(tmp_path, model, samples), output_dir=str(tmp_path / "out"))
    assert report["status"] == "ok" and len(report["stages"][0]["static_graph"]["einsum_as_matmul"]) == 2
    assert report["evaluation"]["outputs"]["y"]["cosine_mean"] > 0.99


@pytest.mark.slow
def test_the_toolkit_s_reason_for_a_random_op_reaches_the_error(tmp_path):
    """The toolkit's own refusal (what a user of the Toolkit client sees when an op is not refused up front)."""
    pytest.importorskip("rknn.api")
    from qprep.errors import QprepError
    from qprep.quantize.rknn.toolkit import Toolkit

    model = _conv_model(13, [helper.make_node("RandomNormalLike", ["r"], ["noise"], name="noise")])
    onnx.save(model, str(tmp_path / "m.onnx"))
    np.save(tmp_path / "x.npy", _conv_samples(1)[0]["x"])
    (tmp_path / "dataset.txt").write_text(f"{tmp_path / 'x.npy'}\n")
    toolkit = Toolkit(tmp_path)
    toolkit.start()
    try:
        rknn = toolkit.new()
        toolkit.call("config", rknn, "config", target_platform="rk3588")
        toolkit.call("load_onnx", rknn, "load_onnx", model=str(tmp_path / "m.onnx"))
        with pytest.raises(QprepError, match=r"build failed: build: Found Random node 'noise', which is not supported"):
            toolkit.call("build", rknn, "build", do_quantization=True, dataset=str(tmp_path / "dataset.txt"))
    finally:
        toolkit.close()


@pytest.mark.slow
def test_masked_attention_builds_all_int8_on_rknn_with_the_mask_clipped_to_its_bound(tmp_path):
    """HF's `(1 - mask) * -1e9`: the fill is clipped to the bound the scores need (~-30 here), so the mask chain,
    kept float for its values, is int8 again (finite, two levels). Earlier: float16 with the fill at -10000,
    cosine 0.876 (unclipped, float16 holds -inf: 0.778); now 0.9998."""
    pytest.importorskip("rknn.api")
    import qprep

    report = qprep.run(_write(tmp_path, masked_attention_model(-1e9, "scale"), masked_attention_samples(8)),
                       output_dir=str(tmp_path / "out"))
    stage = report["stages"][0]
    clip = stage["nonfinite"]["float16_clip"]
    assert clip["clipped"] and clip["mask_bound"]["bound"] < 100
    assert set(stage["nonfinite"]["int8_not_float16"]) == {"mask_scale", "mask_rows", "mask_add", "softmax"}
    assert not stage["nonfinite"]["nodes"] and not stage.get("float16_layers")
    # measured 0.9998 (float16 mask chain at -10000: 0.876)
    assert report["status"] == "ok" and report["evaluation"]["outputs"]["y"]["cosine_mean"] > 0.99


@pytest.mark.parametrize("layout, on_npu", [("nchw", True), ("nhwc", False)])
def test_the_npu_normalizes_only_channels_first_image_inputs(layout, on_npu):
    """The toolkit reads a 4-D input's dim 1 as channels: mean/std for an NHWC input fail in load_onnx
    ("The len of mean_values ... expect 128!"), so a channels-last model keeps qprep's normalized samples."""
    from types import SimpleNamespace

    from qprep.quantize.rknn.dataset import normalization

    reader = SimpleNamespace(channels=3, mean=np.full(3, 127.5), std=np.full(3, 127.5), channel_order="rgb",
                             layout=layout, resize="stretch", input=SimpleNamespace(name="image"))
    job = SimpleNamespace(calibration=SimpleNamespace(image_reader=reader))
    assert (normalization(job) is not None) == on_npu


@pytest.mark.slow
def test_a_gated_if_and_a_139_character_output_name_build_and_keep_the_users_names(tmp_path):
    """oww_hey_jarvis / oww_timer in small: a data-dependent If (the toolkit: "will cause the graph to be a dynamic
    graph", and a Where over one element crashes it) and an output name of 128+ characters (KeyError in build)."""
    pytest.importorskip("rknn.api")
    import json

    import qprep

    long_name = '{"1": "1_minute_timer", "2": "5_minute_timer", "3": "10_minute_timer", "4": "20_minute_timer", ' \
                '"5": "30_minute_timer", "6": "1_hour_timer"}'
    model = gated_model()
    model.graph.output[0].name = model.graph.node[-1].output[0] = long_name
    config = _write(tmp_path, model, gated_samples(8))
    config["pipeline"][0]["quantize"]["rknn"]["analysis_samples"] = 1
    config["evaluation"]["layers"] = True
    report = qprep.run(config, output_dir=str(tmp_path / "out"))
    stage = report["stages"][0]
    assert report["status"] in ("ok", "gate missed") and list(report["evaluation"]["outputs"]) == [long_name]
    assert stage["static_graph"]["if_as_both_branches"] == ["if"] and long_name in stage["toolkit_io_names"]
    contract = json.loads((tmp_path / "out" / "input_contract.json").read_text())
    assert [i["name"] for i in contract["inputs"]] == ["x.1"]
    rows = [row["tensor"] for row in report["evaluation"]["layers"]]
    assert rows and not any(row.startswith(stage["toolkit_io_names"][long_name]) for row in rows)


@pytest.mark.slow
def test_batchnorm_over_runtime_statistics_builds_instead_of_crashing_the_toolkit(tmp_path):
    """Before: SIGSEGV in the toolkit's build after "I rknn building ..." (magika's last LayerNorm)."""
    pytest.importorskip("rknn.api")
    import qprep

    samples = [{"x": np.random.default_rng(i).standard_normal((1, 4, 8)).astype(np.float32)} for i in range(8)]
    report = qprep.run(_write(tmp_path, runtime_batchnorm_model(), samples), output_dir=str(tmp_path / "out"))
    assert report["stages"][0]["static_graph"]["batchnorm_as_arithmetic"] == ["bn"]
    assert report["evaluation"]["outputs"]["y"]["cosine_mean"] > 0.95


def test_float_set_nodes_whose_values_overflow_float16_stay_int8_and_infinite_masks_stay_float16():
    """magika: activations up to 3.7e6 kept float16 became inf (cosine 1.8e-19); int8 holds them (0.937)."""
    nodes = [helper.make_node("Mul", ["x", "big"], ["huge"], name="scale_up"),
             helper.make_node("Relu", ["huge"], ["r"], name="relu"),
             helper.make_node("Add", ["r", "mask"], ["masked"], name="mask_add"),
             helper.make_node("Softmax", ["masked"], ["y"], name="softmax")]
    model = make_model(nodes, [("x", [1, 4])], [("y", [1, 4])],
                       {"big": np.float32(1e6), "mask": np.array([0, 0, 0, -np.inf], np.float32)})
    samples = [{"x": np.random.default_rng(i).standard_normal((1, 4)).astype(np.float32)} for i in range(4)]
    extremes = nonfinite.find(model, samples)
    float_set = set(extremes.nodes) | {"kept_by_config"}
    assert {"scale_up", "relu", "mask_add", "softmax"} <= float_set
    kept, dropped = without_float16_overflow(model, float_set, extremes, samples)
    assert set(dropped) == {"scale_up", "relu", "mask_add"} and "'huge'" in dropped["scale_up"]
    assert kept == {"softmax", "kept_by_config"}  # reads the -inf sum only: float16 holds inf
    assert without_float16_overflow(model, float_set, nonfinite.Extremes(), samples) == (float_set, {})


def test_nodes_kept_float_only_for_a_mask_go_back_to_int8_once_the_mask_is_clipped():
    """A mask clipped to its bound (~-30 here) is two int8 levels; each float16 layer is one a deployment pays."""
    model, samples = masked_attention_model(-1e9, "scale"), masked_attention_samples(4)
    extremes = nonfinite.find(model, samples)
    extremes.added = set(extremes.nodes) - {"softmax"}  # as if the config had kept the softmax float itself
    clipped, _ = float16_safe(model, extremes, samples)
    float_set = set(extremes.nodes) | {"kept_by_config"}
    kept, dropped = without_float16_overflow(clipped, float_set, extremes, samples)
    assert set(dropped) == {"mask_scale", "mask_rows", "mask_add"} and kept == {"softmax", "kept_by_config"}
    assert dropped["mask_add"].startswith("int8: its values are within ±1000")
    extremes.added = set()  # every node asked for by the config: float16 whatever its values
    assert without_float16_overflow(clipped, float_set, extremes, samples) == (float_set, {})


def test_a_mask_without_a_softmax_node_stays_float16_at_minus_10000():
    """flax's softmax by hand (Max, Sub, Exp): no Add before a Softmax, so no mask bound; clipped to -10000 its
    chain must stay float16 (int8 over -10000: zoo flax_minilm cosine 0.40)."""
    nodes = [helper.make_node("Add", ["x", "mask"], ["masked"], name="mask_add"),
             helper.make_node("Exp", ["masked"], ["y"], name="exp")]
    model = make_model(nodes, [("x", [1, 4])], [("y", [1, 4])], {"mask": np.array([0, 0, 0, -np.inf], np.float32)})
    samples = [{"x": np.random.default_rng(i).standard_normal((1, 4)).astype(np.float32)} for i in range(4)]
    extremes = nonfinite.find(model, samples)
    extremes.added = set(extremes.nodes)
    clipped, record = float16_safe(model, extremes, samples)
    assert record["clipped"] and "mask_bound" not in record
    assert without_float16_overflow(clipped, set(extremes.nodes), extremes, samples) == ({"mask_add", "exp"}, {})


def test_a_loop_whose_stop_depends_on_the_input_is_refused_before_any_work_naming_the_node():
    """SLANet's decoder Loop stops at its end token: the toolkit refused it after 90 s ("will cause the graph to be a
    dynamic graph"), and unrolling it to its trip count would change the model."""
    from graphs import make_graph

    body = make_graph([helper.make_node("Add", ["v_in", "one"], ["v_out"]),
                       helper.make_node("ReduceSum", ["v_out"], ["total"], keepdims=0),
                       helper.make_node("Less", ["total", "limit"], ["cond_out"])],
                      [("i", [], np.int64), ("cond_in", [], np.bool_), ("v_in", [1])],
                      [("cond_out", [], np.bool_), ("v_out", [1])],
                      {"one": np.ones(1, np.float32), "limit": np.float32(10)}, name="body")
    model = make_model([helper.make_node("Loop", ["trips", "cond", "x"], ["y"], name="decoder", body=body)],
                       [("x", [1])], [("y", [1])], {"trips": np.int64(40), "cond": np.bool_(True)}, infer_shapes=False)
    with pytest.raises(ModelError, match="node 'decoder' is a Loop whose stop depends on the input.*fixed length, or "
                                         "use backend ort"):
        refuse_unsupported(model)


def test_a_uint8_input_is_refused_before_the_toolkit_aborts_on_it():
    """rknn-toolkit2 2.5.0 aborted the process (SIGABRT, "Not Support Dtype: 2") on a uint8 image input."""
    model = make_model([helper.make_node("Cast", ["pixels"], ["x"], to=onnx.TensorProto.FLOAT),
                        helper.make_node("Relu", ["x"], ["y"])], [("pixels", [1, 3, 4, 4], np.uint8)],
                       [("y", [1, 3, 4, 4])])
    with pytest.raises(ModelError, match="input 'pixels' is uint8.*float32 input"):
        refuse_unsupported(model)
