"""A small report.json as a run writes it (a classifier judged by a gate, per-layer errors, stage records), built
by hand so the report's renderings can be tested without a run; the tests change the parts they need."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np

from qprep.measure.gate import check_gate
from qprep.measure.metrics import compare_output

_BASE = {
    "schema_version": 1, "status": "ok", "seconds": 12.5,
    "model": {"path": "models/net.onnx", "kind": "float", "nodes": 6, "opsets": {"ai.onnx": 17},
              "op_counts": {"Conv": 2, "Relu": 2, "Gemm": 1, "Softmax": 1}},
    "warnings": ["calibration and evaluation use different preprocess settings"],
    "calibration": {"count": 8, "format": "npy", "source": "data/calib"},
    "stages": [{"name": "quantize", "index": 0, "status": "ok", "nodes_before": 6, "nodes_after": 20, "seconds": 3.0,
                "backend": "ort", "calibrate_method": "minmax", "calibration_samples": 8,
                "weight_rounding": {"method": "gptq", "layers": 3, "kept": True,
                                    "calibration_sqnr_db": {"nearest": 30.1, "gptq": 33.4}},
                "bias_correction": {"applied": False, "layers": 3, "kept": False, "reason": "no gain",
                                    "calibration_sqnr_db": {"before": 33.4, "after": 33.2}}}],
    "result": {"path": "model.onnx", "kind": "qdq", "nodes": 20, "bytes": 2_000_000,
               "op_counts": {"Conv": 2, "QuantizeLinear": 7, "DequantizeLinear": 7}, "artifacts": []},
}


def classifier_outputs(samples: int = 16, flips: int = 1, seed: int = 0) -> dict:
    """Metrics of a [1, 10] classifier output where `flips` samples change their top-1 class."""
    rng = np.random.default_rng(seed)
    reference = [rng.random((1, 10)) for _ in range(samples)]
    result = [r + rng.normal(0, 0.01, r.shape) for r in reference]
    for r in result[:flips]:
        r[0] = -r[0]
    metrics = compare_output(reference, result, "classification")
    metrics.pop("per_sample")
    return {"logits": metrics}


def layers(cosines: list[float]) -> list[dict]:
    """Per-layer rows in graph order with the given accumulated cosines (as evaluate.layers writes them)."""
    return [{"tensor": f"layer{i}_out", "node": f"layer{i}", "op_type": "Conv", "order": i, "cosine_mean": c,
             "sqnr_db": None, "quantized": True} for i, c in enumerate(cosines)]


def report(gate: dict | None = None, heldout: bool = False, layer_cosines: list[float] | None = None) -> dict:
    """The synthetic report; `gate` as evaluation.gate records it (None: no gate and no floor)."""
    data = copy.deepcopy(_BASE)
    outputs = classifier_outputs()
    evaluation = {"reference_model": "models/net.onnx", "samples": {"count": 16, "source": "data/eval"},
                  "outputs": outputs, "notes": [], "size_bytes": {"reference": 4_000_000, "result": 2_000_000}}
    if heldout:
        evaluation["heldout"] = {"samples": {"count": 16, "source": "data/heldout"},
                                 "outputs": classifier_outputs(flips=2, seed=1), "notes": []}
    if gate is not None:
        evaluation["gate"] = {**gate, "judged_on": "heldout" if heldout else "evaluation"}
    evaluation["layers"] = layers(layer_cosines if layer_cosines is not None else [0.99999, 0.9995, 0.995, 0.93])
    data["evaluation"] = evaluation
    return data


def judged(gate: dict, heldout: bool = False, floor: bool = False) -> dict:
    """A report whose gate is checked on the set it would be judged on, as evaluate() does."""
    data = report(heldout=heldout)
    evaluation = data["evaluation"]
    outputs = (evaluation["heldout"] if heldout else evaluation)["outputs"]
    evaluation["gate"] = {**check_gate(gate, outputs, floor=floor), "judged_on": "heldout" if heldout else "evaluation"}
    return data


def write_run(tmp_path: Path, name: str, data: dict) -> str:
    """`data` as the report.json of a run directory `name` under tmp_path → its path (compare reads it)."""
    (tmp_path / name).mkdir()
    (tmp_path / name / "report.json").write_text(json.dumps(data))
    return str(tmp_path / name)


def rows_of(result: dict) -> dict:
    """compare's rows by metric."""
    return {r["metric"]: r for r in result["rows"]}
