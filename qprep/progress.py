"""Progress lines for work that takes seconds; silent only with --quiet.

On a terminal a step's line stays open until the step ends (`qprep: [2/5] optimize … 3.1 s`). Elsewhere (a pipe, a
CI log, a file) every event is a line of its own, and a step says something only once it has run for LONG
seconds: a log then shows what a slow run is doing, while a quick run (or a quick refusal, whose one line is
the error) prints nothing more.
"""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager

LONG = 5.0  # seconds after which a step or a watched piece of work says it is still running
AGAIN = 60.0  # ...and again every this many seconds while it runs on


class Progress:
    def __init__(self, enabled: bool | None = None, stream=None, long: float | None = None):
        """`enabled`: False is --quiet; None or True prints (on a terminal with open lines, else plain lines)."""
        self.stream = stream or sys.stderr
        self.enabled = enabled is not False
        isatty = getattr(self.stream, "isatty", None)
        self.live = bool(isatty and isatty())  # a terminal: a step's line stays open until it ends
        self.long = LONG if long is None else long
        self._open = False  # a step's line is waiting for its "… 3.1 s"
        self._step_started: float | None = None  # when the open step began (plain lines: its notes wait for LONG)
        self._lock = threading.Lock()  # watchers print from a timer thread

    def note(self, message: str) -> None:
        """A line of its own, also in the middle of a step (long steps report what they are doing). Off a terminal,
        a step's notes are said once it has run `long` seconds, as the step itself: a quick run or refusal keeps
        to its one line."""
        started = self._step_started
        if not self.live and started is not None and time.perf_counter() - started < self.long:
            return
        if self.enabled:
            with self._lock:
                print(f"{chr(10) if self._open else ''}qprep:   {message}", file=self.stream, flush=True)
                self._open = False

    @contextmanager
    def step(self, label: str):
        """A pipeline step: `[2/5] optimize … 3.1 s` on a terminal; elsewhere `[2/5] optimize …` once it has
        run for `long` seconds and `[2/5] optimize: 12.3 s` when such a step ends."""
        start = time.perf_counter()
        outer, self._step_started = self._step_started, start
        said = []  # plain lines: whether the step said it was running
        if self.enabled and self.live:
            with self._lock:
                print(f"qprep: {label} …", end="", file=self.stream, flush=True)
                self._open = True
        timer = None if not self.enabled or self.live else self._after(self.long, lambda: self._running(label, said))
        ok = False
        try:
            yield
            ok = True
        finally:
            if timer is not None:
                timer.cancel()
            self._step_started = outer
            status = f"{time.perf_counter() - start:.1f} s" if ok else "failed"
            if self.enabled and self.live:
                with self._lock:
                    print(f" {status}" if self._open else f"qprep: {label} … {status}", file=self.stream, flush=True)
                    self._open = False
            elif self.enabled and said:
                self._line(f"qprep: {label}: {status}")

    @contextmanager
    def watch(self, what: str):
        """Work inside a step that may run long (an optimize pass): a note saying `what` and for how long, once
        it has run for `long` seconds and every AGAIN seconds after, and a note when such work ends."""
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        said, done = [], []

        def tell() -> None:
            if done:
                return
            said.append(True)
            self.note(f"{what}: running for {time.perf_counter() - start:.0f} s")
            nonlocal timer
            timer = self._after(AGAIN, tell)

        timer = self._after(self.long, tell)
        try:
            yield
        finally:
            done.append(True)
            timer.cancel()
            if said:
                self.note(f"{what}: done in {time.perf_counter() - start:.1f} s")

    def _running(self, label: str, said: list) -> None:
        said.append(True)
        self._line(f"qprep: {label} …")

    def _line(self, text: str) -> None:
        with self._lock:
            print(text, file=self.stream, flush=True)

    @staticmethod
    def _after(seconds: float, action) -> threading.Timer:
        timer = threading.Timer(seconds, action)
        timer.daemon = True  # a timer must never keep the process alive
        timer.start()
        return timer
