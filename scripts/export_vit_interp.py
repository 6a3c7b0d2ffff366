"""Export a small ViT whose position embeddings are resized bicubically at forward time (the
`interpolate_pos_encoding` export of ViT/DeiT/DINOv2), random weights, dynamic H/W: the model class whose
constant folding ran for minutes inside onnx's Python reference Resize (issue #61).

    python scripts/export_vit_interp.py OUT.onnx [--exporter torchscript|dynamo] [--layers 4] [--dim 384] [--grid 14]

Writes OUT.onnx only (never into the repository unless asked to). `--grid` is the position-embedding grid the
weights were "trained" at (DINOv2: 37, for 518 px); at 224 px the grid is resized to 14×14. The TorchScript
export bakes the token count into the attention's Reshapes, so it runs at 224 px only; the dynamo export runs at
other sizes too.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn


class InterpViT(nn.Module):
    def __init__(self, dim: int, layers: int, heads: int, patch: int = 16, grid: int = 14, classes: int = 1000):
        super().__init__()
        self.patch = patch
        self.embed = nn.Conv2d(3, dim, patch, patch)
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, dim, grid, grid) * 0.02)  # the grid the weights were trained at
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, activation="gelu", batch_first=True, norm_first=True,
                                           dropout=0.0)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        h, w = pixel_values.shape[-2] // self.patch, pixel_values.shape[-1] // self.patch
        x = self.embed(pixel_values).flatten(2).transpose(1, 2)
        pos = F.interpolate(self.pos, size=(h, w), mode="bicubic", align_corners=False)
        x = x + pos.flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1)
        return self.head(self.norm(self.blocks(x))[:, 0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--exporter", choices=("torchscript", "dynamo"), default="torchscript")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--grid", type=int, default=14)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = InterpViT(args.dim, args.layers, args.heads, grid=args.grid).eval()
    example = torch.randn(1, 3, 224, 224)
    if args.exporter == "dynamo":
        dims = {"pixel_values": {2: torch.export.Dim("height", min=32, max=1024),
                                 3: torch.export.Dim("width", min=32, max=1024)}}
        torch.onnx.export(model, (example,), args.out, input_names=["pixel_values"], output_names=["logits"],
                          dynamo=True, dynamic_shapes=dims, opset_version=18, external_data=False)
    else:
        torch.onnx.export(model, (example,), args.out, input_names=["pixel_values"], output_names=["logits"],
                          dynamo=False, opset_version=17,
                          dynamic_axes={"pixel_values": {2: "height", 3: "width"}})
    print(args.out)


if __name__ == "__main__":
    main()
