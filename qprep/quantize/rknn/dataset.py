"""What the toolkit calibrates and runs on: dataset.txt, and the normalization the NPU applies.

Facts this module is built on (measured with rknn-toolkit2 2.5.0, see ../shared/notes/rknn-toolkit2.md):
- mean/std in `config` apply to `.npy` calibration files too, and RGB→BGR does not: for image sources the
  raw pixels (already in the model's channel order) go to dataset.txt and the normalization to the config,
  so it runs on the NPU and becomes the deployed input contract (contract.py). `.npy` files must be NCHW.
- so the simulator is fed raw pixels too (runner.py): qprep's normalized evaluation samples are undone here.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from qprep.errors import QprepError
from qprep.model.info import graph_inputs
from qprep.quantize.backend import QuantizeJob


def normalization(job: QuantizeJob) -> dict | None:
    """mean/std for RKNN.config when calibration comes from images (normalization then runs on the NPU).
    Not for a channels-last input: the toolkit takes a 4-D ONNX input's dim 1 as its channels (an NHWC
    [1,128,128,3] face detector: "The len of mean_values ([127.5, 127.5, 127.5]) for input 0 is wrong, expect
    128!"), so such a model gets qprep's normalized samples and the board normalizes as the contract says."""
    reader = job.calibration.image_reader if job.calibration is not None else None
    if reader is None or reader.layout != "nchw":
        return None
    channels = reader.channels
    mean = reader.mean.tolist() if reader.mean is not None else [0.0] * channels
    std = reader.std.tolist() if reader.std is not None else [1.0] * channels
    return {"input": reader.input.name, "mean": mean, "std": std, "channel_order": reader.channel_order,
            "layout": reader.layout, "resize": reader.resize}


def write_dataset(job: QuantizeJob, work: Path, normalization: dict | None) -> Path:
    """dataset.txt: one line per sample, one NCHW .npy per input (raw pixels when the NPU normalizes)."""
    if job.calibration is None:
        raise QprepError("quantize.rknn: calibration data is required; add `calibration: {source: <folder>}`")
    folder = work / "dataset"
    folder.mkdir(exist_ok=True)
    lines = []
    count = min(job.max_samples, len(job.calibration))
    for index in range(count):
        paths = []
        for spec in graph_inputs(job.model):
            if normalization and spec.name == normalization["input"]:
                array = job.calibration.image_reader.read_raw(Path(job.calibration.files[index]))
                if normalization["layout"] == "nhwc":
                    array = array.transpose(0, 3, 1, 2)
                array = np.ascontiguousarray(array)
            else:
                array = job.calibration.samples[index][spec.name]
            path = folder / f"{index:04d}_{file_safe(spec.name)}.npy"
            np.save(path, array)
            paths.append(str(path))
        lines.append(" ".join(paths))
    dataset = work / "dataset.txt"
    dataset.write_text("\n".join(lines) + "\n")
    return dataset


def count_lines(path: Path) -> int:
    """The samples in a dataset.txt (its non-empty lines)."""
    return sum(1 for line in path.read_text().splitlines() if line.strip())


def raw_pixels(array: np.ndarray, normalization: dict) -> np.ndarray:
    """A normalized sample of the normalized input back to the pixels the NPU normalizes itself, NCHW."""
    shape = (1, -1, 1, 1) if normalization["layout"] == "nchw" else (1, 1, 1, -1)
    mean = np.asarray(normalization["mean"], np.float32).reshape(shape)
    std = np.asarray(normalization["std"], np.float32).reshape(shape)
    array = array * std + mean
    if normalization["layout"] == "nhwc":
        array = array.transpose(0, 3, 1, 2)
    return array


def file_safe(name: str) -> str:
    """An input name as part of a file name."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)
