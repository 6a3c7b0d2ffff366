"""Atomic writes: a file appears whole or not at all (temp file beside it, then rename).

The rename replaces the directory entry, so a symlink at the destination is replaced by the file and its target
is never written. The temp names (`.NAME.XXXX.tmp`) are qprep's own: an owned folder's --force removes any an
interrupted write left (owned.TEMPORARY).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """UTF-8; a file name that is not (Python keeps its bytes as lone surrogates) is written as `\\udcff`."""
    atomic_write_bytes(path, text.encode("utf-8", errors="backslashreplace"))


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # the name cut so that a 255-byte file name still leaves room for the temp name's 14 more
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".qprep-{path.name[:120]}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; reports are shared like any written file
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
