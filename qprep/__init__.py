"""qprep: quantization preparation for ONNX models (verified graph rewrites, QDQ cleanup, ORT/RKNN/FP16
quantization, and a report of the accuracy lost against the float model).

Python API mirroring the CLI:

    import qprep
    report = qprep.run("configs/rknn_int8.yaml", output_dir="runs/x", force=True,
                       **{"calibration.max_samples": 16})
"""

from __future__ import annotations

from qprep.version import __version__

__all__ = ["__version__", "run"]


def run(config, *, force: bool = False, quiet: bool = True, **overrides) -> dict:
    """Run a config (YAML path or dict); overrides are config key paths (`a.b` or `a__b`) → values.

    Returns the report as a dict (also written to the run directory). Raises `qprep.errors.QprepError`
    subclasses for user errors.
    """
    from qprep.config import load_config
    from qprep.pipeline.runner import execute

    paths = {key.replace("__", "."): value for key, value in overrides.items()}
    return execute(load_config(config, paths), force=force, quiet=quiet)
