"""One qprep run, inside one run directory: load and check → stages in config order → save the result →
(evaluation) → record (report + manifest, however the run ended).

The runner owns what every stage has in common: timing, op counts before/after, the record, saving the
per-stage model, turning a stage failure into a report that says where it failed, and applying what each
stage hands back (its StageResult, the contract in qprep/contract.py) to the run.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import onnx

from qprep import run_log
from qprep.config import Config
from qprep.contract import Products, RunContext, StageResult
from qprep.data import random_samples
from qprep.errors import ConfigError, QprepError
from qprep.evaluate import evaluate
from qprep.graph.verify import Tolerance, Verifier
from qprep.measure.reference import ReferenceOutputs
from qprep.memory import return_freed_memory
from qprep.model import info as model_info
from qprep.model.io import save_model, sha256_file
from qprep.model.noise import Noise, restore
from qprep.pipeline import preflight, result_size, run_dir
from qprep.progress import Progress
from qprep.report import write_report, write_report_json
from qprep.schema import Settings
from qprep.stage_registry import registry
from qprep.version import __version__

log = logging.getLogger("qprep")
SCHEMA_VERSION = 1


@dataclass
class Run:
    """One run as the runner builds it: the report, the files written, the timings, the context the stages read
    and what they handed back."""

    config: Config
    directory: Path
    report: dict
    timings: dict[str, float]
    written: list[str] = field(default_factory=list)
    products: Products = field(default_factory=Products)
    ctx: RunContext | None = None  # set once the run directory is claimed
    claimed: run_dir.owned.Owned | None = None  # the run directory's lock and identity (qprep/disk/owned.py)
    announced: list[str] = field(default_factory=list)  # folders stages made (work/NAME/**), in the manifest first
    users: set[str] = field(default_factory=set)  # what was in work/ and stages/ before the run: the user's


def execute(config: Config, force: bool = False, quiet: bool = False, progress: Progress | None = None) -> dict:
    """Run a validated config; returns the report (also written to the run directory).

    Every input is loaded and checked (preflight) before the run directory is locked and touched, so a bad
    input never costs the previous run."""
    out = config["output_dir"]
    if not out:
        raise ConfigError("output_dir: no run directory; set output_dir in the config or pass --out DIR")
    progress = progress or Progress(enabled=False if quiet else None)
    return_freed_memory()  # before the model is loaded: its copies, once freed, must not stay resident
    started = time.time()
    checked = preflight.check(config, progress)  # before the run directory is claimed
    load_seconds = time.time() - started
    artifacts = tuple(name for stage, options in config.stages if registry()[stage].artifacts
                      for name in registry()[stage].artifacts(options))
    claimed = run_dir.claim(Path(out), force, artifacts)
    directory = claimed.path
    handler = run_log.attach_log(directory)
    run = Run(config, directory, _new_report(directory, checked), timings={"load": load_seconds}, claimed=claimed,
              users={name for name in run_dir.files_inside(directory, [n for n in run_dir.OWN_FOLDERS
                                                                        if (directory / n).is_dir()])
                     if not name.endswith("/")})  # files only: the folders' markers are the run's to list
    report = run.report
    try:
        log.info("run started (pid %d): config %s, model %s", os.getpid(), config.path, config["model"])
        run.ctx = replace(_context(config, checked, directory, progress, report),
                          announce=lambda name: _announce(run, name))
        model, noise, checked = checked.model, checked.noise, None  # the input: the reference's to release
        model = _run_stages(run, model)
        _save_result(run, model, noise)
        if config["evaluation"]:
            _evaluate(run, model)
        report["warnings"] += run.products.warnings
        gate = (report.get("evaluation") or {}).get("gate")
        report["status"] = "gate missed" if gate and not gate["passed"] else "ok"
        return report
    except QprepError as exc:
        report["status"], report["error"] = "failed", str(exc)
        raise
    except Exception as exc:  # internal error: still leave a report that says where it happened
        report["status"], report["error"] = "failed", f"internal error: {type(exc).__name__}: {exc}"
        raise
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM/SIGHUP (errors.Interrupted)
        report["status"], report["error"] = "interrupted", f"interrupted by {getattr(exc, 'cause', 'SIGINT (Ctrl-C)')}"
        raise
    finally:
        _close(run.products.closers)  # e.g. the RKNN runner's toolkit worker, kept for the evaluation
        run.timings["total"] = time.time() - started
        with run_dir.deferred_signals():  # an interrupt while the record is written would leave it half-done
            _write_record(run)
            log.info("run finished: %s", report["status"])
            run_log.detach_log(handler)
            claimed.release()


def _new_report(directory: Path, checked: preflight.Checked) -> dict:
    """The report as the run starts: what preflight loaded (model, load record) and its warnings."""
    return {"schema_version": SCHEMA_VERSION, "qprep_version": __version__, "status": "running",
            "run_dir": str(directory), **checked.record, "stages": [], "warnings": list(checked.warnings)}


def _context(config: Config, checked: preflight.Checked, directory: Path, progress: Progress,
             report: dict) -> RunContext:
    """What the first stage reads; the calibration's record (and random samples' warnings) go into the report."""
    calibration = checked.calibration
    if calibration is not None:
        report["calibration"] = calibration.describe()
    verify_cfg = config["verify"]
    if calibration is not None:
        samples = calibration.samples[: verify_cfg["max_samples"]]
        source = f"calibration ({len(samples)} samples)"
    else:
        fallback = random_samples(model_info.graph_inputs(checked.model), verify_cfg["max_samples"])
        samples, source = fallback.samples, "random (no calibration data)"
        if config.stages:
            report["warnings"] += fallback.warnings
    verifier = Verifier(samples, Tolerance.from_config(verify_cfg), threads=config["threads"], source=source)
    return RunContext(config=config, run_dir=directory, calibration=calibration, verifier=verifier,
                      progress=progress, reference=ReferenceOutputs.of_run(config, checked, progress))


def _run_stages(run: Run, model: onnx.ModelProto) -> onnx.ModelProto:
    """Every stage in config order, each on the model the one before handed back."""
    stages = run.config.stages
    for index, (name, options) in enumerate(stages):
        with run.ctx.progress.step(f"[{index + 1}/{len(stages)}] {name}"), run_log.toolkit_logging_to_run_log():
            model = _run_stage(run, index, name, options, model)
        run.timings[f"stage {index} {name}"] = run.report["stages"][-1]["seconds"]
    return model




def _run_stage(run: Run, index: int, name: str, options: Settings, model: onnx.ModelProto) -> onnx.ModelProto:
    """One stage: a report.json checkpoint first (a run killed outright still says which stage it was in), then
    the stage, its record, what it handed back applied to the run, and its model saved when asked."""
    stage, report, ctx = registry()[name], run.report, run.ctx
    record = {"name": name, "index": index, "status": "running", "nodes_before": model_info.node_count(model),
              "op_counts_before": model_info.op_counts(model)}
    report["stages"].append(record)
    start = time.perf_counter()
    log.info("stage %d %s: options %s", index, name, options)
    report["step"] = f"stage {index} {name}"
    write_report_json(run.directory, report)
    try:
        result = stage.run(model, ctx, options)
    except Exception as exc:
        record.update(status="failed", seconds=round(time.perf_counter() - start, 3), error=str(exc))
        raise
    _apply(run, result)  # first: what it holds open (closers) must reach the finally block whatever follows
    record.update(status=result.status, seconds=round(time.perf_counter() - start, 3),
                  nodes_after=model_info.node_count(result.model), op_counts_after=model_info.op_counts(result.model),
                  rolled_back=result.rolled_back, **({"reason": result.reason} if result.reason else {}),
                  **result.details)
    log.info("stage %d %s: %s in %.2f s", index, name, result.status, record["seconds"])
    if run.config["save_stage_models"]:
        relative = f"stages/{index:02d}_{name}.onnx"
        _will_write(run, [relative])
        save_model(result.model, run.directory / relative)
        run.written.append(relative)
    return result.model


def _apply(run: Run, result: StageResult) -> None:
    """What a stage handed back: the float set into the context later stages read, the rest into the products
    the result, the evaluation and the record use."""
    run.products.add(result)
    if result.float_set:
        run.ctx = replace(run.ctx, float_set=run.ctx.float_set | result.float_set)


def _save_result(run: Run, model: onnx.ModelProto, noise: Noise) -> None:
    """model.onnx, the backends' artifacts moved into the run directory, and the result's part of the report.
    A model measured on fed noise draws it again in model.onnx (model/noise.py); a compiled deployable (.rknn)
    keeps the noise as inputs, and its model.onnx stays the float model it was built from."""
    directory, products, report = run.directory, run.products, run.report
    drawn_again, left = (model, [s.output for s in noise.sources]) if products.deployable else \
        restore(model, noise.sources)
    written = save_model(drawn_again, directory / "model.onnx")
    run.written.append("model.onnx")
    _will_write(run, list(products.artifacts))
    for name, source in products.artifacts.items():
        os.replace(source, directory / name)
        run.written.append(name)
    report["result"] = {"path": "model.onnx", "bytes": written,  # with its external data (over 2 GB)
                        "artifacts": sorted(products.artifacts), **model_info.summary(drawn_again)}
    if noise.sources:
        report["result"]["noise"] = {"drawn": [s.describe() for s in noise.sources], "inputs": left}
    if "input_contract.json" in products.artifacts:  # what to feed: the report's deployment text follows it
        report["result"]["input_contract"] = json.loads((directory / "input_contract.json").read_text())
    quantized = products.prepared_model is not None and model_info.model_kind(model) != model_info.FLOAT
    if products.prepared_model is not None:  # what each float node costs (report/float_nodes.py)
        report["result"]["multiply_adds"] = model_info.multiply_adds(products.prepared_model)
    if quantized and not products.deployable:  # (RKNN's model.onnx is the float model it was built from)
        macs = report["result"]["multiply_adds"]
        report["result"]["integer_share"] = model_info.integer_share(products.prepared_model, model, macs)
        report["result"]["float_multiply_adds"] = model_info.float_multiply_adds(macs, model)
        in_bodies = sum(model_info.layers_in_bodies(model).values())
        if in_bodies:  # not in the share: their shapes are the bodies' own, and no quantizer here entered them
            report["result"]["float_layers_in_bodies"] = in_bodies
    if products.deployable:  # e.g. the .rknn; model.onnx is then the float model it was built from
        report["result"]["deployable"] = {
            "path": products.deployable, "bytes": (directory / products.deployable).stat().st_size,
            "note": f"model.onnx is the prepared float model {products.deployable} was built from"}
    report["float_set"] = sorted(run.ctx.float_set)


def _will_write(run: Run, names: list[str]) -> None:
    """Names beyond run_dir.OWN_FILES go into the running manifest before they are written (a run killed
    between the two still lists them for `--force`); one that exists now is not this run's: refused."""
    for name in names:
        if os.path.lexists(run.directory / name):
            raise QprepError(f"{run.directory / name} exists and was not written by this run; move it out of the "
                             "run directory and rerun")
    run_dir.write_manifest(run.claimed, {"status": "running", "pid": os.getpid(),
                                         "files": sorted({*run_dir.OWN_FILES, *run.written, *run.announced, *names,
                                                          *(f"{name}/" for name in run_dir.OWN_FOLDERS)})})


