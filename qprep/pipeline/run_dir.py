"""The run directory: claiming it, the log file, and the manifest of what went in and came out.

Every file a run writes lives here (never the caller's current directory) and is listed in manifest.json,
so `--force` can remove exactly the previous run's files and nothing else of the user's (qprep/disk/owned.py
proves the ownership and holds the lock: one run at a time per run directory).
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import signal
import sys
from importlib import metadata
from pathlib import Path

from qprep.disk import owned
from qprep.disk.owned import MANIFEST
from qprep.disk.reading import read_json
from qprep.errors import RunDirError, signal_handlers

LOG = "qprep.log"
VERSIONED_PACKAGES = ("qprep", "onnx", "onnxruntime", "numpy", "protobuf", "onnxconverter-common",
                      "rknn-toolkit2", "torch")


# Every name a run may write at the top of its run directory (artifacts are added as they come, run.will_write):
# listed in the manifest before the run writes any, so even a run killed outright is one `--force` can replace.
OWN_FILES = ("model.onnx", "model.onnx.data", "report.json", "report.md", "report.html", MANIFEST, LOG, "work",
             "stages")


def claim(path: Path, force: bool, artifacts: tuple[str, ...] = ()) -> owned.Owned:
    """Lock the run directory and prove it is free: new, empty, or a previous run's (its manifest), which
    `force` replaces by removing exactly what that manifest lists. Anything else is refused, leaving the
    folder as it was. `artifacts`: what the stages add beside OWN_FILES (model.rknn)."""
    names = (*OWN_FILES, *artifacts)
    run = owned.claim(path, "run", "--out", reserved=names)
    try:
        if run.previous is not None and not force:
            raise RunDirError(f"output directory {path} holds a previous qprep run; pass --force to replace it "
                              "or choose another --out")
        if run.previous is not None:
            run.clear_previous()
        run.write_manifest({"status": "running", "pid": os.getpid(), "files": list(names)})
    except OSError as exc:
        run.release()
        raise RunDirError(f"cannot use output directory {path}: {exc.strerror}; choose another --out") from None
    except BaseException:
        run.release()
        raise
    return run


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


@contextlib.contextmanager
def deferred_signals():
    """Ctrl-C and SIGTERM ignored while the final report and manifest are written (well under a second):
    a second Ctrl-C must not leave a run without its record."""
    with signal_handlers(signal.SIG_IGN, signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        yield


def detach_log(handler: logging.Handler) -> None:
    logging.getLogger("qprep").removeHandler(handler)
    handler.close()


def versions() -> dict[str, str | None]:
    found = {"python": platform.python_version()}
    for name in VERSIONED_PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def write_manifest(run: owned.Owned, manifest: dict) -> None:
    """The run's final manifest: what went in, what came out (`files`: what `--force` may remove)."""
    run.write_manifest({"command": sys.argv, **manifest, "versions": versions()})


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


def recorded_inputs(path: Path) -> dict[str, str]:
    """What a finished run read, from its manifest (described → path): what a command reading the run (evaluate)
    must not write over either. Read as it is, proven or not (a copied run protects its inputs too); empty for a
    folder without a manifest (the command refuses it itself)."""
    try:
        manifest = read_json(path / MANIFEST)
    except (OSError, ValueError, UnicodeDecodeError):
        manifest = {}
    if not isinstance(manifest, dict):
        manifest = {}
    inputs, config = manifest.get("inputs") or {}, manifest.get("config") or {}
    found = {f"the run's {what}": (inputs.get(what) or {}).get("path")
             for what in ("model", "config", "overlay", "reference_model")}
    model = (inputs.get("model") or {}).get("path")
    for location in ((inputs.get("model") or {}).get("data_files") or {}) if isinstance(model, str) else ():
        found[f"the run's model's external data {location}"] = str(Path(model).parent / location)
    for role in ("calibration", "evaluation"):
        found[f"the run's {role} data"] = (config.get(role) or {}).get("source")
    return {what: where for what, where in found.items() if isinstance(where, str) and where}
