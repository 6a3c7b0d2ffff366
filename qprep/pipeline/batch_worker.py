"""One model of a batch in its own process (`python -m qprep run ...`): the isolation every executor shares.

Why a subprocess per model rather than a call: a toolkit that segfaults, hangs or leaks takes down only its own
model, which is recorded with its one-line error. The local pool runs it on a thread of `qprep batch`; Ray runs
it inside a task on whichever node the task lands.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from qprep.errors import EXIT_GATE_MISSED, EXIT_OK, EXIT_USAGE

POLL_S = 1.0  # how soon a cancelled task notices
TERMINATE_GRACE_S = 30  # a stopped model gets this long to write its report after SIGTERM, then SIGKILL
SIDECAR_SUFFIX = ".qprep.yaml"  # NAME.qprep.yaml beside NAME.onnx: merged over the batch config for that model
_PR_SET_PDEATHSIG = 1
BLAS_THREADS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
PARENT_ENV = "QPREP_BATCH_PARENT"  # set for a batch worker: the pid whose death must end it
# set for a batch worker: the --out it runs for; its --force replaces only a run a batch on that --out made
BATCH_ENV = "QPREP_BATCH_OUT"

_live: set[subprocess.Popen] = set()  # workers running now, so an interrupted batch can stop them
_live_lock = threading.Lock()


@dataclass(frozen=True)
class RunSpec:
    """What every model of the batch is run with (plain data: Ray ships it to the nodes)."""
    config_path: str
    sets: tuple[str, ...] = ()
    timeout: float | None = None
    cwd: str | None = None  # the batch's working directory: `--set key=relative/path` resolves against it
    threads: int | None = None  # the config's `threads`: also the worker's BLAS/OpenMP threads (see run_one)
    batch: str | None = None  # the --out's identity (device:inode): what the worker's runs record (BATCH_ENV)


@dataclass(frozen=True)
class Task:
    """One model of the batch and the run directory it gets under --out."""
    name: str
    model: Path
    run_dir: Path


@dataclass(frozen=True)
class Outcome:
    status: str
    seconds: float
    error: str = ""
    note: str = ""  # where it ran and how its results came back, when that is worth saying (Ray)


def sidecar(model: Path) -> Path | None:
    """The model's own overlay (input dims, its samples), when there is one."""
    path = model.with_name(model.name.removesuffix(".onnx") + SIDECAR_SUFFIX)
    try:  # present but no regular file (a FIFO): the run refuses it in one line, not silently without it
        return path if os.path.lexists(path) else None
    except OSError:  # e.g. the name grown past the file system's limit: there can be no such file
        return None


def run_one(spec: RunSpec, model: Path, run_dir: Path) -> tuple[str, float, str]:
    """(status, seconds, one-line error) of `qprep run` on one model into `run_dir`."""
    command = [sys.executable, "-m", "qprep", "run", spec.config_path, "--model", str(model), "--out", str(run_dir),
               "--force", "--quiet"]
    overlay = sidecar(Path(model))
    if overlay:
        command += ["--overlay", str(overlay)]
    for assignment in spec.sets:
        command += ["--set", assignment]
    start = time.perf_counter()
    cwd = spec.cwd if spec.cwd and Path(spec.cwd).is_dir() else None
    env = {**os.environ, PARENT_ENV: str(os.getpid()), **({BATCH_ENV: spec.batch} if spec.batch else {})}
    if spec.threads:  # numpy's BLAS would otherwise start one thread per core in every worker (what Ray does too)
        for name in BLAS_THREADS:
            env.setdefault(name, str(spec.threads))
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
                          env=env) as worker:
        with _live_lock:
            _live.add(worker)
        try:
            stderr = _wait(worker, start, spec.timeout)
            if stderr is None:  # timed out
                _stop(worker)
        except KeyboardInterrupt:  # Ray's cancel of this task: the model still writes its report ("interrupted")
            _stop(worker)
            raise
        finally:
            with _live_lock:
                _live.discard(worker)
    if stderr is None:
        return "failed", time.perf_counter() - start, f"timed out after {spec.timeout:g} s"
    status, error = run_outcome(worker.returncode, stderr)
    return status, time.perf_counter() - start, error


def _wait(worker: subprocess.Popen, start: float, timeout: float | None) -> str | None:
    """The worker's stderr once it exits, or None at the timeout. Waits in short slices: Ray cancels a task by
    raising KeyboardInterrupt in it, which Python delivers only between slices, not inside one blocking wait."""
    while True:
        left = None if timeout is None else timeout - (time.perf_counter() - start)
        if left is not None and left <= 0:
            return None
        try:
            return worker.communicate(timeout=POLL_S if left is None else min(POLL_S, left))[1]
        except subprocess.TimeoutExpired:
            continue


def run_outcome(returncode: int, stderr: str) -> tuple[str, str]:
    """(status, one-line error) the batch summary shows for a `qprep run` that exited with `returncode` after
    writing `stderr`: ok, gate missed (the miss's line), refused (a one-line usage refusal) or failed.

    Public because it is the batch's whole reading of how a worker ended: tests pin it on a captured stderr
    without starting a worker."""
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    error = lines[-1].removeprefix("qprep: error: ") if lines and returncode != EXIT_OK else ""
    if returncode == EXIT_OK:
        return "ok", ""
    if returncode == EXIT_GATE_MISSED:  # the miss's line (what to do about it may follow it)
        missed = next((line for line in reversed(lines) if " missed: " in line), lines[-1] if lines else "")
        return "gate missed", missed.removeprefix("qprep: ")
    if returncode < 0:
        return "failed", f"worker died (signal {-returncode})"
    if returncode == EXIT_USAGE and error:  # a one-line refusal: the model or its config asks for
        return "refused", error              # something qprep does not take, and the line says what
    return "failed", error or f"exit code {returncode}"


def stop_all() -> None:
    """Stop every running worker (an interrupted batch): SIGTERM, so each writes its report, then SIGKILL."""
    with _live_lock:
        workers = list(_live)
    for worker in workers:
        worker.send_signal(signal.SIGTERM)


def _stop(worker: subprocess.Popen) -> None:
    worker.terminate()  # SIGTERM first: the run writes its report ("interrupted") and manifest
    try:
        worker.communicate(timeout=TERMINATE_GRACE_S)
    except subprocess.TimeoutExpired:
        worker.kill()
        worker.communicate()


def die_with_parent() -> None:
    """Called first thing by a batch worker (cli.main). Linux: the worker gets SIGKILL when the process that
    started it dies (a Ray worker lost mid-task), so a retried model never has an orphan still writing into its
    run directory. Set in the child, not with preexec_fn, which can deadlock in a threaded parent."""
    parent = os.environ.pop(PARENT_ENV, None)  # popped: the worker's own subprocesses are not batch workers
    if parent is None or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):  # the parent died before prctl took effect
        os._exit(128 + signal.SIGKILL)
