"""Padding positions: the attention mask found by structure and values, outputs judged on the real positions,
the whole-tensor figure still reported, and the setting that turns it off or names the input."""

import numpy as np
import onnx
import pytest
from onnx import helper

from graphs import make_model, masked_attention_model, masked_attention_samples
from qprep.errors import ConfigError
from qprep.measure.outputs import output_metrics
from qprep.measure.kinds import output_kinds
from qprep.measure.padding import Padding, find
from qprep.model.runtime import run_model

SEQ, DIM = 6, 8


def typed_attention_model() -> onnx.ModelProto:
    """masked_attention_model with a token-type input (0/1 too) added to x through an embedding Gather, and a
    pooled [1, SEQ] output (mean over the features: as long as the sequence, but not laid out along it)."""
    model = masked_attention_model(seq=SEQ, dim=DIM)
    graph = model.graph
    for node in graph.node:
        node.input[:] = ["x_typed" if name == "x" else name for name in node.input]
    table = np.random.default_rng(3).standard_normal((2, DIM)).astype(np.float32)
    graph.initializer.append(onnx.numpy_helper.from_array(table, "type_table"))
    graph.node.insert(0, helper.make_node("Gather", ["type_table", "types"], ["type_rows"], name="type_embedding"))
    graph.node.insert(1, helper.make_node("Add", ["x", "type_rows"], ["x_typed"], name="type_add"))
    graph.node.append(helper.make_node("ReduceMean", ["y"], ["pooled"], axes=[2], keepdims=0, name="pool"))
    graph.input.append(helper.make_tensor_value_info("types", onnx.TensorProto.INT64, [1, SEQ]))
    graph.output.append(helper.make_tensor_value_info("pooled", onnx.TensorProto.FLOAT, [1, SEQ]))
    onnx.checker.check_model(model)
    return model


def typed_samples(count: int = 6) -> list[dict]:
    samples = masked_attention_samples(count, seq=SEQ, dim=DIM)
    for i, sample in enumerate(samples):
        sample["types"] = (np.arange(SEQ)[None] >= 1 + i % 3).astype(np.int64)  # 0s then 1s: a sentence pair
    return samples


def test_the_mask_is_found_by_structure_and_the_token_types_are_not():
    model, samples = typed_attention_model(), typed_samples()
    expected = run_model(model, samples)
    padding = find(model, samples, expected)
    assert padding == Padding("mask", frozenset({"y"}))  # not `pooled` ([1, SEQ] by chance), not `types`
    assert find(model, samples, expected, "none") is None
    assert find(model, samples, expected, "mask") == padding
    assert find(model, samples, expected, "types") == Padding("types", frozenset({"y"}))  # named: the user's word
    for setting, message in (("x", "with only 0 and 1"), ("ids", "not an input")):
        with pytest.raises(ConfigError, match=message):
            find(model, samples, expected, setting)
    with pytest.raises(ConfigError, match="no output"):
        find(model, samples, [{"pooled": e["pooled"]} for e in expected], "mask")


def test_without_padding_on_the_samples_there_is_nothing_to_leave_out():
    model = masked_attention_model(seq=SEQ, dim=DIM)
    samples = masked_attention_samples(4, seq=SEQ, dim=DIM)
    for sample in samples:
        sample["mask"][:] = 1
    assert find(model, samples, run_model(model, samples)) is None
    assert find(model, samples, run_model(model, samples), "mask") is None  # named: still nothing to leave out


def test_a_mask_whose_reading_is_not_sure_is_not_taken_by_itself():
    """A mask that marks padding with 1 (its first position 0) or a boolean one (PyTorch's key_padding_mask: True
    is padding) is not read the Hugging Face way; naming it does."""
    model = masked_attention_model(seq=SEQ, dim=DIM)
    samples = masked_attention_samples(4, seq=SEQ, dim=DIM)
    expected = run_model(model, samples)
    inverted = [{**s, "mask": 1 - s["mask"]} for s in samples]
    assert find(model, inverted, expected) is None
    boolean = [{**s, "mask": s["mask"].astype(bool)} for s in samples]
    assert find(model, boolean, expected) is None
    assert find(model, boolean, expected, "mask") == Padding("mask", frozenset({"y"}))


