"""A build on the x86 simulator: evaluation samples in, outputs out, and the toolkit's per-layer
accuracy_analysis as the rows of the report's layer table (and of the search's ranking, search.py).

The simulator and accuracy_analysis need the build in the same RKNN object (a `.rknn` loaded back runs only
on a board), so a Runner holds the handle of a built object in the toolkit worker.
"""

from __future__ import annotations

import shutil

import numpy as np
import onnx

from qprep.model.info import graph_inputs, graph_outputs
from qprep.quantize.rknn import ranges as rknn_ranges
from qprep.quantize.rknn.dataset import file_safe, raw_pixels
from qprep.quantize.rknn.io_names import translated
from qprep.quantize.rknn.names import parse_error_analysis
from qprep.quantize.rknn.toolkit import Toolkit


class Runner:
    """Runs evaluation samples on the simulator; undoes qprep's normalization where the NPU normalizes."""

    def __init__(self, rknn: int, toolkit: Toolkit, model: onnx.ModelProto, normalization: dict | None,
                 renames: dict[str, str] | None = None):
        """`renames`: the graph input/output names the toolkit was given instead of the model's (io_names.py);
        inputs and outputs go by position, analysis rows are named back."""
        self.rknn, self.toolkit, self.normalization = rknn, toolkit, normalization
        self._original = {new: old for old, new in (renames or {}).items()}
        self.inputs = graph_inputs(model)
        self.outputs = graph_outputs(model)

    def _feeds(self, sample: dict) -> list[np.ndarray]:
        feeds = []
        for spec in self.inputs:
            array = sample[spec.name]
            if self.normalization and spec.name == self.normalization["input"]:
                array = raw_pixels(array, self.normalization)
            feeds.append(np.ascontiguousarray(array.astype(np.float32) if array.dtype == np.float64 else array))
        return feeds

    def __call__(self, samples: list[dict]) -> list[dict]:
        results = []
        # data_format: one entry per input, and the toolkit calls .lower() on each, so no None entries;
        # 'nchw' describes our 4-D arrays and is ignored for other ranks.
        formats = ["nchw"] * len(self.inputs) if any(len(spec.shape) == 4 for spec in self.inputs) else None
        for sample in samples:
            outs = self.toolkit.call("inference", self.rknn, "inference", inputs=self._feeds(sample),
                                     data_format=formats)
            results.append({spec.name: self._shaped(out, spec) for spec, out in zip(self.outputs, outs)})
        return results

    def quantization_table(self) -> dict[str, dict]:
        """The build's quantization table (rknn_ranges.table_of, read in the worker); ValueError if unreadable."""
        return self.toolkit.apply("quantization table", self.rknn, rknn_ranges.table_of)

    @staticmethod
    def _shaped(array: np.ndarray, spec) -> np.ndarray:
        shape = spec.shape or []
        if shape and all(isinstance(d, int) for d in shape) and int(np.prod(shape)) == array.size:
            return array.reshape(shape)
        return array

    def analyze(self, samples: list[dict]) -> list[dict]:
        """accuracy_analysis per sample (one per call) → per-layer rows; the tensor dumps are deleted."""
        rows_by_tensor: dict[str, list[dict]] = {}
        order: list[str] = []
        for index, sample in enumerate(samples):
            out_dir = self.toolkit.work_dir / f"analysis_{index}"
            paths = []
            for spec, array in zip(self.inputs, self._feeds(sample)):
                path = self.toolkit.work_dir / f"analysis_{index}_{file_safe(spec.name)}.npy"
                np.save(path, array)
                paths.append(str(path))
            self.toolkit.call("accuracy_analysis", self.rknn, "accuracy_analysis", inputs=paths,
                              output_dir=str(out_dir))
            for row in parse_error_analysis((out_dir / "error_analysis.txt").read_text()):
                row["tensor"] = translated(row["tensor"], self._original)
                if row["tensor"] not in rows_by_tensor:
                    order.append(row["tensor"])
                rows_by_tensor.setdefault(row["tensor"], []).append(row)
            shutil.rmtree(out_dir, ignore_errors=True)
        layers = []
        for position, tensor in enumerate(order):
            rows = [r for r in rows_by_tensor[tensor] if "entire_cosine" in r]
            if not rows:
                continue  # fused into a neighbour: no numbers of its own
            layers.append({"tensor": tensor, "node": tensor, "op_type": rows[0]["op_type"], "order": position,
                           "cosine_mean": float(np.mean([r["entire_cosine"] for r in rows])),
                           "single_cosine": float(np.mean([r["single_cosine"] for r in rows])),
                           "sqnr_db": None, "quantized": True, "source": "rknn accuracy_analysis"})
        return sorted(layers, key=lambda r: (r["cosine_mean"], r["order"]))
