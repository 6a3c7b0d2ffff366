"""Folders qprep owns: ownership is proven by a manifest qprep wrote, never inferred from what a folder holds.

A run (or batch) directory is claimed before anything is written in it:
1. lock it: an flock on the folder itself, so a refused attempt leaves no file behind and the kernel drops the
   lock however the process ends (a lock *file* used to stay, and made a user's folder look like a run);
2. prove what is there: nothing, or a manifest.json a qprep run of the same kind wrote *for this folder*
   (`kind`, `files`, and `folder`: the device and inode it was written in, which a `mv` keeps and a copy does
   not: a manifest copied into a user's folder proves nothing); a folder with anything else is refused,
   `--force` or not;
3. write a manifest first ("status: running", the names the run may write: they are absent now, so whatever of
   them exists later is the run's own), so a run killed outright is still a run `--force` can replace.

Removal (`clear_previous`) takes exactly the previous manifest's `files` (plus qprep's temporary names) and
never follows a symlink: a listed link is unlinked, its target untouched; a listed entry that leads outside the
folder is skipped.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
import stat
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from qprep import jsonfile
from qprep.disk.atomic import atomic_write_text
from qprep.disk.reading import read_json
from qprep.errors import RunDirError
from qprep.version import __version__

MANIFEST = "manifest.json"
LEGACY_LOCK = ".qprep.lock"  # the lock file qprep once kept inside a run directory
# What an interrupted atomic write (disk/atomic.py: `.qprep-NAME.XXXXXXXX.tmp`) or model save (model/io.py:
# `.qprep-tmp-XXXXXXXX/`) leaves: exactly the names qprep's tempfile calls make there, marked `.qprep-` so that no
# name a user would choose matches (`.notes.20261207.tmp` did, and --force removed it).
TEMPORARY = re.compile(r"^\.qprep-(tmp-[a-z0-9_]{8}|.+\.[a-z0-9_]{8}\.tmp)$")


@dataclass
class Owned:
    """A claimed folder: locked while this object lives, its manifest identifying this run or batch."""

    path: Path
    kind: str  # "run" | "batch"
    fd: int | None
    previous: dict | None  # the manifest of the run or batch that used the folder before, if any
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: bool = False  # the folder did not exist: this claim made it
    batch: str | None = None  # a batch worker's run: the batch --out it belongs to (its identity)

    def identity(self) -> dict:
        """The fields every manifest this claim writes ends with: what proves the folder is qprep's."""
        return {"kind": self.kind, "run_id": self.run_id, "qprep_version": __version__,
                "folder": folder_identity(self.path), **({"batch": self.batch} if self.batch else {})}

    def write_manifest(self, manifest: dict) -> None:
        atomic_write_text(self.path / MANIFEST, jsonfile.dumps({**manifest, **self.identity()}) + "\n")

    def clear_previous(self) -> None:
        """Remove what the previous manifest lists, and qprep's temporary names; nothing else."""
        root = Path(os.path.realpath(self.path))
        names = [*listed_files(self.previous), MANIFEST, LEGACY_LOCK]
        names += [p.name for p in self.path.iterdir() if TEMPORARY.match(p.name)]
        for name in names:  # checked before anything is removed: a refusal leaves the folder as it was
            if not name.endswith("/") and name not in LEGACY_FOLDERS and (root / name).is_dir() \
                    and not (root / name).is_symlink():
                raise RunDirError(f"{self.path / name} is a folder the previous qprep run did not write (it wrote a "
                                  "file there); move it out of the run directory, then run again")
        for name in names:  # a link where the run had a folder (work/, stages/, work/ort/): replaced, target kept
            parts = Path(name.removesuffix("/**").rstrip("/")).parts
            folders = len(parts) if name.endswith("/") or name.endswith("/**") else len(parts) - 1
            for depth in range(1, folders + 1):
                if root.joinpath(*parts[:depth]).is_symlink():
                    root.joinpath(*parts[:depth]).unlink()
                    break
        for name in dict.fromkeys(names):
            if name.endswith("/**"):  # a folder qprep made whose contents are all its own (a stage's work folder)
                _remove_inside(root, name[:-3])
            else:
                _remove_inside(root, name.rstrip("/"), only_if_empty=name.endswith("/"))

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def listed_files(manifest: dict | None) -> list[str]:
    """The manifest's `files` that name something inside the folder (relative, no `..`, not the folder itself),
    normalized (`./a//b` → `a/b`)."""
    names = [n for n in (manifest or {}).get("files") or [] if isinstance(n, str) and n and not os.path.isabs(n)]
    normal = [os.path.normpath(n) + ("/" if n.endswith("/") else "") for n in names]  # "dir/": only if empty
    return [n for n in normal if n.rstrip("/") != "." and ".." not in Path(n).parts]


