"""The output guard (qprep/disk/guard.py): every kind of dangerous destination, for a file and for a folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from qprep.disk.guard import Guard, OutputError


@pytest.fixture
def place(tmp_path, monkeypatch):
    """inputs/model.onnx, inputs/data/0.npy, a sentinel outside, a user folder; HOME and cwd of their own."""
    (tmp_path / "inputs" / "data").mkdir(parents=True)
    (tmp_path / "inputs" / "model.onnx").write_bytes(b"model")
    (tmp_path / "inputs" / "data" / "0.npy").write_bytes(b"sample")
    (tmp_path / "sentinel.txt").write_text("keep me")
    (tmp_path / "user").mkdir()
    (tmp_path / "home" / "work").mkdir(parents=True)
    (tmp_path / "cwd").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path / "cwd")
    return tmp_path


def guard_of(root):
    return Guard({"the model": root / "inputs" / "model.onnx", "the data": root / "inputs" / "data"})


def dangerous_file(root, case: str):
    if case == "an input":
        return root / "inputs" / "model.onnx"
    if case == "inside an input folder":
        return root / "inputs" / "data" / "out.md"
    if case == "a symlink to an input":
        os.symlink(root / "inputs" / "model.onnx", root / "user" / "link.md")
        return root / "user" / "link.md"
    if case == "a path through a symlinked input folder":
        os.symlink(root / "inputs" / "data", root / "user" / "data")
        return root / "user" / "data" / "out.md"
    if case == "a FIFO":
        os.mkfifo(root / "user" / "pipe.md")
        return root / "user" / "pipe.md"
    if case == "a folder":
        return root / "user"
    raise AssertionError(case)


FILE_CASES = ["an input", "inside an input folder", "a symlink to an input", "a path through a symlinked input folder",
              "a FIFO", "a folder"]


@pytest.mark.parametrize("case", FILE_CASES)
def test_a_dangerous_file_destination_is_refused_and_nothing_changes(place, case):
    path = dangerous_file(place, case)
    before = snapshot(place)
    with pytest.raises(OutputError) as refused:
        guard_of(place).write_text(path, "table", "--markdown")
    assert "\n" not in str(refused.value) and "--markdown" in str(refused.value)
    assert snapshot(place) == before


def test_a_symlink_destination_is_replaced_never_written_through(place):
    link = place / "user" / "table.md"
    os.symlink(place / "sentinel.txt", link)
    guard_of(place).write_text(link, "table", "--markdown")
    assert (place / "sentinel.txt").read_text() == "keep me"
    assert not link.is_symlink() and link.read_text() == "table"


def test_inputs_learnt_later_are_checked_at_write_time(place):
    guard = Guard()
    out = place / "user" / "result.json"
    guard.output_file(out, "--json")
    guard.add_inputs({"the run's model": out})
    with pytest.raises(OutputError, match="the run's model"):
        guard.write_text(out, "{}", "--json")


def dangerous_folder(root, case: str):
    return {"home": root / "home", "above home": root, "the current directory": root / "cwd",
            "the current directory, relative": ".", "the root folder": "/", "an input folder": root / "inputs" / "data",
            "inside an input folder": root / "inputs" / "data" / "run", "a folder holding inputs": root / "inputs",
            "an input file": root / "inputs" / "model.onnx", "a file": root / "sentinel.txt"}[case]


FOLDER_CASES = ["home", "above home", "the current directory", "the current directory, relative", "the root folder",
                "an input folder", "inside an input folder", "a folder holding inputs", "an input file", "a file"]


@pytest.mark.parametrize("case", FOLDER_CASES)
def test_a_dangerous_run_folder_is_refused(place, case):
    before = snapshot(place)
    with pytest.raises(OutputError) as refused:
        guard_of(place).output_folder(dangerous_folder(place, case), "--out")
    assert "\n" not in str(refused.value) and "--out" in str(refused.value)
    assert snapshot(place) == before


def test_a_fifo_run_folder_is_refused(place):
    os.mkfifo(place / "user" / "pipe")
    with pytest.raises(OutputError, match="FIFO"):
        Guard().output_folder(place / "user" / "pipe", "--out")


def test_a_new_folder_beside_the_inputs_is_fine(place):
    assert guard_of(place).output_folder(place / "runs" / "a", "--out") == place / "runs" / "a"
    assert guard_of(place).output_file(place / "user" / "table.md", "--markdown") == place / "user" / "table.md"


def snapshot(root):
    """Every entry under root (links not followed) with its bytes or link target."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            if os.path.islink(path):
                found[path] = "-> " + os.readlink(path)
            elif os.path.isfile(path) and not name.startswith("pipe"):
                with open(path, "rb") as f:
                    found[path] = f.read()
            else:
                found[path] = "entry"
    return found


@pytest.mark.parametrize("make", ["link_to_a_device", "in_dev"])
def test_an_output_never_replaces_a_systems_link_nor_lands_in_dev(tmp_path, make):
    """`compare --markdown /dev/stdout` replaced the system's /dev/stdout link with a regular file: the guard
    replaced a link whose target was no input. A link to a special file, and any path in /dev, /proc or /sys,
    are refused; nothing is created."""
    from qprep.disk.guard import Guard, OutputError

    if make == "link_to_a_device":
        path = tmp_path / "out.md"
        path.symlink_to("/dev/null")
    else:
        path = Path("/dev") / f"qprep-test-{os.getpid()}.md"
    try:
        with pytest.raises(OutputError, match="a link to a character device|the system's"):
            Guard().write_text(path, "table", "--markdown")
        assert (path.is_symlink() and os.readlink(path) == "/dev/null") if make == "link_to_a_device" \
            else not path.exists()
    finally:
        if make == "in_dev" and path.exists():  # the code before the guard wrote it there
            path.unlink()
