"""The stage registry: YAML stage names → the function that runs the stage and its option schema.

A stage takes the current ModelProto, the run context and its validated options, and returns a StageResult:
the new model, its record and everything later steps use (the contract: qprep/contract.py). Stage modules
register themselves with `@stage(...)`; `registry()` imports them by name, so config validation and the runner
see the same list. This module sits at the bottom of the package and imports neither the contract nor the
config (both above it): the stages and the config name it, not the other way round.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

from qprep.schema import Key, section

StageFunction = Callable[..., Any]  # qprep.contract.StageFunction: (model, RunContext, options) → StageResult
StageCheck = Callable[[Any, Any], None]  # (options, config): refuses, before the run starts, what would fail
ModelCheck = Callable[[Any, Any], None]  # (options, the loaded model): the same, for the model
FixedDims = Callable[[Any], bool]  # (options): the stage compiles for one input size (open dims taken from samples)
Artifacts = Callable[[Any], tuple]  # (options): the files the stage adds to the run directory (model.rknn)

# Modules that define stages (imported on first use; each registers itself).
STAGE_MODULES: tuple[str, ...] = ("qprep.optimize.stage", "qprep.quantize.stage", "qprep.qdq.remove_redundant", "qprep.keep_float", "qprep.qdq.fuse_conv")


@dataclass
class Stage:
    name: str
    run: StageFunction
    options: Key
    summary: str
    check: StageCheck | None = None
    check_model: ModelCheck | None = None
    fixed_dims: FixedDims | None = None
    artifacts: Artifacts | None = None


REGISTRY: dict[str, Stage] = {}  # filled by @stage as the stage modules are imported; read it through registry()


def stage(name: str, summary: str, check: StageCheck | None = None, check_model: ModelCheck | None = None,
          fixed_dims: FixedDims | None = None, artifacts: Artifacts | None = None,
          **options: Key) -> Callable[[StageFunction], StageFunction]:
    """Register a stage function under its YAML name with the schema of its options; `check` refuses, from the
    config alone, what would make the stage fail after the run started, `check_model` the same from the loaded
    model, `fixed_dims` says the stage needs every input dim fixed (qprep/preflight.py calls all three);
    `artifacts` names the files it adds to the run directory (claimed with it: qprep/pipeline/run_dir.py)."""

    def register(func: StageFunction) -> StageFunction:
        REGISTRY[name] = Stage(name=name, run=func, options=section(**options), summary=summary, check=check,
                               check_model=check_model, fixed_dims=fixed_dims, artifacts=artifacts)
        return func

    return register


def registry() -> dict[str, Stage]:
    for module in STAGE_MODULES:
        importlib.import_module(module)
    return REGISTRY
