"""Image folders as model inputs: decode, resize to the model's input size, normalize, lay out.

Normalization uses RKNN's convention, (pixel - mean) / std with pixels in 0..255, so the same numbers can
go to `RKNN.config(mean_values, std_values)` and become the deployed input contract.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from qprep.disk.reading import require_regular_file
from qprep.errors import DataError
from qprep.model.info import TensorSpec

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".webp"}
ORIENTATION_TAG = 0x0112  # EXIF Orientation: 1 as stored, 2-8 mirrored and/or rotated


@dataclass
class ImagePreprocess:
    input: TensorSpec
    layout: str  # nchw | nhwc
    channels: int
    size: tuple[int, int] | None  # (height, width); None when the model's dims are dynamic
    mean: np.ndarray | None
    std: np.ndarray | None
    channel_order: str
    resize: str
    deep_files: list[str] = field(default_factory=list)  # images read at 16 bits per channel (a warning)

    @classmethod
    def for_model(cls, cfg: dict, inputs: list[TensorSpec], role: str) -> "ImagePreprocess":
        if len(inputs) != 1:
            raise DataError(f"{role}: image folders feed single-input models; this model has {len(inputs)} "
                            "inputs: store samples as .npz keyed by input name")
        spec = inputs[0]
        if not spec.shape or len(spec.shape) != 4:
            raise DataError(f"{role}: image samples need a 4-D image input, '{spec.name}' has shape {spec.shape}")
        layout = cfg["layout"] if cfg["layout"] != "auto" else guess_layout(spec.shape, role)
        c_axis, h_axis, w_axis = (1, 2, 3) if layout == "nchw" else (3, 1, 2)
        channels = spec.shape[c_axis]
        if channels not in (1, 3):
            raise DataError(f"{role}: input '{spec.name}' has {channels} channels in {layout} layout; "
                            f"images give 1 or 3 (set {role}.preprocess.layout)")
        h, w = spec.shape[h_axis], spec.shape[w_axis]
        size = (h, w) if isinstance(h, int) and isinstance(w, int) else None
        if size is None and cfg["resize"] != "none":
            raise DataError(f"{role}: input '{spec.name}' has dynamic height/width {spec.shape}; fix them with "
                            f"`inputs: {{{spec.name}: [...]}}` or set {role}.preprocess.resize: none")
        mean, std = (_per_channel(cfg[k], channels, f"{role}.preprocess.{k}") for k in ("mean", "std"))
        if spec.numpy_dtype.kind != "f" and (mean is not None or std is not None):
            raise DataError(f"{role}.preprocess: input '{spec.name}' is {spec.dtype}; mean/std need a float input")
        return cls(spec, layout, channels, size, mean, std, cfg["channel_order"], cfg["resize"])

    def describe(self) -> dict:
        """The deployed input contract, for the report."""
        return {"input": self.input.name, "dtype": self.input.dtype, "layout": self.layout,
                "channel_order": self.channel_order, "size_hw": list(self.size) if self.size else None,
                "resize": self.resize, "mean": None if self.mean is None else self.mean.tolist(),
                "std": None if self.std is None else self.std.tolist()}

    def read(self, path: Path) -> np.ndarray:
        """The model input: resized, channel-ordered, normalized, laid out, batch axis added."""
        if self.input.numpy_dtype.kind != "f":  # an integer input takes no mean/std (for_model): its raw pixels
            return self.read_raw(path).astype(self.input.numpy_dtype)
        pixels = self.read_pixels(path).astype(np.float32)
        if self.mean is not None:
            pixels = pixels - self.mean
        if self.std is not None:
            pixels = pixels / self.std
        return self._layout(pixels).astype(self.input.numpy_dtype)

    def read_raw(self, path: Path) -> np.ndarray:
        """uint8 pixels laid out like the model input but not normalized: what an NPU that normalizes on
        chip (RKNN's mean_values/std_values) is fed.

        A 16-bit image is rounded to 8 bits here (v·255/65535), not refused: the deployed model takes uint8
        pixels (the input contract), so the board is fed 8-bit frames whatever its camera gives, and calibrating
        on them rounded the same way is calibrating on what the board sees. Refusing would also come too late:
        this runs in the quantize stage, after the run directory is taken. The samples' warnings say so."""
        pixels = self.read_pixels(path)
        if pixels.dtype != np.uint8:
            pixels = np.clip(np.rint(pixels), 0, 255).astype(np.uint8)
        return self._layout(pixels)

    def read_pixels(self, path: Path) -> np.ndarray:
        """HWC pixels at the model's size, in the model's channel order, in 0..255 units: uint8 from an 8-bit
        image, float32 from a 16-bit one (resized at its depth and scaled, never clipped)."""
        from PIL import Image, UnidentifiedImageError

        require_regular_file(path, "image", DataError, "store each sample as a regular image file")
        try:
            with Image.open(path) as img:
                full_scale = _full_scale(img, path)
                img = _upright(img)
                if full_scale is None:
                    img = img.convert("L" if self.channels == 1 else "RGB")
                    pixels = np.asarray(self._resize(img, path), dtype=np.uint8)
                else:  # "F": 32-bit float pixels, exact for 16-bit values and resized without rounding
                    pixels = np.asarray(self._resize(img.convert("F"), path), dtype=np.float32) * 255 / full_scale
                    self.deep_files.append(str(path))
        except (UnidentifiedImageError, OSError, SyntaxError) as exc:
            raise DataError(f"{path}: not a readable image ({str(exc).splitlines()[0][:160]})") from None
        if pixels.ndim == 2:
            pixels = np.repeat(pixels[:, :, None], self.channels, axis=2)  # gray: as convert("RGB") gives it
        return pixels[:, :, ::-1] if self.channel_order == "bgr" else pixels

    def _layout(self, pixels: np.ndarray) -> np.ndarray:
        if self.layout == "nchw":
            pixels = pixels.transpose(2, 0, 1)
        return np.ascontiguousarray(pixels[None])

    def _resize(self, img, path: Path):
        from PIL import Image

        if self.size is None:
            return img
        h, w = self.size
        if self.resize == "none":
            if (img.height, img.width) != (h, w):
                raise DataError(f"{path}: image is {img.width}x{img.height}, the model takes {w}x{h}; "
                                "set preprocess.resize to stretch or center_crop")
            return img
        if self.resize == "center_crop":
            scale = max(h / img.height, w / img.width)
            img = img.resize((max(w, round(img.width * scale)), max(h, round(img.height * scale))),
                             Image.BILINEAR)
            left, top = (img.width - w) // 2, (img.height - h) // 2
            return img.crop((left, top, left + w, top + h))
        return img if (img.height, img.width) == (h, w) else img.resize((w, h), Image.BILINEAR)


def _full_scale(img, path: Path) -> float | None:
    """None for an image of 8 bits per channel; else the value of full white, for an image Pillow gives at a
    greater depth (16-bit gray: mode I;16, or I holding 0..65535). Refused in one line: an image stored at more
    bits than Pillow gives (48/64-bit RGB(A) PNGs open as RGB/RGBA keeping each value's high byte) and float
    or wider integer images, whose scale is unknown. Why: convert("RGB") clipped every 16-bit value to 255."""
    from PIL import ImageMode

    typestr = ImageMode.getmode(img.mode).typestr
    eight_bit = typestr in ("|u1", "|b1")
    stored = [str(tile.args) for tile in img.tile]  # the raw modes Pillow decodes, e.g. "RGB;16B" (before load)
    if eight_bit and not any(re.search(r";16[BLN]\b", raw) for raw in stored):
        return None
    if typestr.endswith("u2"):
        return 65535.0
    if typestr.endswith("i4"):
        low, high = img.getextrema()
        if 0 <= low and high <= 65535:
            return 65535.0
    why = "is stored at 16 bits per channel, which Pillow reads only at 8 bits" if eight_bit else \
        "holds values of no known pixel scale"
    raise DataError(f"{path}: the image (Pillow mode {img.mode}) {why}; save it as an 8-bit image or a 16-bit "
                    "grayscale PNG, or as .npy/.npz arrays already normalized")


def _upright(img):
    """The image as viewers show it: a camera's JPEG stored sideways with an EXIF Orientation (6: rotate 90°) is
    turned, as cv2.imread and Pillow's ImageOps.exif_transpose do; read as stored, it would be calibrated on
    sideways (or refused as the wrong size, 48x192 for 192x48)."""
    from PIL import ImageOps

    orientation = img.getexif().get(ORIENTATION_TAG, 1)
    return ImageOps.exif_transpose(img) if orientation in range(2, 9) else img


def guess_layout(shape: list, role: str) -> str:
    if shape[1] in (1, 3):
        return "nchw"
    if shape[3] in (1, 3):
        return "nhwc"
    raise DataError(f"{role}: cannot tell the image layout from input shape {shape}; "
                    f"set {role}.preprocess.layout to nchw or nhwc")


def _per_channel(values: list | None, channels: int, where: str) -> np.ndarray | None:
    if values is None:
        return None
    if len(values) not in (1, channels):
        raise DataError(f"{where}: {len(values)} values given for {channels} channels")
    array = np.asarray(values, dtype=np.float32)
    return np.broadcast_to(array, (channels,)).copy()
