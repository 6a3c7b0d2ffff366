"""The run directory: refusing to overwrite, the log file, and the manifest of what went in and came out.

Every file a run writes lives here (never the caller's current directory) and is listed in manifest.json,
so `--force` can remove exactly the previous run's files and nothing else of the user's. One run at a time
uses a run directory: it holds an flock on `.qprep.lock` inside it while it runs.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import platform
import re
import shutil
import signal
import sys
from importlib import metadata
from pathlib import Path

from qprep import jsonfile
from qprep.errors import RunDirError, signal_handlers
from qprep.model.io import atomic_write_text

MANIFEST = "manifest.json"
LOG = "qprep.log"
VERSIONED_PACKAGES = ("qprep", "onnx", "onnxruntime", "numpy", "protobuf", "onnxconverter-common",
                      "rknn-toolkit2", "torch")


LOCK = ".qprep.lock"
# What a run writes besides the files its manifest lists: removed by --force even when the manifest is missing
# or corrupt (a run killed with SIGKILL writes none).
OWN_FILES = ("model.onnx", "model.onnx.data", "report.json", "report.md", "report.html", MANIFEST, LOG, "work")
STAGE_FILE = re.compile(r"^\d{2}_\w+\.onnx(\.data)?$")  # stages/<index>_<stage>.onnx


class RunLock:
    """An exclusive flock on <run dir>/.qprep.lock, held for the whole run; the kernel releases it when the
    process ends however it ends (SIGKILL included), so a stale lock cannot block the next run."""

    def __init__(self, fd: int):
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def claim(path: Path, force: bool) -> tuple[Path, RunLock]:
    """Lock the run directory (created if needed), then check it is free to use: a non-empty one needs
    `force`, which removes the previous run's files; a folder that holds no qprep run is never cleared."""
    path = Path(path)
    try:
        if path.exists() and not path.is_dir():
            raise RunDirError(f"output directory {path} is a file; choose another --out")
        path.mkdir(parents=True, exist_ok=True)
        was_run_dir = any((path / name).exists() for name in (LOCK, MANIFEST, LOG))
        if not os.access(path, os.W_OK | os.X_OK):  # an existing read-only folder: refuse before writing
            raise PermissionError(13, "Permission denied")
        fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:  # e.g. permission denied on it or a folder above it
        raise RunDirError(f"cannot use output directory {path}: {exc.strerror}; choose another --out") from None
    lock = RunLock(fd)
    try:
        _take(fd, path)
        entries = [p for p in path.iterdir() if p.name != LOCK]
        if entries and not force:
            raise RunDirError(f"output directory {path} is not empty; pass --force to replace the previous run "
                              "or choose another --out")
        if entries and not was_run_dir:
            raise RunDirError(f"output directory {path} holds files that are not a qprep run (no {MANIFEST} or "
                              f"{LOG}); --force only replaces a previous run: choose another --out")
        if entries:
            _remove_previous_run(path)
    except OSError as exc:
        lock.release()
        raise RunDirError(f"cannot use output directory {path}: {exc.strerror}; choose another --out") from None
    except BaseException:
        lock.release()
        raise
    return path, lock


def _take(fd: int, path: Path) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        raise RunDirError(f"output directory {path} is in use by pid {holder} (another qprep run); wait for it "
                          "to finish or choose another --out") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)


def _remove_previous_run(path: Path) -> None:
    try:
        listed = json.loads((path / MANIFEST).read_text()).get("files", [])
        listed = [name for name in listed if isinstance(name, str)]
    except (OSError, ValueError, AttributeError):
        listed = []
    stages = path / "stages"
    staged = [f"stages/{p.name}" for p in stages.iterdir() if STAGE_FILE.match(p.name)] if stages.is_dir() else []
    root = path.resolve()
    for name in dict.fromkeys([*listed, *OWN_FILES, *staged]):
        target = (path / name).resolve()
        if root not in target.parents:
            continue  # never follow a manifest entry out of the run directory
        if target.is_dir():
            shutil.rmtree(target, ignore_errors=True)
        elif target.exists():
            target.unlink()
        parent = target.parent
        while parent != root and parent.is_dir() and not any(parent.iterdir()):
            parent.rmdir()  # a folder the previous run made and that is now empty (stages/)
            parent = parent.parent


# Libraries whose INFO records (one line per pass over the graph) drowned the run log: warnings only.
CHATTY_LIBRARIES = ("onnx_ir", "onnxscript")


def attach_log(path: Path) -> logging.Handler:
    """Send the `qprep` logger (and toolkits we capture) to <run dir>/qprep.log."""
    handler = logging.FileHandler(path / LOG, encoding="utf-8")
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


def write_manifest(path: Path, manifest: dict) -> None:
    manifest = {"command": sys.argv, **manifest, "versions": versions()}
    atomic_write_text(path / MANIFEST, jsonfile.dumps(manifest) + "\n")


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
