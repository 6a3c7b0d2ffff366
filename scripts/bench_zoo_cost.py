"""What a zoo run costs against ONNX Runtime's quantize_static alone on the same model and calibration samples.

Why: a run that measures its result costs more than the quantizer alone, and a user reads the difference as cost;
issue #61 bounds it: qprep's run without its evaluation at most 2x quantize_static. quantize_static runs here in a
subprocess per model (QDQ, per-channel, U8S8, MinMax, the zoo's calibration samples), the qprep figures are read
from a finished `scripts/zoo.py run` (each run's manifest.json: timings_s).

    .venv/bin/python scripts/bench_zoo_cost.py LABEL [--models a,b] [--markdown]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUANTIZE = """
import sys
from pathlib import Path
import numpy as np
import onnx
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

model, calib, out = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
names = {i.name for i in onnx.load(model, load_external_data=False).graph.input}

class Reader(CalibrationDataReader):
    def __init__(self):
        self.files = iter(sorted(calib.glob("*.npz"))[:32])
    def get_next(self):
        path = next(self.files, None)
        return None if path is None else {k: v for k, v in np.load(path).items() if k in names}

quantize_static(model, out, Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
"""


def quantize_static_seconds(model: Path, calibration: Path, out: Path) -> tuple[float | None, str]:
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", QUANTIZE, str(model), str(calibration), str(out)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return None, (proc.stderr.strip().splitlines() or ["failed"])[-1][:80]
    return time.perf_counter() - started, ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("label")
    parser.add_argument("--models", default="")
    args = parser.parse_args(argv)
    batch = ROOT / "zoo" / "runs" / args.label / "batch"
    wanted = set(filter(None, args.models.split(",")))
    print("| model | quantize_static s | qprep run s | of it evaluation s | run without evaluation / quantize_static |")
    print("|---|---|---|---|---|")
    for run in sorted(p for p in batch.iterdir() if (p / "manifest.json").exists()):
        if wanted and run.name not in wanted:
            continue
        timings = json.loads((run / "manifest.json").read_text()).get("timings_s") or {}
        total, evaluation = timings.get("total"), timings.get("evaluation", 0.0)
        model = ROOT / "zoo" / "models" / f"{run.name}.onnx"
        seconds, why = quantize_static_seconds(model, ROOT / "zoo" / "samples" / run.name / "calibration",
                                               Path("/tmp") / f"qs_{run.name}.onnx")
        ratio = f"{(total - evaluation) / seconds:.2f}x" if seconds and total else why or "–"
        print(f"| {run.name} | {seconds:.1f} | {total:.1f} | {evaluation:.1f} | {ratio} |" if seconds else
              f"| {run.name} | failed: {why} | {total} | {evaluation} | – |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
