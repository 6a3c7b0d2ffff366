"""The run directory: claiming it, the log file, and the manifest of what went in and came out.

Every file a run writes lives here (never the caller's current directory) and is listed in manifest.json,
so `--force` can remove exactly the previous run's files and nothing else of the user's (qprep/disk/owned.py
proves the ownership and holds the lock: one run at a time per run directory).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import signal
import sys
from importlib import metadata
from pathlib import Path

from qprep.disk import owned
from qprep.disk.owned import MANIFEST
from qprep.disk.reading import read_json
from qprep.pipeline.batch_worker import BATCH_ENV
from qprep.errors import RunDirError, signal_handlers
from qprep.run_log import LOG

VERSIONED_PACKAGES = ("qprep", "onnx", "onnxruntime", "numpy", "protobuf", "onnxconverter-common",
                      "rknn-toolkit2", "torch")


# Every name a run may write at the top of its run directory (artifacts are added as they come, run.will_write):
# listed in the manifest before the run writes any, so even a run killed outright is one `--force` can replace.
OWN_FILES = ("model.onnx", "model.onnx.data", "report.json", "report.md", "report.html", MANIFEST, LOG)
# Folders a run makes at the top of its run directory: reserved (a user's folder of that name is not taken over),
# listed by what the run puts in them (a stage's work/<name>/ as it is made, each saved stage model), never whole.
OWN_FOLDERS = ("work", "stages")


def claim(path: Path, force: bool, artifacts: tuple[str, ...] = ()) -> owned.Owned:
    """Lock the run directory and prove it is free: new, empty, or a previous run's (its manifest), which
    `force` replaces by removing exactly what that manifest lists. Anything else is refused, leaving the
    folder as it was. `artifacts`: what the stages add beside OWN_FILES (model.rknn)."""
    names = (*OWN_FILES, *artifacts)
    run = owned.claim(path, "run", "--out", reserved=(*names, *OWN_FOLDERS))
    run.batch = os.environ.get(BATCH_ENV)  # a batch worker (always --force): it replaces only its batches' runs
    try:
        if run.previous is not None and not force:
            raise RunDirError(f"output directory {path} holds a previous qprep run; pass --force to replace it "
                              "or choose another --out")
        if run.previous is not None and run.batch and run.previous.get("batch") != run.batch:
            raise RunDirError(f"{path} holds a qprep run this batch's --out did not make (run there by hand?); the "
                              "batch leaves it: move it out, or give the batch another --out")
        if run.previous is not None:
            run.clear_previous()
        run.write_manifest({"status": "running", "pid": os.getpid(),
                            "files": [*names, *(f"{name}/" for name in OWN_FOLDERS)]})
    except OSError as exc:
        run.release()
        raise RunDirError(f"cannot use output directory {path}: {exc.strerror}; choose another --out") from None
    except BaseException:
        run.release()
        raise
    return run


@contextlib.contextmanager
def deferred_signals():
    """Ctrl-C and SIGTERM ignored while the final report and manifest are written (well under a second):
    a second Ctrl-C must not leave a run without its record."""
    with signal_handlers(signal.SIG_IGN, signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        yield


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


def fingerprint(path: str | os.PathLike) -> str | None:
    """A cheap mark of a file's or folder's state (each file's name, size and modification time): what
    `batch --resume` compares before reusing a result, so data edited in place since the run is run again.
    None: nothing readable there."""
    entries = []
    try:
        if not os.path.isdir(path):
            info = os.stat(path)
            return f"{info.st_size}:{info.st_mtime_ns}"
        for folder, _, files in os.walk(path):
            for name in files:
                where = os.path.join(folder, name)
                info = os.stat(where)
                entries.append(f"{os.path.relpath(where, path)}\0{info.st_size}:{info.st_mtime_ns}")
    except OSError:
        return None
    return hashlib.sha256("\n".join(sorted(entries)).encode("utf-8", "surrogateescape")).hexdigest()


def changed_inputs(manifest: dict) -> list[str]:
    """The inputs a run recorded (`read_state`) whose state differs now."""
    recorded = manifest.get("read_state")
    return [path for path, mark in (recorded.items() if isinstance(recorded, dict) else ())
            if fingerprint(path) != mark]


def files_inside(directory: Path, names: list[str]) -> list[str]:
    """`names` with each real folder among them (work/, stages/) replaced by the files and links inside it, and
    its empty folders as `dir/` (removed only while still empty): the final manifest lists what the run wrote
    there, so `--force` leaves a file the user added to work/ (folders are pruned as their last file goes)."""
    listed = []
    for name in names:
        top = directory / name
        if not top.is_dir() or top.is_symlink():
            listed.append(name)
            continue
        for folder, subfolders, files in os.walk(top):
            base = Path(folder).relative_to(directory)
            listed.append(f"{base}/")  # each folder it holds: removed once empty, so no empty one is left over
            listed += [str(base / entry) for entry in files]
            listed += [str(base / entry) for entry in subfolders if (Path(folder) / entry).is_symlink()]
    return listed


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
    read = manifest.get("read")
    found.update({f"the run's {what}": where for what, where in (read.items() if isinstance(read, dict) else ())})
    return {what: where for what, where in found.items() if isinstance(where, str) and where}
