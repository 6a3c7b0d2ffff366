"""Everything a run can check before it touches the run directory; `qprep validate` and `qprep run` share it.

Why: a mistyped `--model`, a missing evaluation folder or NaN in the evaluation samples found after `--force`
cleared the previous run (or after minutes of stage work) costs the user a good result or their time. So the
model, the calibration and evaluation samples (their values too: qprep/data/bounds.py), the labels, the reference
model and what each stage needs (calibration data, an installed toolkit) are loaded and checked first, and the run
reuses what was loaded.
A run directory that holds an input, lies inside one or is home or the current directory is refused.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import onnx

from qprep.config import SCHEMA, Config
from qprep.data import SampleSet, load_samples
from qprep.data.bounds import check_values
from qprep.data.pitfalls import data_warnings
from qprep.disk.guard import Guard
from qprep.errors import ConfigError, ModelError, Problems, QprepError
from qprep.model import info as model_info
from qprep.model.io import sha256_file
from qprep.model.noise import Noise, drawn_ops, taken_out
from qprep.model.load import load_model_and_data_files
from qprep.model.prepare import fix_input_dims_ort_accepts, infer_shapes, left_symbolic_warning, name_nodes
from qprep.progress import Progress
from qprep.schema import closest
from qprep.stage_registry import registry


@dataclass
class Checked:
    """What the checks loaded, handed to the run so nothing is read twice."""

    model: onnx.ModelProto  # nodes named, input dims fixed, shapes inferred
    record: dict  # report["model"] and report["load"]
    calibration: SampleSet | None
    evaluation: SampleSet | None
    heldout: SampleSet | None  # evaluation.heldout: measured at the end only, never seen by a decision
    reference: onnx.ModelProto | None  # evaluation.reference_model (None: the input model is the reference)
    warnings: list[str] = field(default_factory=list)
    noise: Noise = field(default_factory=Noise)  # random ops fed as inputs; the result draws again


class _Collector:
    """Runs checks: the first failure is raised (`run`), or every independent one is kept (`validate`)."""

    def __init__(self, every: bool):
        self.every, self.problems = every, []

    @contextlib.contextmanager
    def attempt(self):
        try:
            yield
        except QprepError as exc:
            if not self.every:
                raise
            self.problems.append(exc)

    def raise_found(self) -> None:
        if self.problems:
            raise self.problems[0] if len(self.problems) == 1 else Problems(self.problems)


def check(config: Config, progress: Progress | None = None, every_problem: bool = False) -> Checked:
    """Load and check every input of `config`; raises a one-line QprepError on the first problem, or with
    `every_problem` (qprep validate) one `Problems` naming each problem that does not follow from another."""
    progress = progress or Progress(enabled=False)
    found = _Collector(every_problem)
    with found.attempt():
        check_run_dir(config)
    run_dir_ok = not found.problems  # checked again below with what loading finds, and said once
    for name, options in config.stages:  # cheap, config-only checks before any file is read
        stage = registry()[name]
        if stage.check:
            with found.attempt():
                stage.check(options, config)
    loaded = None
    with found.attempt(), progress.step("load model"):
        loaded = _load_model(config)
    if loaded is None:  # the samples are checked against the model's inputs: nothing more to check
        found.raise_found()
    model, record, warnings, data_files, drawn = loaded
    user_inputs = [spec for spec in model_info.graph_inputs(model) if spec.name not in drawn.inputs()]
    calibration = evaluation = heldout = reference = None
    reference_files: list[Path] = []
    if config["calibration"]:
        with found.attempt(), progress.step("load calibration data"):
            calibration = _fed(drawn, load_samples(config["calibration"], user_inputs, role="calibration"))
            warnings += calibration.warnings
    if config["evaluation"]:
        with progress.step("load evaluation data"):
            evaluation, heldout, reference, reference_files = _evaluation_data(config["evaluation"], model, found,
                                                                               drawn)
        if reference is not None:  # the manifest keeps its digests: `qprep evaluate` must judge against the same
            record["reference_model"] = digests(config["evaluation"]["reference_model"], reference_files)
    compiled_by, unfixable = _fixed_dims_stage(config), None
    if compiled_by:
        model, fixed_warnings = _dims_from_samples(model, record, (calibration, evaluation, heldout))
        warnings += fixed_warnings
        unfixable = _dims_ort_cannot_fix(model, record, compiled_by)
        if unfixable:
            with found.attempt():
                raise ModelError(unfixable)
    for name, options in config.stages:  # what a stage cannot take from this model (e.g. an op its toolkit refuses)
        stage = registry()[name]
        if unfixable and stage.fixed_dims and stage.fixed_dims(options):
            continue  # its own refusal would say "add `inputs:`", which the config already does
        if stage.check_model:
            with found.attempt():
                stage.check_model(options, model)
    for role, samples in (("calibration", calibration), ("evaluation", evaluation), ("evaluation.heldout", heldout)):
        with found.attempt():  # ids beyond their table, masks not 0/1: what ONNX Runtime would refuse mid-run
            check_values(model, samples, role)
    if run_dir_ok:  # the inputs known only now: external data, a list file's samples (anywhere, the run directory
        with found.attempt():  # included), the reference's external data
            check_run_dir(config, data_files, {**sample_files(calibration, evaluation, heldout),
                                               **{f"the reference model's external data {f.name}": str(f)
                                                  for f in reference_files}})
    found.raise_found()
    warnings += data_warnings(model, calibration, evaluation, heldout) + ignored_preprocess(config, calibration,
                                                                                            evaluation, heldout)
    return Checked(model=model, record=record, calibration=calibration, evaluation=evaluation, heldout=heldout,
                   reference=reference, warnings=warnings, noise=drawn)


def ignored_preprocess(config: Config, calibration: SampleSet | None, evaluation: SampleSet | None,
                       heldout: SampleSet | None) -> list[str]:
    """A `preprocess:` set (any key off its default) on samples that are no images, said in one warning per
    section. Why: it applies to images only, and .npy/.npz arrays go in as stored, so a mean/std or layout
    written for them would otherwise pass validate and run silently, changing nothing (issue #59). A warning,
    not a refusal: a shared config (a batch's) may set it for image models beside array ones."""
    warnings = []
    for role, sets in (("calibration", (calibration,)), ("evaluation", (evaluation, heldout))):
        read = [samples for samples in sets if samples is not None]
        if not config[role] or not read or any(samples.preprocess for samples in read):
            continue  # absent, not loaded, or read as images: it applies
        defaults = SCHEMA.fields[role].fields["preprocess"].fields
        given = [key for key, value in config[role]["preprocess"].items() if value != defaults[key].default]
        if given:
            kind = {Path(f).suffix.lower() for f in read[0].files} or {read[0].format}
            warnings.append(f"{role}.preprocess ({', '.join(given)}) is ignored: the samples are not images "
                            f"({'/'.join(sorted(kind))} arrays go into the model as stored); remove it, or point "
                            f"{role}.source at images")
    return warnings


def _fed(drawn: Noise, samples: SampleSet | None) -> SampleSet | None:
    """The samples with the values the model's random ops draw for each (the same for the float model and the
    result: model/noise.py)."""
    if samples is None or not drawn.sources:
        return samples
    return replace(samples, samples=drawn.samples(samples.samples))


def _fixed_dims_stage(config: Config) -> str | None:
    """The stage that compiles for one input size (e.g. "quantize.rknn"), if the pipeline has one."""
    for name, options in config.stages:
        if registry()[name].fixed_dims and registry()[name].fixed_dims(options):
            return f"{name}.{options.backend}" if hasattr(options, "backend") else name
    return None


def _dims_ort_cannot_fix(model: onnx.ModelProto, record: dict, stage: str) -> str | None:
    """For `stage`, which compiles one input size: the refusal of an input whose fixed dims ONNX Runtime refuses
    (If/Loop branches inferred at those dims), if one is left symbolic — saying so, where the stage's own
    refusal would advise `inputs:`, which would not help."""
    refused = record["load"].get("inputs_left_symbolic") or {}
    for spec in model_info.graph_inputs(model):
        if spec.name in refused and not all(isinstance(d, int) for d in spec.shape or [None]):
            return (f"{stage}: input '{spec.name}' must have fixed dims, and with them ONNX Runtime refuses the "
                    f"model ({refused[spec.name][:120]}): it infers the shapes of If/Loop branches that do not run "
                    "at these dims; export the model without that control flow (e.g. traced at the deployment size)")
    return None


def _dims_from_samples(model: onnx.ModelProto, record: dict, sets) -> tuple[onnx.ModelProto, list[str]]:
    """Dynamic input dims that `inputs:` left open, fixed to the shape every calibration and evaluation sample
    has: for a backend that compiles one size, the samples' size is the deployment's (the run says so; set
    `inputs:` for another). Inputs whose samples differ in shape stay open, and the backend refuses them."""
    shapes = {}
    for spec in model_info.graph_inputs(model):
        if spec.shape is not None and all(isinstance(d, int) for d in spec.shape):
            continue
        seen = {tuple(sample[spec.name].shape) for samples in sets if samples is not None
                for sample in samples.samples if spec.name in sample}
        if len(seen) == 1:
            shapes[spec.name] = list(seen.pop())
    if not shapes:
        return model, []
    fixed, refused = fix_input_dims_ort_accepts(model, shapes)
    warnings = _left_symbolic(record, refused)
    if not fixed:
        return model, warnings
    model, warning = infer_shapes(model)
    record["load"]["inputs_fixed_from_samples"] = {name: shapes[name] for name in fixed}
    record["load"]["inputs"] = [s.as_dict() for s in model_info.graph_inputs(model)]
    said = ", ".join(f"{name} {shapes[name]}" for name in fixed)
    return model, warnings + ([warning] if warning else []) + [
        f"inputs: {said} fixed from the samples (RKNN compiles one input size; set `inputs:` to choose another)"]


def digests(path: str, data_files: list[Path]) -> dict:
    """A model file's path and sha256, and its external data files' (by location beside it): what the manifest
    keeps so `qprep evaluate` can tell the model it judges against is the one the run read."""
    found = {"path": path, "sha256": sha256_file(path)}
    if data_files:
        found["data_files"] = {os.path.relpath(f, Path(path).parent): sha256_file(f) for f in data_files}
    return found


def _evaluation_data(cfg: dict, model: onnx.ModelProto, found: _Collector, drawn: Noise):
    """(evaluation samples, held-out samples, reference model, its external data files), None where absent or
    failed."""
    from qprep.evaluate import read_labels

    evaluation = heldout = reference = None
    reference_files = []
    if cfg["reference_model"]:
        with found.attempt():
            reference, reference_files = load_model_and_data_files(cfg["reference_model"])
            name_nodes(reference.graph)  # ORT refuses duplicate node names; names do not change numbers
            if drawn.sources:  # its random ops fed the same noise as the model's (named alike: same export)
                reference, _ = taken_out(reference)
        if reference is None:
            return None, None, None, []  # the samples are checked against the reference's inputs
    inputs = [spec for spec in model_info.graph_inputs(reference or model) if spec.name not in drawn.inputs()]
    outputs = [value.name for value in model.graph.output]
    for name in cfg["tasks"]:  # a misspelt output name would leave the output judged by its shape, silently
        if name not in outputs:
            with found.attempt():
                guess = closest(name, outputs)
                raise ConfigError(f"evaluation.tasks: the model has no output '{name}'; "
                                  + (f"did you mean '{guess}'?" if guess else f"its outputs: {', '.join(outputs)}"))
    with found.attempt():
        evaluation = _fed(drawn, load_samples(cfg, inputs, role="evaluation"))
    if evaluation is not None and cfg["labels"]:
        with found.attempt():
            read_labels(Path(cfg["labels"]), cfg["label_names"], evaluation.files)
    if cfg["heldout"]:
        with found.attempt():
            heldout = _fed(drawn, load_samples({**cfg, **cfg["heldout"]}, inputs, role="evaluation.heldout"))
        if heldout is not None and cfg["heldout"]["labels"]:
            with found.attempt():
                read_labels(Path(cfg["heldout"]["labels"]), cfg["label_names"], heldout.files)
        shared = set(heldout.files) & set(evaluation.files) if heldout and evaluation else set()
        if shared:
            with found.attempt():
                raise ConfigError(f"evaluation.heldout shares {len(shared)} samples with evaluation.source "
                                  f"(e.g. {Path(sorted(shared)[0]).name}): held-out samples must be others")
    return evaluation, heldout, reference, reference_files


def _load_model(config: Config) -> tuple[onnx.ModelProto, dict, list[str], list[Path], Noise]:
    """Read and check the model, name its nodes, take its random ops out as noise inputs, fix input dims, infer
    shapes; record what it is. Also the external data files it read and the noise it is fed."""
    path = config["model"]
    model, data_files = load_model_and_data_files(path, rewrites=bool(config.stages))  # none: it only runs
    record = {"model": {**digests(path, data_files), "bytes": Path(path).stat().st_size, **model_info.summary(model)}}
    fed, random = drawn_ops(model)
    if random and config.stages:
        node, why = random[0]
        way_out = ("export the model in eval mode (`model.eval()` before `torch.onnx.export`)"
                   if why.startswith("Dropout") else
                   "remove it from the export, or feed the values it draws as an input")
        raise ModelError(f"model: node '{node.name or node.output[0]}' ({why}) draws random values that reach the "
                         f"outputs, so no comparison with the float model can judge a quantized one; {way_out}")
    named = name_nodes(model.graph)
    drawn = Noise()
    if fed and config.stages:  # measured on the same noise (model/noise.py); the deployable draws it again
        model, drawn = taken_out(model)
    fixed, refused = fix_input_dims_ort_accepts(model, config["inputs"] or {})
    model, warning = infer_shapes(model)
    record["load"] = {"nodes_named": named, "inputs_fixed": fixed,
                      "inputs": [s.as_dict() for s in model_info.graph_inputs(model)]}
    if drawn.sources:
        record["load"]["noise"] = [source.describe() for source in drawn.sources]
    return model, record, _left_symbolic(record, refused) + ([warning] if warning else []), data_files, drawn


def _left_symbolic(record: dict, refused: dict[str, str]) -> list[str]:
    """Inputs whose fixed dims ONNX Runtime refused (fix_input_dims_ort_accepts): recorded for the stage that
    needs them fixed (_dims_ort_cannot_fix) → the run's warnings."""
    if refused:
        record["load"].setdefault("inputs_left_symbolic", {}).update(refused)
    return [left_symbolic_warning(name, problem) for name, problem in refused.items()]


def input_paths(config: Config, data_files=()) -> dict[str, Path]:
    """Every file or folder the run reads (with the model's external data files, once known): what must
    survive it untouched."""
    paths = {"the input model": Path(config["model"])}
    for location in data_files:
        paths[f"the input model's external data {location.name}"] = location
    if config.path:
        paths["the config"] = Path(config.path)
    if config.overlay:
        paths["the config overlay"] = config.overlay
    for role in ("calibration", "evaluation"):
        if config[role]:
            paths[f"the {role} data"] = Path(config[role]["source"])
    evaluation = config["evaluation"] or {}
    for key in ("reference_model", "labels"):
        if evaluation.get(key):
            paths[f"evaluation.{key}"] = Path(evaluation[key])
    for key, value in (evaluation.get("heldout") or {}).items():
        if value:
            paths[f"evaluation.heldout.{key}"] = Path(value)
    module = str(evaluation.get("metric") or "").rpartition(":")[0]  # resolved: a file's path is absolute
    if module.endswith(".py"):
        paths["evaluation.metric's module"] = Path(module)
    return paths


def check_run_dir(config: Config, data_files=(), samples: dict[str, str] | None = None) -> None:
    """The run directory is written by the run and cleared by --force: never an input, inside one, holding
    one, nor home, the current directory or `/` (qprep/disk/guard.py). `samples`: the sample files read."""
    if config["output_dir"]:
        Guard({**input_paths(config, data_files), **(samples or {})}).output_folder(config["output_dir"], "output_dir")


def sample_files(*sets: SampleSet | None) -> dict[str, str]:
    """Every sample file the sets read (described → path), for the output guard."""
    return {f"the sample {path}": path for samples in sets if samples is not None for path in samples.every_file}
