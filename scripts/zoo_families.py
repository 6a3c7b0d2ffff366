"""Architecture families no wheel ships as ONNX, built here in plain torch with seeded random weights, and their
samples: the zoo's structural cases (scripts/zoo.yaml, `source: {build: zoo_families.NAME}`).

Why: users bring vision transformers, DETR-style detectors, Whisper-style encoders and decoders with key/value
caches, VITS/Piper voices, U-Nets, super-resolution nets and RNNs; what breaks on them is structure (a bicubic
position-embedding resize, a random op, an empty optional RNN input, an input no node reads), not trained
weights. Random weights are fine for structure and cost; accuracy figures on these models judge agreement with
their own float outputs on inputs of the right kind and range, never a task score.

Each build exports with the exporter users use for that family (TorchScript unless noted), checks ONNX Runtime
against torch on two inputs, and writes to the path it is given. Each sampler writes NNNN.npz keyed by the
model's inputs, one seeded stream per (sampler, split, index) as in zoo_samples.py. Built and cached by
`scripts/zoo.py fetch --models NAME` (the manifest's `source: {build: zoo_families.NAME}`).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fetch_models  # noqa: E402
import zoo_samples  # noqa: E402
from zoo_exports import report, require_close  # noqa: E402

OPSET = 17
TTS_HOP = 64  # waveform samples per acoustic frame of the VITS-style voice
WHISPER_MELS, WHISPER_FRAMES, WHISPER_DIM = 80, 400, 128
DECODER_VOCAB, DECODER_LAYERS, DECODER_HEADS, DECODER_PAST = 512, 2, 4, 12
PHONEMES, PHONEME_LENGTH = 96, 24


def _torch():
    torch = fetch_models.import_torch()  # seeds torch: the same weights on every build
    torch.manual_seed(0)
    torch.backends.mha.set_fastpath_enabled(False)  # the fused eval-mode kernel has no ONNX export; users' exports
    return torch                                    # of nn.Transformer layers go through the plain ops as here


def _export(model, args: tuple, out: Path, names: tuple[list[str], list[str]], axes: dict | None = None,
            checks: list[tuple] = ()) -> None:
    """TorchScript export at OPSET, then ONNX Runtime vs torch on `checks` (tuples of tensors like `args`)."""
    torch = _torch()
    model.eval()
    with fetch_models.quiet_export(), torch.no_grad():
        torch.onnx.export(model, args, str(out), dynamo=False, opset_version=OPSET, input_names=names[0],
                          output_names=names[1], dynamic_axes=axes or {})
    error = 0.0
    for check in checks:
        with torch.no_grad():
            expected = model(*check)
        expected = [t.numpy() for t in (expected if isinstance(expected, tuple) else (expected,))]
        feeds = {name: t.numpy() for name, t in zip(names[0], check)}
        error = max(error, require_close(out, feeds, expected, "torch"))
    report(error, "torch")


# ------------------------------------------------------------------------------------------- vision


def _block(torch, dim: int, heads: int):
    return torch.nn.TransformerEncoderLayer(dim, heads, dim * 4, dropout=0.0, activation="gelu",
                                            batch_first=True, norm_first=True)


def _vit_block(torch, dim: int, heads: int):
    """A pre-norm block written as Hugging Face's ViT writes it: reshapes by -1, so the token count stays dynamic
    (nn.MultiheadAttention's TorchScript export bakes the traced length in)."""

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
            self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
            self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))

        def forward(self, x):
            q, k, v = (t.reshape(x.shape[0], -1, heads, dim // heads).transpose(1, 2)
                       for t in self.qkv(self.norm1(x)).chunk(3, dim=-1))
            attended = torch.softmax(q @ k.transpose(2, 3) / math.sqrt(dim // heads), dim=-1) @ v
            x = x + self.proj(attended.transpose(1, 2).reshape(x.shape[0], -1, dim))
            return x + self.mlp(self.norm2(x))

    return Block()


def vit_model(torch, dim: int = 384, heads: int = 6, depth: int = 4, grid: int = 14, patch: int = 16,
              classes: int = 1000):
    """A ViT whose grid x grid position embeddings (the size the weights were trained at; DINOv2: 37) are resized
    bicubically to the input's patch grid at run time: the `interpolate_pos_encoding` export of ViT / DeiT /
    DINOv2. Its blocks reshape by -1, so height and width stay dynamic in a TorchScript export too."""
    functional = torch.nn.functional

    class ViT(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.patch = patch
            self.embed = torch.nn.Conv2d(3, dim, patch, patch)
            self.cls = torch.nn.Parameter(torch.randn(1, 1, dim) * 0.02)
            self.pos = torch.nn.Parameter(torch.randn(1, 1 + grid * grid, dim) * 0.02)
            self.blocks = torch.nn.Sequential(*[_vit_block(torch, dim, heads) for _ in range(depth)])
            self.norm = torch.nn.LayerNorm(dim)
            self.head = torch.nn.Linear(dim, classes)

        def forward(self, pixel_values):
            h, w = pixel_values.shape[2] // self.patch, pixel_values.shape[3] // self.patch
            x = self.embed(pixel_values).flatten(2).transpose(1, 2)
            trained = self.pos[:, 1:].reshape(1, grid, grid, -1).permute(0, 3, 1, 2)
            resized = functional.interpolate(trained, size=(h, w), mode="bicubic", align_corners=False)
            pos = torch.cat([self.pos[:, :1], resized.flatten(2).transpose(1, 2)], dim=1)
            x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + pos
            return self.head(self.norm(self.blocks(x))[:, 0])

    return ViT()


def vit_interpolated(out: Path) -> None:
    """A ViT-S/16-shaped classifier (4 blocks, vit_model) exported with height and width dynamic; the zoo fixes
    the input at 224, which makes the position-embedding Resize a constant."""
    torch = _torch()
    pictures = [torch.randn(1, 3, 224, 224), torch.randn(1, 3, 256, 192)]
    _export(vit_model(torch), (pictures[0],), out, (["pixel_values"], ["logits"]),
            {"pixel_values": {2: "height", 3: "width"}}, [(p,) for p in pictures])


def detr_like(out: Path) -> None:
    """A DETR-style detector: a small CNN backbone, a transformer encoder-decoder over its feature map with
    sine position embeddings and 50 learned queries, class logits (softmax over 21 + no-object) and boxes
    (sigmoid cx, cy, w, h) per query; no NMS."""
    torch = _torch()

    class Detr(torch.nn.Module):
        def __init__(self, dim=128, queries=50, classes=21):
            super().__init__()
            layers, channels = [], 3
            for width in (32, 64, 128, dim):
                layers += [torch.nn.Conv2d(channels, width, 3, 2, 1), torch.nn.BatchNorm2d(width), torch.nn.ReLU()]
                channels = width
            self.backbone = torch.nn.Sequential(*layers)
            self.transformer = torch.nn.Transformer(dim, 4, 2, 2, dim * 4, dropout=0.0, batch_first=True)
            self.queries = torch.nn.Parameter(torch.randn(1, queries, dim))
            self.classes = torch.nn.Linear(dim, classes + 1)
            self.boxes = torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.ReLU(), torch.nn.Linear(dim, 4))

        def forward(self, images):
            features = self.backbone(images)
            b, c, h, w = features.shape
            ys = torch.arange(h, dtype=torch.float32).reshape(1, h, 1, 1).expand(1, h, w, c // 2)
            xs = torch.arange(w, dtype=torch.float32).reshape(1, 1, w, 1).expand(1, h, w, c // 2)
            frequencies = torch.exp(torch.arange(c // 2, dtype=torch.float32) * (-math.log(1e4) / (c // 2)))
            pos = torch.cat([torch.sin(ys * frequencies), torch.cos(xs * frequencies)], dim=-1).reshape(1, h * w, c)
            memory = features.flatten(2).transpose(1, 2) + pos
            decoded = self.transformer(memory, self.queries.expand(b, -1, -1))
            return self.classes(decoded).softmax(-1), self.boxes(decoded).sigmoid()

    pictures = [torch.randn(1, 3, 320, 320), torch.randn(1, 3, 320, 320)]
    _export(Detr(), (pictures[0],), out, (["images"], ["scores", "boxes"]), None, [(p,) for p in pictures])


def unet_segmentation(out: Path) -> None:
    """A U-Net for 6-class segmentation: GroupNorm + SiLU blocks, strided downsampling, nearest upsampling and
    skip concatenations; per-pixel class logits at the input's size."""
    torch = _torch()

    def block(cin, cout):
        return torch.nn.Sequential(torch.nn.Conv2d(cin, cout, 3, 1, 1), torch.nn.GroupNorm(8, cout), torch.nn.SiLU(),
                                   torch.nn.Conv2d(cout, cout, 3, 1, 1), torch.nn.GroupNorm(8, cout), torch.nn.SiLU())

    class UNet(torch.nn.Module):
        def __init__(self, widths=(16, 32, 64, 128), classes=6):
            super().__init__()
            self.down = torch.nn.ModuleList()
            channels = 3
            for width in widths:
                self.down.append(block(channels, width))
                channels = width
            self.pool = torch.nn.MaxPool2d(2)
            self.up = torch.nn.ModuleList(block(widths[i] + widths[i + 1], widths[i])
                                          for i in reversed(range(len(widths) - 1)))
            self.head = torch.nn.Conv2d(widths[0], classes, 1)

        def forward(self, image):
            skips, x = [], image
            for i, down in enumerate(self.down):
                x = down(x if i == 0 else self.pool(x))
                skips.append(x)
            for up, skip in zip(self.up, reversed(skips[:-1])):
                x = up(torch.cat([torch.nn.functional.interpolate(x, scale_factor=2.0, mode="nearest"), skip], 1))
            return self.head(x)

    pictures = [torch.randn(1, 3, 256, 256), torch.randn(1, 3, 256, 256)]
    _export(UNet(), (pictures[0],), out, (["image"], ["logits"]), None, [(p,) for p in pictures])


def super_resolution(out: Path) -> None:
    """An ESPCN-style x3 super-resolution net on the luma channel: convolutions then PixelShuffle (DepthToSpace),
    [1, 1, H, W] in [0, 1] → [1, 1, 3H, 3W]; height and width dynamic."""
    torch = _torch()

    class Espcn(torch.nn.Module):
        def __init__(self, scale=3):
            super().__init__()
            self.body = torch.nn.Sequential(torch.nn.Conv2d(1, 64, 5, 1, 2), torch.nn.Tanh(),
                                            torch.nn.Conv2d(64, 32, 3, 1, 1), torch.nn.Tanh(),
                                            torch.nn.Conv2d(32, scale * scale, 3, 1, 1), torch.nn.PixelShuffle(scale))

        def forward(self, luma):
            return self.body(luma).clamp(0.0, 1.0)

    pictures = [torch.rand(1, 1, 96, 96), torch.rand(1, 1, 64, 80)]
    _export(Espcn(), (pictures[0],), out, (["luma"], ["upscaled"]),
            {"luma": {2: "height", 3: "width"}, "upscaled": {2: "height3", 3: "width3"}}, [(p,) for p in pictures])


# ------------------------------------------------------------------------------------------- speech


def whisper_encoder_like(out: Path) -> None:
    """A Whisper-style audio encoder: two Conv1d + GELU over an 80-bin log-mel spectrogram (the second strided),
    sinusoidal positions, pre-norm transformer blocks, a final LayerNorm → [1, frames / 2, 128]."""
    torch = _torch()

    class Encoder(torch.nn.Module):
        def __init__(self, dim=WHISPER_DIM, depth=3):
            super().__init__()
            self.conv1 = torch.nn.Conv1d(WHISPER_MELS, dim, 3, 1, 1)
            self.conv2 = torch.nn.Conv1d(dim, dim, 3, 2, 1)
            frames = WHISPER_FRAMES // 2
            scales = torch.exp(-math.log(1e4) * torch.arange(dim // 2) / (dim // 2 - 1))
            angles = torch.arange(frames)[:, None] * scales[None]
            self.register_buffer("positions", torch.cat([angles.sin(), angles.cos()], 1)[None])
            self.blocks = torch.nn.Sequential(*[_block(torch, dim, 4) for _ in range(depth)])
            self.norm = torch.nn.LayerNorm(dim)

        def forward(self, mel):
            x = torch.nn.functional.gelu(self.conv2(torch.nn.functional.gelu(self.conv1(mel))))
            return self.norm(self.blocks(x.transpose(1, 2) + self.positions))

    mels = [torch.randn(1, WHISPER_MELS, WHISPER_FRAMES) for _ in range(2)]
    _export(Encoder(), (mels[0],), out, (["mel"], ["encoded"]), None, [(m,) for m in mels])


def whisper_decoder_kv(out: Path) -> None:
    """A Whisper-style text decoder step with a key/value cache: one new token, the encoder's states and each
    layer's past self-attention keys and values in; the next token's logits and the present keys and values
    (past + this step) out: the state outputs a caller feeds back."""
    torch = _torch()
    dim, heads = WHISPER_DIM, DECODER_HEADS
    depth = dim // heads

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens = torch.nn.Embedding(DECODER_VOCAB, dim)
            self.positions = torch.nn.Parameter(torch.randn(64, dim) * 0.02)
            self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(dim) for _ in range(3 * DECODER_LAYERS + 1))
            self.qkv = torch.nn.ModuleList(torch.nn.Linear(dim, 3 * dim) for _ in range(DECODER_LAYERS))
            self.cross_q = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(DECODER_LAYERS))
            self.cross_kv = torch.nn.ModuleList(torch.nn.Linear(dim, 2 * dim) for _ in range(DECODER_LAYERS))
            self.mlp = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(),
                                                               torch.nn.Linear(4 * dim, dim))
                                           for _ in range(DECODER_LAYERS))

        @staticmethod
        def heads(x):
            return x.reshape(x.shape[0], x.shape[1], heads, depth).transpose(1, 2)

        def forward(self, token, encoded, *past):
            step = past[0].shape[2]
            x = self.tokens(token) + self.positions[step:step + 1]
            present = []
            for i in range(DECODER_LAYERS):
                q, k, v = self.qkv[i](self.norms[3 * i](x)).chunk(3, dim=-1)
                k = torch.cat([past[2 * i], self.heads(k)], dim=2)
                v = torch.cat([past[2 * i + 1], self.heads(v)], dim=2)
                present += [k, v]
                attended = torch.softmax(self.heads(q) @ k.transpose(2, 3) / math.sqrt(depth), -1) @ v
                x = x + attended.transpose(1, 2).reshape(x.shape)
                ck, cv = self.cross_kv[i](encoded).chunk(2, dim=-1)
                cq = self.heads(self.cross_q[i](self.norms[3 * i + 1](x)))
                crossed = torch.softmax(cq @ self.heads(ck).transpose(2, 3) / math.sqrt(depth), -1) @ self.heads(cv)
                x = x + crossed.transpose(1, 2).reshape(x.shape)
                x = x + self.mlp[i](self.norms[3 * i + 2](x))
            logits = self.norms[-1](x) @ self.tokens.weight.T
            return (logits, *present)

    def inputs(seed: int):
        generator = torch.Generator().manual_seed(seed)
        past = [torch.randn(1, heads, DECODER_PAST, depth, generator=generator) for _ in range(2 * DECODER_LAYERS)]
        return (torch.randint(0, DECODER_VOCAB, (1, 1), generator=generator),
                torch.randn(1, WHISPER_FRAMES // 2, dim, generator=generator), *past)

    past_names = [f"past_key_values.{i}.{kv}" for i in range(DECODER_LAYERS) for kv in ("key", "value")]
    present_names = [name.replace("past_key_values", "present") for name in past_names]
    _export(Step(), inputs(0), out, (["input_ids", "encoder_hidden_states", *past_names], ["logits", *present_names]),
            None, [inputs(1), inputs(2)])


def vits_like_tts(out: Path) -> None:
    """A VITS / Piper-style voice: phoneme ids → text encoder → prior mean and log-scale per frame, a sample
    mean + exp(log-scale) · noise · noise_scale drawn by RandomNormalLike (the `scales` input is Piper's
    [noise_scale, length_scale, noise_w]), then a HiFi-GAN-style decoder of transposed convolutions and
    residual blocks → waveform [1, 1, length · 64]. Each phoneme lasts a fixed number of frames (Piper predicts
    durations; the random op and the upsampling decoder are the structure under test)."""
    torch = _torch()

    class Voice(torch.nn.Module):
        def __init__(self, dim=96, frames_per_phoneme=2):
            super().__init__()
            self.embed = torch.nn.Embedding(PHONEMES, dim)
            self.encoder = torch.nn.Sequential(*[_vit_block(torch, dim, 2) for _ in range(2)])
            self.prior = torch.nn.Conv1d(dim, 2 * dim, 1)
            self.repeat = frames_per_phoneme
            ups, channels = [], dim
            for stride in (4, 4, 4):
                ups += [torch.nn.LeakyReLU(0.1), torch.nn.ConvTranspose1d(channels, channels // 2, 2 * stride,
                                                                          stride, stride // 2)]
                ups += [torch.nn.LeakyReLU(0.1), torch.nn.Conv1d(channels // 2, channels // 2, 3, 1, 1)]
                channels //= 2
            self.decoder = torch.nn.Sequential(torch.nn.Conv1d(dim, dim, 7, 1, 3), *ups, torch.nn.LeakyReLU(0.1),
                                               torch.nn.Conv1d(channels, 1, 7, 1, 3), torch.nn.Tanh())

        def forward(self, input, scales):
            h = self.encoder(self.embed(input)).transpose(1, 2)
            mean, log_scale = self.prior(h).repeat_interleave(self.repeat, dim=2).chunk(2, dim=1)
            z = mean + torch.randn_like(mean) * torch.exp(log_scale) * scales[0]
            return self.decoder(z)

    def inputs(seed: int, length: int = PHONEME_LENGTH):  # noise_scale 0 (as Piper users fix it): torch and
        generator = torch.Generator().manual_seed(seed)  # ONNX Runtime draw different noise
        return (torch.randint(1, PHONEMES, (1, length), generator=generator), torch.tensor([0.0, 1.0, 0.8]))

    _export(Voice(), inputs(0), out, (["input", "scales"], ["output"]), {"input": {1: "phonemes"},
                                                                        "output": {2: "samples"}},
            [inputs(1), inputs(2, length=17)])  # another length: the phoneme axis is dynamic


# ------------------------------------------------------------------------------------------- recurrent


def gru_tagger(out: Path) -> None:
    """A bidirectional GRU sequence tagger as torch exports it: GRU nodes whose optional `sequence_lens` input is
    left empty (''), per-step tag logits [1, steps, 12] and the final hidden state [2, 1, 64]."""
    torch = _torch()

    class Tagger(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gru = torch.nn.GRU(40, 64, batch_first=True, bidirectional=True)
            self.tags = torch.nn.Linear(128, 12)

        def forward(self, features):
            steps, hidden = self.gru(features)
            return self.tags(steps), hidden

    frames = [torch.randn(1, 50, 40) for _ in range(2)]
    _export(Tagger(), (frames[0],), out, (["features"], ["tags", "hidden"]), None, [(f,) for f in frames])


def lstm_with_ignored_input(out: Path) -> None:
    """An LSTM language-model step as tf2onnx / paddle2onnx leave one: token embeddings through an LSTM with the
    state passed in and out (Y_h, Y_c), plus a `length` input that no node reads (exporters keep declared
    inputs the graph does not use)."""
    import onnx
    torch = _torch()

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(256, 48)
            self.lstm = torch.nn.LSTM(48, 96, batch_first=True)
            self.out = torch.nn.Linear(96, 256)

        def forward(self, tokens, h0, c0):
            steps, (h, c) = self.lstm(self.embed(tokens), (h0, c0))
            return self.out(steps), h, c

    def inputs(seed: int):
        generator = torch.Generator().manual_seed(seed)
        return (torch.randint(0, 256, (1, 16), generator=generator), torch.randn(1, 1, 96, generator=generator) * 0.5,
                torch.randn(1, 1, 96, generator=generator) * 0.5)

    names = (["tokens", "h0", "c0"], ["logits", "hn", "cn"])
    _export(Step(), inputs(0), out, names, None, [inputs(1), inputs(2)])
    model = onnx.load(str(out))
    model.graph.input.append(onnx.helper.make_tensor_value_info("length", onnx.TensorProto.INT64, [1]))
    onnx.save(model, str(out))


# ------------------------------------------------------------------------------------------- samples


def _photo(rng, height: int, width: int) -> np.ndarray:
    """A real photo crop, RGB float in [0, 1] as [1, 3, H, W]."""
    from PIL import Image

    picture = Image.fromarray(zoo_samples.photo(rng, max(height, width))).resize((width, height))
    return (np.asarray(picture, dtype=np.float32)[None] / 255.0).transpose(0, 3, 1, 2)


@zoo_samples.each_sample("families_imagenet")
def samples_imagenet_224(rng, _context) -> dict:
    """Photo crops at 224x224, ImageNet mean/std normalized (pixel_values)."""
    x = _photo(rng, 224, 224)
    mean, std = zoo_samples.IMAGENET_MEAN[:, None, None], zoo_samples.IMAGENET_STD[:, None, None]
    return {"pixel_values": ((x - mean) / std).astype(np.float32)}


@zoo_samples.each_sample("families_detr")
def samples_detr(rng, _context) -> dict:
    x = _photo(rng, 320, 320)
    mean, std = zoo_samples.IMAGENET_MEAN[:, None, None], zoo_samples.IMAGENET_STD[:, None, None]
    return {"images": ((x - mean) / std).astype(np.float32)}


@zoo_samples.each_sample("families_unet")
def samples_unet(rng, _context) -> dict:
    return {"image": _photo(rng, 256, 256) * 2.0 - 1.0}


@zoo_samples.each_sample("families_luma")
def samples_luma(rng, _context) -> dict:
    """The luma (BT.601) of a 96x96 photo crop in [0, 1]."""
    rgb = _photo(rng, 96, 96)[0]
    return {"luma": (0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2])[None, None].astype(np.float32)}


def _log_mel(rng) -> np.ndarray:
    """A Whisper-style log-mel of a synthetic sound (harmonic notes under noise: zoo_samples' music without a
    voice), [80, WHISPER_FRAMES], scaled as Whisper does ((max(log10, max − 8) + 4) / 4)."""
    audio = zoo_samples.noise(rng, WHISPER_FRAMES * 160 + 400) * 0.05
    t = np.arange(audio.size) / zoo_samples.SAMPLE_RATE
    for _ in range(3):
        pitch = rng.uniform(110, 880)
        audio += rng.uniform(0.1, 0.4) * sum(np.sin(2 * np.pi * pitch * k * t) / k for k in range(1, 5))
    frames = np.lib.stride_tricks.sliding_window_view(audio, 400)[::160][:WHISPER_FRAMES] * np.hanning(400)
    power = np.abs(np.fft.rfft(frames, axis=1)) ** 2  # [frames, 201]
    edges = np.linspace(0, power.shape[1] - 1, WHISPER_MELS + 2)
    bins = np.arange(power.shape[1])[None]
    triangles = np.maximum(0, 1 - np.abs(bins - edges[1:-1, None]) / (edges[1] - edges[0]))
    log = np.log10(np.maximum(triangles @ power.T, 1e-10))
    return ((np.maximum(log, log.max() - 8.0) + 4.0) / 4.0).astype(np.float32)


@zoo_samples.each_sample("families_mel")
def samples_mel(rng, _context) -> dict:
    return {"mel": _log_mel(rng)[None]}


def _encoder_session(model: Path, _split: str):
    """The decoder's cross-attention reads the encoder's states: its sibling whisper_encoder_like computes them."""
    return zoo_samples.session(zoo_samples.sibling(model, "whisper_encoder_like"))


def _decoder_step(rng, encoder) -> dict:
    """One decoding step at a random position: the encoder's states of a sound, a token and a cache of
    DECODER_PAST steps with the spread of a real cache (the decoder's own keys/values scale)."""
    encoded = encoder.run(None, {"mel": _log_mel(rng)[None]})[0]
    depth = WHISPER_DIM // DECODER_HEADS
    past = {f"past_key_values.{i}.{kv}": rng.normal(0, 1.0, (1, DECODER_HEADS, DECODER_PAST, depth)).astype(np.float32)
            for i in range(DECODER_LAYERS) for kv in ("key", "value")}
    return {"input_ids": rng.integers(0, DECODER_VOCAB, (1, 1), dtype=np.int64), "encoder_hidden_states": encoded,
            **past}


samples_decoder = zoo_samples.each_sample("families_decoder")(_decoder_step, _encoder_session)


@zoo_samples.each_sample("families_phonemes")
def samples_phonemes(rng, _context) -> dict:
    """Phoneme ids of PHONEME_LENGTH (1..95; 0 pads) and Piper's default scales [0.667, 1.0, 0.8]."""
    return {"input": rng.integers(1, PHONEMES, (1, PHONEME_LENGTH), dtype=np.int64),
            "scales": np.array([0.667, 1.0, 0.8], dtype=np.float32)}


@zoo_samples.each_sample("families_features")
def samples_features(rng, _context) -> dict:
    """50 frames of 40 log-mel features of a synthetic sound (as a tagger reads them)."""
    return {"features": _log_mel(rng)[:40, :100:2].T[None].copy()}


@zoo_samples.each_sample("families_lm_step")
def samples_lm_step(rng, _context) -> dict:
    """16 byte-level tokens of a real sentence, a state in the range an LSTM's tanh gives, the ignored length."""
    text = zoo_samples.sentences()[int(rng.integers(len(zoo_samples.sentences())))].encode()[:16].ljust(16)
    state = [np.tanh(rng.normal(0, 0.7, (1, 1, 96))).astype(np.float32) for _ in range(2)]
    return {"tokens": np.frombuffer(text, dtype=np.uint8).astype(np.int64)[None], "h0": state[0], "c0": state[1],
            "length": np.array([16], dtype=np.int64)}
