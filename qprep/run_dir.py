"""The run directory: refusing to overwrite, the log file, and the manifest of what went in and came out.

Every file a run writes lives here (never the caller's current directory) and is listed in manifest.json,
so `--force` can remove exactly the previous run's files and nothing else of the user's.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import shutil
import sys
from importlib import metadata
from pathlib import Path

from qprep import jsonfile
from qprep.errors import RunDirError
from qprep.model_io import atomic_write_text

MANIFEST = "manifest.json"
LOG = "qprep.log"
VERSIONED_PACKAGES = ("qprep", "onnx", "onnxruntime", "numpy", "protobuf", "onnxconverter-common",
                      "rknn-toolkit2", "torch")


def prepare(path: Path, force: bool) -> Path:
    """Create the run directory; a non-empty one needs `force`, which removes the previous run's files."""
    path = Path(path)
    try:
        if path.exists() and not path.is_dir():
            raise RunDirError(f"output directory {path} is a file; choose another --out")
        if path.is_dir() and any(path.iterdir()):
            if not force:
                raise RunDirError(f"output directory {path} is not empty; pass --force to replace the previous "
                                  "run or choose another --out")
            _remove_previous_run(path)
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # e.g. permission denied on it or a folder above it
        raise RunDirError(f"cannot use output directory {path}: {exc.strerror}; choose another --out") from None
    if not os.access(path, os.W_OK | os.X_OK):  # an existing read-only folder: refuse before writing anything
        raise RunDirError(f"cannot use output directory {path}: Permission denied; choose another --out")
    return path


def _remove_previous_run(path: Path) -> None:
    try:
        previous = json.loads((path / MANIFEST).read_text()).get("files", [])
    except (OSError, ValueError):
        previous = []
    for name in [*previous, MANIFEST, LOG]:
        target = (path / name).resolve()
        if path.resolve() not in target.parents:
            continue  # never follow a manifest entry out of the run directory
        if target.is_dir():
            shutil.rmtree(target, ignore_errors=True)
        elif target.exists():
            target.unlink()


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
    terminal; while they run, their records go to the run log instead."""
    root = logging.getLogger()
    run_handlers = logging.getLogger("qprep").handlers
    saved, level = root.handlers[:], root.level
    root.handlers = list(run_handlers)
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)  # Python warnings (e.g. onnxconverter-common's) go the same way
    printed = _LogWriter(logging.getLogger("qprep.toolkit"))
    try:
        with contextlib.redirect_stdout(printed):  # ORT's calibrators print progress with print()
            yield
    finally:
        logging.captureWarnings(False)
        root.handlers, root.level = saved, level


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
