"""`qprep evaluate RUN_DIR --samples DIR`: a finished run's result measured again on other samples.

Why: the run's own evaluation samples may have taken part in its choices (the fallback picks its float set on
them), so an unbiased figure needs samples the run never saw. This re-runs exactly the run's evaluation (the
same reference, input fixes, metrics, tasks and gate, from the run's manifest) on a held-out folder, without
touching the run directory. The result's per-layer error and latency are left out: they describe the model,
not the samples, and the run's report has them. The given samples are the only ones measured, and the gate is
judged on them: the run's own `evaluation.heldout` is dropped (else it, not the samples given, decided the gate).
Given the run's own evaluation or held-out folder, the figures repeat the report's, and a note says which.
"""

from __future__ import annotations

import errno
from pathlib import Path

from qprep import jsonfile
from qprep.config import Config, load_config
from qprep.contract import Products, RunContext
from qprep.disk.guard import Guard
from qprep.disk.reading import read_json, require_regular_file
from qprep.errors import ConfigError, ModelError
from qprep.evaluate import evaluate
from qprep.measure.reference import ReferenceOutputs
from qprep.model.io import sha256_file
from qprep.model.load import load_model
from qprep.model.noise import taken_out
from qprep.pipeline import preflight
from qprep.pipeline.run_dir import fingerprint
from qprep.progress import Progress


def reevaluate(run_dir: str | Path, samples: str | Path, labels: str | None = None, sets: dict | None = None,
               quiet: bool = True, guard: Guard | None = None) -> dict:
    """The evaluation section a run would have written with `evaluation.source: samples` (plus `run_dir` and
    `status`); raises a one-line QprepError for a folder that holds no finished ONNX result."""
    run_dir = Path(run_dir)
    report, manifest = _read_run(run_dir)
    deployable = report["result"].get("deployable")
    if deployable:
        config_path = ((manifest.get("inputs") or {}).get("config") or {}).get("path") or "CONFIG"
        calibration = (manifest["config"].get("calibration") or {}).get("source")
        calibrated = bool(calibration) and Path(calibration).resolve() == Path(samples).resolve()
        held = (f"{samples} holds the run's calibration samples, whose figures flatter the result: run the config "
                "again with samples it never saw held out" if calibrated
                else "run the config again with these samples held out")
        raise ConfigError(f"evaluate {run_dir}: the result is {deployable.get('path')}, which the toolkit's "
                          "simulator runs only inside the process that built it, so it cannot be measured again "
                          f"here; {held}: `qprep run {config_path} --set evaluation.heldout.source="
                          f"{'DIR' if calibrated else samples}`")
    source = str(Path(samples).resolve())
    repeated, own_labels = _own_split(manifest["config"].get("evaluation") or {}, source)
    overrides = {"output_dir": None, "evaluation.source": source, "evaluation.heldout": None,
                 "evaluation.layers": False, "evaluation.latency.runs": 0, "evaluation.max_samples": 100000,
                 "evaluation.gate": recorded_gate(report, manifest["config"])}
    if labels or own_labels:
        overrides["evaluation.labels"] = str(Path(labels).resolve()) if labels else own_labels
    _refuse_sets_of_its_own(sets or {})
    config = load_config(manifest["config"], {**overrides, **(sets or {})})
    _check_unchanged(run_dir, manifest.get("inputs") or {}, manifest.get("results"), config)
    _check_metric_unchanged(run_dir, manifest)
    progress = Progress(enabled=False if quiet else None)
    checked = preflight.check(config, progress)
    if guard is not None:  # what --json must not overwrite: every sample file read (a list's may lie anywhere)
        guard.add_inputs(preflight.sample_files(checked.evaluation))
    ctx = RunContext(config=config, run_dir=run_dir, calibration=checked.calibration, verifier=None,
                     progress=progress, reference=ReferenceOutputs.of_run(config, checked, progress))
    # its random ops fed the noise the samples hold; only run here, never rewritten
    model, _ = taken_out(load_model(run_dir / "model.onnx", rewrites=False))
    result = evaluate(config, ctx, Products(), model, report["model"]["kind"])
    if repeated:  # said by the command too: figures equal to the report's are no news
        result["notes"], result["repeats"] = [repeated, *result.get("notes", [])], repeated
    gate = result.get("gate")
    return {"run_dir": str(run_dir), "status": "gate missed" if gate and not gate["passed"] else "ok", **result}


# keys evaluate sets itself from its options: a --set of one would measure other samples than the figures name
OWN_KEYS = {"evaluation.source": "--samples", "evaluation.heldout": "--samples",
            "evaluation.labels": "--labels", "output_dir": "--json (evaluate writes nothing into a run directory)"}


