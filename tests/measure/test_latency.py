"""The latency step's budget: a model's runs follow its measured single-run time, on numbers and on a fake clock
(never a speed assertion on this CPU)."""

import itertools
import math
from types import SimpleNamespace

import pytest

from qprep.measure import latency
from qprep.measure.latency import MODEL_SECONDS, planned_runs


@pytest.mark.parametrize("single_ms, runs, rounds, expected", [
    (1300.0, 50, 3, 1),  # BERT-large on 2 cores: one run a round, 3 in all
    (300.0, 50, 3, 3),
    (100.0, 50, 3, 7),
    (10.0, 50, 3, 50),  # the configured counts
    (1.0, 50, 3, 50),
    (0.01, 50, 3, 50),
    (5000.0, 50, 1, 1),  # never fewer than one a round
])
def test_a_models_runs_follow_its_single_run_time(single_ms, runs, rounds, expected):
    assert planned_runs(single_ms, runs, rounds) == expected


def test_the_timed_runs_cost_a_bounded_multiple_of_one_run():
    """Whatever the model: at most the per-model budget, or one run a round when a run is longer than that."""
    for single_ms in [0.05, 0.7, 3.0, 40.0, 250.0, 900.0, 1300.0, 4000.0, 60000.0]:
        total = planned_runs(single_ms, 50, 3) * 3 * single_ms
        assert total <= max(MODEL_SECONDS * 1000 + 3 * single_ms, 3 * single_ms), single_ms


def fake_sessions(monkeypatch, seconds_per_run: dict):
    """ort_session → a session whose run advances a fake clock by the model's time; the levels it was built at."""
    clock = {"now": 0.0}
    levels = {}

    def session_of(model, optimize=False, **_):
        levels[model] = optimize
        steps = seconds_per_run[model]

        def run(_, feeds):
            clock["now"] += next(steps)
        return SimpleNamespace(get_inputs=lambda: [], run=run)

    monkeypatch.setattr(latency, "ort_session", session_of)
    monkeypatch.setattr(latency.time, "perf_counter", lambda: clock["now"])
    return clock, levels


def test_a_slow_model_is_timed_a_few_times_and_a_fast_one_to_its_limit(monkeypatch):
    """A 1.3 s model: its warm-up stops after two runs and each round times one run (the code before timed at
    least 8 runs a round: 31 s); a 1 ms model next to it still gets its runs until its median is known."""
    clock, _ = fake_sessions(monkeypatch, {"slow": itertools.repeat(1.3),
                                           "fast": itertools.cycle([0.001, 0.0012, 0.0009, 0.0011])})
    timed = latency.interleaved({"slow": ("slow", {})}, 2, runs=50, warmup=10, rounds=3, tight=0.02, seconds=30)
    assert timed["slow"]["round_runs"] == [1, 1, 1]
    assert timed["slow"]["single_ms"] == pytest.approx(1300.0)
    assert clock["now"] == pytest.approx(5 * 1.3)  # two warm-up runs, three timed
    assert timed["slow"]["interval"] is not None  # over the three runs: one a round has none of its own
    clock["now"] = 0.0
    fast = latency.interleaved({"fast": ("fast", {})}, 2, runs=50, warmup=10, rounds=3, tight=0.02)
    assert all(latency.MIN_RUNS <= n <= 50 for n in fast["fast"]["round_runs"])
    # evaluation.latency.within: 0, the benchmarks' setting: every round times all its runs, whatever one costs
    fixed = latency.interleaved({"slow": ("slow", {})}, 2, runs=4, warmup=2, rounds=2)
    assert fixed["slow"]["round_runs"] == [4, 4]


def test_a_model_is_built_at_the_level_its_entry_names(monkeypatch):
    _, levels = fake_sessions(monkeypatch, {"a": itertools.repeat(0.001), "b": itertools.repeat(0.001)})
    latency.interleaved({"a": ("a", {}), "b": ("b", {}, "basic")}, 1, runs=2, warmup=0, rounds=1)
    assert levels == {"a": True, "b": "basic"}


def test_a_round_ends_once_it_spent_the_plans_time_when_runs_get_slower_than_the_warm_run(monkeypatch):
    """The warm run said 10 ms (50 runs a round), then the machine slowed to 100 ms a run: each round still ends
    after about MODEL_SECONDS / rounds (EfficientNet-Lite0 at ORT_ENABLE_BASIC: 17 ms warm, 45 ms timed, 10 s)."""
    steps = itertools.chain([0.010, 0.010], itertools.cycle([0.080, 0.120]))  # never within ±2%
    clock, _ = fake_sessions(monkeypatch, {"m": steps})
    timed = latency.interleaved({"m": ("m", {})}, 2, runs=50, warmup=2, rounds=3, tight=0.02)
    per_round = MODEL_SECONDS / 3
    assert all(n <= math.ceil(per_round / 0.08) for n in timed["m"]["round_runs"]), timed["m"]["round_runs"]
    assert clock["now"] <= 0.02 + 3 * (per_round + 0.12)