def folder_identity(path: Path) -> list[int]:
    """(device, inode) of a folder: the same after a rename, another for a copy."""
    info = os.stat(path)
    return [info.st_dev, info.st_ino]


def read_manifest(folder: Path) -> dict | None:
    """The manifest a qprep run or batch wrote in `folder`, or None (absent, unreadable, or not qprep's:
    a qprep manifest is a JSON object with `qprep_version` and a `files` list)."""
    path = folder / MANIFEST
    try:
        if stat.S_ISLNK(os.lstat(path).st_mode):  # a link proves nothing about this folder
            return None
        manifest = read_json(path)
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), list) \
            or not isinstance(manifest.get("qprep_version"), str):
        return None
    if "folder" not in manifest and _report_names(folder):  # a run of a qprep from before folder identities
        return manifest
    if manifest.get("folder") != folder_identity(folder):  # copied from elsewhere
        return None
    return manifest


def _report_names(folder: Path) -> bool:
    """The folder's report.json (a regular file) gives this folder as its run directory: how a run written
    before manifests held a folder identity proves it was written here (a copy or a moved run names another)."""
    try:
        report = read_json(folder / "report.json")
    except (OSError, ValueError):
        return False
    where = report.get("run_dir") if isinstance(report, dict) else None
    return isinstance(where, str) and os.path.realpath(where) == os.path.realpath(folder)


def claim(path: Path, kind: str, option: str, reserved: tuple[str, ...] = ()) -> Owned:
    """Lock `path` (made if missing) and prove it is free or the previous `kind`'s: raises a one-line
    RunDirError otherwise, leaving the folder as it was. `reserved`: the names this kind writes; one of them
    present but not listed by the previous manifest is the user's, and refused."""
    path = Path(path)
    created = not os.path.lexists(path)
    try:
        if created:
            path.mkdir(parents=True)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise RunDirError(f"cannot use {option} {path}: {_reason(exc)}; choose another {option}") from None
    owned = Owned(path, kind, fd, previous=None, created=created)
    try:
        _lock(owned, option)
        if not created:
            owned.previous = _prove(path, kind, option, reserved)
        if not os.access(path, os.W_OK | os.X_OK):  # a read-only folder: refuse before writing anything
            raise RunDirError(f"cannot use {option} {path}: permission denied; choose another {option}")
    except BaseException:
        owned.release()
        if created:
            _rmdir_quietly(path)
        raise
    return owned


