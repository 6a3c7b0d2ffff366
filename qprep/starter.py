"""`qprep init MODEL`: a commented starter config written from what the model and the data folder say.

Why: the first config is where new users go wrong — input names and dims, the image normalization the model
was trained with, an evaluation set apart from calibration, a gate. The model answers the first questions
(names, dtypes, layout, dynamic dims, whether it normalizes its own input, LayerNorms, output kinds); the data
folder answers the rest (splits, image size); what neither can answer (mean/std when the model does not
normalize itself) is written as a suggestion with a comment that says so.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import onnx

from qprep.config import SCHEMA
from qprep.data.images import IMAGE_SUFFIXES, guess_layout
from qprep.data.samples import FORMAT_SUFFIXES, MIN_SAMPLES
from qprep.data.pitfalls import normalizes_itself
from qprep.disk.guard import Guard
from qprep.errors import ConfigError, DataError
from qprep.measure.gate import GOOD_FLIPS, ODDS, agreement_target
from qprep.model import info as model_info
from qprep.model.info import TensorSpec
from qprep.model.load import load_model, load_model_and_data_files

# Folder names `--data` may hold, per role (first match wins).
SPLIT_NAMES = {"calibration": ("calib", "calibration", "train"), "evaluation": ("eval", "evaluation", "val"),
               "heldout": ("heldout", "test", "holdout")}
IMAGENET_MEAN, IMAGENET_STD = [123.675, 116.28, 103.53], [58.395, 57.12, 57.375]
BUDGET_S = {"ort": 600, "rknn": 1200}
FILL_IN = "FILL IN"  # marks what neither the model nor the data folder could answer
GUESSED_PREPROCESS = "MUST match its training"  # marks a mean/std suggestion the model cannot confirm
METRICS_SECTION = "Metrics: what the figures mean"  # a heading of README.md (tests/test_starter.py checks it)


def starter_config(model_path: str, config_path: str, backend: str = "ort", data: str | None = None,
                   model: onnx.ModelProto | None = None) -> str:
    """The YAML text of a starter config for `model_path` (loaded, unless `model` is it), for `config_path`."""
    model = model if model is not None else load_model(model_path)
    base = Path(os.path.abspath(config_path)).parent
    inputs = model_info.graph_inputs(model)
    splits = find_splits(Path(data)) if data else {}
    image = image_input(inputs)
    fixed = fixed_dims(inputs, image, splits.get("calibration"), backend)
    run_dir = f"runs/{Path(config_path).stem}"  # one per config: an rknn config's run --force never clears the ort run
    lines = [f"# qprep starter config for {Path(model_path).name}, written by `qprep init`.",
             "# Read every comment, adjust, then: qprep validate THIS_FILE && qprep run THIS_FILE",
             f"model: {_rel(model_path, base)}", ""]
    lines += _inputs_block(inputs, fixed, backend)
    lines += ["calibration:"] + _source_lines("calibration", splits.get("calibration"), base, image, model,
                                              "32-500 samples like the deployment inputs (images, .npy, .npz)")
    samples = gate_samples(splits)
    gate = _gate(model, samples[0])
    lines += _evaluation_block(splits, base, image, model, gate, samples)
    lines += [f"output_dir: {json.dumps(run_dir)}   # next to this file, named after it", ""]
    lines += _pipeline_block(model, backend, gate)
    return "\n".join(lines) + "\n"


def find_splits(folder: Path) -> dict[str, Path]:
    """role → folder inside `folder` (calib/eval/heldout and their synonyms); a folder without them is the
    calibration data."""
    if not folder.is_dir():
        raise ConfigError(f"init --data: folder not found: {folder}")
    children = {p.name.lower(): p for p in folder.iterdir() if p.is_dir()}
    found = {}
    for role, names in SPLIT_NAMES.items():
        match = next((children[name] for name in names if name in children), None)
        if match is not None:
            found[role] = match
    return found or {"calibration": folder}


def image_input(inputs: list[TensorSpec]) -> dict | None:
    """{name, layout, channels} when the model takes one 4-D float input with 1 or 3 channels."""
    if len(inputs) != 1 or not inputs[0].shape or len(inputs[0].shape) != 4 or inputs[0].numpy_dtype.kind != "f":
        return None
    shape = inputs[0].shape
    try:
        layout = guess_layout(shape, "init")  # as the image reader will decide it
    except DataError:
        return None
    return {"name": inputs[0].name, "layout": layout, "channels": shape[1 if layout == "nchw" else 3]}


def fixed_dims(inputs: list[TensorSpec], image: dict | None, calibration: Path | None, backend: str) -> dict:
    """input → dims for `inputs:`, when some dim is dynamic and a value is known: batch 1, image height and
    width from the first calibration image, other dims from the first .npy/.npz sample."""
    fixed = {}
    sample_shapes = _sample_shapes(calibration) if calibration else {}
    for spec in inputs:
        if spec.shape is None or all(isinstance(d, int) for d in spec.shape):
            continue
        known = sample_shapes.get(spec.name)
        dims = list(spec.shape)
        if image and spec.name == image["name"] and calibration is not None:
            size = _first_image_size(calibration)
            if size:
                h_axis, w_axis = (2, 3) if image["layout"] == "nchw" else (1, 2)
                dims[h_axis], dims[w_axis] = size
        elif known and len(known) == len(dims):
            dims = [d if isinstance(d, int) else k for d, k in zip(dims, known)]
        if not isinstance(dims[0], int):
            dims[0] = 1
        if all(isinstance(d, int) for d in dims) or backend == "rknn":
            fixed[spec.name] = dims
    return fixed


def _inputs_block(inputs: list[TensorSpec], fixed: dict, backend: str) -> list[str]:
    lines = ["# The model's inputs (from the graph):"]
    lines += [f"#   {s.name}: {s.dtype} {s.shape}" for s in inputs]
    if not fixed:
        lines += ["# Every dim is fixed or may stay dynamic for this backend; fix dims with `inputs:` if needed.", ""]
        return lines
    open_dims = [name for name, dims in fixed.items() if not all(isinstance(d, int) for d in dims)]
    if open_dims:
        lines.append(f"# {FILL_IN}: the named dims of {', '.join(open_dims)} below; {backend} needs numbers "
                     "(the deployment's input size)")
    lines += ["inputs:   # dynamic dims fixed: batch 1, the others from the calibration data"]
    lines += [f"  {json.dumps(name)}: {json.dumps(dims)}" for name, dims in fixed.items()]
    return lines + [""]


def _source_lines(role: str, folder: Path | None, base: Path, image: dict | None, model: onnx.ModelProto,
                  what: str) -> list[str]:
    """`source:` (the folder found, or a placeholder to fill in) and, for image inputs, `preprocess:` — unless
    the folder found holds no images: preprocess applies to images only, and .npy/.npz samples would leave it
    unread (a mean/std to check that changes nothing)."""
    if folder:
        lines = [f"  source: {_rel(folder, base)}   # {what}"]
    else:
        lines = [f"  source: {json.dumps(f'data/{role}')}   # {FILL_IN}: {what}"]
    if not image or (folder is not None and not _holds_images(folder)):
        return lines
    return lines + _preprocess_lines(image, model, "  ")


def _holds_images(folder: Path) -> bool:
    return any(path.suffix.lower() in IMAGE_SUFFIXES for path in folder.iterdir() if path.is_file())


def _preprocess_lines(image: dict, model: onnx.ModelProto, indent: str) -> list[str]:
    if normalizes_itself(model, image["name"]):
        return [f"{indent}preprocess: {{mean: [0], std: [1]}}   # the model normalizes its input itself: raw 0..255"]
    # the comment says what the written values are: ImageNet's mean/std exist for 3 channels only
    if image["channels"] == 3:
        mean, std = IMAGENET_MEAN, IMAGENET_STD
        choices = ["ImageNet-trained: the values below; inputs in [-1, 1]: mean [127.5], std [127.5];",
                   "inputs in [0, 1]: mean [0], std [255]. channel_order bgr for OpenCV pipelines (PaddleOCR)."]
    else:
        mean, std = [127.5], [127.5]
        choices = ["inputs in [-1, 1]: the values below; inputs in [0, 1]: mean [0], std [255]."]
    return [f"{indent}# The model does not normalize its input: mean/std {GUESSED_PREPROCESS} (0..255 units):",
            *(f"{indent}#   {line}" for line in choices),
            f"{indent}#   (images only: .npy/.npz samples go in as stored)",
            f"{indent}preprocess: {{mean: {json.dumps(mean)}, std: {json.dumps(std)}, channel_order: rgb, "
            f"layout: {image['layout']}}}"]


def _evaluation_block(splits: dict, base: Path, image: dict | None, model: onnx.ModelProto, gate: dict,
                      samples: tuple[int, str]) -> list[str]:
    lines = ["", "evaluation:   # the result against the FP32 model, on samples apart from calibration"]
    lines += _source_lines("evaluation", splits.get("evaluation"), base, image, model,
                           "other samples than calibration (the fallback chooses on these)")
    heldout = splits.get("heldout")
    if heldout:
        lines.append(f"  heldout: {{source: {_rel(heldout, base)}}}   # never seen by a decision; judges the gate")
    else:
        lines.append("  # heldout: {source: data/heldout}   # recommended: samples no decision sees judge the gate")
    lines += [f"  gate: {_flow(gate)}   # a miss exits 1; good values: README.md, '{METRICS_SECTION}'"]
    if "top1_agreement" in gate:
        count, source = samples
        flips = agreement_target(count)[1]
        lines.append(f"  # top1_agreement {gate['top1_agreement']:g}: on {count} samples ({source}) one sample is "
                     f"{100 / count:.1f}%; a good INT8 result (about {GOOD_FLIPS:.0%} of top-1 flips) meets it with "
                     f"{ODDS:.0%} odds ({flips} flips allowed). More samples: a higher target (0.97 from ~500)")
    return lines + [""]


def _pipeline_block(model: onnx.ModelProto, backend: str, gate: dict) -> list[str]:
    from qprep.inspection import count_layernorms

    layernorms = count_layernorms(model)  # as `qprep inspect` counts them: what optimize would fuse
    lines = ["pipeline:", "  - optimize: {}                # verified rewrites: folding, fusions, shape cleanup"]
    if layernorms:
        lines.append(f"  - keep_float: {{}}              # its {layernorms} LayerNorms stay float")
    if backend == "fp16":
        lines.append("  - quantize: {backend: fp16}")
        return lines
    lines.append("  - quantize:")
    lines.append(f"      backend: {backend}")
    if backend == "rknn":
        lines.append("      rknn: {target_platform: rk3588}   # your SoC: rk3562, rk3566, rk3568, rk3576, rk3588, ...")
    lines.append(f"      fallback: {{target: {_flow(gate)}, time_budget_s: {BUDGET_S[backend]}}}   "
                 "# layers kept float until the target is met")
    return lines


def _gate(model: onnx.ModelProto, samples: int) -> dict:
    """cosine 0.99 (outputs judged otherwise — probabilities, states, ids — are held to their own metric at the
    same level), and a top-1 agreement that a good INT8 result meets on `samples` (agreement_target) when the
    first output looks like single-label class scores ([N, C], not a Sigmoid: multi-label outputs are judged as
    probabilities)."""
    outputs = model_info.graph_outputs(model)
    gate = {"cosine_mean": 0.99}
    shape = outputs[0].shape if outputs else None
    classes = shape and len(shape) == 2 and isinstance(shape[-1], int) and shape[-1] >= 2
    producer = next((n.op_type for n in model.graph.node if outputs and outputs[0].name in n.output), None)
    if classes and outputs[0].dtype.startswith("float") and producer != "Sigmoid":
        gate["top1_agreement"] = agreement_target(samples)[0]
    return gate


def gate_samples(splits: dict) -> tuple[int, str]:
    """(how many samples the gate is judged on, where that count comes from): the held-out folder's when given
    (it judges the gate), else the evaluation folder's, capped by evaluation.max_samples; the README's "a few
    dozen" (MIN_SAMPLES) when no folder is known yet."""
    cap = SCHEMA.fields["evaluation"].fields["max_samples"].default
    counts = {role: _count(splits[role]) for role in ("heldout", "evaluation") if splits.get(role)}
    counts = {role: min(count, cap) for role, count in counts.items() if count}
    if counts:
        role = "heldout" if "heldout" in counts else "evaluation"
        return counts[role], f"the {role.replace('heldout', 'held-out')} samples found"
    return MIN_SAMPLES, "a few dozen samples, as the README asks"


