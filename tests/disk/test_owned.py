"""Owned folders (qprep/disk/owned.py): ownership proven by a manifest, removal of exactly what it lists."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from qprep.disk import owned
from qprep.errors import RunDirError
from test_guard import snapshot

RESERVED = ("model.onnx", "report.json", "manifest.json", "work")


def previous_run(folder, files=("model.onnx", "report.json", "work"), **fields):
    """A folder as a finished run leaves it: its files, and a manifest listing them."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in files:
        if name == "work":
            (folder / "work").mkdir(exist_ok=True)
            (folder / "work" / "data.bin").write_bytes(b"w")
        else:
            (folder / name).write_text(name)
    manifest = {"kind": "run", "qprep_version": "0", "files": [*files, "manifest.json"],
                "folder": owned.folder_identity(folder), **fields}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def test_a_new_folder_is_made_and_an_empty_one_taken(tmp_path):
    claim = owned.claim(tmp_path / "new", "run", "--out", RESERVED)
    assert claim.created and claim.previous is None
    claim.release()
    (tmp_path / "empty").mkdir()
    claim = owned.claim(tmp_path / "empty", "run", "--out", RESERVED)
    assert not claim.created and claim.previous is None
    claim.release()


def user_folder(root, case: str):
    """Folders that hold something no qprep run of this kind wrote."""
    folder = root / "user"
    folder.mkdir()
    if case == "user files":
        (folder / "notes.txt").write_text("mine")
        (folder / "work").mkdir()
        (folder / "work" / "thesis.tex").write_text("mine")
    elif case == "a lock file left by an older qprep":
        (folder / ".qprep.lock").write_text("123\n")
        (folder / "report.json").write_text("{}")
    elif case == "a symlinked lock":
        os.symlink(root / "sentinel.txt", folder / ".qprep.lock")
    elif case == "a corrupt manifest":
        (folder / "manifest.json").write_text("{")
    elif case == "a manifest that is not qprep's":
        (folder / "manifest.json").write_text(json.dumps({"name": "my package", "files": ["x"]}))
    elif case == "a symlinked manifest":
        os.symlink(previous_run(root / "elsewhere") / "manifest.json", folder / "manifest.json")
    elif case == "a batch":
        (folder / "manifest.json").write_text(json.dumps({"kind": "batch", "qprep_version": "0", "files": [],
                                                          "folder": owned.folder_identity(folder)}))
    elif case == "a run's manifest copied in":
        (folder / "model.onnx").write_text("my model")
        shutil.copy(previous_run(root / "elsewhere") / "manifest.json", folder / "manifest.json")
    elif case == "a manifest from before folder identities":
        previous_run(folder, files=("model.onnx",))
        manifest = json.loads((folder / "manifest.json").read_text())
        (folder / "manifest.json").write_text(json.dumps({k: v for k, v in manifest.items() if k != "folder"}))
    elif case == "a run plus a user file with a name qprep writes":
        previous_run(folder, files=("model.onnx",))
        (folder / "report.json").write_text("my report")
    else:
        raise AssertionError(case)
    return folder


USER_CASES = ["user files", "a lock file left by an older qprep", "a symlinked lock", "a corrupt manifest",
              "a manifest that is not qprep's", "a symlinked manifest", "a batch",
              "a run plus a user file with a name qprep writes", "a run's manifest copied in",
              "a manifest from before folder identities"]


@pytest.mark.parametrize("case", USER_CASES)
def test_a_folder_not_proven_a_previous_run_is_refused_and_left_as_it_was(tmp_path, case):
    (tmp_path / "sentinel.txt").write_text("keep me")
    folder = user_folder(tmp_path, case)
    before = snapshot(tmp_path)
    with pytest.raises(RunDirError) as refused:
        owned.claim(folder, "run", "--out", RESERVED)
    assert "\n" not in str(refused.value)
    assert snapshot(tmp_path) == before


def test_force_removes_exactly_what_the_manifest_lists(tmp_path):
    folder = previous_run(tmp_path / "run")
    (folder / "notes.txt").write_text("mine")  # added by the user after the run
    (folder / ".qprep-report.json.ab12cd34.tmp").write_text("x")  # an interrupted atomic write
    (folder / ".notes.tmp").write_text("mine")  # a name of the user's, not one qprep makes
    (folder / ".notes.20261207.tmp").write_text("mine")  # the pattern of Python's tempfile, not qprep's mark
    (folder / ".tmp-backup01").write_text("mine")
    claim = owned.claim(folder, "run", "--out", RESERVED)
    claim.clear_previous()
    claim.release()
    assert sorted(p.name for p in folder.iterdir()) == [".notes.20261207.tmp", ".notes.tmp", ".tmp-backup01",
                                                         "notes.txt"]


