"""Latency of models with ONNX Runtime on the CPU: batch 1, fixed threads, median of N runs after warm-up.

Models compared with each other are timed in turn, over several rounds, and each reports the median of its
rounds' medians: timing one model after the other drifts with whatever else the machine does (measured on the
~1 ms PP-OCR classifier: 1.94× one way, 0.86× interleaved). Speed is a benchmark, never a test assertion: the
settings are recorded beside the numbers so two reports can be compared honestly.
"""

from __future__ import annotations

import statistics
import time

import onnx

from qprep.model_io import ort_session


def interleaved(models: dict[str, tuple[onnx.ModelProto, dict]], threads: int, runs: int, warmup: int,
                rounds: int = 3) -> dict[str, dict]:
    """label → timing, for label → (model, sample fed to it); one session per model, built once."""
    sessions = {}
    for label, (model, sample) in models.items():
        session = ort_session(model, threads=threads, optimize=True)
        feeds = {i.name: sample[i.name] for i in session.get_inputs()}
        for _ in range(warmup):
            session.run(None, feeds)
        sessions[label] = (session, feeds)
    medians: dict[str, list[float]] = {label: [] for label in models}
    p90s: dict[str, list[float]] = {label: [] for label in models}
    for _ in range(rounds):
        for label, (session, feeds) in sessions.items():
            times = []
            for _ in range(runs):
                start = time.perf_counter()
                session.run(None, feeds)
                times.append((time.perf_counter() - start) * 1000)
            medians[label].append(statistics.median(times))
            p90s[label].append(sorted(times)[int(0.9 * (len(times) - 1))])
    return {label: {"median_ms": statistics.median(medians[label]), "p90_ms": statistics.median(p90s[label]),
                    "runs": runs, "warmup": warmup, "rounds": rounds, "threads": threads} for label in models}

