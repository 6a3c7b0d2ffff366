"""Benchmark qprep's `optimize` stage against onnxslim and onnxsim on the real demo models, in one process.

For each model and tool: nodes after, LayerNorms fused / still decomposed, BatchNorms left, seconds, and the
max abs error of every output against the original model on the same real calibration samples. qprep's time
is split into rewriting and verification (the verification is what the others do not do).

    .venv/bin/python scripts/bench_optimize.py [--samples 8] [--markdown BENCH.md]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import qprep  # noqa: E402
from qprep.model import info as model_info  # noqa: E402
from qprep.data import load_samples  # noqa: E402
from qprep.model.runtime import run_model# noqa: E402

OCR = {"mean": [127.5], "std": [127.5], "channel_order": "bgr", "resize": "none"}
MODELS = {  # model file → (calibration set, image preprocessing)
    "efficientnet_lite0": ("imagenet", {"mean": [127.0], "std": [128.0]}),
    "minilm_l6_v2": ("minilm", None),
    "ppocr_cls": ("ocr_cls", OCR),
    "ppocrv4_rec": ("ocr_rec", OCR),
    "ppocrv4_det": ("imagenet", {"mean": [123.7, 116.3, 103.5], "std": [58.4, 57.1, 57.4], "resize": "none"}),
}


def calibration(name: str, samples: int) -> dict:
    data, preprocess = MODELS[name]
    cfg = {"source": str(ROOT / "calibration_data" / data / "calib"), "max_samples": samples}
    if preprocess:
        cfg["preprocess"] = preprocess
    return cfg


def load(name: str, samples: int):
    from qprep.config import data_source
    from qprep.schema import validate

    model = onnx.load(str(ROOT / "models" / f"{name}.onnx"))
    cfg = validate(calibration(name, samples), data_source(""), "calibration", ROOT)
    return model, load_samples(cfg, model_info.graph_inputs(model)).samples


def facts(model: onnx.ModelProto, original_outputs, samples) -> dict:
    """What a tool left: nodes, LayerNorms fused / still decomposed / refused by reason, GELUs fused / left,
    BatchNorms left, and the max abs error of every output against the original on the same samples."""
    from qprep.inspection import FUSED_GELU_OPS
    from qprep.optimize.passes.gelu import count_gelus
    from qprep.optimize.passes.layernorm import find_layernorms

    ops = model_info.op_counts(model)
    layernorms, gelus = find_layernorms(model), count_gelus(model)
    result = run_model(model, samples)
    pairs = [(a[k], b[k]) for a, b in zip(original_outputs, result) for k in a]
    error = (max((float(np.abs(a.astype(np.float64) - b).max(initial=0.0)) for a, b in pairs), default=0.0)
             if all(a.shape == b.shape for a, b in pairs) else float("nan"))  # nan: an output changed its shape
    return {"nodes": model_info.node_count(model), "ops": ops, "ln_fused": ops.get("LayerNormalization", 0),
            "ln_left": sum(layernorms["decomposed"].values()), "ln_refused": layernorms.get("refused", {}),
            "gelu_fused": sum(ops.get(op, 0) for op in FUSED_GELU_OPS),
            "gelu_left": sum(gelus["decomposed"].values()), "bn_left": ops.get("BatchNormalization", 0),
            "max_abs_error": error}


def optimize_with_qprep(config: dict) -> tuple[onnx.ModelProto, dict]:
    """The real `optimize` stage on `config` (a validated-to-be dict: model, calibration, inputs, ...; its
    pipeline is replaced by `optimize` alone): the model it writes and its stage record."""
    with tempfile.TemporaryDirectory() as out:
        report = qprep.run({**config, "pipeline": [{"optimize": {}}]}, output_dir=out)
        stage = report["stages"][0]
        model = onnx.load(str(Path(out) / "model.onnx"))
    return model, stage


def run_qprep(name: str, samples: int):
    model, stage = optimize_with_qprep({"model": str(ROOT / "models" / f"{name}.onnx"),
                                        "calibration": calibration(name, samples)})
    return model, stage["rewrite_seconds"], stage["verify_seconds"]


def run_onnxslim(model: onnx.ModelProto):
    import onnxslim

    start = time.perf_counter()
    slim = onnxslim.slim(model)
    return slim, time.perf_counter() - start


def run_onnxsim(model: onnx.ModelProto):
    import onnxsim

    start = time.perf_counter()
    simplified, ok = onnxsim.simplify(model)
    return simplified, time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    args = parser.parse_args(argv)
    from importlib.metadata import version

    rows = []
    for name in args.models:
        model, samples = load(name, args.samples)
        reference = run_model(model, samples)
        before = model_info.node_count(model)
        optimized, rewrite_s, verify_s = run_qprep(name, args.samples)
        rows.append((name, before, "qprep optimize", facts(optimized, reference, samples),
                     f"{rewrite_s:.2f} (+{verify_s:.2f} verify)"))
        for tool, runner in (("onnxslim " + version("onnxslim"), run_onnxslim), ("onnxsim " + version("onnxsim"), run_onnxsim)):
            try:
                result, seconds = runner(onnx.load(str(ROOT / "models" / f"{name}.onnx")))
                rows.append((name, before, tool, facts(result, reference, samples), f"{seconds:.2f}"))
            except Exception as exc:  # a contender failing is a result too
                rows.append((name, before, tool, None, f"failed: {str(exc).splitlines()[0][:80]}"))
        print(f"bench: {name} done", file=sys.stderr, flush=True)
    print(f"| model | nodes before | tool | nodes after | LayerNorm fused / left | BatchNorm left | seconds | "
          f"max abs error ({args.samples} real samples) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, before, tool, f, seconds in rows:
        if f is None:
            print(f"| {name} | {before} | {tool} | – | – | – | {seconds} | – |")
        else:
            print(f"| {name} | {before} | {tool} | {f['nodes']} | {f['ln_fused']} / {f['ln_left']} | {f['bn_left']} | "
                  f"{seconds} | {f['max_abs_error']:.2g} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
