"""Files qprep reads are regular files: a FIFO, device or socket is refused in one line, without blocking.

Why before every read of a user's path: a FIFO opened for reading blocks until a writer appears (a batch hung on
a FIFO named a.onnx), and a device such as /dev/zero never ends.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

from qprep.errors import QprepError

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symlink"))


def file_kind(mode: int) -> str | None:
    """What an st_mode names when it is not a regular file ('a FIFO (named pipe)', 'a folder'...), else None."""
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in _KINDS if test(mode)), "a special file")


def special_kind(mode: int) -> str | None:
    """The kind of a FIFO, device or socket; None for regular files, folders and links (places qprep may use)."""
    kind = file_kind(mode)
    return None if kind in (None, "a folder", "a symlink") else kind


def require_regular_file(path: str | os.PathLike, what: str, error: type[QprepError] = QprepError,
                         fix: str = "give the path of a regular file") -> Path:
    """`path` if it names a regular file (links followed), else a one-line `error` naming it and what it is.
    `what` leads the message ("model file"), `fix` ends it."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        raise error(f"{what} not found: {path}; {fix}") from None
    except OSError as exc:
        raise error(f"{what} {path} cannot be read ({exc.strerror}); {fix}") from None
    kind = file_kind(mode)
    if kind:
        raise error(f"{what} {path} is {kind}, not a regular file; {fix}")
    return Path(path)


def read_json(path: str | os.PathLike):
    """The JSON a regular file holds (a run's report.json, manifest.json): OSError for a missing or special file
    (a FIFO would block the read), ValueError for text that is not JSON; callers already handle both."""
    kind = file_kind(os.stat(path).st_mode)
    if kind:
        raise OSError(errno.EINVAL, f"{kind}, not a regular file", str(path))
    return json.loads(Path(path).read_text())


def read_text(path: str | os.PathLike, what: str, error: type[QprepError] = QprepError,
              fix: str = "save it as UTF-8 text") -> str:
    """The UTF-8 text of a user's regular file (labels, lists), or a one-line `error` saying why not."""
    require_regular_file(path, what, error, fix)
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{what} {path} is not UTF-8 text (byte {exc.start}); {fix}") from None
    except OSError as exc:
        raise error(f"{what} {path} cannot be read ({exc.strerror}); {fix}") from None
