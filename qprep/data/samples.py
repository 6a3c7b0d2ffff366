"""Choosing sample files, loading them by format, and validating them against the model's inputs."""

from __future__ import annotations

import hashlib
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from qprep.data.arrays import read_array_sample
from qprep.data.images import IMAGE_SUFFIXES, ImagePreprocess
from qprep.disk.reading import require_regular_file
from qprep.errors import DataError
from qprep.model.info import TensorSpec

FORMAT_SUFFIXES = {"npy": {".npy"}, "npz": {".npz"}, "images": IMAGE_SUFFIXES}
MIN_SAMPLES = 32  # "a few dozen per split" (README), "32-500 samples" (qprep init's comment)


@dataclass
class SampleSet:
    """Samples ready to feed: each a dict input name → array (batch dim included)."""

    samples: list[dict[str, np.ndarray]]
    files: list[str] = field(default_factory=list)
    source: str = ""
    format: str = ""
    sha256: str = ""
    warnings: list[str] = field(default_factory=list)
    preprocess: dict | None = None
    image_reader: ImagePreprocess | None = None  # for backends that normalize on chip (raw pixels)
    every_file: list[str] = field(default_factory=list)  # every file read (a list's lines: one per input)
    extras: list[dict] = field(default_factory=list)  # per sample: its .npz's arrays beside the inputs (arrays.py)

    def __len__(self) -> int:
        return len(self.samples)

    def describe(self) -> dict:
        return {"source": self.source, "format": self.format, "count": len(self.samples),
                "sha256": self.sha256, "warnings": self.warnings, "preprocess": self.preprocess}


def load_samples(cfg: dict, inputs: list[TensorSpec], role: str = "calibration") -> SampleSet:
    """Load the samples a config section (`source`, `format`, `max_samples`, `seed`, …) points to."""
    source = Path(cfg["source"])
    if cfg["format"] == "list" or (source.exists() and not source.is_dir()):  # a file: a list, if regular
        return _load_list(source, cfg, inputs, role)
    if not source.is_dir():
        raise DataError(f"{role}.source: folder not found: {source}")
    fmt, files = _pick_files(source, cfg["format"], role)
    chosen, warnings = _choose(files, cfg["max_samples"], cfg["seed"], role)
    warnings = _not_files_warning(source, role) + warnings
    reader = ImagePreprocess.for_model(cfg["preprocess"], inputs, role) if fmt == "images" else None
    with split_named(role):
        samples, extras = zip(*(_read(path, inputs, reader) for path in chosen))
    for path, sample in zip(chosen, samples):
        check_sample(sample, inputs, f"{role} sample {path.name}")
    return SampleSet(samples=list(samples), files=[str(p) for p in chosen], source=str(source), format=fmt,
                     sha256=_hash_files(chosen), warnings=warnings + _depth_warning(reader, role),
                     preprocess=reader.describe() if reader else None, image_reader=reader,
                     every_file=[str(p) for p in chosen], extras=list(extras))


def _read(path: Path, inputs: list[TensorSpec], reader: ImagePreprocess | None) -> tuple[dict, dict]:
    if reader is not None:
        return {reader.input.name: reader.read(path)}, {}
    return read_array_sample(path, inputs)


def _load_list(path: Path, cfg: dict, inputs: list[TensorSpec], role: str) -> SampleSet:
    """An RKNN-style dataset.txt: one sample per line, one file per model input (space-separated, in input
    order), paths relative to the list's folder; .npy arrays or, for single-input image models, images."""
    require_regular_file(path, f"{role}.source: list file", DataError,
                         "point source at a folder of samples or at a dataset.txt list")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:  # e.g. one image or .npy given where its folder was meant
        raise DataError(f"{role}.source: {path} is a single binary file, not a dataset.txt list; point source at "
                        "the folder of samples or at a text list of sample files") from None
    lines = [(number, line.split()) for number, line in enumerate(text.splitlines(), 1)
             if line.strip() and not line.startswith("#")]  # file line numbers, for the messages
    if not lines:
        raise DataError(f"{role}.source: {path} lists no samples; one sample per line, one file per input")
    chosen, warnings = _choose(lines, cfg["max_samples"], cfg["seed"], role)
    kinds = {(Path(p).suffix.lower() in IMAGE_SUFFIXES) for _, line in chosen for p in line}
    if len(kinds) > 1:  # else every image would be read as an array and blamed for it
        number, entry = next((n, p) for n, line in chosen for p in line if Path(p).suffix.lower() not in IMAGE_SUFFIXES)
        suffixes = ", ".join(sorted(IMAGE_SUFFIXES))
        raise DataError(f"{role}.source: {path} line {number}: {entry} is not an image ({suffixes}) while other "
                        "lines are; a list holds images or arrays, not both")
    images = kinds == {True}
    reader = ImagePreprocess.for_model(cfg["preprocess"], inputs, role) if images else None
    samples, files, every_file, extras = [], [], [], []
    with split_named(role):
        for number, entries in chosen:
            _read_line(path, number, entries, inputs, reader, role, (samples, files, every_file, extras))
    return SampleSet(samples=samples, files=files, source=str(path), format="list",
                     warnings=warnings + _depth_warning(reader, role),
                     sha256=_hash_files(every_file),  # every input's file: a changed mask changes the hash
                     preprocess=reader.describe() if reader else None, image_reader=reader,
                     every_file=[str(p) for p in every_file], extras=extras)