def _lock(owned: Owned, option: str) -> None:
    try:
        fcntl.flock(owned.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        manifest = read_manifest(owned.path) or {}
        holder, kind = manifest.get("pid"), manifest.get("kind", owned.kind)  # the holder's kind, not the asker's
        by = f"pid {holder}" if isinstance(holder, int) else "another process"
        raise RunDirError(f"{option} {owned.path} is in use by {by} (a qprep {kind} running there); wait for it to "
                          f"finish or choose another {option}") from None


def _prove(path: Path, kind: str, option: str, reserved: tuple[str, ...]) -> dict | None:
    """The previous manifest of this kind, None for an empty folder; refuses anything else."""
    entries = sorted(p.name for p in path.iterdir())
    if not entries:
        return None
    manifest = read_manifest(path)
    if manifest is None and MANIFEST in entries:
        raise RunDirError(f"{option} {path} holds a manifest.json no qprep {kind} wrote in this folder (a copy, or one "
                          f"from an older qprep): qprep replaces only what it can prove its own; remove the folder "
                          f"yourself or choose another {option}")
    if manifest is None:
        shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
        raise RunDirError(f"{option} {path} holds files no qprep {kind} wrote ({shown}); qprep writes only into "
                          f"a new or empty folder or a previous {kind}'s: choose another {option}")
    found = manifest.get("kind", "run")  # manifests from before `kind` are runs'
    if found != kind:
        raise RunDirError(f"{option} {path} holds a qprep {found}, not a {kind}; choose another {option}")
    listed = {Path(name).parts[0] for name in listed_files(manifest)} | {MANIFEST, LEGACY_LOCK}
    foreign = [name for name in entries if name not in listed and not TEMPORARY.match(name)
               and name in reserved]
    if foreign:
        raise RunDirError(f"{option} {path} holds {foreign[0]}, which its previous qprep {kind} did not write and "
                          f"a new one would; move it out or choose another {option}")
    return manifest


def folder_inside(root: Path, *parts: str) -> Path:
    """root/parts..., each folder made here or already a real folder: never a symlink, so files a stage writes
    in `work/` cannot land wherever a link planted in the run directory points."""
    path = root
    for part in parts:
        path = path / part
        try:
            os.mkdir(path)
        except FileExistsError:
            pass
        except OSError as exc:
            raise RunDirError(f"cannot make {path} ({exc.strerror}); fix its permissions or choose another --out") \
                from None
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            raise RunDirError(f"{path} in the run directory is not a folder qprep made (a symlink or a file put there "
                              "while the run went on); remove it and run again")
    return path


# A manifest's entries: "name" a file qprep wrote, "name/" a folder it left empty (removed only while empty),
# "name/**" a folder it made whose contents are all its own (removed whole). LEGACY_FOLDERS: the folders manifests
# of older versions listed plainly, removed whole as those versions did.
LEGACY_FOLDERS = ("work", "stages")


def _remove_inside(root: Path, name: str, only_if_empty: bool = False) -> None:
    """Remove root/name without following a symlink anywhere on the way; prune the folders it leaves empty
    (clear_previous refused a folder found where the manifest lists a file: the user's, made there since)."""
    target = root / name
    if Path(os.path.realpath(target.parent)) != target.parent:  # a listed path through a symlinked folder
        return
    try:
        mode = os.lstat(target).st_mode
    except OSError:
        return
    if only_if_empty:
        if stat.S_ISDIR(mode):
            _rmdir_quietly(target)
            _prune_empty_parents(root, target.parent)
        return
    try:
        if stat.S_ISDIR(mode):
            shutil.rmtree(target)  # unlinks the links inside, never follows them
        else:
            os.unlink(target)
    except OSError as exc:  # said here, not later as a failure of whatever writes there next
        raise RunDirError(f"cannot remove {exc.filename or target} of the previous run ({exc.strerror}); fix its "
                          "permissions or choose another --out") from None
    _prune_empty_parents(root, target.parent)


def _prune_empty_parents(root: Path, parent: Path) -> None:
    """The folders the previous run made that are empty now (stages/, work/ once its last file went)."""
    while parent != root and parent.is_dir() and not parent.is_symlink() and not any(parent.iterdir()):
        parent.rmdir()
        parent = parent.parent


def _rmdir_quietly(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass


def _reason(exc: OSError) -> str:
    if exc.errno == errno.ENOTDIR:
        return "not a folder"
    return (exc.strerror or str(exc)).lower()
