"""The client of rknn-toolkit2: every toolkit call of the backend goes through `Toolkit`.

Facts this module is built on (measured with rknn-toolkit2 2.5.0, see ../shared/notes/rknn-toolkit2.md):
- calls fail three ways: an exception (its last line is the message), a non-zero return, or None; the
  reason is in the toolkit's own `E <api>: ...` log line. Every call goes through `Toolkit.call`.
- the toolkit prints from C++ straight to file descriptors 1/2, writes working files into the current
  directory and aborts the process on some inputs: every call runs in a worker process (worker.py) that
  sits in the work folder with both fds on the toolkit log, so a crash becomes a one-line ToolkitError.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from qprep.errors import QprepError, ToolkitError
from qprep.quantize.rknn import worker as rknn_worker

log = logging.getLogger("qprep")

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STAMP = re.compile(r"^RKNN: \[[0-9:.]+\] ")  # the C++ logger's prefix: `E RKNN: [02:41:12.288] message`
_LOG_LINE = re.compile(r"^[EWID] ")  # a new line of the toolkit's logger
_RULE = re.compile(r"disable_rules=\[['\"](\w+)['\"]\] in rknn\.config\(\)")
_NOISE = ("Unkown op target", "rknn-toolkit2 version")
_SETUP = "run `qprep setup rknn` (it installs rknn-toolkit2 2.5.0 with the pins it needs and a CPU torch)"


class Toolkit:
    """Every rknn-toolkit2 call: made in the toolkit worker process (worker.py), which owns the RKNN
    objects (the parent holds integer handles), runs in the work folder and prints into the toolkit log. A
    failed call (exception, non-zero or None) becomes a QprepError with the toolkit's own error line; a crash
    of the worker (a signal) a ToolkitError naming the step, the signal and that line."""

    def __init__(self, work_dir: Path):
        self.work_dir = work_dir
        self.log_path = work_dir / "rknn-toolkit.log"
        self._worker: rknn_worker.Worker | None = None

    def start(self) -> None:
        """Start the worker (it imports the toolkit, seconds, while the parent goes on until the first call).
        Once per builder: a stopped or crashed worker is not restarted (the RKNN objects died with it)."""
        if self._worker is None:
            self._worker = rknn_worker.Worker(self.work_dir, self.log_path)
            log.info("rknn-toolkit2 worker started (pid %d)", self._worker.pid)

    def close(self) -> None:
        """Release the RKNN objects and stop the worker (terminated if it is stuck or mid-call)."""
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    @property
    def running(self) -> bool:
        """The worker is up (a crash or close ends it, and the RKNN objects it held with it)."""
        return self._worker is not None

    def new(self) -> int:
        """A new RKNN object in the worker → its handle."""
        return self._request("RKNN()", "new")

    def call(self, step: str, rknn: int, method: str, *args, **kwargs):
        """`rknn.method(*args, **kwargs)` in the worker; its result checked (0 or a value, not None)."""
        start = self.log_path.stat().st_size if self.log_path.exists() else 0
        try:
            result = self._request(step, "call", rknn, method, args, kwargs, start)
        except QprepError:
            raise
        except Exception as exc:  # the toolkit raises bare ValueError/KeyError with its message last
            self._copy_to_run_log(start, step)
            lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
            raise ToolkitError(f"rknn-toolkit2 {step} failed: {self.error_line(start) or (lines[-1] if lines else type(exc).__name__)}"
                             f" (toolkit log: {self.log_path})", rule=self.failed_rule(start)) from None
        self._copy_to_run_log(start, step)
        if result is None or (isinstance(result, int) and result != 0):
            raise ToolkitError(f"rknn-toolkit2 {step} failed: {self.error_line(start) or f'returned {result}'} "
                             f"(toolkit log: {self.log_path})", rule=self.failed_rule(start))
        return result

    def apply(self, step: str, rknn: int, function, *args):
        """`function(the RKNN object, *args)` in the worker (a module-level function: it is sent by name);
        what it raises is raised here."""
        return self._request(step, "apply", rknn, function, args)

    def release(self, rknn: int) -> None:
        """Release one RKNN object in the worker (its simulator runtime with it)."""
        self._request("release", "release", rknn)

    def discard(self, rknn: int) -> None:
        """Release an RKNN object, unless the worker that held it has died (then it is gone already): for the
        objects a failed step leaves behind, where a second error would hide the first."""
        if self.running:
            self.release(rknn)

    def _request(self, step: str, kind: str, rknn: int | None = None, name=None, args: tuple = (),
                 kwargs: dict | None = None, start: int | None = None):
        if self._worker is None:  # closed, or crashed before: its RKNN objects are gone
            raise RuntimeError(f"rknn-toolkit2 {step}: the toolkit worker is not running")
        if start is None:
            start = self.log_path.stat().st_size if self.log_path.exists() else 0
        try:
            return self._worker.request(kind, rknn, name, args, kwargs)
        except rknn_worker.NotInstalled as exc:
            self.close()
            raise QprepError(f"rknn-toolkit2 is not installed or does not import ({exc}); {_SETUP}") from None
        except rknn_worker.WorkerDied as exc:
            self._copy_to_run_log(start, step)
            self.close()
            why = self.error_line(start) or ("no error in its log; killed from outside (out of memory?)"
                                              if exc.how == "SIGKILL" else "no error in its log")
            raise ToolkitError(f"rknn-toolkit2 crashed ({exc.how}) in {step}: {why} (toolkit log: {self.log_path})",
                               crashed=True) from None

    def _copy_to_run_log(self, start: int, step: str) -> None:
        """What the toolkit printed during one call, into qprep.log (colour codes stripped)."""
        if self.log_path.exists():
            with open(self.log_path, errors="replace") as f:
                f.seek(start)
                text = _ANSI.sub("", f.read()).strip()
            if text:
                log.info("rknn-toolkit2 %s:\n%s", step, text)

    def failed_rule(self, start: int) -> str | None:
        """The graph rule the toolkit names after `start` when one of its optimization rules failed: it logs
        "You can add disable_rules=['remove_concat_slice'] in rknn.config() to temporarily disable the error
        rule!" (basic-pitch's CQT: that rule raised IndexError on a Concat whose input it had left shapeless)."""
        if not self.log_path.exists():
            return None
        with open(self.log_path, errors="replace") as f:
            f.seek(start)
            found = _RULE.search(_ANSI.sub("", f.read()))
        return found.group(1) if found else None

    def error_line(self, start: int) -> str:
        """The toolkit's first error line logged after offset `start` (its noise lines skipped; a logged
        traceback becomes its exception line), "" if there is none."""
        if not self.log_path.exists():
            return ""
        with open(self.log_path, errors="replace") as f:
            f.seek(start)
            lines = [_ANSI.sub("", line).strip() for line in f]
        for index, line in enumerate(lines):
            if line.startswith("E ") and not any(noise in line for noise in _NOISE):
                message = _STAMP.sub("", line[2:].strip())
                if message.endswith("Traceback (most recent call last):"):  # the toolkit logged a traceback:
                    cause = next((l for l in lines[index + 1:] if re.match(r"^\w+(Error|Exception)\b", l)), "")
                    message = f"{message.split(':')[0]}: {cause}" if cause else message
                elif re.fullmatch(r"[\w.]+:", message):  # `E build: ` with its reason on the next line(s)
                    cause = next((l for l in lines[index + 1:] if l), "")
                    message = f"{message} {cause}" if cause and not _LOG_LINE.match(cause) else message
                return message
        return ""
