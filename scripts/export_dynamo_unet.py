"""A small diffusion-style U-Net exported with torch's dynamo exporter, and random samples for it.

Why: dynamo exports name their values `val_N`, the form onnx_ir gives a value it names itself; a rewrite that
lets onnx_ir name a value can then collide with one of the model's (issue #61: "Duplicate definition of name
(val_3589)" from ONNX Runtime's quantizer). The net has what a diffusion U-Net has around its convolutions:
GroupNorm, SiLU, a timestep embedding added per channel, nearest upsampling, skip concatenations and a
transformer block (LayerNorm, attention, GEGLU). Weights are
random (seeded): structure and names are what this is for.

    python scripts/export_dynamo_unet.py OUT_DIR [--size 32] [--samples 16] [--opset 18]

writes OUT_DIR/unet.onnx, OUT_DIR/calib/*.npz and OUT_DIR/eval/*.npz (inputs `x` and `t`) and OUT_DIR/unet.yaml,
a config for `qprep run` with the ORT backend.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
import torch
from torch import nn


class Block(nn.Module):
    """GroupNorm → SiLU → Conv, twice, with the timestep embedding added between, and a residual."""

    def __init__(self, cin: int, cout: int, tdim: int):
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(min(8, cin), cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.time = nn.Linear(tdim, cout)
        self.norm2, self.conv2 = nn.GroupNorm(8, cout), nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x, emb):
        h = self.conv1(nn.functional.silu(self.norm1(x)))
        h = h + self.time(nn.functional.silu(emb))[:, :, None, None]
        h = self.conv2(nn.functional.silu(self.norm2(h)))
        return h + self.skip(x)


class Attention(nn.Module):
    """A diffusion U-Net's transformer block: GroupNorm, LayerNorm, self-attention (Softmax), GEGLU feed-forward."""

    def __init__(self, width: int, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.norm, self.proj_in = nn.GroupNorm(8, width), nn.Conv2d(width, width, 1)
        self.ln1, self.qkv, self.proj = nn.LayerNorm(width), nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.ln2, self.geglu, self.ff = nn.LayerNorm(width), nn.Linear(width, 8 * width), nn.Linear(4 * width, width)
        self.proj_out = nn.Conv2d(width, width, 1)

    def forward(self, x):
        b, c, h, w = x.shape
        t = self.proj_in(self.norm(x)).flatten(2).transpose(1, 2)  # [b, hw, c]
        q, k, v = self.qkv(self.ln1(t)).chunk(3, dim=-1)
        split = lambda a: a.reshape(b, h * w, self.heads, c // self.heads).transpose(1, 2)  # noqa: E731
        weights = torch.softmax(split(q) @ split(k).transpose(-1, -2) / math.sqrt(c // self.heads), dim=-1)
        t = t + self.proj((weights @ split(v)).transpose(1, 2).reshape(b, h * w, c))
        a, gate = self.geglu(self.ln2(t)).chunk(2, dim=-1)
        t = t + self.ff(a * nn.functional.gelu(gate))
        return x + self.proj_out(t.transpose(1, 2).reshape(b, c, h, w))


class TinyUNet(nn.Module):
    def __init__(self, channels: int = 3, width: int = 16, tdim: int = 32):
        super().__init__()
        self.tdim = tdim
        self.embed = nn.Sequential(nn.Linear(tdim, tdim), nn.SiLU(), nn.Linear(tdim, tdim))
        self.inp = nn.Conv2d(channels, width, 3, padding=1)
        self.down1, self.down2 = Block(width, width, tdim), Block(width, 2 * width, tdim)
        self.pool = nn.Conv2d(2 * width, 2 * width, 3, stride=2, padding=1)
        self.mid = Block(2 * width, 2 * width, tdim)
        self.attention = Attention(2 * width)
        self.up1 = Block(4 * width, 2 * width, tdim)
        self.up2 = Block(3 * width, width, tdim)
        self.out = nn.Sequential(nn.GroupNorm(8, width), nn.SiLU(), nn.Conv2d(width, channels, 3, padding=1))

    def timestep(self, t):
        half = self.tdim // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
        angles = t[:, None] * freqs[None]
        return self.embed(torch.cat([torch.sin(angles), torch.cos(angles)], dim=1))

    def forward(self, x, t):
        emb = self.timestep(t)
        h0 = self.inp(x)
        h1 = self.down1(h0, emb)
        h2 = self.down2(h1, emb)
        m = self.attention(self.mid(self.pool(h2), emb))
        u = nn.functional.interpolate(m, scale_factor=2.0, mode="nearest")
        u = self.up1(torch.cat([u, h2], dim=1), emb)
        u = self.up2(torch.cat([u, h1], dim=1), emb)
        return self.out(u)


def samples(folder: Path, count: int, size: int, seed: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(count):
        np.savez(folder / f"{i:03d}.npz", x=rng.standard_normal((1, 3, size, size)).astype(np.float32),
                 t=rng.uniform(0, 1000, (1,)).astype(np.float32))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--opset", type=int, default=18, help="18: the issue's U-Net")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = TinyUNet().eval()
    example = (torch.randn(1, 3, args.size, args.size), torch.tensor([500.0]))
    program = torch.onnx.export(model, example, dynamo=True, opset_version=args.opset, input_names=["x", "t"],
                                output_names=["eps"])
    program.save(str(args.out / "unet.onnx"))
    samples(args.out / "calib", args.samples, args.size, seed=1)
    samples(args.out / "eval", args.samples, args.size, seed=2)
    (args.out / "unet.yaml").write_text(
        "model: unet.onnx\ncalibration: {source: calib}\nevaluation: {source: eval}\noutput_dir: run\n"
        "pipeline:\n  - optimize: {}\n  - quantize: {backend: ort}\n")
    print(f"wrote {args.out / 'unet.onnx'}, {args.samples} calib and eval samples, {args.out / 'unet.yaml'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
