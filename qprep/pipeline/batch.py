"""`qprep batch CONFIG DIR`: one config over a folder of models, each in its own process and run directory.

Each model runs isolated (batch_worker.py) on an executor: the local pool (batch_local.py, the default) or a Ray
cluster (batch_ray.py). Every finished model's run directory is complete on disk, so a killed batch loses
nothing and `--resume` picks up where it stopped, whichever executor ran it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from qprep import jsonfile
from qprep.config import load_config, run_overrides
from qprep.disk import owned
from qprep.disk.atomic import atomic_write_text
from qprep.disk.guard import Guard
from qprep.disk.reading import read_json, require_regular_file, special_kind
from qprep.errors import EXIT_GATE_MISSED, EXIT_OK, EXIT_USAGE, QprepError, signal_handlers
from qprep.model.info import unique_name
from qprep.model.io import sha256_file
from qprep.pipeline.batch_worker import RunSpec, Task, sidecar
from qprep.pipeline.preflight import input_paths
from qprep.pipeline.run_dir import changed_inputs
from qprep.report.summary import render_summary_csv, render_summary_html, render_summary_md, summary_row

SUMMARY_FILES = ("summary.json", "summary.csv", "summary.md", "summary.html")
# Names of the batch's own at the top of --out: no model's run directory may take one (`summary.json.onnx`).
BATCH_FILES = (*SUMMARY_FILES, owned.MANIFEST, ".qprep-batch-token")
STATUSES = ("ok", "gate missed", "refused", "failed")  # refused: a one-line QprepError (exit 2) naming what is not taken
CANCELLED = "cancelled: the batch was interrupted before this model finished; rerun with --resume"


def dir_name(name: str, used: set[str]) -> str:
    """`a/b.onnx` → `a__b`; a second model mapping to a taken name (`a__b.onnx`) gets `a__b-2`, so two models
    never share a run directory."""
    return unique_name(name.removesuffix(".onnx").replace(os.sep, "__"), used, separator="-")


def _onnx_entries(folder: Path, recursive: bool, skipped: dict[str, str]) -> list[Path]:
    """The entries named *.onnx, sorted; with `recursive`, in every subfolder too (not through symlinked folders,
    as before). A subfolder that cannot be listed is put in `skipped` with why, never passed over in silence: its
    models would be missing from the summary with nothing to say so."""
    if not recursive:
        return sorted(folder.glob("*.onnx"))
    found = []

    def unreadable(error: OSError) -> None:
        where = Path(error.filename)
        name = str(where.relative_to(folder)) if folder in where.parents else str(where)
        skipped[name + os.sep] = f"a folder that cannot be listed ({error.strerror}); its models were not looked for"

    for top, dirs, files in os.walk(folder, onerror=unreadable):
        found += [Path(top) / name for name in files + dirs if name.endswith(".onnx")]
    return sorted(found)


def find_models(folder: Path, recursive: bool) -> tuple[list[Path], dict[str, str]]:
    """The models to run, and the entries named *.onnx skipped with why (a FIFO would block the batch on its
    first read, a device or socket is no model)."""
    if not folder.is_dir():
        raise QprepError(f"batch: model folder not found: {folder}")
    if not os.access(folder, os.R_OK | os.X_OK):  # else it would read as a folder without models
        raise QprepError(f"batch: cannot list the model folder {folder} (permission denied); give this user access")
    models, skipped = [], {}
    for entry in _onnx_entries(folder, recursive, skipped):
        if entry.name.startswith("."):  # an editor's or OS's file, as a rule: named, not run
            skipped[str(entry.relative_to(folder))] = "a hidden file (its name starts with '.'); rename it to run it"
            continue
        try:
            kind = special_kind(os.stat(entry).st_mode)  # through a symlink: what would be read
        except OSError:
            kind = None  # dangling or looping: refused with its own row when read
        if kind:
            skipped[str(entry.relative_to(folder))] = f"{kind}, not a model file"
        else:
            models.append(entry)
    if not models:
        hidden = f" (skipped: {', '.join(sorted(skipped))})" if skipped else ""
        raise QprepError(f"batch: no .onnx files to run in {folder}{hidden}{'' if recursive else ' (try --recursive)'}")
    return models, skipped


def default_jobs(threads: int) -> int:
    """As many workers as cores allow at `threads` ORT threads each, and at most one per 4 GB of memory."""
    cores = os.cpu_count() or 1
    try:
        memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES") / 2**30
    except (ValueError, OSError):
        memory_gb = 8
    return max(1, min(cores // max(threads, 1), int(memory_gb // 4)))


def run_batch(config_path: str, folder: str, out: str, jobs: int | None = None, recursive: bool = False,
              resume: bool = False, timeout: float | None = None, sets: list[str] = (), quiet: bool = False,
              executor: str = "local", address: str | None = None, guard: Guard | None = None) -> dict:
    """Every model of `folder` into its run directory under `out`, the summary after each (and on any
    interrupt); `out` is claimed for the whole batch (one batch at a time per --out)."""
    if jobs is not None and jobs < 1:
        raise QprepError(f"batch --jobs {jobs}: needs at least 1 worker; omit --jobs for a default from cores "
                         "and memory")
    if address and executor != "ray":
        raise QprepError("batch --address: only the Ray executor joins a cluster; add --executor ray")
    folder_path, out_path = Path(folder).resolve(), Path(out).resolve()
    guard = guard or Guard()
    guard.add_inputs({"the config": config_path, "the models folder": folder})
    guard.output_folder(out, "batch --out")
    models, skipped = find_models(folder_path, recursive)
    base = load_config(config_path, run_overrides(sets, models[0], out_path / "_check"))  # threads, backend
    guard.add_inputs(input_paths(base))  # the config's data, labels, reference: --out must hold none of them
    for model in models:  # and the data each model's own overlay names
        guard.add_inputs(_overlay_inputs(config_path, sets, model, out_path))
    guard.output_folder(out, "batch --out")
    for name, why in skipped.items():
        if not quiet:
            print(f"qprep batch: skipped {name}: {why}", file=sys.stderr, flush=True)
    claimed = owned.claim(out_path, "batch", "batch --out", reserved=BATCH_FILES)
    state = _Batch(claimed.path, skipped, executor)
    ended = "interrupted"
    try:
        batch = ":".join(map(str, owned.folder_identity(claimed.path)))
        _plan(state, claimed, config_path, folder_path, models, sets, batch if resume else None, quiet)
        summary = _run(state, RunSpec(str(Path(config_path).resolve()), tuple(sets), timeout, os.getcwd(),
                                      base["threads"], batch), len(models), jobs, base, address, quiet)
        ended = "finished"
        return summary
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM, wherever it came: stop what runs, keep what finished
        with _signals_deferred():  # a second Ctrl-C must not cost the summary: it is written first, then kept
            state.cancelled()
            state.write()
        if state.pool:  # (further Ctrl-C only print a line: errors.InterruptOnce, set by cli.main)
            for task, outcome in state.pool.cancel():  # the running models write their reports (SIGTERM)
                state.finished(task, outcome)
            with _signals_deferred():
                state.write()
        raise
    finally:
        with _signals_deferred():
            if state.pool:
                state.pool.close()
            if state.manifest:  # the batch's own record says how it ended, not "running" for ever
                claimed.write_manifest({**state.manifest, "status": ended, "pid": None})
            claimed.release()


@dataclass
class _Batch:
    """A batch as it goes: the summary's rows so far, the models still to run, the executor once started."""

    out: Path
    skipped: dict[str, str]
    executor: str
    rows: dict[str, dict] = field(default_factory=dict)
    twins: dict[str, Path] = field(default_factory=dict)
    tasks: list[Task] = field(default_factory=list)
    pool: object = None
    manifest: dict = field(default_factory=dict)  # the batch's manifest as written when it started

    def finished(self, task: Task, outcome) -> None:
        self.rows[task.name] = summary_row(task.name, task.run_dir, seconds=outcome.seconds, error=outcome.error,
                                           status=outcome.status, note=outcome.note)

    def cancelled(self) -> None:
        for task in self.tasks:
            self.rows.setdefault(task.name, summary_row(task.name, task.run_dir, seconds=None, error=CANCELLED,
                                                        status="failed"))

    def write(self) -> dict:
        where = (self.pool.name, self.pool.where) if self.pool else (self.executor, "not started")
        return _write_summary(self.out, self.rows, self.twins, where, self.skipped)


