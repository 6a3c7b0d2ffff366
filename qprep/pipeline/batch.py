"""`qprep batch CONFIG DIR`: one config over a folder of models, each in its own process and run directory.

Why a subprocess per model (`python -m qprep run ...`) rather than a pool: a toolkit that segfaults, hangs or
leaks takes down only its own model, which is recorded with its one-line error; every finished model's run
directory is complete on disk, so a killed batch loses nothing and `--resume` picks up where it stopped.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from qprep import jsonfile
from qprep.config import load_config, run_overrides
from qprep.errors import EXIT_GATE_MISSED, EXIT_OK, EXIT_USAGE, QprepError
from qprep.model.io import atomic_write_text, sha256_file
from qprep.report.summary import render_summary_csv, render_summary_html, render_summary_md, summary_row


TERMINATE_GRACE_S = 30  # a timed-out model gets this long to write its report after SIGTERM, then SIGKILL
STATUSES = ("ok", "gate missed", "refused", "failed")  # refused: a one-line QprepError (exit 2) naming what is not taken
SIDECAR_SUFFIX = ".qprep.yaml"  # NAME.qprep.yaml beside NAME.onnx: merged over the batch config for that model


def sidecar(model: Path) -> Path | None:
    """The model's own overlay (input dims, its samples), when there is one."""
    path = model.with_name(model.name.removesuffix(".onnx") + SIDECAR_SUFFIX)
    return path if path.is_file() else None


def dir_name(name: str, used: set[str]) -> str:
    """`a/b.onnx` → `a__b`; a second model mapping to a taken name (`a__b.onnx`) gets `a__b-2`, so two models
    never share a run directory."""
    stem = name.removesuffix(".onnx").replace(os.sep, "__")
    candidate, index = stem, 1
    while candidate in used:
        index += 1
        candidate = f"{stem}-{index}"
    used.add(candidate)
    return candidate


def find_models(folder: Path, recursive: bool) -> list[Path]:
    if not folder.is_dir():
        raise QprepError(f"batch: model folder not found: {folder}")
    models = sorted(folder.rglob("*.onnx") if recursive else folder.glob("*.onnx"))
    models = [m for m in models if not m.name.startswith(".")]
    if not models:
        raise QprepError(f"batch: no .onnx files in {folder}{'' if recursive else ' (try --recursive)'}")
    return models


