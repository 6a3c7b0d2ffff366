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

from qprep.model.runtime import ort_session

UNSTABLE = 1.15  # rounds whose speed ratios differ by more than this factor make the figure unreliable


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
                    "round_ms": medians[label], "runs": runs, "warmup": warmup, "rounds": rounds,
                    "threads": threads} for label in models}


def speedups(reference: dict, result: dict) -> dict:
    """The speed ratio of two interleaved timings: overall (medians) and per round, with a warning when the
    rounds disagree. Why: on shared CPUs the machine's speed changes in phases that do not slow every kernel
    alike (measured on this 2-core VM, PP-OCR classifier: FP32 0.90 ms ↔ 2.06 ms, INT8 0.75 ↔ 1.10 ms, so the
    ratio moved between 1.22× and 1.9× within minutes); one number hides that."""
    rounds = [r / s for r, s in zip(reference["round_ms"], result["round_ms"])]
    low, high = min(rounds), max(rounds)
    out = {"speedup": reference["median_ms"] / result["median_ms"], "speedup_rounds": [low, high]}
    if high > UNSTABLE * low:
        out["unstable"] = (f"the speed ratio ranged {low:.2f}×–{high:.2f}× across {len(rounds)} timing rounds: "
                           "the machine's speed changed while timing; re-run on a quiet machine for a figure to trust")
    return out

