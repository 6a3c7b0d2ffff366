"""`qprep batch` through the local executor and through Ray on the same folder of demo models: wall time,
per-model time, the overhead Ray adds per model, and whether the figures agree.

    .venv/bin/python scripts/bench_batch.py [--work /tmp/qprep-bench-batch] [--rounds 2] [--markdown F]

Each demo model gets a sidecar with its inputs and its calibration_data samples; the batch config
is optimize → quantize(ort) with `threads: 1`, two models at a time on both executors (this machine's 2 cores:
`--jobs 2` locally, a Ray instance started here with 2 CPUs); then `--copies` small models through both, for
the cost each executor adds per model. Compare on an idle machine: Ray's workers run at nice 15.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
OCR = {"channel_order": "bgr", "mean": [127.5], "std": [127.5], "resize": "none"}
IMAGENET = {"mean": [127.0, 127.0, 127.0], "std": [128.0, 128.0, 128.0]}
MODELS = {  # model → (calibration_data folder, preprocess, inputs)
    "efficientnet_lite0": ("imagenet", IMAGENET, None),
    "minilm_l6_v2": ("minilm", None, None),
    "ppocr_cls": ("ocr_cls", OCR, {"x": [1, 3, 48, 192]}),
    "ppocrv4_rec": ("ocr_rec", OCR, {"x": [1, 3, 48, 320]}),
}


def build_folder(work: Path) -> tuple[Path, Path]:
    models = work / "models"
    if models.exists():
        shutil.rmtree(models)
    models.mkdir(parents=True)
    for name, (data, preprocess, inputs) in MODELS.items():
        shutil.copy(ROOT / "models" / f"{name}.onnx", models / f"{name}.onnx")
        sets = ROOT / "calibration_data" / data
        side = {"calibration": {"source": str(sets / "calib"), "max_samples": 32},
                "evaluation": {"source": str(sets / "eval"), "max_samples": 64, "latency": {"runs": 0}}}
        if preprocess:
            side["calibration"]["preprocess"] = side["evaluation"]["preprocess"] = preprocess
        if inputs:
            side["inputs"] = inputs
        (models / f"{name}.qprep.yaml").write_text(yaml.safe_dump(side, sort_keys=False))
    config = work / "int8.yaml"
    config.write_text("model: unused.onnx\nthreads: 1\npipeline: [optimize, {quantize: {backend: ort}}]\n")
    return models, config


def run(config: Path, models: Path, out: Path, executor: str) -> tuple[float, dict]:
    if out.exists():
        shutil.rmtree(out)
    command = [str(ROOT / ".venv/bin/qprep"), "batch", str(config), str(models), "--out", str(out), "--quiet",
               "--executor", executor] + (["--jobs", "2"] if executor == "local" else [])
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode not in (0, 1):
        sys.exit(f"bench_batch: {executor} batch failed ({done.returncode}): {done.stderr.strip()[-400:]}")
    return wall, json.loads((out / "summary.json").read_text())


def build_copies(work: Path, count: int) -> tuple[Path, Path]:
    """`count` distinct copies of the PP-OCR classifier (their producer names differ, so none is a duplicate)
    and an optimize-only config: each model is ~1 s of work, so the executor's own cost shows."""
    import onnx

    models = work / "copies"
    if models.exists():
        shutil.rmtree(models)
    models.mkdir(parents=True)
    model = onnx.load(str(ROOT / "models" / "ppocr_cls.onnx"))
    for index in range(count):
        model.producer_name = f"copy-{index}"
        onnx.save(model, str(models / f"cls_{index:02d}.onnx"))
    config = work / "optimize.yaml"
    config.write_text("model: unused.onnx\nthreads: 1\ninputs: {x: [1, 3, 48, 192]}\npipeline: [optimize]\n")
    return models, config


def compare(models: Path, config: Path, work: Path, rounds: int) -> dict:
    """Median wall time per executor over `rounds` alternating runs, and the last summary of each."""
    walls: dict[str, list[float]] = {"local": [], "ray": []}
    summaries = {}
    for round_ in range(rounds):  # alternating order, so a change in machine load hits both alike
        for executor in ("local", "ray") if round_ % 2 == 0 else ("ray", "local"):
            wall, summaries[executor] = run(config, models, work / f"out_{models.name}_{executor}", executor)
            walls[executor].append(wall)
    return {e: (statistics.median(walls[e]), summaries[e]) for e in walls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="/tmp/qprep-bench-batch")
    parser.add_argument("--markdown", help="also write the tables to this file")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each executor, alternating (median wall)")
    parser.add_argument("--copies", type=int, default=20, help="small models for the per-model overhead")
    args = parser.parse_args()
    work = Path(args.work)
    results = compare(*build_folder(work), work, args.rounds)
    rows = {e: {r["model"]: r for r in s["models"]} for e, (_, s) in results.items()}
    lines = ["| model | local: status, s | Ray: status, s | cosine local / Ray |", "|---|---|---|---|"]
    for name in sorted(rows["local"]):
        a, b = rows["local"][name], rows["ray"][name]
        lines.append(f"| {name} | {a['status']}, {a['seconds']:.1f} | {b['status']}, {b['seconds']:.1f} | "
                     f"{a.get('cosine_mean') or 0:.5f} / {b.get('cosine_mean') or 0:.5f} |")
    (local_wall, _), (ray_wall, summary) = results["local"], results["ray"]
    lines += ["", f"Demo models (optimize → quantize(ort), evaluation on 64 samples), median of {args.rounds} "
              f"rounds, 2 models at a time: local {local_wall:.1f} s, Ray {ray_wall:.1f} s "
              f"({summary['executor']['where']})."]
    small = compare(*build_copies(work, args.copies), work, args.rounds)
    (local_wall, _), (ray_wall, _) = small["local"], small["ray"]
    lines += ["", f"{args.copies} small models (the classifier, optimize only), median of {args.rounds} rounds: "
              f"local {local_wall:.1f} s, Ray {ray_wall:.1f} s (Ray's start included) → "
              f"{(ray_wall - local_wall) / args.copies:+.2f} s per model."]
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")


if __name__ == "__main__":
    main()
