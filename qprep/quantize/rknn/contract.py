"""The files a board needs next to model.rknn: input_contract.json (what to feed each input) and
run_on_board.py (an example runner for rknn-toolkit-lite2).

run_on_board.py is a file of this package, shipped as package data (pyproject.toml), copied as it is: it
runs on the board, never in qprep, and reads the contract written here.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path


def input_contract(inputs, normalization: dict | None, options: dict, ignored=()) -> dict:
    """Per input: its shape and dtype, and how to feed it; where the NPU normalizes (dataset.py), uint8
    pixels in the calibration's channel order with the mean/std the model was built with. `ignored`: the user's
    inputs no node reads, which model.rknn does not have (static_graph/hygiene.py): listed, marked ignored, so a
    caller that feeds every input of the ONNX model knows which ones to leave out."""
    contract = {"target_platform": options.target_platform, "inputs": []}
    for spec in inputs:
        entry = {"name": spec.name, "shape": spec.shape, "dtype": spec.dtype}
        if spec.name in ignored:
            entry.update(ignored=True, feed="not fed: no node of the model reads it, and model.rknn has no such "
                                            "input (run_on_board.py skips it)")
        elif normalization and spec.name == normalization["input"]:
            entry.update(feed="uint8 pixels, NHWC, in this channel order; the NPU applies (x - mean) / std",
                         channel_order=normalization["channel_order"], mean=normalization["mean"],
                         std=normalization["std"], resize=normalization.get("resize", "stretch"))
        else:
            entry["feed"] = f"{spec.dtype} array of this shape, as given to the ONNX model"
        contract["inputs"].append(entry)
    return contract


def write_board_files(work: Path, inputs, normalization: dict | None, options: dict,
                      characters: list[str] | None = None, ignored=()) -> dict[str, Path]:
    """input_contract.json and run_on_board.py in `work` → artifact name → path. `inputs`: the user's model's;
    `ignored`: those model.rknn does not take. `characters`: an OCR model's CTC dictionary (its metadata,
    measure/ctc.py), so the board runner prints text, not class ids."""
    contract = input_contract(inputs, normalization, options, ignored)
    if characters:
        contract["ctc_characters"] = characters
    (work / "input_contract.json").write_text(json.dumps(contract, indent=2) + "\n")
    script = resources.files(__package__).joinpath("run_on_board.py").read_text()
    (work / "run_on_board.py").write_text(script)
    return {"input_contract.json": work / "input_contract.json", "run_on_board.py": work / "run_on_board.py"}