def _read_line(path: Path, number: int, entries: list[str], inputs: list[TensorSpec],
               reader: ImagePreprocess | None, role: str, into: tuple[list, ...]) -> None:
    """One line of a dataset.txt: its files read, checked and appended to (samples, files, every_file, extras)."""
    samples, files, every_file, extras = into
    if len(entries) != len(inputs):
        raise DataError(f"{path} line {number}: {len(entries)} files for {len(inputs)} model inputs "
                        f"({', '.join(s.name for s in inputs)}); list one file per input, in that order")
    paths = [require_regular_file(path.parent / e, f"{path} line {number}: file", DataError,
                                  "fix the path in the list").resolve() for e in entries]
    sample, beside = {}, {}
    if reader is not None:
        sample = {reader.input.name: reader.read(paths[0])}
    for spec, p in zip(inputs, paths) if reader is None else ():
        arrays, others = read_array_sample(p, [spec])
        sample[spec.name] = arrays[spec.name]
        beside.update(others)
    check_sample(sample, inputs, f"{role} sample {paths[0].name}")
    samples.append(sample)
    extras.append({name: value for name, value in beside.items() if name not in sample})
    files.append(str(paths[0]))
    every_file += paths


@contextmanager
def split_named(role: str):
    """Every error about a sample names its split (calibration, evaluation, evaluation.heldout) beside the file:
    the readers (arrays, images, a list's lines) name the file, this names the split, once for all of them."""
    try:
        yield
    except DataError as exc:
        if str(exc).startswith(role):
            raise
        raise DataError(f"{role}: {exc}") from None


def _depth_warning(reader: ImagePreprocess | None, role: str) -> list[str]:
    """Images read at 16 bits per channel: said, as a model fed uint8 pixels gets them rounded to 8 bits."""
    if reader is None or not reader.deep_files:
        return []
    example = Path(reader.deep_files[0]).name
    return [f"{role}: {len(reader.deep_files)} images have 16 bits per channel (e.g. {example}), read at "
            "that depth scaled to 0..255 (v*255/65535); a model fed uint8 pixels (an integer input, rknn's on-chip "
            "normalization) gets them rounded to 8 bits: convert the deployed model's input the same way"]


def _pick_files(folder: Path, fmt: str, role: str) -> tuple[str, list[Path]]:
    # is_file(): regular files (links followed) only; a FIFO, device or socket among the samples is no sample
    files = sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
    by_format = {name: [p for p in files if p.suffix.lower() in suffixes] for name, suffixes in FORMAT_SUFFIXES.items()}
    if fmt == "auto":
        present = [name for name, found in by_format.items() if found]
        if not present:
            raise DataError(f"{role}.source: {folder} holds no samples (.npy, .npz or images); "
                            "point it at a folder of samples")
        if len(present) > 1:
            raise DataError(f"{role}.source: {folder} mixes {' and '.join(present)} files; "
                            f"keep one kind per folder or set {role}.format")
        fmt = present[0]
    if not by_format[fmt]:
        raise DataError(f"{role}.source: {folder} holds no {fmt} samples; point it at a folder of samples")
    return fmt, by_format[fmt]


def _not_files_warning(folder: Path, role: str) -> list[str]:
    """Entries named like samples that are no regular files (a FIFO would block, a device never ends): skipped,
    and said, never silently."""
    suffixes = set().union(*FORMAT_SUFFIXES.values())
    skipped = sorted(p.name for p in folder.iterdir() if p.suffix.lower() in suffixes and not p.is_file()
                     and not p.is_dir() and not p.name.startswith("."))
    if not skipped:
        return []
    return [f"{role}: skipped {len(skipped)} entr{'y' if len(skipped) == 1 else 'ies'} of {folder} that "
            f"{'is' if len(skipped) == 1 else 'are'} no regular file (e.g. {skipped[0]}: a FIFO, device, socket or "
            "dangling link)"]


def _choose(files: list, cap: int, seed: int, role: str) -> tuple[list, list[str]]:
    """At most `cap` files: a seeded subset, kept in sorted order (same config → same samples).

    `cap` is a ceiling, not a request: fewer files are all used, and said only when the set is smaller than
    MIN_SAMPLES (the README's "a few dozen per split" would otherwise be warned of on every run with the
    default caps of 64 and 128), or than a cap set below it."""
    if len(files) <= cap:
        if len(files) == cap or len(files) >= MIN_SAMPLES:
            return files, []
        if cap <= MIN_SAMPLES:
            return files, [f"{role}: {len(files)} samples found, fewer than max_samples={cap}; using all of them"]
        return files, [f"{role}: only {len(files)} samples: a set smaller than a few dozen ({MIN_SAMPLES}) may not "
                       "stand for the deployment's inputs; add samples if you have them"]
    picks = np.random.default_rng(seed).choice(len(files), size=cap, replace=False)
    return [files[i] for i in sorted(picks)], []


