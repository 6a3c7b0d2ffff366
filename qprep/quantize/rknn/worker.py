"""rknn-toolkit2 in a worker process, so that its crashes are not qprep's.

Why: the toolkit aborts the whole process from C++ on some inputs (SIGABRT, "Can not find quantize
information!" on a model with no float tensor), and a process that is killed writes no report and prints
nothing. In a worker, a crash is an EOF on the pipe that the parent turns into one line, and the run still
writes its failed report and manifest.

The worker (`serve`) owns the RKNN objects and hands out integer handles. It runs in the work folder with fds
1/2 on the toolkit log: the toolkit prints from C++ straight to the fds and writes its working files into the
current directory, so nothing has to be redirected per call in the parent. Requests are
`(kind, handle, name, args, kwargs)` over a multiprocessing Connection (numpy arrays pickle): "new" an RKNN
object, "call" one of its methods, "apply" a module-level function to it (how rknn_ranges reads the toolkit's
private table), "release".

It is a fresh interpreter (`python -m qprep.quantize.rknn.worker`), not a fork: the parent has ONNX Runtime
thread pools, which a fork would copy mid-state. Not multiprocessing's "spawn" either: spawn re-runs the
parent's main script in the child, so `qprep.run()` from a script without an `if __name__ == "__main__"` guard
would fail, and its resource tracker would print the semaphores a crashed worker leaked onto the terminal.
One worker per RknnBuilder: starting costs seconds, mostly `import rknn.api` importing torch. It must not outlive
qprep: it asks the kernel for SIGKILL when its parent dies (PR_SET_PDEATHSIG; strictly, when the parent thread
that started it ends: qprep starts it from the thread that runs the pipeline), ignores SIGINT (a Ctrl-C
reaches the whole process group; the parent decides and stops it) and exits when the pipe closes.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
import socket
import subprocess
import sys
import weakref
from multiprocessing.connection import Connection
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_ROOT = Path(__file__).resolve().parents[2]  # the folder holding the qprep package, for the worker's imports


class WorkerDied(Exception):
    """The worker process is gone: `how` says by which signal (or exit status)."""

    def __init__(self, how: str):
        super().__init__(how)
        self.how = how


class NotInstalled(Exception):
    """`import rknn.api` failed in the worker; the message is the ImportError's."""


class Worker:
    """The parent's side: starts the worker, sends requests, raises what the toolkit raised, and stops it."""

    def __init__(self, work_dir: Path, log_path: Path):
        ours, theirs = socket.socketpair()
        paths = [str(_ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "qprep.quantize.rknn.worker", str(theirs.fileno()), str(os.getpid())],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd=work_dir, pass_fds=[theirs.fileno()],
                env={**os.environ, "PYTHONPATH": os.pathsep.join(paths)})
        theirs.close()
        self._conn = Connection(ours.detach())
        self._ready = False
        self._busy = False  # a request is in flight: stopping must not wait for an answer
        # tests and API users may drop a builder without closing it: stop the worker when it is collected
        self._finalizer = weakref.finalize(self, _stop, self.process, self._conn)

    @property
    def pid(self) -> int:
        return self.process.pid

    def request(self, kind: str, handle: int | None = None, name=None, args: tuple = (), kwargs: dict | None = None):
        """One request → its result; re-raises the toolkit's exception; WorkerDied when the worker is gone."""
        self._wait_ready()
        try:
            self._conn.send((kind, handle, name, args, kwargs or {}))
        except OSError:  # BrokenPipeError: it died between requests
            raise WorkerDied(self._death()) from None
        ok, value = self._receive()
        if not ok:
            raise value
        return value

    def _wait_ready(self) -> None:
        if not self._ready:
            ok, value = self._receive()
            if not ok:
                raise NotInstalled(value)
            self._ready = True

    def _receive(self):
        self._busy = True
        try:
            reply = self._conn.recv()
        except (EOFError, OSError):
            raise WorkerDied(self._death()) from None
        self._busy = False
        return reply

    def _death(self) -> str:
        try:
            code = self.process.wait(10)
        except subprocess.TimeoutExpired:
            return "closed its pipe"
        if code < 0:
            try:
                return signal.Signals(-code).name
            except ValueError:
                return f"signal {-code}"
        return f"exit status {code}"

    def close(self) -> None:
        """Release every RKNN object and stop (wait); a busy or stuck worker is terminated, then killed."""
        if self._busy:  # interrupted mid-request: the answer would never be read
            self.process.terminate()
        self._finalizer()


def _stop(process: subprocess.Popen, conn: Connection, timeout: float = 30) -> None:
    try:
        conn.send(None)  # the worker releases its RKNN objects and returns
    except OSError:
        pass
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.terminate()
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    conn.close()


def serve(conn: Connection, parent: int) -> None:
    """The worker's loop (in the child process, started in the work folder with fds 1/2 on the toolkit log)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the death signal was armed
        return
    try:
        from rknn.api import RKNN
    except ImportError as exc:
        conn.send((False, str(exc)))
        return
    conn.send((True, None))
    objects: dict[int, object] = {}
    handles = iter(range(1, sys.maxsize))
    while True:
        try:
            request = conn.recv()
        except EOFError:  # the parent is gone
            break
        if request is None:
            break
        kind, handle, name, args, kwargs = request
        try:
            if kind == "new":
                handle = next(handles)
                objects[handle] = RKNN(verbose=False)
                reply = (True, handle)
            elif kind == "call":
                reply = (True, getattr(objects[handle], name)(*args, **kwargs))
            elif kind == "apply":
                reply = (True, name(objects[handle], *args, **kwargs))
            elif kind == "release":
                objects.pop(handle).release()
                reply = (True, None)
            else:
                raise ValueError(f"unknown request {kind!r}")
        except Exception as exc:  # noqa: BLE001 - the parent turns the toolkit's exceptions into errors
            reply = (False, _portable(exc))
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            conn.send(reply)
        except Exception as exc:  # noqa: BLE001 - a result that does not pickle
            conn.send((False, RuntimeError(f"{type(exc).__name__}: {exc}")))
    for rknn in objects.values():
        rknn.release()
    sys.stdout.flush()
    sys.stderr.flush()


def _portable(exc: Exception) -> Exception:
    """The exception itself when it survives pickling (the toolkit raises bare ValueError/KeyError), else a
    RuntimeError with its type and message."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(exc).__name__}: {exc}")


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])), int(sys.argv[2]))
