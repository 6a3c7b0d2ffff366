"""The fallback's time budget as a limit: every step asks, before it starts, whether it can finish in time.

Why a prediction and not a check of the clock: a check after each step lets the step that starts just before
the deadline run to its end (a stage ran to more than twice its budget: bias correction, range choices and the
final build all ran after the search's own check). So each kind of step is timed, its next run predicted from
the measured ones (the slowest of the last few: later builds reuse caches, but samples differ), and a step
that would end past the limit is not started. Time for what must still run after the search (the final
build) is reserved up front.
"""

from __future__ import annotations

import time
from contextlib import contextmanager


class Budget:
    """`seconds` from `started` (perf_counter). `reserved`: seconds kept back for the steps after the search."""

    RECENT = 3  # a prediction is the slowest of this many last runs of a kind

    def __init__(self, seconds: float, started: float | None = None):
        self.seconds = seconds
        self.started = time.perf_counter() if started is None else started
        self.reserve_kind: str | None = None  # the kind of step kept time for (the final build)
        self.reserve_factor = 1.0  # how many of them (a slower variant of the kind: RKNN's kl_divergence build)
        self.durations: dict[str, list[float]] = {}
        self.firsts: dict[str, float] = {}  # kind → its first run, which forget() keeps
        self.skipped: list[str] = []  # steps not started for lack of time, for the record
        self.stand_ins: dict[str, str] = {}  # kind → the kind predicting it until one of its own has run

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    @property
    def reserved(self) -> float:
        """Seconds kept back for the step after the search, as long as the last steps of its kind took."""
        return self.reserve_factor * self.predict(self.reserve_kind) if self.reserve_kind else 0.0

    @property
    def deadline(self) -> float:
        """perf_counter time by which the steps before the reserved ones must end."""
        return self.started + self.seconds - self.reserved

    def record(self, kind: str, seconds: float) -> None:
        self.durations.setdefault(kind, []).append(seconds)
        self.firsts.setdefault(kind, seconds)

    def forget(self, *kinds: str) -> None:
        """The runs of `kinds` measured so far no longer predict the next (the backend now builds another way)."""
        for kind in kinds:
            self.durations.pop(kind, None)

    @contextmanager
    def timed(self, kind: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.record(kind, time.perf_counter() - start)

    def predict(self, kind: str, default: float = 0.0) -> float:
        """How long the next step of `kind` will take: the slowest of its last runs; if none ran, what its
        stand-in kind predicts, else `default`."""
        runs = self.durations.get(kind)
        if not runs and kind in self.stand_ins:
            return self.predict(self.stand_ins[kind], default)
        return max(runs[-self.RECENT:]) if runs else default

    def first(self, kind: str, default: float = 0.0) -> float:
        """How long the first step of `kind` took (the one every setting's later steps are measured against),
        forgotten or not, else `default`."""
        return self.firsts.get(kind, default)

    def fits(self, seconds: float) -> bool:
        """Would a step of `seconds`, started now, end before the deadline (the reserve kept)?"""
        return time.perf_counter() + seconds <= self.deadline

    def ends_in_last(self, share: float, seconds: float) -> bool:
        """Would a step of `seconds`, started now, end in the budget's last `share`?"""
        return self.elapsed() + seconds > self.seconds * (1 - share)

    def allows(self, step: str, seconds: float) -> bool:
        """fits(), and a step that does not fit is recorded as skipped (`step` says what it was)."""
        if self.fits(seconds):
            return True
        self.skipped.append(f"{step} (~{seconds:.0f} s, {max(0.0, self.deadline - time.perf_counter()):.0f} s left)")
        return False

    def record_dict(self) -> dict:
        return {"seconds": self.seconds, "elapsed": round(self.elapsed(), 1), "skipped": list(self.skipped)}
