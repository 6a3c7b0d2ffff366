"""One qprep run: load → stages in config order → (evaluation) → report, inside one run directory.

The runner owns what every stage has in common: timing, op counts before/after, the record, saving the
per-stage model, and turning a stage failure into a report that says where it failed.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import onnx

from qprep import __version__
from qprep.model import info as model_info
from qprep.pipeline import preflight
from qprep.pipeline import run_dir
from qprep.config import Config
from qprep.data import SampleSet, random_samples
from qprep.errors import ConfigError, QprepError
from qprep.evaluate import evaluate
from qprep.verify import Tolerance, Verifier
from qprep.model.io import save_model, sha256_file
from qprep.progress import Progress
from qprep.report import write_report, write_report_json
from qprep.pipeline.stages import StageResult, registry

log = logging.getLogger("qprep")
SCHEMA_VERSION = 1


@dataclass
class RunContext:
    """What stages share: config, run directory, samples, the verifier and the float set."""

    config: Config
    run_dir: Path
    calibration: SampleSet | None
    verifier: Verifier
    progress: Progress
    float_set: set[str] = field(default_factory=set)  # node names that must stay float (keep_float)
    warnings: list[str] = field(default_factory=list)
    prepared_model: onnx.ModelProto | None = None  # the float model handed to quantize (per-layer analysis)
    artifacts: dict[str, Path] = field(default_factory=dict)  # extra deployable files: run-dir name → source
    deployable: str | None = None  # the artifact to ship when it is not model.onnx (a backend says so)
    runner: Callable[[list[dict]], list[dict]] | None = None  # runs the result when it is not ONNX (RKNN)
    layer_analyzer: Callable[[list[dict]], list[dict]] | None = None  # backend's own per-layer analysis
    input_model: onnx.ModelProto | None = None  # the input as loaded and prepared: the default FP32 reference
    evaluation: SampleSet | None = None  # evaluation samples, loaded and checked before the run started
    reference_model: onnx.ModelProto | None = None  # evaluation.reference_model, when set (loaded likewise)
    fallback_target: dict = field(default_factory=dict)  # quantize.fallback's target, checked again by evaluation
    reference_run: object = None  # evaluate.ReferenceRun: FP32 outputs on the evaluation samples, computed once
    closers: list[Callable[[], None]] = field(default_factory=list)  # run when the run ends (toolkit workers)

    def work_dir(self, name: str) -> Path:
        """A folder inside the run directory for a stage's or toolkit's working files."""
        path = self.run_dir / "work" / name
        path.mkdir(parents=True, exist_ok=True)
        return path


def execute(config: Config, force: bool = False, quiet: bool = False, progress: Progress | None = None) -> dict:
    """Run a validated config; returns the report (also written to the run directory).

    Every input is loaded and checked (preflight) before the run directory is locked and touched, so a bad
    input never costs the previous run."""
    out = config["output_dir"]
    if not out:
        raise ConfigError("output_dir: no run directory; set output_dir in the config or pass --out DIR")
    progress = progress or Progress(enabled=False if quiet else None)
    started = time.time()
    checked = preflight.check(config, progress)
    load_seconds = time.time() - started
    directory, lock = run_dir.claim(Path(out), force)
    handler = run_dir.attach_log(directory)
    report: dict = {"schema_version": SCHEMA_VERSION, "qprep_version": __version__, "status": "running",
                    "run_dir": str(directory), **checked.record, "stages": [], "warnings": list(checked.warnings)}
    written: list[str] = []
    timings: dict[str, float] = {"load": load_seconds}
    ctx: RunContext | None = None
    try:
        log.info("run started (pid %d): config %s, model %s", os.getpid(), config.path, config["model"])
        ctx = _context(config, checked, directory, progress, report)
        model = checked.model
        for index, (name, options) in enumerate(config.stages):
            with progress.step(f"[{index + 1}/{len(config.stages)}] {name}"), run_dir.toolkit_logging_to_run_log():
                model = _run_stage(index, name, options, model, ctx, report, written)
            timings[f"stage {index} {name}"] = report["stages"][-1]["seconds"]
        save_model(model, directory / "model.onnx")
        written.append("model.onnx")
        for name, source in ctx.artifacts.items():
            os.replace(source, directory / name)
            written.append(name)
        if (directory / "work").exists():
            written.append("work")  # toolkits' working files (dataset, logs): listed so --force removes them
        report["result"] = {"path": "model.onnx", "bytes": (directory / "model.onnx").stat().st_size,
                            "artifacts": sorted(ctx.artifacts), **model_info.summary(model)}
        if ctx.deployable:  # e.g. the .rknn; model.onnx is then the float model it was built from
            report["result"]["deployable"] = {
                "path": ctx.deployable, "bytes": (directory / ctx.deployable).stat().st_size,
                "note": f"model.onnx is the prepared float model {ctx.deployable} was built from"}
        report["float_set"] = sorted(ctx.float_set)
        if config["evaluation"]:
            report["step"] = "evaluation"
            write_report_json(directory, report)
            t0 = time.perf_counter()
            report["evaluation"] = evaluate(config, ctx, model, report["model"]["kind"])
            deployable = report["result"].get("deployable")
            if deployable:
                report["evaluation"]["size_bytes"]["result"] = deployable["bytes"]
            timings["evaluation"] = time.perf_counter() - t0
        report["warnings"] += ctx.warnings
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
        for close in ctx.closers if ctx else []:  # e.g. the RKNN runner's toolkit worker, kept for the evaluation
            try:
                close()
            except Exception as exc:  # noqa: BLE001 - the report and manifest must still be written
                log.warning("closing a backend's resources failed: %s: %s", type(exc).__name__, exc)
        timings["total"] = time.time() - started
        if report["status"] in ("ok", "gate missed"):
            report.pop("step", None)  # where the run was: kept only when it did not finish
        report["seconds"] = round(timings["total"], 3)
        with run_dir.deferred_signals():  # an interrupt while the record is written would leave it half-done
            written += write_report(directory, report)
            run_dir.write_manifest(directory, {
                "qprep_version": __version__,
                "inputs": {
                    "config": {"path": str(config.path) if config.path else None,
                               "sha256": sha256_file(config.path) if config.path else None},
                    "model": {"path": config["model"], "sha256": report.get("model", {}).get("sha256")},
                    "calibration": report.get("calibration"),
                },
                "config": config.resolved(),
                "timings_s": {k: round(v, 3) for k, v in timings.items()},
                "files": sorted(set(written + [run_dir.LOG])),
            })
            log.info("run finished: %s", report["status"])
            run_dir.detach_log(handler)
            lock.release()


def _context(config: Config, checked: preflight.Checked, directory: Path, progress: Progress,
             report: dict) -> RunContext:
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
                      progress=progress, input_model=checked.model, evaluation=checked.evaluation,
                      reference_model=checked.reference)


def _run_stage(index: int, name: str, options: dict, model: onnx.ModelProto, ctx: RunContext,
               report: dict, written: list[str]) -> onnx.ModelProto:
    stage = registry()[name]
    record = {"name": name, "index": index, "status": "running", "nodes_before": model_info.node_count(model),
              "op_counts_before": model_info.op_counts(model)}
    report["stages"].append(record)
    start = time.perf_counter()
    log.info("stage %d %s: options %s", index, name, options)
    report["step"] = f"stage {index} {name}"
    write_report_json(ctx.run_dir, report)  # a run killed outright still says which stage it was in
    try:
        result: StageResult = stage.run(model, ctx, options)
    except Exception as exc:
        record.update(status="failed", seconds=round(time.perf_counter() - start, 3), error=str(exc))
        raise
    record.update(status=result.status, seconds=round(time.perf_counter() - start, 3),
                  nodes_after=model_info.node_count(result.model), op_counts_after=model_info.op_counts(result.model),
                  rolled_back=result.rolled_back, **({"reason": result.reason} if result.reason else {}),
                  **result.details)
    log.info("stage %d %s: %s in %.2f s", index, name, result.status, record["seconds"])
    if ctx.config["save_stage_models"]:
        relative = f"stages/{index:02d}_{name}.onnx"
        save_model(result.model, ctx.run_dir / relative)
        written.append(relative)
    return result.model
