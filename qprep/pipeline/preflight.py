"""Everything a run can check before it touches the run directory; `qprep validate` and `qprep run` share it.

Why: a mistyped `--model`, a missing evaluation folder or NaN in the evaluation samples found after `--force`
cleared the previous run (or after minutes of stage work) costs the user a good result or their time. So the
model, the calibration and evaluation samples, the labels, the reference model and what each stage needs
(calibration data, an installed toolkit) are loaded and checked first, and the run reuses what was loaded.
An input that lies inside the run directory is refused: `--force` would delete it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import onnx

from qprep.model import info as model_info
from qprep.config import Config
from qprep.data import SampleSet, load_samples
from qprep.errors import ConfigError
from qprep.model.prepare import fix_input_shapes, infer_shapes, name_nodes
from qprep.model.io import load_model, load_model_and_data_files, sha256_file
from qprep.progress import Progress
from qprep.pipeline.stages import registry


@dataclass
class Checked:
    """What the checks loaded, handed to the run so nothing is read twice."""

    model: onnx.ModelProto  # nodes named, input dims fixed, shapes inferred
    record: dict  # report["model"] and report["load"]
    calibration: SampleSet | None
    evaluation: SampleSet | None
    reference: onnx.ModelProto | None  # evaluation.reference_model (None: the input model is the reference)
    warnings: list[str] = field(default_factory=list)


def check(config: Config, progress: Progress | None = None) -> Checked:
    """Load and check every input of `config`; raises a one-line QprepError on the first problem."""
    progress = progress or Progress(enabled=False)
    refuse_inputs_inside_run_dir(config)
    for name, options in config.stages:  # cheap, config-only checks before any file is read
        stage = registry()[name]
        if stage.check:
            stage.check(options, config)
    with progress.step("load model"):
        model, record, warnings, data_files = _load_model(config)
    refuse_inputs_inside_run_dir(config, data_files)  # the external data files are known once it is read
    inputs = model_info.graph_inputs(model)
    calibration = evaluation = reference = None
    if config["calibration"]:
        with progress.step("load calibration data"):
            calibration = load_samples(config["calibration"], inputs, role="calibration")
        warnings += calibration.warnings
    if config["evaluation"]:
        cfg = config["evaluation"]
        with progress.step("load evaluation data"):
            if cfg["reference_model"]:
                reference = load_model(cfg["reference_model"])
                name_nodes(reference.graph)  # ORT refuses duplicate node names; names do not change numbers
            evaluation = load_samples(cfg, model_info.graph_inputs(reference or model), role="evaluation")
            if cfg["labels"]:
                from qprep.evaluate import read_labels

                read_labels(Path(cfg["labels"]), cfg["label_names"], evaluation.files)
    return Checked(model=model, record=record, calibration=calibration, evaluation=evaluation,
                   reference=reference, warnings=warnings)


def _load_model(config: Config) -> tuple[onnx.ModelProto, dict, list[str], list[Path]]:
    """Read and check the model, name its nodes, fix input dims, infer shapes; record what it is. Also the
    external data files it read."""
    path = config["model"]
    model, data_files = load_model_and_data_files(path)
    record = {"model": {"path": path, "sha256": sha256_file(path), "bytes": Path(path).stat().st_size,
                        **model_info.summary(model)}}
    named = name_nodes(model.graph)
    fixed = fix_input_shapes(model, config["inputs"] or {})
    model, warning = infer_shapes(model)
    record["load"] = {"nodes_named": named, "inputs_fixed": fixed,
                      "inputs": [s.as_dict() for s in model_info.graph_inputs(model)]}
    return model, record, [warning] if warning else [], data_files


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
    return paths


def refuse_inputs_inside_run_dir(config: Config, data_files=()) -> None:
    """The run directory is cleared by --force and written by the run: no input may live in it (or be it)."""
    if not config["output_dir"]:
        return
    out = Path(config["output_dir"]).resolve()
    for what, path in input_paths(config, data_files).items():
        resolved = path.resolve()
        if resolved == out or out in resolved.parents:
            raise ConfigError(f"output_dir {config['output_dir']} would overwrite {what} ({path}), which lies "
                              "inside it; choose another --out or move the input out of the run directory")
