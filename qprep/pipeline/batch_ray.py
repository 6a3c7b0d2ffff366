"""`qprep batch --executor ray`: one Ray task per model, on a Ray cluster.

Ray schedules and recovers; qprep declares what a model needs and ships results. Each task runs the same isolated
worker as the local pool (batch_worker.run_one), with the model's resources declared: CPUs = the config's
`threads`, memory from the model's size, and the custom resource `rknn` when the config converts for RKNN, so
that work lands only on nodes started with it (`ray start --resources='{"rknn": 4}'`). A task whose Ray worker or
node is lost is retried by Ray (`max_retries`); a model that fails on its own (a refusal, a crash of its qprep
process, a timeout) returns that outcome and is not retried.

Storage: the driver leaves a token in --out; a task that reads it writes the run directory there (shared
filesystem); one that does not runs into a temporary folder on its node and returns the run directory's files
(report, deployable, logs; not `work/`), which the driver writes. Inputs (config, models, calibration data) must
be readable at the same path on every node.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from qprep.disk.atomic import atomic_write_bytes
from qprep.disk.owned import MANIFEST
from qprep.errors import Interrupted, QprepError
from qprep.pipeline.batch_worker import TERMINATE_GRACE_S, Outcome, RunSpec, Task, run_one
from qprep.pipeline.run_dir import claim

RETRIES = 2  # Ray re-runs a task this many times after losing its worker process or node
PROBE = ".qprep-batch-token"  # in --out: a node that reads the driver's token shares the driver's storage
NOT_RETURNED = ("work",)  # intermediates stay on the node when results travel back
MEMORY_BASE = 1 << 30  # declared memory per model: 1 GiB + 9 × the model's bytes (BERT-large: 12 GB for 1.34)
MEMORY_PER_MODEL_BYTE = 9


@dataclass
class NodeResult:
    """What a task hands back: the outcome, where it ran, and the run directory's files when not shared."""
    status: str
    seconds: float
    error: str
    node: str
    files: dict[str, bytes] | None = None  # relative path → bytes; None: written on shared storage


def run_on_node(spec: RunSpec, model: str, run_dir: str, probe: str, token: str) -> NodeResult:
    """The body of one Ray task (a plain function, so a test can call it without a cluster)."""
    node = socket.gethostname()
    if not Path(model).is_file():
        return NodeResult("refused", 0.0, f"model not found on node {node} at {model}: inputs must be at the same "
                          "path on every node (a shared filesystem or identical copies)", node)
    if _read(probe) == token:
        return NodeResult(*run_one(spec, Path(model), Path(run_dir)), node)
    with tempfile.TemporaryDirectory(prefix="qprep-ray-") as scratch:
        local = Path(scratch) / Path(run_dir).name
        status, seconds, error = run_one(spec, Path(model), local)
        return NodeResult(status, seconds, error, node, files=collect(local))


def collect(run_dir: Path) -> dict[str, bytes]:
    """The run directory's files worth returning: everything except the intermediates under work/."""
    if not run_dir.is_dir():
        return {}
    return {str(path.relative_to(run_dir)): path.read_bytes() for path in sorted(run_dir.rglob("*"))
            if path.is_file() and path.relative_to(run_dir).parts[0] not in NOT_RETURNED}


def write_returned(run_dir: Path, files: dict[str, bytes]) -> None:
    """The driver's copy of a run directory a node sent back, replacing an older one exactly as `run --force`
    would: claimed first, so a folder of the user's named like the model is refused, never removed."""
    claimed = claim(run_dir, force=True)
    try:
        for relative, data in files.items():
            if relative != MANIFEST:
                atomic_write_bytes(run_dir / relative, data)
        if MANIFEST in files:  # the node's manifest, proving this folder (not the node's) the run's
            manifest = json.loads(files[MANIFEST])
            claimed.run_id = manifest.get("run_id", claimed.run_id)
            claimed.write_manifest(manifest)
    finally:
        claimed.release()


