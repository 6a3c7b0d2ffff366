"""Run model.rknn on a Rockchip board with rknn-toolkit-lite2 (pip install rknn-toolkit-lite2 on the board).

    python3 run_on_board.py image.png        # single image-input models (see input_contract.json)
"""
import json
import sys

import numpy as np
from PIL import Image
from rknnlite.api import RKNNLite

contract = json.load(open("input_contract.json"))
spec = contract["inputs"][0]
rknn = RKNNLite()
assert rknn.load_rknn("model.rknn") == 0, "load_rknn failed"
assert rknn.init_runtime() == 0, "init_runtime failed"
n, c, h, w = spec["shape"]
image = Image.open(sys.argv[1]).convert("RGB").resize((w, h))
pixels = np.asarray(image, dtype=np.uint8)
if spec.get("channel_order") == "bgr":
    pixels = pixels[:, :, ::-1]
outputs = rknn.inference(inputs=[np.ascontiguousarray(pixels[None])])  # NHWC uint8; the NPU normalizes
for i, out in enumerate(outputs):
    print(f"output {i}: shape {out.shape}, argmax {int(np.argmax(out))}")
rknn.release()
