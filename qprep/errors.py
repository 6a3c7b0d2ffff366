"""Exceptions that carry an exit code, so the CLI can turn them into one actionable line.

User errors (bad config, missing file, data that does not match the model) exit 2; anything else is a bug
or an environment failure and exits 3. A missed accuracy gate is not an exception: it is a result (exit 1).
"""

import contextlib
import signal
import threading

EXIT_OK = 0
EXIT_GATE_MISSED = 1
EXIT_USAGE = 2
EXIT_INTERNAL = 3


class QprepError(Exception):
    """A problem the user can fix; the message says what is wrong and how to fix it, in one line."""

    exit_code = EXIT_USAGE


class ConfigError(QprepError):
    """The YAML config (or a --set override) is invalid; the message starts with the key path."""


class ModelError(QprepError):
    """The model file is missing, unreadable or not something qprep can take."""


class DataError(QprepError):
    """Calibration/evaluation data is missing, empty, non-finite or does not match the model's inputs."""


class RunDirError(QprepError):
    """The run directory cannot be used (non-empty without --force, not writable)."""


class Problems(QprepError):
    """Several independent problems found at once (`qprep validate`): the message is the first one, `all`
    holds every one, each a one-line QprepError of its own."""

    def __init__(self, problems: list[QprepError]):
        super().__init__(str(problems[0]))
        self.all = problems
        self.exit_code = max(p.exit_code for p in problems)


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP (what `timeout`, `kill`, batch timeouts and process managers send), unwound like
    Ctrl-C so the run still writes its report and manifest."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum
        self.cause = signal.Signals(signum).name


@contextlib.contextmanager
def signal_handlers(handler, *signals: int, keep=lambda: False):
    """`handler` for `signals` while the block runs, the previous handlers after it, unless `keep()` says the
    process is on its way out (then the handler stays: a late signal must not kill it before it exits). Only
    the main thread can set handlers; elsewhere (qprep called from a worker thread) the block runs with the
    handlers it has."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        if not keep():
            for sig, previous in saved.items():
                signal.signal(sig, previous)


class InterruptOnce:
    """A signal handler that unwinds on the first Ctrl-C, SIGTERM or SIGHUP and only notes the ones after it:
    a second Ctrl-C 30 ms later must not cut short the cleanup the first one started (a batch's summary)."""

    def __init__(self, say=None):
        self.fired, self.say = False, say

    def __call__(self, signum, frame):
        if not self.fired:
            self.fired = True
            raise KeyboardInterrupt() if signum == signal.SIGINT else Interrupted(signum)
        if self.say:
            self.say()


class ToolkitError(QprepError):
    """A third-party toolkit (rknn-toolkit2) failed on a model qprep handed it: an error of its own (a
    traceback, a non-zero return), or its process died from a signal (SIGABRT from a C++ assertion, SIGSEGV,
    SIGKILL from the OOM killer).

    Exit 3, not 2: qprep could not foresee the input that breaks the toolkit, so it cannot say what to
    change; the line names the toolkit step, the signal and the toolkit's own last error, and the toolkit log
    holds the rest. Inputs qprep knows the toolkit cannot take are refused before it runs, with exit 2 and the
    fix (e.g. a model with no float tensor on backend rknn). It is still one line without a traceback: the
    run directory has the failed report and the manifest."""

    exit_code = EXIT_INTERNAL

    def __init__(self, message: str, crashed: bool = False, rule: str | None = None):
        super().__init__(message)
        self.crashed = crashed  # the worker died: every RKNN object it held is gone
        self.rule = rule  # the toolkit's graph rule that failed, where it names it for `disable_rules`
