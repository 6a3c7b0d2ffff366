"""Latency of a model with ONNX Runtime on the CPU: batch 1, fixed threads, median of N runs after warm-up.

Speed is a benchmark, never a test assertion: the numbers depend on the machine; the settings are recorded
beside them so two reports can be compared honestly.
"""

from __future__ import annotations

import statistics
import time

import onnx

from qprep.model_io import ort_session


def measure(model: onnx.ModelProto, sample: dict, threads: int, runs: int, warmup: int) -> dict:
    session = ort_session(model, threads=threads, optimize=True)
    feeds = {i.name: sample[i.name] for i in session.get_inputs()}
    for _ in range(warmup):
        session.run(None, feeds)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        session.run(None, feeds)
        times.append((time.perf_counter() - start) * 1000)
    return {"median_ms": statistics.median(times), "p90_ms": sorted(times)[int(0.9 * (len(times) - 1))],
            "runs": runs, "warmup": warmup, "threads": threads}
