"""Latency of models with ONNX Runtime on the CPU: batch 1, fixed threads, median of N runs after warm-up.

Models compared with each other are timed in turn, over several rounds, and each reports the median of its
rounds' medians: timing one model after the other drifts with whatever else the machine does (BENCHMARKS.md:
"latency timed interleaved, until its interval is tight"). Speed is a benchmark, never a test assertion: the
settings are recorded beside the numbers so two reports can be compared honestly.
"""

from __future__ import annotations

import math
import statistics
import time

import onnx

from qprep.model.runtime import ort_session

UNSTABLE = 1.15  # rounds whose speed ratios differ by more than this factor make the figure unreliable
MIN_RUNS = 8  # a round stops early (`tight`) only after this many runs
MIN_BUDGET_RUNS = 5  # ... and (`seconds` spent) after this many
WARMUP_SECONDS = 0.5  # warm-up runs beyond the second stop once they took this long (ORT is warm after one)
MODEL_SECONDS = 2.0  # with `tight`: each model's timed runs cost about this in all (`planned_runs`)


def interleaved(models: dict[str, tuple], threads: int, runs: int, warmup: int, rounds: int = 3,
                tight: float | None = None, seconds: float | None = None) -> dict[str, dict]:
    """label → timing, for label → (model or its session, sample fed to it[, optimize: True or "basic"]); one
    session per model, built once (at ORT_ENABLE_ALL unless the third item says otherwise).
    Each round times `runs` runs per model; with `tight`, a round stops as soon as its median's 95% interval is
    within ±tight of it (at least MIN_RUNS), and a model whose warm run is slow gets fewer runs (`planned_runs`;
    a round also ends once it spent the plan's time, should the runs get slower than the warm run said): a fixed
    run count is too many for a big model and too few for a small fast one. With `seconds`, a round also
    ends once it has used its share of that budget (at least MIN_BUDGET_RUNS runs, fewer if planned), and each
    timing reports the interval it reached: on a noisy machine a big model's rounds may never get within ±tight
    (BENCHMARKS.md: "latency timed interleaved, until its interval is tight")."""
    sessions, planned = {}, {}
    for label, (model, sample, *level) in models.items():  # a model, or a session built already (the reference's)
        session = model if hasattr(model, "run") else ort_session(model, threads=threads,
                                                                    optimize=level[0] if level else True)
        feeds = {i.name: sample[i.name] for i in session.get_inputs()}
        single = _warm_up(session, feeds, warmup)
        planned[label] = (planned_runs(single, runs, rounds) if tight and single else runs, single)
        sessions[label] = (session, feeds)
    medians: dict[str, list[float]] = {label: [] for label in models}
    p90s: dict[str, list[float]] = {label: [] for label in models}
    every: dict[str, list[list[float]]] = {label: [] for label in models}
    share = seconds / (rounds * len(models)) * 1000 if seconds else None  # ms per round and model
    for _ in range(rounds):
        for label, (session, feeds) in sessions.items():
            most, times = planned[label][0], []
            # the plan's time, should the runs get slower than its warm run said
            spend = MODEL_SECONDS * 1000 / rounds if tight and planned[label][1] else None
            while len(times) < most and not (tight and len(times) >= MIN_RUNS and median_known(times, tight)) \
                    and not (share and len(times) >= min(MIN_BUDGET_RUNS, most) and sum(times) >= share) \
                    and not (spend and times and sum(times) >= spend):
                start = time.perf_counter()
                session.run(None, feeds)
                times.append((time.perf_counter() - start) * 1000)
            medians[label].append(statistics.median(times))
            p90s[label].append(sorted(times)[int(0.9 * (len(times) - 1))])
            every[label].append(times)
    return {label: {"median_ms": statistics.median(medians[label]), "p90_ms": statistics.median(p90s[label]),
                    "round_ms": medians[label], "runs": int(statistics.median(len(t) for t in every[label])),
                    "round_runs": [len(t) for t in every[label]], "warmup": warmup, "rounds": rounds,
                    "threads": threads, "interval": _finite(reached(every[label])),
                    **({"single_ms": round(planned[label][1], 4)} if planned[label][1] else {}),
                    **({"tight": tight} if tight else {}), **({"seconds": seconds} if seconds else {})}
            for label in models}


def _warm_up(session, feeds: dict, warmup: int) -> float | None:
    """Up to `warmup` untimed runs (those beyond the second stop after WARMUP_SECONDS); the time of the last
    one in ms (a warm run: the first builds caches and pages weights in), None with fewer than two."""
    started, last = time.perf_counter(), None
    for done in range(warmup):
        start = time.perf_counter()
        session.run(None, feeds)
        last = (time.perf_counter() - start) * 1000 if done else None
        if done and time.perf_counter() - started > WARMUP_SECONDS:
            break
    return last


def planned_runs(single_ms: float, runs: int, rounds: int, each: float = MODEL_SECONDS) -> int:
    """Runs per round for a model whose warm run takes `single_ms`: its timed runs cost about `each` seconds in
    all, at least one a round, at most `runs`. Why: the step then costs a bounded multiple of one run (a 1.3 s
    BERT-large: 3 runs, not 30 s), while a 1 ms model still gets the counts its noise needs (a round stops
    sooner once its median is known)."""
    return max(1, min(runs, math.ceil(each * 1000 / rounds / max(single_ms, 1e-6))))


def reached(rounds: list[list[float]]) -> float:
    """The interval a timing reached, over all its runs: a slow model's plan leaves a round one or a few runs,
    too few for an interval of its own, and a machine that changed speed between rounds widens it, as it should."""
    return interval([t for times in rounds for t in times])


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

