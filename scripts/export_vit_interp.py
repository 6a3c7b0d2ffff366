"""Export the zoo's ViT with bicubically resized position embeddings (zoo_families.vit_model: the
`interpolate_pos_encoding` export of ViT/DeiT/DINOv2), random weights, dynamic height and width, at any size and
with either torch exporter: the model class whose constant folding ran for minutes inside onnx's Python reference
Resize (issue #61).

    python scripts/export_vit_interp.py OUT.onnx [--exporter torchscript|dynamo] [--layers 4] [--dim 384]
                                                 [--heads 6] [--grid 14]

Writes OUT.onnx only. `--grid` is the position-embedding grid the weights were "trained" at (DINOv2: 37, for
518 px); at 224 px it is resized to 14x14.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fetch_models  # noqa: E402
import zoo_families  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--exporter", choices=("torchscript", "dynamo"), default="torchscript")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--grid", type=int, default=14)
    args = parser.parse_args()
    torch = fetch_models.import_torch()
    torch.backends.mha.set_fastpath_enabled(False)
    model = zoo_families.vit_model(torch, args.dim, args.heads, args.layers, args.grid).eval()
    example = torch.randn(1, 3, 224, 224)
    with fetch_models.quiet_export():
        if args.exporter == "dynamo":
            dims = {"pixel_values": {2: torch.export.Dim("height", min=32, max=1024),
                                     3: torch.export.Dim("width", min=32, max=1024)}}
            torch.onnx.export(model, (example,), args.out, input_names=["pixel_values"], output_names=["logits"],
                              dynamo=True, dynamic_shapes=dims, opset_version=18, external_data=False)
        else:
            torch.onnx.export(model, (example,), args.out, input_names=["pixel_values"], output_names=["logits"],
                              dynamo=False, opset_version=17, dynamic_axes={"pixel_values": {2: "height", 3: "width"}})
    print(args.out)


if __name__ == "__main__":
    main()
