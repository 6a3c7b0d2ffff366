"""The ONNX file the toolkit loads, and how its weights get their integers (`weight_rounding`).

Why: the toolkit cannot be handed integers, only a model file; qprep chooses the integers by what it writes
there. GPTQ writes its weights onto the toolkit's own grid (weights.py); mmse's weight ranges leave the model as
prepared and go to hybrid step1 instead (ranges.py); nearest leaves everything to the toolkit. The file is
written only when another model goes there (a big model's write takes seconds).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import onnx

from qprep.errors import QprepError
from qprep.model.io import save_model
from qprep.quantize.backend import QuantizeJob
from qprep.quantize.rknn import io_names

log = logging.getLogger("qprep")

# calibration samples of the mmse build whose weight ranges `weight_rounding: mmse` takes. The toolkit's mmse gain
# is in its weight ranges (normal builds with them score as an mmse build does, with its activation ranges they
# do not), and a build on 8 samples gives them at a fraction of a full mmse build (fewer lose accuracy); nearest
# rounding on mmse's grid beat GPTQ on it. Which 8 matters (8 spread over the calibration lines fell below GPTQ),
# so the fallback measures the harvest against the weights as they are and keeps it only where it wins; the
# first 8 are the ones measured (BENCHMARKS.md: "mmse's weight ranges without an mmse build per trial").
MMSE_WEIGHT_SAMPLES = 8

MmseBuild = Callable[[Path], dict]  # an mmse build on the given dataset file → its quantization table


class ModelFile:
    """`path` holds the model the toolkit loads: `job.model` with GPTQ weights (made once) or as prepared.
    `weight_rounding` is the method asked for (the fallback may change it); `weights_in_use` says which one a
    build under a given range algorithm gets, and `record` what the report says of it."""

    def __init__(self, job: QuantizeJob, renames: dict[str, str], path: Path, dataset: Path):
        self.job, self.options, self.renames, self.path, self.dataset = job, job.options, renames, path, dataset
        self.weight_rounding: str = job.options.weight_rounding
        self.record: dict = {}  # the report's weight_rounding entry, as of the last save
        self._on_grid: onnx.ModelProto | None = None  # the model with GPTQ weights, made once
        self._grid_record: dict = {}
        self._weight_table: dict | None = None  # weight_rounding mmse: the int8 weight entries step1 is given
        self._weight_record: dict = {}
        self._written: onnx.ModelProto | None = None  # the model in path (write)

    def rounds_weights(self) -> bool:
        """Is this a build whose weight grid qprep knows (w8a8, per channel, calibrated)?"""
        options = self.options
        return bool(options.do_quantization and options.quantized_dtype == "w8a8"
                    and options.quantized_method == "channel" and self.job.samples)

    def weights_in_use(self, algorithm: str) -> str:
        """How the weights get their integers under `algorithm`'s activation ranges, where chosen and measured:
        gptq (weights.py) under `normal` ranges, mmse (its weight ranges from a few samples, mmse_weight_ranges)
        under `normal` or `kl_divergence` ones; else the toolkit's own: nearest, or the search of its mmse
        algorithm."""
        if self.rounds_weights():
            if self.weight_rounding == "mmse" and algorithm in ("normal", "kl_divergence"):
                return "mmse"
            if self.weight_rounding == "gptq" and algorithm == "normal":
                return "gptq"
        return "mmse search" if algorithm == "mmse" else "nearest"

    def weight_table(self, algorithm: str) -> dict | None:
        """mmse's int8 weight entries, where a build under `algorithm` takes them (hybrid step1 is given them)."""
        return self._weight_table if self.weights_in_use(algorithm) == "mmse" else None

    def holds(self) -> str:
        """Which model the file holds: "gptq" (GPTQ's weights) or "prepared" (what step1's outputs are kept by)."""
        return "gptq" if self._written is self._on_grid else "prepared"

    def save(self, algorithm: str, mmse_build: MmseBuild, otherwise: str = "gptq") -> None:
        """The file for builds under `algorithm`: with GPTQ weights where the toolkit's weight grid is the one
        weights.py reproduces, else the model as prepared (mmse weight ranges are given to step1). Where mmse's
        weight ranges are wanted and their build fails, the weights are rounded the `otherwise` way."""
        if self.weights_in_use(algorithm) == "mmse" and self._weight_table is None:
            try:
                self._weight_table = self.mmse_weight_ranges(mmse_build)
            except (ValueError, QprepError) as exc:
                if getattr(exc, "crashed", False):  # the worker died: nothing can be built any more
                    raise
                log.warning("rknn: mmse weight ranges unavailable (%s); the weights are rounded %s", exc, otherwise)
                self.weight_rounding = otherwise
        weights = self.weights_in_use(algorithm)
        if weights == "gptq" and self._on_grid is None:
            from qprep.quantize.rknn import weights as rknn_weights

            start = time.perf_counter()
            self._on_grid, layers, left = rknn_weights.on_grid(self.job.model, self.job.samples, self.job.threads)
            self._grid_record = {"method": "gptq", "layers": layers, **left,
                                 "seconds": round(time.perf_counter() - start, 1)}
            log.info("rknn: GPTQ weights on the toolkit's grid for %d layers", layers)
        self.record = {"gptq": self._grid_record, "mmse": self._weight_record}.get(weights, {"method": weights})
        self.write(self._on_grid if weights == "gptq" else self.job.model)

    def write(self, model: onnx.ModelProto) -> None:
        """`model` where the toolkit loads it, unless it is there already (a big model's write takes seconds)."""
        if model is not self._written:
            # io.save_model: over 2 GB the weights go to external data beside it, which the toolkit reads
            # (onnx.save_model wrote a 2.2 GB single file that the toolkit's load_onnx could not parse)
            save_model(io_names.renamed(model, self.renames), self.path)
            self._written = model

    def mmse_weight_ranges(self, mmse_build: MmseBuild) -> dict[str, dict]:
        """The int8 weight entries of `mmse_build` on MMSE_WEIGHT_SAMPLES calibration samples of the model as
        prepared: mmse's gain is in its weight ranges (MMSE_WEIGHT_SAMPLES), and they come from a few samples
        at a fraction of a full mmse build. ValueError if the toolkit's table cannot be read."""
        start = time.perf_counter()
        self.write(self.job.model)
        few = self.dataset.with_name("dataset_mmse_weights.txt")
        lines = self.dataset.read_text().splitlines(keepends=True)[:MMSE_WEIGHT_SAMPLES]
        few.write_text("".join(lines))
        table = mmse_build(few)
        weights = {name: entry for name, entry in table.items()
                   if entry["qmethod"] == "channel" and entry["dtype"] == "int8"}
        if not weights:
            raise ValueError("the mmse build's table holds no per-channel int8 weights")
        self._weight_record = {"method": "mmse", "calibration_samples": len(lines), "weights": len(weights),
                               "seconds": round(time.perf_counter() - start, 1)}
        log.info("rknn: weight ranges of an mmse build on %d calibration samples for %d weights (%.0f s)",
                 len(lines), len(weights), time.perf_counter() - start)
        return weights
