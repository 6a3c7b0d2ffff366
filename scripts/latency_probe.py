"""Is this machine's speed steady? Time one model repeatedly and print each probe's median latency.

Why: on shared (virtual) CPUs the speed changes in phases that do not slow every kernel alike: on this
project's VM the FP32 PP-OCR classifier took 0.90 ms in some minutes and 2.06 ms in others while its INT8 model
moved less, so an FP32 ÷ INT8 speed ratio depends on the minute it was measured in (BENCHMARKS.md, Measured
choices: "the machine's speed phases").
Run this before trusting a speed figure; spread across probes means the figure needs its rounds' range.

    .venv/bin/python scripts/latency_probe.py models/ppocr_cls.onnx --inputs x=1,3,48,192 [--probes 12]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import onnx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from qprep.data import random_samples  # noqa: E402
from qprep.model.info import graph_inputs  # noqa: E402
from qprep.model.runtime import ort_session# noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--inputs", nargs="*", default=[], help="fixed dims for dynamic inputs: name=1,3,48,192")
    parser.add_argument("--probes", type=int, default=12)
    parser.add_argument("--runs", type=int, default=300, help="timed runs per probe (median printed)")
    parser.add_argument("--pause", type=float, default=2.0, help="seconds between probes")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    model = onnx.load(args.model)
    fixed = {name: [int(d) for d in dims.split(",")] for name, dims in (item.split("=") for item in args.inputs)}
    specs = graph_inputs(model)
    for spec in specs:
        spec.shape = fixed.get(spec.name, spec.shape)
    feeds = random_samples(specs, 1).samples[0]
    session = ort_session(model, threads=args.threads, optimize=True)
    for _ in range(20):
        session.run(None, feeds)
    medians = []
    for probe in range(args.probes):
        times = []
        for _ in range(args.runs):
            start = time.perf_counter()
            session.run(None, feeds)
            times.append((time.perf_counter() - start) * 1000)
        medians.append(statistics.median(times))
        print(f"{time.strftime('%H:%M:%S')} probe {probe + 1}: median {medians[-1]:.3f} ms", flush=True)
        time.sleep(args.pause)
    print(f"{Path(args.model).name}: {min(medians):.3f}–{max(medians):.3f} ms over {args.probes} probes "
          f"(max/min {max(medians) / min(medians):.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
