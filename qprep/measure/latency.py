"""Latency of models with ONNX Runtime on the CPU: batch 1, fixed threads, median of N runs after warm-up.

Models compared with each other are timed in turn, over several rounds, and each reports the median of its
rounds' medians: timing one model after the other drifts with whatever else the machine does (BENCHMARKS.md:
"latency timed interleaved, until its interval is tight"). Speed is a benchmark, never a test assertion: the
settings are recorded beside the numbers so two reports can be compared honestly.
"""

from __future__ import annotations

import statistics
import time

import onnx

from qprep.model.runtime import ort_session

UNSTABLE = 1.15  # rounds whose speed ratios differ by more than this factor make the figure unreliable
MIN_RUNS = 8  # a round stops early (`tight`) only after this many runs
MIN_BUDGET_RUNS = 5  # ... and (`seconds` spent) after this many
WARMUP_SECONDS = 2.0  # warm-up runs beyond the first stop once they took this long


def interleaved(models: dict[str, tuple[onnx.ModelProto, dict]], threads: int, runs: int, warmup: int,
                rounds: int = 3, tight: float | None = None, seconds: float | None = None) -> dict[str, dict]:
    """label → timing, for label → (model or its session, sample fed to it); one session per model, built once.
    Each round times `runs` runs per model; with `tight`, a round stops as soon as its median's 95% interval is within
    ±tight of it (at least MIN_RUNS). Why: a fixed run count is too many for a big model and too few for a small
    fast one: the interval says when the figure is known. With `seconds`, a round also ends once it has used its
    share of that budget (at least MIN_BUDGET_RUNS runs), and each timing reports the interval it reached: on a
    noisy machine a big model's rounds may never get within ±tight (BENCHMARKS.md: "latency timed interleaved,
    until its interval is tight")."""
    sessions = {}
    for label, (model, sample) in models.items():  # a model, or a session built already (the reference's)
        session = model if hasattr(model, "run") else ort_session(model, threads=threads, optimize=True)
        feeds = {i.name: sample[i.name] for i in session.get_inputs()}
        started = time.perf_counter()
        for done in range(warmup):
            session.run(None, feeds)
            if done and time.perf_counter() - started > WARMUP_SECONDS:
                break
        sessions[label] = (session, feeds)
    medians: dict[str, list[float]] = {label: [] for label in models}
    p90s: dict[str, list[float]] = {label: [] for label in models}
    counts: dict[str, list[int]] = {label: [] for label in models}
    intervals: dict[str, list[float]] = {label: [] for label in models}
    share = seconds / (rounds * len(models)) * 1000 if seconds else None  # ms per round and model
    for _ in range(rounds):
        for label, (session, feeds) in sessions.items():
            times = []
            while len(times) < runs and not (tight and len(times) >= MIN_RUNS and median_known(times, tight)) \
                    and not (share and len(times) >= MIN_BUDGET_RUNS and sum(times) >= share):
                start = time.perf_counter()
                session.run(None, feeds)
                times.append((time.perf_counter() - start) * 1000)
            medians[label].append(statistics.median(times))
            p90s[label].append(sorted(times)[int(0.9 * (len(times) - 1))])
            counts[label].append(len(times))
            intervals[label].append(interval(times))
    return {label: {"median_ms": statistics.median(medians[label]), "p90_ms": statistics.median(p90s[label]),
                    "round_ms": medians[label], "runs": int(statistics.median(counts[label])),
                    "round_runs": counts[label], "warmup": warmup, "rounds": rounds, "threads": threads,
                    "interval": _finite(max(intervals[label])),
                    **({"tight": tight} if tight else {}), **({"seconds": seconds} if seconds else {})}
            for label in models}


def median_known(times: list[float], tight: float) -> bool:
    """Is the median's 95% interval within ±tight of it?"""
    return interval(times) <= tight


def interval(times: list[float]) -> float:
    """Half-width of the median's 95% interval as a share of the median: a box plot's notch (median ±
    1.58 IQR / √n, McGill et al. 1978), robust to the odd slow run that a mean's interval is not."""
    if len(times) < 2:
        return float("inf")
    quartiles = statistics.quantiles(times, n=4)
    return 1.58 * (quartiles[2] - quartiles[0]) / len(times) ** 0.5 / statistics.median(times)


def _finite(share: float) -> float | None:
    """JSON has no infinity: an interval that could not be computed (one run) is None."""
    return round(share, 4) if share != float("inf") else None


def speedups(reference: dict, result: dict) -> dict:
    """The speed ratio of two interleaved timings: overall (medians) and per round, with a warning when the
    rounds disagree. Why: on shared CPUs the machine's speed changes in phases that do not slow every kernel
    alike, so the ratio moves within minutes (BENCHMARKS.md: "the machine's speed phases"); one number hides
    that."""
    rounds = [r / s for r, s in zip(reference["round_ms"], result["round_ms"])]
    low, high = min(rounds), max(rounds)
    out = {"speedup": reference["median_ms"] / result["median_ms"], "speedup_rounds": [low, high]}
    if high > UNSTABLE * low:
        out["unstable"] = (f"the speed ratio ranged {low:.2f}×–{high:.2f}× across {len(rounds)} timing rounds: "
                           "the machine's speed changed while timing; re-run on a quiet machine for a figure to trust")
    return out

