"""The run log: qprep's own records and what toolkits say while they run go to <run dir>/qprep.log, not the
terminal (which shows progress lines and errors)."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

LOG = "qprep.log"


# Libraries whose INFO records (one line per pass over the graph) drowned the run log: warnings only.
CHATTY_LIBRARIES = ("onnx_ir", "onnxscript")


def attach_log(path: Path) -> logging.Handler:
    """Send the `qprep` logger (and toolkits we capture) to <run dir>/qprep.log."""
    handler = logging.FileHandler(path / LOG, encoding="utf-8", errors="backslashreplace")  # non-UTF-8 file names
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("qprep")
    logger.setLevel(logging.DEBUG)
    logger.propagate = False  # the terminal shows progress lines and errors, not the log
    logger.addHandler(handler)
    return handler


@contextlib.contextmanager
def toolkit_logging_to_run_log():
    """Toolkits (ORT's quantizer, rknn-toolkit2) log through the root logger and would print to the
    terminal; while they run, their warnings go to the run log instead. Not their INFO records: ORT's quantizer
    writes one per tensor ("Quantization parameters for tensor ... not specified", "Ignore MatMul due to non
    constant B"), hundreds of lines on a transformer that said nothing qprep's own lines do not."""
    root = logging.getLogger()
    run_handlers = logging.getLogger("qprep").handlers
    saved, level = root.handlers[:], root.level
    root.handlers = list(run_handlers)
    root.setLevel(logging.WARNING)
    quiet = [logging.getLogger(name) for name in CHATTY_LIBRARIES]
    quiet_levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.WARNING)
    logging.captureWarnings(True)  # Python warnings (e.g. onnxconverter-common's) go the same way
    printed = _LogWriter(logging.getLogger("qprep.toolkit"))
    try:
        with contextlib.redirect_stdout(printed):  # ORT's calibrators print progress with print()
            yield
    finally:
        logging.captureWarnings(False)
        root.handlers, root.level = saved, level
        for logger, saved_level in zip(quiet, quiet_levels):
            logger.setLevel(saved_level)


def detach_log(handler: logging.Handler) -> None:
    logging.getLogger("qprep").removeHandler(handler)
    handler.close()


class _LogWriter:
    """A file-like object that turns print() output into log records, line by line."""

    def __init__(self, logger: logging.Logger):
        self.logger, self.buffer = logger, ""

    def write(self, text: str) -> int:
        self.buffer += text
        *lines, self.buffer = self.buffer.split("\n")
        for line in lines:
            if line.strip():
                self.logger.info(line.rstrip())
        return len(text)

    def flush(self) -> None:
        pass
