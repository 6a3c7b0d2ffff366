"""ONNX Runtime latency of fuse_conv_qdq's output against the QDQ model it came from (and FP32), in one process.

The QDQ model is scripts/build_qdq_fixtures.py's quantize_static EfficientNet-Lite0; "fused" is that model after
`remove_redundant_qdq → fuse_conv_qdq` (format qlinear, and format integer). Every model is timed the same way
(qprep.measure.latency: batch 1, 2 intra-op threads, ORT_ENABLE_ALL, median of N runs after a warm-up) on the
same real sample, in interleaved rounds (the median of the rounds' medians is reported) so that load from other
processes hits every model alike. Also the QAT CNN fixture before/after qat_cleanup's stages.

    .venv/bin/python scripts/bench_qdq.py [--runs 100] [--warmup 20] [--rounds 3]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import onnx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import qprep  # noqa: E402
from qprep.config import data_source  # noqa: E402
from qprep.data import load_samples  # noqa: E402
from qprep.measure.latency import interleaved  # noqa: E402
from qprep.model.info import graph_inputs, op_counts  # noqa: E402
from qprep.schema import validate  # noqa: E402

IMAGENET = {"source": str(ROOT / "calibration_data" / "imagenet" / "calib"),
            "preprocess": {"mean": [127.0], "std": [128.0]}}
QDQ = ROOT / "models" / "qdq"


def staged(model: Path, pipeline: list, out: Path) -> onnx.ModelProto:
    qprep.run({"model": str(model), "calibration": {**IMAGENET, "max_samples": 8}, "pipeline": pipeline},
              output_dir=str(out), force=True)
    return onnx.load(str(out / "model.onnx"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    if not (QDQ / "efficientnet_lite0.qdq.onnx").is_file():
        print("bench_qdq: models/qdq/ missing; run scripts/build_qdq_fixtures.py", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="bench-qdq-") as tmp:
        tmp = Path(tmp)
        qdq = onnx.load(str(QDQ / "efficientnet_lite0.qdq.onnx"))
        qat_stages = [{"optimize": {}}, {"remove_redundant_qdq": {}}, {"keep_float": {}}, {"fuse_conv_qdq": {}}]
        models = {
            "EfficientNet-Lite0 FP32": onnx.load(str(ROOT / "models" / "efficientnet_lite0.onnx")),
            "EfficientNet-Lite0 QDQ (quantize_static)": qdq,
            "EfficientNet-Lite0 fused, format qlinear": staged(
                QDQ / "efficientnet_lite0.qdq.onnx",
                [{"remove_redundant_qdq": {}}, {"fuse_conv_qdq": {"format": "qlinear"}}], tmp / "qlinear"),
            "EfficientNet-Lite0 fused, format integer": staged(
                QDQ / "efficientnet_lite0.qdq.onnx",
                [{"remove_redundant_qdq": {}}, {"fuse_conv_qdq": {"format": "integer"}}], tmp / "integer"),
            "QAT CNN (PyTorch export)": onnx.load(str(QDQ / "qat_cnn.onnx")),
            "QAT CNN after qat_cleanup stages": staged(QDQ / "qat_cnn.onnx", qat_stages, tmp / "qat"),
        }
    cfg = validate({**IMAGENET, "max_samples": 1}, data_source(""), "calibration", ROOT)
    sample = load_samples(cfg, graph_inputs(qdq)).samples[0]
    timed = interleaved({name: (model, sample) for name, model in models.items()}, args.threads, args.runs,
                        args.warmup, args.rounds)
    print(f"| model | integer ops | median ms | p90 ms | vs QDQ |")
    print("|---|---|---|---|---|")
    reference = {"EfficientNet": timed["EfficientNet-Lite0 QDQ (quantize_static)"]["median_ms"],
                 "QAT": timed["QAT CNN (PyTorch export)"]["median_ms"]}
    for name, model in models.items():
        counts = op_counts(model)
        integer = ", ".join(f"{op} {n}" for op, n in counts.items() if op.startswith(("QLinear", "ConvInteger",
                                                                                      "MatMulInteger"))) or "–"
        median = timed[name]["median_ms"]
        base = reference["QAT" if name.startswith("QAT") else "EfficientNet"]
        print(f"| {name} | {integer} | {median:.2f} | {timed[name]['p90_ms']:.2f} | {base / median:.2f}x |")
    print(f"\nbatch 1, {args.threads} threads, ORT_ENABLE_ALL, median of {args.runs} runs after {args.warmup} "
          f"warm-up, median of {args.rounds} interleaved rounds")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
