"""Progress lines on the terminal for work that takes seconds; silent when not a TTY or with --quiet."""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager


class Progress:
    def __init__(self, enabled: bool | None = None, stream=None):
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self._open = False  # a step's line is waiting for its "… 3.1 s"

    def note(self, message: str) -> None:
        """A line of its own, also in the middle of a step (long steps report what they are doing)."""
        if self.enabled:
            print(f"{chr(10) if self._open else ''}qprep:   {message}", file=self.stream, flush=True)
            self._open = False

    @contextmanager
    def step(self, label: str):
        """`[2/5] optimize … 3.1 s` — printed when the step starts and completed when it ends."""
        start = time.perf_counter()
        if self.enabled:
            print(f"qprep: {label} …", end="", file=self.stream, flush=True)
            self._open = True
        ok = False
        try:
            yield
            ok = True
        finally:
            if self.enabled:
                status = f"{time.perf_counter() - start:.1f} s" if ok else "failed"
                print(f" {status}" if self._open else f"qprep: {label} … {status}", file=self.stream, flush=True)
                self._open = False