def _plan(state: _Batch, claimed: owned.Owned, config_path: str, folder_path: Path, models: list[Path], sets,
          resume: str | None, quiet: bool) -> None:
    """Each model's row (unreadable, duplicate, resumed) or task; then the batch's manifest lists every run
    directory it may write before any is."""
    used_dirs: set[str] = set(BATCH_FILES)
    for model in models:
        name = str(model.relative_to(folder_path))
        try:
            digest = sha256_file(require_regular_file(model, "this entry", fix="fix it or move it out of the folder"))
        except (QprepError, OSError) as exc:  # a symlink loop, a folder named *.onnx, no permission: it fails alone
            state.rows[name] = _refused_row(name, str(exc) if isinstance(exc, QprepError) else
                                            f"this entry cannot be read ({exc.strerror}); fix it or move it out of "
                                            "the folder")
            if not quiet:
                print(f"qprep batch: {name}: refused — {state.rows[name]['error']}", file=sys.stderr, flush=True)
            continue
        overlay = sidecar(model)  # the same bytes with other settings of their own are another run, not a twin
        twin_key = digest + (":" + sha256_file(overlay) if overlay and overlay.is_file() else "")
        if twin_key in state.twins:
            twin = state.twins[twin_key]
            state.rows[name] = {"model": name, "status": "duplicate", "note": f"identical to {twin}", "twin": str(twin)}
            continue
        state.twins[twin_key] = Path(name)
        run_dir = state.out / dir_name(name, used_dirs)
        if os.path.islink(run_dir):  # not a folder the batch made: writing through it writes where no one pointed
            state.rows[name] = _refused_row(name, f"{run_dir} is a symlink, not a run directory this batch made; "
                                                  "remove it or choose another --out")
            continue
        if resume and _complete(run_dir, digest, config_path, sets, model, sidecar(model), resume):
            state.rows[name] = summary_row(name, run_dir, seconds=None, note="resumed: result reused")
            continue
        state.tasks.append(Task(name, model, run_dir))
    state.manifest = {"status": "running", "pid": os.getpid(), "files": sorted(
        {*owned.listed_files(claimed.previous), *BATCH_FILES, *(task.run_dir.name for task in state.tasks)})}
    claimed.write_manifest(state.manifest)


