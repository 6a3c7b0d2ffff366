"""The files a board needs next to model.rknn: input_contract.json (what to feed each input, how to read each
output) and run_on_board.py (an example runner for rknn-toolkit-lite2).

Each input states two facts apart, so they never read as one contradicting description: `onnx_input` is what the
ONNX model takes (shape, dtype, layout when known), `feed` is what model.rknn is fed on the board (shape, dtype,
layout, the data_format rknn-toolkit-lite2 is told, and for an image the NPU normalizes: raw pixels, channel
order (rgb, bgr, or gray for a 1-channel image), resize, and the mean/std the NPU applies). run_on_board.py and
the report's deployment text (report/decisions.py) read the same fields. Each output carries its shape, and the
model's `character` metadata only where it applies: a CTC dictionary on per-step scores over its symbols and the
blank (measure/ctc.py's rule), class names on [N, C] scores with one class per symbol (a text-orientation
classifier's angles).

run_on_board.py is a file of this package, shipped as package data (pyproject.toml), copied as it is: it
runs on the board, never in qprep, and reads the contract written here.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import onnx

from qprep.measure import ctc
from qprep.model.info import graph_outputs

NOT_FED = "not fed: no node of the model reads it, and model.rknn has no such input (run_on_board.py skips it)"


def input_contract(inputs, normalization: dict | None, options, ignored=(), model: onnx.ModelProto | None = None
                   ) -> dict:
    """Per input its ONNX input and its feed: where the NPU normalizes (dataset.py, an NCHW image input), uint8
    NHWC pixels in the calibration's channel order with the mean/std the model was built with; any other input,
    the array as the ONNX model takes it. `ignored`: the user's inputs no node reads, which model.rknn does not
    have (static_graph/hygiene.py): listed, marked ignored, so a caller that feeds every input of the ONNX model
    knows which ones to leave out. `model`: the outputs, and the character list each one is read with."""
    contract = {"target_platform": options.target_platform, "inputs": []}
    for spec in inputs:
        normalized = bool(normalization) and spec.name == normalization["input"] and spec.name not in ignored
        entry = {"name": spec.name, "onnx_input": {"shape": spec.shape, "dtype": spec.dtype}}
        if normalized:
            entry["onnx_input"]["layout"] = normalization["layout"].upper()
        if spec.name in ignored:
            entry.update(ignored=True, feed=NOT_FED)
        elif normalized:
            entry["feed"] = pixel_feed(spec.shape, normalization)
        else:
            entry["feed"] = {"shape": spec.shape, "dtype": spec.dtype, "values": "the array as given to the ONNX model",
                             **({"data_format": "nchw"} if _rank(spec.shape) == 4 else {})}
        contract["inputs"].append(entry)
    if model is not None:
        contract["outputs"] = output_entries(model)
    return contract


def pixel_feed(shape, normalization: dict) -> dict:
    """The feed of an input the NPU normalizes: raw pixels, NHWC (rknn-toolkit-lite2's default data_format), so
    a decoded image goes in as it is."""
    nhwc = list(shape)
    if _rank(shape) == 4 and normalization["layout"] == "nchw":
        nhwc = [shape[0], shape[2], shape[3], shape[1]]
    order = channel_order(normalization["channel_order"], image_channels(shape, normalization["layout"]))
    return {"shape": nhwc, "dtype": "uint8", "layout": "NHWC", "data_format": "nhwc", "values": "raw pixels",
            "channel_order": order, "resize": normalization.get("resize", "stretch"),
            "mean": normalization["mean"], "std": normalization["std"], "mean_std_applied_by": "npu"}


GRAY = "gray"


def channel_order(order: str, channels) -> str:
    """The channel order an image input is fed in: `gray` for one channel (the calibration read the image as
    grayscale, data/images.py), whatever the config's `channel_order` (its rgb default means nothing there),
    else the config's rgb or bgr. The contract states it, and the board runner and the report's deployment text
    read it from there; a 1-channel model was fed an RGB image."""
    return GRAY if channels == 1 else order


def image_channels(shape, layout: str):
    """The channel count of a 4-D image input in `layout` (nchw or nhwc), or None when its shape says nothing."""
    if _rank(shape) != 4:
        return None
    return shape[1] if str(layout).lower() == "nchw" else shape[3]


def output_entries(model: onnx.ModelProto) -> list[dict]:
    """Per output of the model, in model.rknn's order: name, shape, dtype, and the model's character list where
    its shape says how it is read. Written before the evaluation, so by the shape half of its rule
    (measure/kinds.py judges an output `ctc` when it is per-step scores whose class count fits the dictionary):
    a classifier's [N, C] scores never get a CTC dictionary."""
    symbols = ctc.dictionary(model)
    entries = []
    for spec in graph_outputs(model):
        entry = {"name": spec.name, "shape": spec.shape, "dtype": spec.dtype}
        classes = spec.shape[-1] if spec.shape and isinstance(spec.shape[-1], int) else None
        if symbols and classes and _rank(spec.shape) == 3 and ctc.fits(symbols, classes):
            entry["ctc_characters"] = symbols
        elif symbols and classes and _rank(spec.shape) == 2 and classes == len(symbols):
            entry["class_names"] = symbols
        entries.append(entry)
    return entries


def _rank(shape) -> int | None:
    return len(shape) if isinstance(shape, list) else None


def write_board_files(work: Path, inputs, normalization: dict | None, options, model: onnx.ModelProto,
                      ignored=()) -> dict[str, Path]:
    """input_contract.json and run_on_board.py in `work` → artifact name → path. `inputs`: the user's model's;
    `ignored`: those model.rknn does not take; `model`: the model built, whose outputs model.rknn has."""
    contract = input_contract(inputs, normalization, options, ignored, model)
    (work / "input_contract.json").write_text(json.dumps(contract, indent=2) + "\n")
    script = resources.files(__package__).joinpath("run_on_board.py").read_text()
    (work / "run_on_board.py").write_text(script)
    return {"input_contract.json": work / "input_contract.json", "run_on_board.py": work / "run_on_board.py"}
