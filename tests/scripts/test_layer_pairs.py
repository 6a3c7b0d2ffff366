"""scripts/layer_pairs.py counts a run's pairs with the chart's own bands (a table and a chart that disagree on
"red" would mislead whoever reads both)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("layer_pairs", ROOT / "scripts" / "layer_pairs.py")
layer_pairs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(layer_pairs)


def test_a_row_counts_red_by_the_charts_bands_and_names_what_was_left_out(tmp_path):
    report = {"model": {"path": "/m/net.onnx"},
              "evaluation": {"outputs": {"y": {"cosine_mean": 0.999}, "z": {"cosine_mean": 0.9995}},
                             "layers": [{"cosine_mean": 0.9999}, {"cosine_mean": 0.995}, {"cosine_mean": 0.9},
                                        {"cosine_mean": None}],
                             "layers_left_out": {"not comparable": 2, "inside a fused op": 5}}}
    (tmp_path / "report.json").write_text(json.dumps(report))
    assert layer_pairs.row(tmp_path) == ("| net | 0.99900 | 4 / 2 | 7 (5: inside a fused op, 2: not comparable) |")