def _count(folder: Path) -> int:
    suffixes = set().union(*FORMAT_SUFFIXES.values())
    return sum(1 for p in folder.iterdir() if p.is_file() and p.suffix.lower() in suffixes)


def _sample_shapes(folder: Path) -> dict[str, tuple]:
    """input → shape of the first .npz sample in `folder` (what `inputs:` can be fixed to)."""
    import numpy as np

    for path in sorted(folder.iterdir()):
        if path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as arrays:
                return {name: arrays[name].shape for name in arrays.files}
    return {}


def _first_image_size(folder: Path) -> tuple[int, int] | None:
    from PIL import Image

    for path in sorted(folder.iterdir()):
        if path.suffix.lower() in IMAGE_SUFFIXES:
            with Image.open(path) as img:
                return img.height, img.width
    return None


def _rel(path, base: Path) -> str:
    """A path (relative to the current directory) as the config holds it: relative to the config's folder
    (how qprep resolves it) when it lies near it, else absolute."""
    target = os.path.abspath(path)
    relative = os.path.relpath(target, base)
    return json.dumps(relative if not relative.startswith(os.pardir * 2) else target)


def _flow(mapping: dict) -> str:
    return "{" + ", ".join(f"{k}: {v}" for k, v in mapping.items()) + "}"