class RayCluster:
    name = "ray"

    def __init__(self, address: str | None, base, out: Path, quiet: bool):
        self._ray = _import_ray()
        self._out, self._pending, self._token = out, {}, secrets.token_hex(8)
        self._storage = {"shared": 0, "returned": 0}
        dashboard = self._connect(address)
        nodes = [n["Resources"] for n in self._ray.nodes() if n.get("Alive")]
        if any(n == "quantize" and o.backend == "rknn" for n, o in base.stages):
            if not any(node.get("rknn") for node in nodes):
                self._ray.shutdown()
                raise QprepError("batch --executor ray: the config converts for RKNN but no node of the cluster "
                                 "declares the `rknn` resource; start nodes that have rknn-toolkit2 with "
                                 "`ray start ... --resources='{\"rknn\": 4}'`")
            self._resources = {"rknn": 1}
        else:
            self._resources = {}
        # a model asking for more CPUs or memory than any one node has would wait forever: capped at the largest
        self._cpus = max(1, min(base["threads"], int(max(node.get("CPU", 0) for node in nodes))))
        self._memory_cap = max(node.get("memory", 0) for node in nodes)
        total_cpus = int(sum(node.get("CPU", 0) for node in nodes))
        self.slots = max(1, total_cpus // self._cpus)
        self._cluster = (f"Ray cluster {address or '(started here)'}: {len(nodes)} node{'s' if len(nodes) > 1 else ''}"
                         f", {total_cpus} CPUs, {self._cpus} per model")
        if dashboard and not quiet:
            print(f"qprep batch: Ray dashboard http://{dashboard}", file=sys.stderr, flush=True)

    def _connect(self, address: str | None) -> str:
        """Join the cluster at `address`, or start a Ray instance of our own on this machine (with the `rknn`
        resource when the toolkit is installed here); returns the dashboard's address, if any."""
        ray = self._ray
        options = {"logging_level": "ERROR", "log_to_driver": False}
        saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        try:
            if address:
                context = ray.init(address=address, **options)
            else:
                context = ray.init(address="local", resources={"rknn": os.cpu_count() or 1} if _has_rknn() else {},
                                   **options)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise QprepError(f"batch --executor ray: cannot reach the Ray cluster at {address or 'this machine'} "
                             f"({str(exc).splitlines()[0]}); start one with `ray start --head` or check "
                             "--address") from None
        finally:  # ray.init installs its own SIGTERM handler (exit without a summary): qprep's stays in charge
            self._keep_handlers(saved)
        return getattr(context, "dashboard_url", "") or ""

    @property
    def where(self) -> str:
        shared, returned = self._storage["shared"], self._storage["returned"]
        ways = ([f"{shared} written by the nodes on shared storage"] if shared else []) + \
               ([f"{returned} returned by their nodes and written here"] if returned else [])
        return self._cluster + (f"; results: {', '.join(ways)}" if ways else "")

    def results(self, spec: RunSpec, tasks: Iterable[Task]) -> Iterator[tuple[Task, Outcome]]:
        ray = self._ray
        remote = ray.remote(run_on_node)
        probe = self._out / PROBE
        probe.write_text(self._token)
        for task in tasks:
            options = {"num_cpus": self._cpus, "max_retries": RETRIES, "retry_exceptions": False,
                       "resources": self._resources, "name": f"qprep {task.name}"}
            memory = self._memory(task.model)
            if memory:
                options["memory"] = memory
            ref = remote.options(**options).remote(spec, str(task.model), str(task.run_dir), str(probe),
                                                   self._token)
            self._pending[ref] = task
        while self._pending:
            try:
                [ref], _ = ray.wait(list(self._pending), num_returns=1)
            except KeyboardInterrupt:  # Ray turns a SIGTERM raised inside its wait into a plain Ctrl-C
                if self._signal:
                    raise Interrupted(self._signal) from None
                raise
            task = self._pending.pop(ref)
            yield task, self._outcome(ref, task)

    def cancel(self) -> list[tuple[Task, Outcome]]:
        """Interrupted: queued tasks are dropped; running ones get KeyboardInterrupt, so their model is stopped
        with SIGTERM and writes its report (on shared storage) before the task ends. Returns the outcomes of the
        tasks that finished meanwhile."""
        ray = self._ray
        for ref in self._pending:
            ray.cancel(ref)
        if not self._pending:
            return []
        ready, _ = ray.wait(list(self._pending), num_returns=len(self._pending), timeout=TERMINATE_GRACE_S + 5)
        ended = []
        for ref in ready:
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.TaskCancelledError:
                continue
            except ray.exceptions.RayError:
                pass
            ended.append((self._pending[ref], self._outcome(ref, self._pending[ref])))
        return ended

    def close(self) -> None:
        self._ray.shutdown()
        (self._out / PROBE).unlink(missing_ok=True)

    def _keep_handlers(self, saved: dict) -> None:
        """qprep's handlers back after ray.init, SIGTERM/SIGHUP remembered so the exit code can name them."""
        self._signal = None
        if threading.current_thread() is not threading.main_thread():
            return

        def remembering(handler):
            def remember(signum, frame):
                self._signal = signum
                handler(signum, frame)
            return remember

        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, remembering(handler) if callable(handler) else handler)

    def _outcome(self, ref, task: Task) -> Outcome:
        ray = self._ray
        try:
            result: NodeResult = ray.get(ref)
        except ray.exceptions.RayTaskError as exc:  # qprep's own code raised on the node: that model only
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            return Outcome("failed", 0.0, f"task raised {type(cause).__name__}: {str(cause).splitlines()[0]}")
        except ray.exceptions.RayError as exc:  # worker or node lost more than RETRIES times, or cancelled
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return Outcome("failed", 0.0, f"Ray gave up after {RETRIES + 1} attempts: {first}")
        if result.files is None:
            self._storage["shared"] += 1
            return Outcome(result.status, result.seconds, result.error, f"node {result.node}")
        try:
            write_returned(task.run_dir, result.files)
        except QprepError as exc:  # the driver's run directory is not the batch's to write
            return Outcome("refused", result.seconds, str(exc), f"node {result.node}")
        self._storage["returned"] += 1
        return Outcome(result.status, result.seconds, result.error,
                       f"node {result.node}; results returned ({sum(map(len, result.files.values())) >> 20} MB)")

    def _memory(self, model: Path) -> int:
        """Memory to declare for one model, at most what the biggest node has (or Ray would never place it)."""
        try:
            size = model_bytes(model)
        except OSError:
            return 0
        return int(min(MEMORY_BASE + MEMORY_PER_MODEL_BYTE * size, self._memory_cap))


def model_bytes(model: Path) -> int:
    """The model file and the external-data files beside it that it names."""
    size = model.stat().st_size
    if size > 64 << 20:  # weights inside: the file is the model
        return size
    import onnx

    from qprep.third_party import all_tensors

    try:
        proto = onnx.load(str(model), load_external_data=False)
    except Exception:  # noqa: BLE001 - an unreadable model is refused by its own run; its size is the file
        return size
    locations = {entry.value for tensor in all_tensors(proto) for entry in tensor.external_data
                 if entry.key == "location"}
    return size + sum((model.parent / name).stat().st_size for name in locations
                      if (model.parent / name).is_file())


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def _has_rknn() -> bool:
    import importlib.util

    return importlib.util.find_spec("rknn") is not None


def _import_ray():
    try:
        import ray
    except ImportError:
        raise QprepError("batch --executor ray: Ray is not installed; pip install 'qprep[ray]' (or run "
                         "./scripts/setup.sh), or use --executor local") from None
    return ray