def default_jobs(threads: int) -> int:
    """As many workers as cores allow at `threads` ORT threads each, and at most one per 4 GB of memory."""
    cores = os.cpu_count() or 1
    try:
        memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES") / 2**30
    except (ValueError, OSError):
        memory_gb = 8
    return max(1, min(cores // max(threads, 1), int(memory_gb // 4)))


def run_batch(config_path: str, folder: str, out: str, jobs: int | None = None, recursive: bool = False,
              resume: bool = False, timeout: float | None = None, sets: list[str] = (), quiet: bool = False) -> dict:
    if jobs is not None and jobs < 1:
        raise QprepError(f"batch --jobs {jobs}: needs at least 1 worker; omit --jobs for a default from cores "
                         "and memory")
    folder_path, out_path = Path(folder).resolve(), Path(out).resolve()
    models = find_models(folder_path, recursive)
    base = load_config(config_path, {"model": str(models[0]), "output_dir": str(out_path / "_check")})
    jobs = jobs or default_jobs(base["threads"])
    _make_batch_dir(out_path)
    twins: dict[str, Path] = {}
    tasks, rows = [], {}
    used_dirs: set[str] = set()
    for model in models:
        name = str(model.relative_to(folder_path))
        try:
            digest = sha256_file(model)
        except OSError as exc:  # a symlink loop, a dangling symlink, a folder named *.onnx: this entry fails alone
            rows[name] = _unreadable_row(name, model, exc)
            if not quiet:
                print(f"qprep batch: {name}: refused — {rows[name]['error']}", file=sys.stderr, flush=True)
            continue
        if digest in twins:
            rows[name] = {"model": name, "status": "duplicate", "note": f"identical to {twins[digest]}",
                          "twin": str(twins[digest])}
            continue
        twins[digest] = Path(name)
        run_dir = out_path / dir_name(name, used_dirs)
        if resume and _complete(run_dir, digest, config_path, sets, model, sidecar(model)):
            rows[name] = summary_row(name, run_dir, seconds=None, note="resumed: result reused")
            continue
        tasks.append((name, model, run_dir))
    started = time.perf_counter()
    done = len(rows)
    total = len(models)

    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(_run_one, config_path, model, run_dir, sets, timeout): (name, run_dir)
                   for name, model, run_dir in tasks}
        for future in concurrent.futures.as_completed(futures):  # report each model as it finishes
            name, run_dir = futures[future]
            row_status, seconds, error = future.result()
            rows[name] = summary_row(name, run_dir, seconds=seconds, error=error, status=row_status)
            done += 1
            if not quiet:
                print(f"qprep batch: [{done}/{total}] {name}: {rows[name]['status']} ({seconds:.1f} s)"
                      + (f" — {error}" if error else ""), file=sys.stderr, flush=True)
            _write_summary(out_path, rows, twins)
    summary = _write_summary(out_path, rows, twins)
    summary["seconds"] = round(time.perf_counter() - started, 1)
    return summary


def _make_batch_dir(path: Path) -> None:
    """The batch directory may exist (--resume) but must be a folder qprep can write in."""
    try:
        if path.exists() and not path.is_dir():
            raise QprepError(f"batch --out {path} is a file; choose a folder for the run directories")
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise QprepError(f"batch --out {path}: cannot create it ({exc.strerror}); choose another --out") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise QprepError(f"batch --out {path}: Permission denied; choose another --out")


def _unreadable_row(name: str, model: Path, exc: OSError) -> dict:
    """The summary row of a folder entry that cannot be read as a file; it never gets a run directory."""
    what = "symlink" if model.is_symlink() else "entry"
    return {"model": name, "status": "refused", "run_dir": "", "note": "", "seconds": None,
            "error": f"cannot read this {what}: {exc.strerror}; fix it or move it out of the folder"}


def _run_one(config_path: str, model: Path, run_dir: Path, sets, timeout) -> tuple[str, float, str]:
    command = [sys.executable, "-m", "qprep", "run", str(config_path), "--model", str(model), "--out", str(run_dir),
               "--force", "--quiet"]
    overlay = sidecar(model)
    if overlay:
        command += ["--overlay", str(overlay)]
    for assignment in sets:
        command += ["--set", assignment]
    start = time.perf_counter()
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as worker:
        try:
            _, stderr = worker.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            worker.terminate()  # SIGTERM first: the run writes its report ("interrupted") and manifest
            try:
                worker.communicate(timeout=TERMINATE_GRACE_S)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.communicate()
            return "failed", time.perf_counter() - start, f"timed out after {timeout:g} s"
    done = subprocess.CompletedProcess(command, worker.returncode, "", stderr)
    seconds = time.perf_counter() - start
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    error = lines[-1].removeprefix("qprep: error: ") if lines and done.returncode != EXIT_OK else ""
    if done.returncode == EXIT_OK:
        return "ok", seconds, ""
    if done.returncode == EXIT_GATE_MISSED:
        return "gate missed", seconds, error.removeprefix("qprep: ")
    if done.returncode < 0:
        return "failed", seconds, f"worker died (signal {-done.returncode})"
    if done.returncode == EXIT_USAGE and error:  # a one-line refusal: the model or its config asks for
        return "refused", seconds, error          # something qprep does not take, and the line says what
    return "failed", seconds, error or f"exit code {done.returncode}"


def _complete(run_dir: Path, digest: str, config_path: str, sets, model: Path, overlay: Path | None) -> bool:
    """A finished run of the same model bytes with the same resolved config."""
    try:
        manifest = json.loads((run_dir / "manifest.json").read_text())
        report = json.loads((run_dir / "report.json").read_text())
    except (OSError, ValueError):
        return False
    wanted = json.loads(jsonfile.dumps(load_config(config_path, run_overrides(sets, model, run_dir),
                                                   overlay=overlay).resolved()))
    return (report.get("status") in ("ok", "gate missed") and manifest.get("config") == wanted
            and report.get("model", {}).get("sha256") == digest)


def _write_summary(out: Path, rows: dict, twins: dict) -> dict:
    for row in rows.values():  # a duplicate shows its twin's outcome
        if row["status"] == "duplicate" and row["twin"] in rows and rows[row["twin"]]["status"] != "duplicate":
            twin = rows[row["twin"]]
            row.update({k: v for k, v in twin.items() if k not in ("model", "note", "twin", "status", "run_dir")})
            row["status"] = twin["status"]
    ordered = sorted(rows.values(), key=_worst_first)
    summary = {"models": ordered, "counts": {s: sum(r["status"] == s for r in ordered)
                                             for s in STATUSES}}
    atomic_write_text(out / "summary.json", jsonfile.dumps(summary) + "\n")
    atomic_write_text(out / "summary.csv", render_summary_csv(ordered))
    atomic_write_text(out / "summary.md", render_summary_md(ordered))
    atomic_write_text(out / "summary.html", render_summary_html(ordered))
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