@pytest.mark.parametrize("entry", ["../outside.txt", "ABSOLUTE", "link.txt", "linked_dir", "linked_dir/inner.txt", ".",
                                   "./", "", "a/../..", "linked_dir/../../outside.txt"])
def test_removal_never_leaves_the_folder(tmp_path, entry):
    (tmp_path / "outside.txt").write_text("keep me")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "inner.txt").write_text("keep me")
    folder = previous_run(tmp_path / "run")
    os.symlink(tmp_path / "outside.txt", folder / "link.txt")
    os.symlink(tmp_path / "outside", folder / "linked_dir")
    listed = str(tmp_path / "outside.txt") if entry == "ABSOLUTE" else entry
    manifest = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps({**manifest, "files": [*manifest["files"], listed]}))
    claim = owned.claim(folder, "run", "--out", RESERVED)
    claim.clear_previous()
    claim.release()
    assert (tmp_path / "outside.txt").read_text() == "keep me"
    assert (tmp_path / "outside" / "inner.txt").read_text() == "keep me"


def test_a_claimed_folder_is_in_use_for_another_claim(tmp_path):
    folder = previous_run(tmp_path / "run", pid=4242)
    first = owned.claim(folder, "run", "--out", RESERVED)
    try:
        with pytest.raises(RunDirError, match="in use by pid 4242"):
            owned.claim(folder, "run", "--out", RESERVED)
        first.write_manifest({**first.previous, "pid": 4243})
        with pytest.raises(RunDirError, match=r"in use by pid 4243 \(a qprep run running there\)"):
            owned.claim(folder, "batch", "batch --out", RESERVED)  # the holder's kind, not the asker's
    finally:
        first.release()
    owned.claim(folder, "run", "--out", RESERVED).release()  # free again once released


def test_a_refused_claim_of_a_new_folder_leaves_no_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(owned, "_lock", lambda claim, option: (_ for _ in ()).throw(RunDirError("busy")))
    with pytest.raises(RunDirError):
        owned.claim(tmp_path / "new", "run", "--out", RESERVED)
    assert not (tmp_path / "new").exists()


def test_the_manifest_written_says_whose_folder_it_is(tmp_path):
    claim = owned.claim(tmp_path / "run", "batch", "--out", RESERVED)
    claim.write_manifest({"files": ["a"]})
    claim.release()
    manifest = owned.read_manifest(tmp_path / "run")
    assert manifest["kind"] == "batch" and manifest["run_id"] == claim.run_id and manifest["files"] == ["a"]


@pytest.mark.parametrize("where", ["this folder", "another folder"])
def test_a_run_from_before_folder_identities_is_proven_by_its_report(tmp_path, where):
    """An older qprep's manifest has no `folder`; its report.json's run_dir names the folder it was written in:
    that one is replaceable, a copy of it elsewhere is not."""
    folder = previous_run(tmp_path / "run", files=("model.onnx", "report.json"))
    manifest = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps({k: v for k, v in manifest.items() if k != "folder"}))
    named = folder if where == "this folder" else tmp_path / "original"
    (folder / "report.json").write_text(json.dumps({"run_dir": str(named)}))
    if where == "this folder":
        owned.claim(folder, "run", "--out", RESERVED).release()
    else:
        with pytest.raises(RunDirError, match="no qprep run wrote in this folder"):
            owned.claim(folder, "run", "--out", RESERVED)


def test_folder_inside_never_goes_through_a_link(tmp_path):
    """A `work` symlink planted in a run directory: the stage's folder is refused, nothing is made where it points."""
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    run.mkdir()
    elsewhere.mkdir()
    assert owned.folder_inside(run, "work", "ort") == run / "work" / "ort"
    assert (run / "work" / "ort").is_dir()
    (run / "work" / "ort").rmdir()
    (run / "work").rmdir()
    (run / "work").symlink_to(elsewhere)
    with pytest.raises(RunDirError, match="not a folder qprep made"):
        owned.folder_inside(run, "work", "ort")
    assert list(elsewhere.iterdir()) == []