def what_to_review(text: str) -> str:
    """What the user must still do with a starter config: the FILL IN lines and the guessed mean/std where the
    config has them (a config with neither needs only its comments read)."""
    todo = []
    fill_in = sum(FILL_IN in line for line in text.splitlines())
    if fill_in:
        todo.append(f"fill in the {fill_in} line{'s' if fill_in > 1 else ''} marked {FILL_IN}")
    if GUESSED_PREPROCESS in text:
        todo.append("check the suggested preprocess mean/std against the model's training")
    return " and ".join(todo) if todo else "read its comments"


def write_starter(model_path: str, config_path: str, backend: str, data: str | None, force: bool,
                  guard: Guard | None = None) -> tuple[Path, str]:
    """The starter config at `config_path`, written through the command's guard (never over the model, into
    the data folder or through a symlink; `force` replaces only a file that is none of those), and its text."""
    out = Path(config_path)
    guard = guard or Guard({"the model": model_path, "the data folder": data})
    model, data_files = load_model_and_data_files(model_path)
    guard.add_inputs({f"the model's external data {f.name}": f for f in data_files})
    guard.output_file(out, "--out")
    if os.path.lexists(out) and not force:
        raise ConfigError(f"init: {out} exists; choose another --out or add --force to replace it")
    text = starter_config(model_path, str(out), backend, data, model)
    guard.write_text(out, text, "--out")
    return out, text
