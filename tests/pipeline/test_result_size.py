"""A result larger than the float model it came from is warned about, per backend: an int8 result (ort, rknn)
above the float size, an fp16 one above half of it; a tiny model's Q/DQ structure is no surprise. The reference
counts its external data. An RKNN result whose ONNX model has weights read by several nodes names them."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from graphs import make_model

from qprep.pipeline.result_size import record, shared_weights_reason, size_warning

MB = 1_000_000


def test_an_int8_result_above_its_float_model_and_an_fp16_one_above_half_are_warned_about():
    warning = size_warning(19_351_359, 77_630_091, "rknn", "model.rknn")
    assert warning.startswith("the result model.rknn is 77.63 MB, 4.0× the float model it came from (19.35 MB); "
                              "an int8 result is expected to be smaller")
    assert size_warning(10 * MB, 12 * MB, "ort", "model.onnx") is not None
    assert size_warning(10 * MB, 3 * MB, "ort", "model.onnx") is None
    assert size_warning(10 * MB, 7 * MB, "fp16", "model.onnx") is not None
    assert size_warning(10 * MB, 5 * MB, "fp16", "model.onnx") is None
    assert size_warning(10 * MB, 7 * MB, "fp16", "model.onnx", float16_input=True) is None  # weights were fp16
    assert size_warning(10 * MB, 13 * MB, None, "model.onnx") is not None  # nothing quantized: same size expected


def test_a_tiny_models_quantized_graph_may_outweigh_its_weights():
    """A 100 kB model whose Q/DQ nodes and scales add more than its int8 weights save: no warning."""
    assert size_warning(100_000, 250_000, "ort", "model.onnx") is None
    assert size_warning(100_000, 250_000, "fp16", "model.onnx") is None


def _unrolled(readers: int = 8) -> onnx.ModelProto:
    """x → Gemm(w) → Tanh, `readers` times with the same 256×1024 weight: an unrolled recurrent layer's steps."""
    nodes, previous = [], "x"
    for step in range(readers):
        nodes += [helper.make_node("Gemm", [previous, "w"], [f"g{step}"], name=f"step{step}", transB=1),
                  helper.make_node("Tanh", [f"g{step}"], [f"t{step}"])]
        previous = f"t{step}"
    weight = np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32)
    nodes.append(helper.make_node("Identity", [previous], ["y"]))
    return make_model(nodes, [("x", [1, 1024])], [("y", [1, 1024])], {"w": weight})


def test_weights_read_by_several_nodes_are_the_likely_reason_of_a_large_rknn_result():
    reason = shared_weights_reason(_unrolled(), excess=6 * MB)
    assert reason == ("1 weight(s) (4.19 MB) are each read by several nodes (up to 8, e.g. an unrolled recurrent "
                      "layer's steps), and rknn-toolkit2 may store a copy per reading node: 7.34 MB more at int8 "
                      "if it does")
    assert shared_weights_reason(_unrolled(), excess=20 * MB) == ""  # the copies explain too little of it
    assert shared_weights_reason(_unrolled(readers=1), excess=MB) == ""


def test_the_run_records_the_reference_with_its_external_data_and_warns_first(tmp_path):
    """The .onnx of a model saved with external data is only its graph: the comparison counts the data file."""
    model = _unrolled()
    onnx.save(model, str(tmp_path / "m.onnx"), save_as_external_data=True, location="m.onnx.data",
              size_threshold=0)
    graph_only, data = (tmp_path / "m.onnx").stat().st_size, (tmp_path / "m.onnx.data").stat().st_size
    report = {"model": {"path": str(tmp_path / "m.onnx"), "data_files": {"m.onnx.data": "sha"}, "kind": "float"},
              "stages": [{"name": "quantize", "status": "ok", "backend": "rknn"}],
              "result": {"path": "model.onnx", "deployable": {"path": "model.rknn"}},
              "evaluation": {"size_bytes": {"reference": graph_only, "result": 10 * MB}},
              "warnings": ["an earlier warning"]}
    record(report, model)
    assert report["evaluation"]["size_bytes"]["reference"] == graph_only + data
    reference = graph_only + data
    assert report["warnings"][0].startswith(f"the result model.rknn is 10.00 MB, {10 * MB / reference:.1f}× the "
                                            f"float model it came from ({reference / 1e6:.2f} MB)")
    assert "likely reason: 1 weight(s) (4.19 MB) are each read by several nodes" in report["warnings"][0]
    report["evaluation"]["size_bytes"]["result"] = 2 * MB
    report["warnings"] = []
    record(report, model)
    assert report["warnings"] == []


def test_a_run_whose_fp16_result_kept_its_weights_float_warns_with_both_sizes(tmp_path):
    """A 4 MB MatMul kept float by an fp16 run: the result is the float model's size, twice what fp16 gives;
    the model was saved with external data, and the sizes count it."""
    import qprep

    weight = np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32)
    model = make_model([helper.make_node("MatMul", ["x", "w"], ["y"], name="big")], [("x", [1, 1024])],
                       [("y", [1, 1024])], {"w": weight})
    onnx.save(model, str(tmp_path / "m.onnx"), save_as_external_data=True, location="m.onnx.data")
    (tmp_path / "eval").mkdir()
    for i in range(4):
        np.save(tmp_path / "eval" / f"{i}.npy", np.random.default_rng(i).standard_normal((1, 1024)).astype(np.float32))
    report = qprep.run({"model": str(tmp_path / "m.onnx"), "evaluation": {"source": str(tmp_path / "eval"),
                                                                          "latency": {"runs": 0}},
                        "pipeline": [{"keep_float": {"nodes": ["big"]}}, {"quantize": {"backend": "fp16"}}]},
                       output_dir=str(tmp_path / "out"))
    sizes = report["evaluation"]["size_bytes"]
    assert sizes["reference"] == sum((tmp_path / name).stat().st_size for name in ("m.onnx", "m.onnx.data"))
    assert report["warnings"][0].startswith(f"the result model.onnx is {sizes['result'] / 1e6:.2f} MB, 1.0× the "
                                            f"float model it came from ({sizes['reference'] / 1e6:.2f} MB); an fp16 "
                                            "result (half the float size) is expected to be smaller")
