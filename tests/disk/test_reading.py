"""Reading a user's files (qprep/disk/reading.py): one line for what cannot be read, never a block or a crash."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from qprep.disk.reading import read_json, read_text
from qprep.errors import DataError
from qprep.evaluate import read_labels


@pytest.mark.parametrize("content", [b"a.npy \xe9t\xe9\n", b"\xdd\x00\x01binary"], ids=["latin-1", "binary"])
def test_labels_that_are_not_utf8_are_one_line(tmp_path, content):
    labels = tmp_path / "labels.txt"
    labels.write_bytes(content)
    with pytest.raises(DataError, match=r"^evaluation.labels: file .* is not UTF-8 text \(byte \d+\); [^\n]*$"):
        read_labels(labels, None, ["a.npy"])


def test_a_fifo_is_refused_by_both_readers_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(DataError, match="FIFO"):
        read_text(tmp_path / "pipe", "list", DataError)
    with pytest.raises(OSError, match="FIFO"):
        read_json(Path(tmp_path / "pipe"))