def test_padding_rows_do_not_move_the_judged_figure_and_the_whole_tensor_figure_is_kept():
    """Noise on the padding rows only: the judged cosine stays 1; over every position it drops."""
    from qprep.measure.outputs import padding_included

    model, samples = typed_attention_model(), typed_samples()
    expected = run_model(model, samples)
    rng = np.random.default_rng(5)
    actual = []
    for sample, outputs in zip(samples, expected):
        y = outputs["y"].copy()
        padded = sample["mask"][0] == 0
        y[0, padded] += rng.standard_normal((int(padded.sum()), DIM)).astype(np.float32) * 3
        pooled = outputs["pooled"].copy()
        pooled[0, padded] += 3
        actual.append({**outputs, "y": y, "pooled": pooled})
    kinds = output_kinds(model, expected, {})
    padding = find(model, samples, expected)
    judged = output_metrics(expected, actual, kinds, padding=padding, inputs=samples)
    assert judged["y"]["cosine_mean"] == pytest.approx(1.0) and "marks real" in judged["y"]["why"]
    assert judged["pooled"]["cosine_mean"] < 0.999  # not laid out along the mask: judged whole
    whole = padding_included(expected, actual, kinds, padding, samples, 0.5)
    assert whole["outputs"]["y"]["cosine_mean"] < 0.95
    assert whole["outputs"]["y"]["cosine_mean"] == pytest.approx(output_metrics(expected, actual, kinds)["y"]["cosine_mean"])
    real = sum(int(s["mask"].sum()) for s in samples)
    assert (whole["real_positions"], whole["positions"]) == (real, len(samples) * SEQ)


def test_a_mask_indexed_by_positions_still_reaches_the_softmax():
    """transformers' exports flatten the mask and Gather it by position (the mask is Gather's data): a mask
    path, where a Gather reading the input as indices (the token types' embedding above) is not."""
    model = masked_attention_model(seq=SEQ, dim=DIM)
    graph = model.graph
    cast, = [node for node in graph.node if node.name == "mask_cast"]
    cast.input[0] = "mask_picked"  # reads the mask picked by position
    graph.initializer.append(onnx.numpy_helper.from_array(np.arange(SEQ, dtype=np.int64), "positions"))
    graph.node.insert(0, helper.make_node("Gather", ["mask", "positions"], ["mask_picked"], axis=1, name="pick"))
    samples = masked_attention_samples(4, seq=SEQ, dim=DIM)
    assert find(model, samples, run_model(model, samples)) == Padding("mask", frozenset({"y"}))


def test_a_run_judges_real_positions_and_reports_the_whole_tensor_figure(tmp_path):
    """qprep.run on the masked attention: the report's figure is over the real positions, the note and
    `with_padding` give the one over every position; evaluation.padding: none judges every position."""
    import qprep

    onnx.save(masked_attention_model(fill=-1e4, style="scale", seq=SEQ, dim=DIM), str(tmp_path / "m.onnx"))
    for split in ("calib", "eval"):
        (tmp_path / split).mkdir()
        for i, sample in enumerate(masked_attention_samples(8, seq=SEQ, dim=DIM)):
            np.savez(tmp_path / split / f"{i}.npz", **sample)
    config = {"model": str(tmp_path / "m.onnx"), "calibration": {"source": str(tmp_path / "calib")},
              "evaluation": {"source": str(tmp_path / "eval"), "latency": {"runs": 0}, "layers": False},
              "pipeline": [{"quantize": {"backend": "ort"}}]}
    report = qprep.run(config, output_dir=str(tmp_path / "run"))
    y = report["evaluation"]["outputs"]["y"]
    assert "with_padding" in y and y["with_padding"]["cosine_mean"] != y["cosine_mean"]
    note, = [n for n in report["evaluation"]["notes"] if "marks real" in n]
    assert note.startswith("output 'y': judged on the 29 of 48 positions the input 'mask' marks real")
    assert "marks real" in (tmp_path / "run" / "report.md").read_text()
    config["evaluation"]["padding"] = "none"
    whole = qprep.run(config, output_dir=str(tmp_path / "whole"))["evaluation"]["outputs"]["y"]
    assert "with_padding" not in whole and whole["cosine_mean"] == pytest.approx(y["with_padding"]["cosine_mean"])


def test_a_softmax_written_out_is_found_as_the_mask_s_end():
    """jax2tf writes softmax as ReduceMax, Sub, Exp, ReduceSum, Div: an Exp a ReduceSum reads ends the mask path."""
    model = masked_attention_model(seq=SEQ, dim=DIM)
    graph = model.graph
    softmax, = [node for node in graph.node if node.op_type == "Softmax"]
    at = list(graph.node).index(softmax)
    graph.node.remove(softmax)
    graph.initializer.append(onnx.numpy_helper.from_array(np.array([-1], np.int64), "last_axis"))
    for offset, node in enumerate([
            helper.make_node("ReduceMax", ["masked"], ["row_max"], axes=[-1], keepdims=1),
            helper.make_node("Sub", ["masked", "row_max"], ["shifted"]),
            helper.make_node("Exp", ["shifted"], ["numerator"]),
            helper.make_node("ReduceSum", ["numerator", "last_axis"], ["denominator"], keepdims=1),
            helper.make_node("Div", ["numerator", "denominator"], ["attention"])]):
        graph.node.insert(at + offset, node)
    samples = masked_attention_samples(4, seq=SEQ, dim=DIM)
    expected = run_model(model, samples)
    assert find(model, samples, expected) == Padding("mask", frozenset({"y"}))
    graph.node[at + 3].op_type = "ReduceMean"  # an Exp some other reduction reads: not a softmax (not run)
    assert find(model, samples, expected) is None
