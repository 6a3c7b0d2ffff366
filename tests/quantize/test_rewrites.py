"""The quantize-time rewrites' table (qprep/quantize/rewrites.py): which backend runs which, when its settings
turn it on, and the one verify-or-revert the exact ones share."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
from onnx import helper

from conftest import typed
from graphs import make_model
from qprep.quantize import rewrites

ROOT = Path(__file__).resolve().parents[2]


def test_the_table_says_which_rewrites_run_for_each_backend_in_order():
    assert [r.name for r in rewrites.of("rknn")] == [
        "opset_converted", "static_graph", "float16_clip", "float16_range", "smoothed_layernorms",
        "outlier_positions", "residual_channels"]
    assert [r.name for r in rewrites.of("ort")] == ["smoothed_layernorms", "maxpool_float", "channel_padding"]
    assert rewrites.of("fp16") == []
    assert all((ROOT / r.module).exists() for r in rewrites.REWRITES)


def test_a_backends_settings_turn_each_rewrite_on_or_off():
    rknn = typed("rknn")
    assert rewrites.runs("outlier_positions", "rknn", rknn) and rewrites.runs("smoothed_layernorms", "rknn", rknn)
    assert not rewrites.runs("outlier_positions", "rknn", typed("rknn", quantized_algorithm="mmse"))
    float16 = typed("rknn", do_quantization=False)  # no int8 build: no int8 rewrite
    assert not any(rewrites.runs(name, "rknn", float16)
                   for name in ("smoothed_layernorms", "outlier_positions", "residual_channels"))
    assert not rewrites.runs("outlier_positions", "ort", typed("ort"))  # not an ort rewrite
    assert rewrites.runs("channel_padding", "ort", typed("ort"))
    assert not rewrites.runs("channel_padding", "ort", typed("ort", activations="dynamic"))
    assert not rewrites.runs("maxpool_float", "ort", typed("ort", activations="dynamic"))
    assert not rewrites.runs("smoothed_layernorms", "ort", typed("ort", smooth_layernorm=False))


def _scaled(factor: float):
    w = helper.make_tensor("w", 1, [1], [factor])
    return make_model([helper.make_node("Mul", ["x", "w"], ["y"])], {"x": [1, 4]}, {"y": [1, 4]}, [w])


def test_an_exact_rewrite_that_changed_the_numbers_is_named_and_left(caplog):
    samples = [{"x": np.arange(4, dtype=np.float32).reshape(1, 4) + 1}]
    original = _scaled(1.0)
    reference = [{"y": samples[0]["x"]}]
    assert rewrites.exact("scaling by one", original, reference, _scaled(1.0), samples, threads=1) == ""
    with caplog.at_level(logging.WARNING, logger="qprep"):
        reason = rewrites.exact("scaling by two", original, reference, _scaled(2.0), samples, threads=1)
    assert reason and "scaling by two changed the outputs" in caplog.text


def test_each_backend_asks_the_table_for_every_rewrite_a_setting_turns_off():
    """A backend that wrote a rewrite's condition again instead of asking would let the table drift from what
    runs: every row with `applies` is asked by the code of each backend it names."""
    code = {"ort": (ROOT / "qprep/quantize/ort/__init__.py").read_text(),
            "rknn": (ROOT / "qprep/quantize/rknn/convert.py").read_text()}
    code["ort"] += (ROOT / "qprep/quantize/smooth_layernorm.py").read_text()  # smooth_job asks for both backends
    code["rknn"] += (ROOT / "qprep/quantize/smooth_layernorm.py").read_text()
    for rewrite in rewrites.REWRITES:
        for backend in rewrite.backends if rewrite.applies is not None else ():
            assert f'rewrites.runs("{rewrite.name}"' in code[backend], (rewrite.name, backend)
