"""Run model.rknn on a Rockchip board with rknn-toolkit-lite2 (pip install rknn-toolkit-lite2 on the board).

    python3 run_on_board.py image.png        # one input, raw pixels the NPU normalizes (input_contract.json)
    python3 run_on_board.py sample.npz       # any model: one array per input name, each as its `feed` says
                                             # (inputs the contract marks ignored are skipped: model.rknn lacks them)

Each input is fed as input_contract.json's `feed` says: its shape and dtype, and the data_format rknn-toolkit-lite2
is told (a 4-D array: NHWC pixels, or NCHW for an array in the ONNX model's own dims). An image is read in the
contract's channel_order (rgb, bgr, or gray: one channel) and resized the way the calibration images were
(stretch, center_crop, or none: the image must already have the model's size). Each output is printed for what
the contract says it is: per-step scores read as text by greedy CTC decoding when the output carries
`ctc_characters` (blank 0, repeats collapsed); the top classes of [1, classes] scores (at most 5, with their
names when the output carries `class_names`); the arg-max per step of a [1, steps, classes] sequence; otherwise
shape and value range.
"""
import json
import sys

import numpy as np
from rknnlite.api import RKNNLite


def image_input(feed, path):
    from PIL import Image

    h, w = feed["shape"][1:3]
    gray = feed.get("channel_order") == "gray"  # a 1-channel model: the calibration read its images as grayscale
    image = Image.open(path).convert("L" if gray else "RGB")
    if feed.get("resize") == "none":
        if (image.height, image.width) != (h, w):
            sys.exit(f"{path} is {image.width}x{image.height}; the model takes {w}x{h}: resize it first")
    elif feed.get("resize") == "center_crop":
        scale = max(h / image.height, w / image.width)
        image = image.resize((max(w, round(image.width * scale)), max(h, round(image.height * scale))),
                             Image.BILINEAR)
        left, top = (image.width - w) // 2, (image.height - h) // 2
        image = image.crop((left, top, left + w, top + h))
    elif (image.height, image.width) != (h, w):
        image = image.resize((w, h), Image.BILINEAR)
    pixels = np.asarray(image, dtype=np.uint8)
    if gray:
        pixels = pixels[:, :, None]
    elif feed.get("channel_order") == "bgr":
        pixels = pixels[:, :, ::-1]
    if list(pixels[None].shape) != list(feed["shape"]):  # the contract's shape is what model.rknn takes
        sys.exit(f"{path} reads as {list(pixels[None].shape)}; input_contract.json feeds {feed['shape']}: "
                 "give a .npz with that array")
    return np.ascontiguousarray(pixels[None])  # NHWC uint8; the NPU applies mean/std


def array_input(name, feed, array):
    """An array of the sample, checked against the feed: a shape the contract does not state is refused here,
    not read by the NPU in the wrong layout."""
    want = feed["shape"]
    if len(array.shape) != len(want) or any(isinstance(d, int) and d != a for d, a in zip(want, array.shape)):
        sys.exit(f"{name} is {list(array.shape)}; input_contract.json feeds it {feed['dtype']} {want} "
                 f"({feed.get('values', '')}{', ' + feed['layout'] if feed.get('layout') else ''}): give that array")
    return np.ascontiguousarray(array.astype(feed["dtype"], copy=False))


def ctc_text(steps, characters):
    """Greedy CTC: repeats collapsed, blank (class 0) dropped; class i is characters[i - 1], the next a space.
    The rule of qprep's measure/ctc.py, written out here because this file runs on the board without qprep."""
    kept = [int(s) for i, s in enumerate(steps) if s != 0 and (i == 0 or s != steps[i - 1])]
    return "".join(characters[s - 1] if s <= len(characters) else " " for s in kept)


def describe(index, out, spec):
    characters, names = spec.get("ctc_characters"), spec.get("class_names")
    if out.ndim == 3 and out.shape[0] == 1 and characters and out.shape[2] in (len(characters) + 1,
                                                                                len(characters) + 2):
        return f"output {index}: text {ctc_text(np.argmax(out[0], axis=-1).tolist(), characters)!r}"
    if out.ndim == 2 and out.shape[0] == 1 and out.shape[1] > 1:
        k = min(5, out.shape[1])
        top = np.argsort(out[0])[::-1][:k]
        label = (lambda c: f"{c} {names[c]!r}") if names and len(names) == out.shape[1] else str
        return f"output {index}: top-{k} " + ", ".join(f"{label(int(c))} ({float(out[0, c]):.4g})" for c in top)
    if out.ndim == 3 and out.shape[0] == 1 and out.shape[2] > 1:
        steps = np.argmax(out[0], axis=-1)
        return f"output {index}: arg-max per step ({len(steps)} steps) {steps.tolist()}"
    return (f"output {index}: shape {list(out.shape)}, min {float(out.min()):.4g}, max {float(out.max()):.4g}, "
            f"mean {float(out.mean()):.4g}")


def main(sample):
    with open("input_contract.json") as file:
        contract = json.load(file)
    specs = [spec for spec in contract["inputs"] if not spec.get("ignored")]  # no node read them: not in model.rknn
    if sample.endswith((".npz", ".npy")):
        arrays = np.load(sample)
        if sample.endswith(".npy") and len(specs) != 1:
            sys.exit(f"{sample}: this model takes {len(specs)} inputs: give a .npz with one array per input name")
        missing = [spec["name"] for spec in specs if sample.endswith(".npz") and spec["name"] not in arrays]
        if missing:
            sys.exit(f"{sample} lacks {', '.join(missing)}: give one array per input name")
        feeds = [array_input(spec["name"], spec["feed"], arrays if sample.endswith(".npy") else arrays[spec["name"]])
                 for spec in specs]
    elif len(specs) == 1 and specs[0]["feed"].get("mean_std_applied_by") == "npu":
        feeds = [image_input(specs[0]["feed"], sample)]
    else:
        sys.exit("this model's inputs are not one image the NPU normalizes: give a .npz sample (input_contract.json "
                 "says what each input takes)")
    formats = [spec["feed"].get("data_format", "nchw") for spec in specs]
    rknn = RKNNLite()
    if rknn.load_rknn("model.rknn") != 0 or rknn.init_runtime() != 0:
        sys.exit("model.rknn did not load on this board's NPU runtime (rknn-toolkit-lite2's log above says why)")
    outputs = rknn.inference(inputs=feeds, data_format=formats if any(f.ndim == 4 for f in feeds) else None)
    specs_out = contract.get("outputs") or []
    for i, out in enumerate(outputs):
        print(describe(i, np.asarray(out), specs_out[i] if i < len(specs_out) else {}))
    rknn.release()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python3 run_on_board.py image.png | sample.npz (input_contract.json says which)")
    main(sys.argv[1])
