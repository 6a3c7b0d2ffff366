"""Issue #8's reference table in one run: qprep vs ONNX Runtime's documented flow vs rknn-toolkit2 direct.

Every contender gets the same calibration (32) and evaluation (128) samples of each reference model and is scored
by the same code against the same FP32 model; ORT speeds are FP32 ÷ INT8 median latency (batch 1, 2 intra-op
threads, 200 runs, 5 interleaved rounds). The two halves are scripts/bench_quantize.py (ORT) and
scripts/bench_rknn.py (RKNN simulator, rk3588 w8a8), which say what each flow runs; qprep runs with the
accuracy-driven fallback aiming at the targets below (10 min budget for ORT, 20 min for RKNN).

    .venv/bin/python scripts/bench.py [--models ...] [--eval-samples 128] [--skip-rknn] [--skip-ort]

Run it on a quiet machine: the latency columns and the budget-limited RKNN searches both need both cores.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_quantize  # noqa: E402
import bench_rknn  # noqa: E402

# issue #8's acceptance table: the ORT backend's cosine / agreement targets are bench_quantize's fallback targets,
# the RKNN backend's are bench_rknn's; the speed targets (FP32 ÷ INT8, ORT) are these
SPEED = {"efficientnet_lite0": 1.8, "minilm_l6_v2": 1.4, "ppocr_cls": 1.2, "ppocrv4_rec": 1.5}


def verdict(row: dict, target: dict, speed: float | None = None) -> str:
    """"met", or what was missed, e.g. "cosine 0.9888 < 0.99"."""
    missed = []
    for metric, threshold in target.items():
        value = row["cosine"] if metric == "cosine_mean" else row["agreement"]
        if value is None:
            missed.append(f"no {metric}")
        elif value < threshold:
            missed.append(f"{metric.split('_')[0]} {value:.4f} < {threshold}")
    if speed is not None and row["speed"] < speed:
        missed.append(f"speed {row['speed']:.2f}× < {speed}×")
    return "**met**" if not missed else "missed: " + ", ".join(missed)


def cell(row: dict | None, speed: bool = False) -> str:
    """cosine / agreement [/ speed] on the evaluation samples, then the same on the held-out samples."""
    if row is None:
        return "–"
    text = f"{row['cosine']:.5f}"
    if row["agreement"] is not None:
        text += f" / {100 * row['agreement']:.1f}%"
    if speed:
        text += f" / {row['speed']:.2f}×"
    if row.get("heldout_cosine") is not None:
        text += f"<br>held-out {bench_quantize.heldout_text(row)}"
    return text


def float_text(row: dict | None) -> str:
    if row is None or row.get("fallback_s") is None:
        return "–"
    return f"{row['float_nodes']} nodes, {row['fallback_s']:.0f} s"


def table(ort: list[dict], rknn: list[dict], models: list[str]) -> str:
    find = {(r["model"], backend, r["flow"]): r for backend, rows in (("ort", ort), ("rknn", rknn)) for r in rows}
    lines = ["| model | ORT documented flow | qprep ORT | float (fallback) | #8 ORT target | rknn-toolkit2 direct | "
             "qprep RKNN | float (fallback) | #8 RKNN target |", "|---|---|---|---|---|---|---|---|---|"]
    for name in models:
        documented, ours = find.get((name, "ort", "ORT documented flow")), find.get((name, "ort", "qprep"))
        direct, fallback = find.get((name, "rknn", "direct")), find.get((name, "rknn", "qprep + fallback"))
        ort_target = bench_quantize.QUANTIZE[name]["fallback"]["target"]
        lines.append(" | ".join([
            f"| {name}", cell(documented, True), cell(ours, True), float_text(ours),
            "–" if ours is None else verdict(ours, ort_target, SPEED[name]),
            cell(direct), cell(fallback), float_text(fallback),
            "–" if fallback is None else verdict(fallback, bench_rknn.TARGETS[name])]) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(SPEED), choices=list(SPEED))
    parser.add_argument("--eval-samples", type=int, default=128)
    parser.add_argument("--skip-ort", action="store_true")
    parser.add_argument("--skip-rknn", action="store_true")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    ort = [] if args.skip_ort else bench_quantize.measure(args.models, args.eval_samples)
    rknn = [] if args.skip_rknn else bench_rknn.measure(args.models, args.eval_samples,
                                                        variants=("direct", "qprep + fallback"))
    print(f"cells: cosine mean / agreement (top-1 or per-step argmax) / INT8 speed vs FP32 (ORT); "
          f"{args.eval_samples} evaluation samples; one run, {(time.perf_counter() - start) / 60:.0f} min\n")
    print(table(ort, rknn, args.models))
    if ort:
        print("\nORT detail\n\n" + bench_quantize.markdown(ort, args.eval_samples))
    if rknn:
        print("\nRKNN detail\n\n" + bench_rknn.markdown(rknn, args.eval_samples))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