def _hash_files(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def check_sample(sample: dict[str, np.ndarray], inputs: list[TensorSpec], where: str) -> None:
    """Names, dtype, rank, static dims and finiteness, each failure one line saying how to fix it."""
    for spec in inputs:
        if spec.name not in sample:
            raise DataError(f"{where}: no array for input '{spec.name}'")
        array = sample[spec.name]
        if array.dtype != spec.numpy_dtype:
            raise DataError(f"{where}: input '{spec.name}' is {array.dtype}, the model expects {spec.dtype}; "
                            f"save the samples as {spec.dtype}")
        if spec.shape is not None:
            if array.ndim != len(spec.shape):
                raise DataError(f"{where}: input '{spec.name}' has shape {list(array.shape)}, the model expects "
                                f"rank {len(spec.shape)} {spec.shape}; {_rank_fix(array, spec)}")
            for i, (have, want) in enumerate(zip(array.shape, spec.shape)):
                if isinstance(want, int) and have != want:
                    raise DataError(f"{where}: input '{spec.name}' has shape {list(array.shape)}, the model "
                                    f"expects {spec.shape} (dim {i} must be {want})")
        _check_not_empty(array, spec, where)
        if array.dtype.kind == "f" and not np.isfinite(array).all():
            bad = int(np.size(array) - np.isfinite(array).sum())
            raise DataError(f"{where}: input '{spec.name}' holds {bad} NaN/Inf values; clean the data")


def _check_not_empty(array: np.ndarray, spec: TensorSpec, where: str) -> None:
    """A sample of no rows (dim 0 is 0) is refused: the model's outputs on it are empty, so an agreement measured
    on them is "met" over nothing and a calibration range over them divides by zero. Another dim of 0 is kept: a
    decoder's first step feeds a key/value cache of past length 0. A dim the model fixes at 0 is its own."""
    fixed = spec.shape if spec.shape is not None and len(spec.shape) == array.ndim else [None] * array.ndim
    empty = [i for i, (have, want) in enumerate(zip(array.shape, fixed)) if have == 0 and want != 0 and i == 0]
    if empty:
        raise DataError(f"{where}: input '{spec.name}' has shape {list(array.shape)}, no elements (dim {empty[0]} "
                        f"is 0; the model expects {spec.shape}); save samples with at least one row")


def _rank_fix(array: np.ndarray, spec: TensorSpec) -> str:
    """How to save a sample of the wrong rank. One saved without its batch dim is refused, not given one: the
    README asks for the batch dim, and a guessed axis could as well be a missing channel (a [224, 224] image for
    [1, 1, 224, 224]) as the batch."""
    batch, rest = spec.shape[0], spec.shape[1:]
    if array.ndim == len(spec.shape) - 1 and all(not isinstance(w, int) or h == w for h, w in zip(array.shape, rest)):
        if isinstance(batch, int) and batch > 1:  # a fixed batch of several: x[None] would fail on dim 0 next
            return f"the sample lacks the batch dim: the model takes {batch} at once, save them stacked"
        return (f"the sample lacks the batch dim: save it as x[None] (shape {[1, *array.shape]}), one sample per "
                "file with the batch dim included")
    return "save each sample with the model's rank, the batch dim included"


def random_samples(inputs: list[TensorSpec], count: int, seed: int = 0) -> SampleSet:
    """Seeded random inputs, only for verifying rewrites when no data is configured (and said so).

    Dynamic dims become 1 for the batch and 32 elsewhere (a multiple of the usual CNN strides); a named dim
    keeps the size of its first appearance, so inputs that share `seq` (ids [batch, seq], mask [seq]) agree.
    """
    rng = np.random.default_rng(seed)
    samples = []
    named: dict[str, int] = {}

    def size(axis: int, dim) -> int:
        if isinstance(dim, int):
            return dim
        default = 1 if axis == 0 else 32
        return named.setdefault(dim, default) if isinstance(dim, str) and dim not in ("", "?") else default

    for _ in range(count):
        sample = {}
        for spec in inputs:
            shape = [size(i, d) for i, d in enumerate(spec.shape or [])]
            dtype = spec.numpy_dtype
            if dtype.kind == "f":
                sample[spec.name] = rng.standard_normal(shape).astype(dtype)
            elif dtype.kind == "b":
                sample[spec.name] = rng.integers(0, 2, shape).astype(dtype)
            else:
                sample[spec.name] = rng.integers(0, 2, shape).astype(dtype)
        samples.append(sample)
    return SampleSet(samples=samples, source="random", format="random",
                     warnings=["no calibration data: rewrites were verified on seeded random inputs only"])