def _announce(run: Run, name: str) -> None:
    """A stage's work folder, listed in the running manifest before it is made (once)."""
    if name not in run.announced:
        run.announced.append(name)
        _will_write(run, [])


def _evaluate(run: Run, model: onnx.ModelProto) -> None:
    """The result against the FP32 reference, after a report.json checkpoint that says the run got this far."""
    report = run.report
    report["step"] = "evaluation"
    write_report_json(run.directory, report)
    t0 = time.perf_counter()
    report["evaluation"] = evaluate(run.config, run.ctx, run.products, model, report["model"]["kind"])
    written = report["result"].get("deployable") or report["result"]
    report["evaluation"]["size_bytes"]["result"] = written["bytes"]
    result_size.record(report, model)  # the reference with its data files; a result larger than it: a warning
    run.timings["evaluation"] = time.perf_counter() - t0


def _close(closers: list[Callable[[], None]]) -> None:
    """Free what the stages held open for the evaluation; a failure is logged, the record must still be written."""
    for close in closers:
        try:
            close()
        except Exception as exc:  # noqa: BLE001 - the report and manifest must still be written
            log.warning("closing a backend's resources failed: %s: %s", type(exc).__name__, exc)


def _write_record(run: Run) -> None:
    """report.json/.md/.html and manifest.json, however the run ended (called with signals deferred)."""
    report, config = run.report, run.config
    if report["status"] in ("ok", "gate missed"):
        report.pop("step", None)  # where the run was: kept only when it did not finish
    report["seconds"] = round(run.timings["total"], 3)
    run.written += write_report(run.directory, report)
    # Every OWN_FILES name present now is this run's: claim() proved each absent (or the previous run's, removed).
    present = [name for name in (*run_dir.OWN_FILES, *run_dir.OWN_FOLDERS) if os.path.lexists(run.directory / name)]
    read = {what: os.path.abspath(path) for what, path in preflight.input_paths(
        config, [Path(config["model"]).parent / name for name in report.get("model", {}).get("data_files") or ()]
    ).items()}
    run_dir.write_manifest(run.claimed, {
        "status": report["status"],
        "qprep_version": __version__,
        # every file and folder the run read, absolute: a command reading the run later (evaluate) must not write
        # over any of them, from whatever directory it is started; and their state, for batch --resume
        "read": read,
        "read_state": {path: run_dir.fingerprint(path) for path in read.values()},
        "inputs": {
            "config": {"path": os.path.abspath(config.path) if config.path else None,
                       "sha256": sha256_file(config.path) if config.path else None},
            **({"overlay": {"path": str(config.overlay), "sha256": sha256_file(config.overlay)}}
               if config.overlay else {}),
            "model": {"path": config["model"], "sha256": report.get("model", {}).get("sha256"),
                      **({"data_files": report["model"]["data_files"]} if report.get("model", {}).get("data_files")
                         else {})},
            **({"reference_model": report["reference_model"]} if report.get("reference_model") else {}),
            "calibration": report.get("calibration"),
        },
        "config": config.resolved(),
        "timings_s": {k: round(v, 3) for k, v in run.timings.items()},
        # what `qprep evaluate` reads back: a result edited or replaced since is refused, not judged
        "results": {name: sha256_file(run.directory / name) for name in ("model.onnx", "model.onnx.data")
                    if (run.directory / name).is_file()},
        "files": sorted({*run.written, *(set(run_dir.files_inside(run.directory, present)) - run.users),
                         run_log.LOG}),  # what the user had put in work/ or stages/ is never the run's
    })
