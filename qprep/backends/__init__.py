"""Quantization backends behind the one `quantize` stage: ONNX Runtime static INT8 (ort.py), FP16 (fp16.py),
and later RKNN. Each takes the prepared float model, calibration samples and the float set (node names that
must stay float) and returns a `Quantized` result; qprep/backends/quantize.py is the stage that dispatches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import onnx


@dataclass
class Quantized:
    """A backend's result: the ONNX model that continues down the pipeline (None when the artifact is not
    ONNX), extra deployable files, an optional runner for evaluation, and facts for the record."""

    model: onnx.ModelProto | None
    details: dict = field(default_factory=dict)
    artifacts: dict[str, Path] = field(default_factory=dict)  # file name in the run dir → where it is now
    runner: Callable[[list[dict]], list[dict]] | None = None  # None: evaluate the ONNX model with ORT