def _run(state: _Batch, spec: RunSpec, total: int, jobs: int | None, base, address: str | None,
         quiet: bool) -> dict:
    tasks = state.tasks
    # nothing left to run (all resumed): no cluster is started for it
    state.pool = _executor(state.executor if tasks else "local", jobs or default_jobs(base["threads"]), address,
                           base, state.out, quiet)
    if not quiet:
        print(f"qprep batch: {len(tasks)} model{'s' if len(tasks) != 1 else ''} to run on {state.pool.where}",
              file=sys.stderr, flush=True)
    progress = _Progress(total, len(state.rows), len(tasks), state.pool.slots, quiet)
    started = time.perf_counter()
    for task, outcome in state.pool.results(spec, tasks):
        state.finished(task, outcome)
        progress.finished(task.name, state.rows[task.name])
        with _signals_deferred():
            state.write()
    with _signals_deferred():
        summary = state.write()
    summary["seconds"] = round(time.perf_counter() - started, 1)
    return summary


def _signals_deferred():
    """Ctrl-C, SIGTERM and SIGHUP ignored while a summary is written (well under a second)."""
    return signal_handlers(signal.SIG_IGN, signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _executor(kind: str, jobs: int, address: str | None, base, out: Path, quiet: bool):
    if kind == "ray":
        from qprep.pipeline.batch_ray import RayCluster

        return RayCluster(address, base, out, quiet)
    from qprep.pipeline.batch_local import LocalPool

    return LocalPool(jobs)


class _Progress:
    """`[3/10] name: ok, gate: cosine_mean of y 0.9991 ≥ 0.99 (held-out, 48 samples) (12.3 s) | 1 failed,
    2 running, 4 queued, ETA 3 min` as each model finishes: the figure that decided its verdict, as the summary
    shows it; the ETA from this batch's throughput so far (models finished per second with every slot busy)."""

    def __init__(self, total: int, done: int, to_run: int, slots: int, quiet: bool):
        self.total, self.done, self.left, self.slots, self.quiet = total, done, to_run, slots, quiet
        self.ran = 0
        self.problems = {"failed": 0, "refused": 0}
        self.start = time.perf_counter()

    def finished(self, name: str, row: dict) -> None:
        self.done, self.left, self.ran = self.done + 1, self.left - 1, self.ran + 1
        if row["status"] in self.problems:
            self.problems[row["status"]] += 1
        if self.quiet:
            return
        running = min(self.left, self.slots)
        parts = [f"{count} {status}" for status, count in self.problems.items() if count]
        parts += [f"{running} running" if running else "",
                 f"{self.left - running} queued" if self.left > running else ""]
        if self.left:
            parts.append(f"ETA {_duration((time.perf_counter() - self.start) / self.ran * self.left)}")
        extra = ", ".join(p for p in parts if p)
        error = f" — {row['error']}" if row.get("error") else ""
        decided = f", {row['decided_by'].replace('`', '')}" if row.get("decided_by") else ""
        print(f"qprep batch: [{self.done}/{self.total}] {name}: {row['status']}{decided} ({row['seconds'] or 0:.1f} s)"
              f"{error}{f' | {extra}' if extra else ''}", file=sys.stderr, flush=True)


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def _overlay_inputs(config_path: str, sets, model: Path, out: Path) -> dict[str, Path]:
    """What a model's NAME.qprep.yaml makes its run read; an overlay that does not load is its run's to refuse."""
    overlay = sidecar(model)
    if overlay is None:
        return {}
    try:
        return input_paths(load_config(config_path, run_overrides(sets, model, out / "_check"), overlay=overlay))
    except QprepError:
        return {}


def _refused_row(name: str, error: str) -> dict:
    """The summary row of a model refused before it ran (unreadable, no run directory of its own)."""
    return {"model": name, "status": "refused", "run_dir": "", "note": "", "seconds": None, "error": error}


def _complete(run_dir: Path, digest: str, config_path: str, sets, model: Path, overlay: Path | None,
              batch: str) -> bool:
    """A finished run of the same model bytes with the same resolved config, made by a batch on this --out (a run
    made there by hand is not the batch's to reuse, as it is not its to replace)."""
    try:
        manifest, report = read_json(run_dir / "manifest.json"), read_json(run_dir / "report.json")
    except (OSError, ValueError):
        return False
    wanted = json.loads(jsonfile.dumps(load_config(config_path, run_overrides(sets, model, run_dir),
                                                   overlay=overlay).resolved()))
    ran = dict(manifest.get("config") or {})
    ran["output_dir"] = wanted.get("output_dir")  # a Ray node without shared storage ran it in a folder of its own
    return (report.get("status") in ("ok", "gate missed") and ran == wanted and manifest.get("batch") == batch
            and report.get("model", {}).get("sha256") == digest
            and not changed_inputs(manifest))  # data edited in place since: the result would not be this data's


def _write_summary(out: Path, rows: dict, twins: dict, executor: tuple[str, str], skipped: dict) -> dict:
    for row in rows.values():  # a duplicate shows its twin's outcome
        if row["status"] == "duplicate" and row["twin"] in rows and rows[row["twin"]]["status"] != "duplicate":
            twin = rows[row["twin"]]
            row.update({k: v for k, v in twin.items() if k not in ("model", "note", "twin", "status", "run_dir")})
            row["status"] = twin["status"]
    ordered = sorted(rows.values(), key=_worst_first)
    summary = {"models": ordered, "counts": {s: sum(r["status"] == s for r in ordered) for s in STATUSES},
               "executor": {"name": executor[0], "where": executor[1]},
               **({"skipped": [{"entry": k, "why": v} for k, v in sorted(skipped.items())]} if skipped else {})}
    atomic_write_text(out / "summary.json", jsonfile.dumps(summary) + "\n")
    atomic_write_text(out / "summary.csv", render_summary_csv(ordered))
    atomic_write_text(out / "summary.md", render_summary_md(ordered, executor[1]))
    atomic_write_text(out / "summary.html", render_summary_html(ordered, executor[1]))
    return summary


def _worst_first(row: dict):
    rank = {"failed": 0, "refused": 1, "gate missed": 2}.get(row["status"], 3)
    cosine = row.get("cosine_mean")
    return rank, cosine if cosine is not None else 2.0, row["model"]


def exit_code(summary: dict) -> int:
    """2 when any model failed or was refused (DESIGN.md: scripts rely on it; the summary says which), else 1
    when any gate was missed, else 0."""
    if summary["counts"]["failed"] or summary["counts"]["refused"]:
        return EXIT_USAGE
    return EXIT_GATE_MISSED if summary["counts"]["gate missed"] else EXIT_OK
