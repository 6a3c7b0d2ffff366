"""Run model.rknn on a Rockchip board with rknn-toolkit-lite2 (pip install rknn-toolkit-lite2 on the board).

    python3 run_on_board.py image.png        # a model whose input the NPU normalizes (see input_contract.json)
    python3 run_on_board.py sample.npz       # any model: one array per input name, as given to the ONNX model
                                             # (inputs the contract marks ignored are skipped: model.rknn lacks them)

Images are resized the way the calibration images were (input_contract.json: stretch, center_crop, or none:
the image must already have the model's size). Each output is printed for what it looks like: top-5 classes of a
[1, classes] output, the arg-max per step of a [1, steps, classes] sequence (read as text by greedy CTC decoding
when input_contract.json carries the model's character list: blank 0, repeats collapsed), otherwise shape and
value range.
"""
import json
import sys

import numpy as np
from rknnlite.api import RKNNLite


def image_input(spec, path):
    from PIL import Image

    n, c, h, w = spec["shape"]
    image = Image.open(path).convert("RGB")
    if spec.get("resize") == "none":
        assert (image.height, image.width) == (h, w), f"{path} is {image.width}x{image.height}; the model takes {w}x{h}"
    elif spec.get("resize") == "center_crop":
        scale = max(h / image.height, w / image.width)
        image = image.resize((max(w, round(image.width * scale)), max(h, round(image.height * scale))),
                             Image.BILINEAR)
        left, top = (image.width - w) // 2, (image.height - h) // 2
        image = image.crop((left, top, left + w, top + h))
    elif (image.height, image.width) != (h, w):
        image = image.resize((w, h), Image.BILINEAR)
    pixels = np.asarray(image, dtype=np.uint8)
    if spec.get("channel_order") == "bgr":
        pixels = pixels[:, :, ::-1]
    return np.ascontiguousarray(pixels[None])  # NHWC uint8; the NPU normalizes


def ctc_text(steps, characters):
    """Greedy CTC: repeats collapsed, blank (class 0) dropped; class i is characters[i - 1], the next a space.
    The rule of qprep's measure/ctc.py, written out here because this file runs on the board without qprep."""
    kept = [int(s) for i, s in enumerate(steps) if s != 0 and (i == 0 or s != steps[i - 1])]
    return "".join(characters[s - 1] if s <= len(characters) else " " for s in kept)


def describe(index, out, characters=None):
    if out.ndim == 2 and out.shape[0] == 1 and out.shape[1] > 1:
        top = np.argsort(out[0])[::-1][:5]
        return f"output {index}: top-5 " + ", ".join(f"{int(k)} ({float(out[0, k]):.4g})" for k in top)
    if out.ndim == 3 and out.shape[0] == 1 and out.shape[2] > 1:
        steps = np.argmax(out[0], axis=-1)
        if characters and out.shape[2] in (len(characters) + 1, len(characters) + 2):
            return f"output {index}: text {ctc_text(steps.tolist(), characters)!r}"
        return f"output {index}: arg-max per step ({len(steps)} steps) {steps.tolist()}"
    return (f"output {index}: shape {list(out.shape)}, min {float(out.min()):.4g}, max {float(out.max()):.4g}, "
            f"mean {float(out.mean()):.4g}")


contract = json.load(open("input_contract.json"))
specs = [spec for spec in contract["inputs"] if not spec.get("ignored")]  # no node read them: not in model.rknn
if sys.argv[1].endswith((".npz", ".npy")):
    arrays = np.load(sys.argv[1])
    feeds = [np.ascontiguousarray(arrays if sys.argv[1].endswith(".npy") else arrays[spec["name"]]) for spec in specs]
else:
    assert len(specs) == 1 and "mean" in specs[0], "this model's inputs are not one image: give a .npz sample"
    feeds = [image_input(specs[0], sys.argv[1])]
rknn = RKNNLite()
assert rknn.load_rknn("model.rknn") == 0, "load_rknn failed"
assert rknn.init_runtime() == 0, "init_runtime failed"
for i, out in enumerate(rknn.inference(inputs=feeds)):
    print(describe(i, np.asarray(out), contract.get("ctc_characters")))
rknn.release()