def _refuse_sets_of_its_own(sets: dict) -> None:
    for key in sets:
        for own, option in OWN_KEYS.items():
            if key == own or key.startswith(own + ".") or own.startswith(key + "."):
                raise ConfigError(f"evaluate: --set {key} is what evaluate's {option} decides; give it there (the "
                                  "figures are labelled with what --samples names)")


def _own_split(evaluation: dict, source: str) -> tuple[str, str | None]:
    """(a note, the labels that go with them) when `source` is a split of the run itself: its figures are the
    report's again. ("", None) for other samples."""
    heldout = evaluation.get("heldout") or {}
    if heldout.get("source") and str(Path(heldout["source"]).resolve()) == source:
        return ("these are the run's held-out samples (evaluation.heldout): the figures repeat the report's "
                "held-out figures, which judged its gate", heldout.get("labels"))
    if evaluation.get("source") and str(Path(evaluation["source"]).resolve()) == source:
        return ("these are the run's evaluation samples (evaluation.source), on which its choices were made: the "
                "figures repeat the report's and flatter the result; give samples the run never saw",
                evaluation.get("labels"))
    return "", None


def _check_unchanged(run_dir: Path, inputs: dict, results: dict | None, config: Config) -> None:
    """The run's result, the input model and the reference model the evaluation loads (their external data
    files too) must be the files the run wrote and read, by the sha256 its manifest records: a model replaced
    since gave other figures without a word (cosine 0.39, "gate missed"). A file the user points elsewhere with
    --set, or a run that recorded no digest, is judged as it is."""
    model, reference = inputs.get("model") or {}, inputs.get("reference_model") or {}
    recorded = [(f"run's {name}", str(run_dir / name), digest) for name, digest in (results or {}).items()]
    for what, entry, used in (("input model", model, config["model"]),
                              ("reference model", reference, (config["evaluation"] or {}).get("reference_model"))):
        if entry.get("path") and entry["path"] == used:
            recorded.append((what, used, entry.get("sha256")))
            recorded += [(f"{what}'s external data file", str(Path(used).parent / name), digest)
                         for name, digest in (entry.get("data_files") or {}).items()]
    fix = "restore the file the run read, or run qprep again to judge the new one"
    for what, path, digest in recorded:
        if not digest:
            continue
        now = sha256_file(require_regular_file(path, f"evaluate {run_dir}: the {what}", ModelError, fix))
        if now != digest:
            raise ModelError(f"evaluate {run_dir}: the {what} {path} changed since the run (sha256 {now[:12]}…, the "
                             f"run read {digest[:12]}…); {fix}")


def _check_metric_unchanged(run_dir: Path, manifest: dict) -> None:
    """The user's metric module, when evaluate imports the one the run did: edited since, its figures would belong
    to neither the run nor its report (a changed module is refused like a changed model)."""
    read, state = manifest.get("read") or {}, manifest.get("read_state") or {}
    module = read.get("evaluation.metric's module") if isinstance(read, dict) else None
    if isinstance(module, str) and isinstance(state, dict) and module in state and fingerprint(module) != state[module]:
        raise ModelError(f"evaluate {run_dir}: the metric module {module} changed since the run; restore the one "
                         "the run used, or run qprep again to judge with the new one")


def _read_run(run_dir: Path) -> tuple[dict, dict]:
    try:  # read_json: a FIFO or device there is refused, not read forever
        report, manifest = jsonfile.numbers(read_json(run_dir / "report.json")), read_json(run_dir / "manifest.json")
    except (OSError, ValueError) as exc:
        what = (f"{exc.filename} is {exc.strerror}" if isinstance(exc, OSError) and exc.errno == errno.EINVAL
                else "no readable report.json and manifest.json")
        raise ConfigError(f"evaluate {run_dir}: {what}; give the run directory of a finished qprep run") from None
    if report.get("status") not in ("ok", "gate missed") or not (run_dir / "model.onnx").is_file():
        raise ConfigError(f"evaluate {run_dir}: the run did not finish (status {report.get('status')!r}); only a "
                          "finished run's model.onnx can be evaluated")
    return report, manifest


def recorded_gate(report: dict, config: dict) -> dict:
    """The gate the run judged its result by, as its report records it (the configured gate with the
    fallback's target, which the quantize stage handed on: evaluate.py): the new samples are held to the same.
    A run held to the accuracy floor alone records no gate of its own; the config's floor applies again."""
    judged = (report.get("evaluation") or {}).get("gate") or {}
    if judged and judged.get("source") != "floor":
        return dict(judged["target"])
    return dict((config.get("evaluation") or {}).get("gate") or {})
