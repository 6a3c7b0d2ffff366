"""Fault suite, issue #57 "Nothing of the user's is ever touched": every command that writes × every dangerous
destination. Each case runs the real CLI (tests/pipeline/faults.py) in a world of user files (a project whose
inputs qprep reads, $HOME, a user's folder, a sentinel file that symlinks point at, the working directory) and
asserts the exit code, at most one `qprep: error:` line and no traceback, no hang, and that nothing outside what
qprep may create changed: every entry of that world is the same file (sha256), folder, symlink or FIFO afterwards,
and no new entry appeared in it — a refused attempt leaves nothing behind, not even a `.qprep.lock`.

The cases are generated: FOLDER_DESTINATIONS × FOLDER_COMMANDS (run, batch) and FILE_DESTINATIONS × FILE_COMMANDS
(compare --markdown/--html, evaluate --json, init --out); a refused destination is tried twice, plainly and then
with the flag that replaces (--force; batch: --resume), and must be refused both times.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import onnx
import pytest
import yaml

from conftest import ROOT
from faults import Outcome, Project, assert_one_line, project, wait_for

pytestmark = pytest.mark.slow  # real models or the CLI in subprocesses: `pytest -m "not slow"` skips them

TIMEOUT = {"run": 120, "batch": 120}  # seconds before a command counts as hung; the others: QUICK
QUICK = 60
REPLACE = {"run": "--force", "init": "--force", "batch": "--resume"}
RUN_FILES = ["model.onnx", "model.onnx.data", "report.json", "report.md", "report.html", "manifest.json", "qprep.log"]  # the flag a second attempt adds
STATUSES = ("ok", "gate missed", "refused", "failed", "duplicate")


# --- running the CLI: every call has a timeout, a hang is a failure -------------------------------------------

def _env(home: Path) -> dict:
    """$HOME is the test's own (part of the sentinel tree); PYTHONPATH makes every process, batch workers
    included, import the qprep of this checkout whatever its working directory."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "HOME": str(home), "PYTHONPATH": path}


def _popen(args, cwd: Path, home: Path, sigint_default: bool = False) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "qprep", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, cwd=cwd, env=_env(home),
                            start_new_session=True,  # its own process group: a hang is killed with its workers
                            preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) if sigint_default
                            else None)


def _finish(process: subprocess.Popen, args, timeout: float) -> Outcome:
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        pytest.fail(f"hang: `qprep {' '.join(map(str, args))}` still running after {timeout} s", pytrace=False)
    return Outcome(process.returncode, out, err)


def cli(*args, cwd: Path, home: Path, timeout: float = QUICK) -> Outcome:
    return _finish(_popen(args, cwd, home), args, timeout)


def assert_outcome(outcome: Outcome, codes: tuple[int, ...], args, root: Path | None = None) -> None:
    """Exit code one of `codes`; at most one stderr line, no traceback, no internal error; with exit 2 that
    line is `qprep: error: ...`. (`root`: left out of the paths the message shows.)"""
    command = f"`qprep {' '.join(map(str, args))}`".replace(f"{root}{os.sep}" if root else "\0", "")
    assert outcome.code in codes, f"{command}: exit {outcome.code} (wanted {' or '.join(map(str, codes))}): " \
                                  f"{outcome.err.strip()}"
    assert_one_line(outcome, outcome.code)
    if outcome.code == 2 and outcome.err.strip():  # (a batch that refused one model says so in its summary)
        assert outcome.err.startswith("qprep: error:"), f"{command}: {outcome.err!r}"


def assert_no_crash(outcome: Outcome) -> None:
    assert "Traceback" not in outcome.err and "internal error" not in outcome.err, outcome.err
    assert outcome.code != 3, outcome.err


# --- the sentinel tree --------------------------------------------------------------------------------------

def tree(root: Path) -> dict[str, tuple]:
    """Every entry under `root` (symlinks not followed) → ("file", sha256) / ("dir",) / ("link", target) /
    ("fifo",): compare before/after to prove nothing changed and nothing appeared."""
    found = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder) / name
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode):
                entry = ("link", os.readlink(path))
            elif stat.S_ISREG(mode):
                entry = ("file", hashlib.sha256(path.read_bytes()).hexdigest())
            elif stat.S_ISDIR(mode):
                entry = ("dir",)
            elif stat.S_ISFIFO(mode):
                entry = ("fifo",)
            else:
                entry = ("other", stat.S_IFMT(mode))
            found[str(path.relative_to(root))] = entry
    return found


def assert_untouched(root: Path, before: dict, owned=(), kept=()) -> None:
    """Nothing under `root` changed or appeared except under `owned` (paths qprep may create or replace);
    `kept` (inside owned) stays the user's all the same."""
    def under(rel: str, paths) -> bool:
        return any(rel == p or rel.startswith(p + os.sep) for p in paths)

    owned = [str(Path(p).relative_to(root)) for p in owned]
    kept = [str(Path(p).relative_to(root)) for p in kept]
    after = tree(root)
    free = {rel for rel in {*before, *after} if under(rel, owned) and not under(rel, kept)}
    changed = sorted(rel for rel in before if rel not in free and after.get(rel) != before[rel])
    new = sorted(rel for rel in after if rel not in before and rel not in free)
    assert not changed and not new, (f"touched the user's files: changed or removed {changed}; new {new}"
                                     f"\n(before: {[before.get(r) for r in changed]}; after: "
                                     f"{[after.get(r) for r in changed]})")


# --- the world every case runs in ---------------------------------------------------------------------------

def _variant(model: Path, target: Path, tag: str) -> Path:
    """A copy of `model` with other bytes (doc_string): a batch runs it instead of calling it a duplicate."""
    proto = onnx.load(str(model))
    proto.doc_string = tag
    onnx.save(proto, str(target))
    return target


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """Built once: project/ (model, calib/, eval/, config.yaml, batch.yaml, out/ = a finished run with
    evaluation), models/ (a.onnx, b.onnx: the tiny model, different bytes), batch/ (a finished batch of them)."""
    root = tmp_path_factory.mktemp("template")
    p = project(root / "project", samples=2)
    p.write_config("batch.yaml", model=None, output_dir=None)
    env = {"cwd": root, "home": root}
    done = cli("run", p.config, "--quiet", **env, timeout=TIMEOUT["run"])
    assert done.code == 0, done.err
    (root / "models").mkdir()
    for tag in ("a", "b"):
        _variant(p.model, root / "models" / f"{tag}.onnx", tag)
    done = cli("batch", p.root / "batch.yaml", root / "models", "--out", root / "batch", "--quiet", **env,
               timeout=TIMEOUT["batch"])
    assert done.code == 0, done.err
    return root


@dataclass
class World:
    tmp: Path
    project: Project  # a copy of the template's: its out/ is a finished run (RUN), eval/ the samples (S)
    home: Path  # $HOME of every command: work/notes.txt, .profile
    user: Path  # a user's folder, no qprep manifest: work/notes.txt, notes.txt, report.json, model.onnx, summary.json
    cwd: Path  # an empty folder: the working directory of every command unless the case says otherwise
    sentinel: Path  # what symlinks point at
    outside: Path  # what a hand-edited manifest names
    models: Path  # a.onnx, b.onnx: batch's model folder
    template: Path

    @property
    def run(self) -> Path:
        return self.project.out

    @property
    def batch_config(self) -> Path:
        return self.project.root / "batch.yaml"

    def qprep(self, *args, cwd: Path | None = None, timeout: float = QUICK) -> Outcome:
        return cli(*args, cwd=cwd or self.cwd, home=self.home, timeout=timeout)

    def previous_run(self, name: str = "prev") -> Path:
        """A run directory that a real, finished run wrote (ownership by its manifest, in place)."""
        out = self.tmp / name
        done = self.qprep("run", self.project.config, "--out", out, "--quiet", timeout=TIMEOUT["run"])
        assert done.code == 0, done.err
        return out

    def batch_copy(self) -> Path:
        shutil.copytree(self.template / "batch", self.tmp / "batch", symlinks=True)
        return self.tmp / "batch"

    def fifo(self, name: str = "fifo") -> Path:
        os.mkfifo(self.tmp / name)
        return self.tmp / name

    def symlink(self, name: str, target: Path | None = None) -> Path:
        (self.tmp / name).symlink_to(target or self.sentinel)
        return self.tmp / name


@pytest.fixture
def world(tmp_path, template) -> World:
    shutil.copytree(template / "project", tmp_path / "project", symlinks=True)
    shutil.copytree(template / "models", tmp_path / "models", symlinks=True)
    root = tmp_path / "project"
    p = Project(root, root / "model.onnx", root / "calib", root / "eval", root / "config.yaml", root / "out")
    home, user, cwd = tmp_path / "home", tmp_path / "user", tmp_path / "cwd"
    for folder in (home / "work", user / "work", cwd):
        folder.mkdir(parents=True)
    (home / "work" / "notes.txt").write_text("the user's work\n")
    (home / ".profile").write_text("export PATH\n")
    (user / "work" / "notes.txt").write_text("the user's work\n")
    (user / "notes.txt").write_text("mine\n")
    (user / "report.json").write_text('{"mine": true}\n')
    (user / "model.onnx").write_bytes(b"the user's own model, not qprep's")
    (user / "summary.json").write_text('{"models": "mine"}\n')
    (tmp_path / "sentinel.txt").write_text("sentinel: a file qprep never made\n")
    (tmp_path / "outside.txt").write_text("outside the run directory\n")
    return World(tmp_path, p, home, user, cwd, tmp_path / "sentinel.txt", tmp_path / "outside.txt",
                 tmp_path / "models", template)


# --- destinations -------------------------------------------------------------------------------------------

@dataclass
class Case:
    dest: Path | str | None  # the --out / --markdown / --html / --json value (None: run takes the config's)
    codes: tuple[int, ...] = (2,)
    owned: tuple[Path, ...] = ()  # what qprep may create or replace
    kept: tuple[Path, ...] = ()  # inside owned, the user's all the same
    cwd: Path | None = None
    config: Path | None = None  # run: another config
    inputs: tuple | None = None  # compare: other inputs
    samples: Path | None = None  # evaluate: other --samples
    run: Path | None = None  # evaluate: another run directory
    model: Path | None = None  # init: another model
    flags: tuple[tuple[str, ...], ...] | None = None  # the attempts; default: plain, then with REPLACE (refusals)

    def attempts(self, command: str) -> tuple[tuple[str, ...], ...]:
        if self.flags is not None:
            return self.flags
        if 2 in self.codes and command in REPLACE:
            return (), (REPLACE[command],)  # refused, then again with --force: the old code cleared it then
        return ((),)


def _maybe(folder: Path) -> Case:
    """A destination qprep may take over (exit 0) or refuse (2); what it points at stays the user's."""
    return Case(folder, codes=(0, 2), owned=(folder,))


def _maybe_file(path: Path) -> Case:
    """A file name qprep may write (exit 0) or refuse in one line (2); never exit 3 for printing it."""
    return Case(path, codes=(0, 2), owned=(path,))


def _symlinked_lock(w: World, command: str) -> Case:
    folder = w.tmp / "locked"
    folder.mkdir()
    (folder / ".qprep.lock").symlink_to(w.sentinel)
    return _maybe(folder)


def _run_with(w: World, change: Callable[[Path], None], codes=(0,), kept: Callable[[Path], tuple] = lambda d: ()):
    """A finished run, changed by hand, replaced with --force."""
    out = w.previous_run()
    change(out)
    return Case(out, codes=codes, owned=(out,), kept=kept(out), flags=(("--force",),))


def _report_symlink(out: Path) -> None:
    (out / "report.json").unlink()
    (out / "report.json").symlink_to(out.parent / "sentinel.txt")


def _manifest_lists(entry: Callable[[Path], str]) -> Callable[[Path], None]:
    def change(out: Path) -> None:
        manifest = json.loads((out / "manifest.json").read_text())
        manifest["files"].append(entry(out))
        (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return change


def _user_file(out: Path) -> None:
    (out / "notes.txt").write_text("mine, added after the run\n")


def _twice(case: Case) -> Case:
    """The same --force again: a run must not adopt the user's files into its manifest (the second removed them)."""
    return replace(case, flags=(("--force",), ("--force",)))


def _stage_folder_symlinked(out: Path) -> None:
    """work/ort replaced by a link to a folder of the user's: the run failed at its stage after clearing the
    previous result; the link is replaced, its target untouched."""
    target = out.parent / "users_scratch"
    target.mkdir()
    (target / "keep.txt").write_text("mine\n")
    shutil.rmtree(out / "work" / "ort")
    (out / "work" / "ort").symlink_to(target)


def _killed_with_user_files(out: Path) -> None:
    """What a run killed outright (SIGKILL) leaves: its running manifest (the stage folders it announced), then
    files of the user's put into work/ and stages/. Older manifests listed those folders whole."""
    manifest = json.loads((out / "manifest.json").read_text())
    manifest.update(status="running", files=[*RUN_FILES, "work/ort/**"])
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    (out / "work" / "mine.txt").write_text("mine\n")
    (out / "stages").mkdir(exist_ok=True)
    (out / "stages" / "notes.txt").write_text("mine\n")


def _user_folder_at_report_md(out: Path) -> None:
    """A folder of the user's where the previous run wrote report.md (listed as a file)."""
    (out / "report.md").unlink()
    (out / "report.md").mkdir()
    (out / "report.md" / "notes.txt").write_text("mine\n")


def _user_file_in_work(out: Path) -> None:
    """A file of the user's inside work/: the manifest listed the folder whole, and --force removed it."""
    assert (out / "work").is_dir()
    (out / "work" / "notes.txt").write_text("mine, added after the run\n")


def _finished_batch(w: World) -> Path:
    out = w.tmp / "batch_out"
    done = w.qprep("batch", w.batch_config, w.models, "--out", out, "--quiet", timeout=TIMEOUT["batch"])
    assert done.code == 0, done.err
    return out


def _previous_batch_with_user_folder(w: World, command: str) -> Case:
    """A finished batch; then the user makes out/b2 (a file of theirs in it) and adds b2.onnx to the model
    folder: `batch --resume` must not clear out/b2 (refusing b2 is fine: exit 2)."""
    out = _finished_batch(w)
    (out / "b2").mkdir()
    (out / "b2" / "notes.txt").write_text("the user's, in a folder named like a model\n")
    _variant(w.models / "a.onnx", w.models / "b2.onnx", "b2")
    return Case(out, codes=(0, 2), owned=(out,), kept=(out / "b2",), flags=(("--resume",),))


def _previous_batch_run_dir_symlink(w: World, command: str) -> Case:
    """A finished batch whose out/b the user replaced by a symlink to an empty folder of theirs elsewhere:
    `batch --resume` writes nothing through it."""
    out = _finished_batch(w)
    shutil.rmtree(out / "b")
    (w.tmp / "elsewhere").mkdir()
    (out / "b").symlink_to(w.tmp / "elsewhere")
    return Case(out, codes=(0, 2), owned=(out,), flags=(("--resume",),))


def _work_symlink(out: Path) -> None:
    """The previous run's work/ replaced by a symlink to the user's own work/ folder."""
    shutil.rmtree(out / "work")
    (out / "work").symlink_to(out.parent / "user" / "work")


def _external_data(w: World) -> tuple[Path, Path]:
    """The project's model saved with its weights in ext/weights.bin → (model, weights)."""
    from onnx.external_data_helper import convert_model_to_external_data

    folder = w.project.root / "ext"
    folder.mkdir()
    model = onnx.load(str(w.project.model))
    convert_model_to_external_data(model, location="weights.bin", size_threshold=0)
    onnx.save(model, str(folder / "model.onnx"))
    return folder / "model.onnx", folder / "weights.bin"


def _input_external_data(w: World, command: str) -> Case:
    """The model's external weights: init's input; evaluate's too (the run's float model, its reference)."""
    model, weights = _external_data(w)
    if command == "init":
        return Case(weights, model=model)
    run = w.tmp / "ext_run"
    done = w.qprep("run", w.project.config, "--model", model, "--out", run, "--quiet", timeout=TIMEOUT["run"])
    assert done.code == 0, done.err
    return Case(weights, run=run)


def _copied_manifest(w: World) -> Path:
    """A user's folder holding a real run's manifest, copied in: it proves nothing about this folder."""
    shutil.copy(w.run / "manifest.json", w.user / "manifest.json")
    return w.user


def _previous_run_holding_a_listed_sample(w: World, command: str) -> Case:
    """A finished run; the calibration is then a list file naming a sample kept in that run's work/: --force
    would delete a file the run reads."""
    out = w.previous_run()
    (out / "work" / "mine").mkdir(parents=True)
    shutil.copy(next(w.project.calibration.glob("*.npy")), out / "work" / "mine" / "0.npy")
    listing = w.project.root / "listed.txt"
    listing.write_text(f"{out / 'work' / 'mine' / '0.npy'}\n")
    config = w.project.write_config("listed.yaml", calibration={"source": str(listing)}, output_dir=str(out))
    return Case(None, config=config, flags=(("--force",),))


def _symlink_loop(w: World) -> Path:
    (w.tmp / "loop_a").symlink_to(w.tmp / "loop_b")
    (w.tmp / "loop_b").symlink_to(w.tmp / "loop_a")
    return w.tmp / "loop_a"


def _temporary_like(out: Path) -> None:
    """Names of the user's that look like temporary files (qprep removes only the exact ones it makes)."""
    (out / ".tmp-photos").mkdir()
    (out / ".tmp-photos" / "1.jpg").write_bytes(b"a photo")
    (out / ".notes.tmp").write_text("mine\n")


def _inside_sidecar_data(w: World, command: str) -> Case:
    """a.onnx's own overlay (a.qprep.yaml) names a calibration folder; --out inside it."""
    data = w.tmp / "a_calib"
    shutil.copytree(w.project.calibration, data)
    (w.models / "a.qprep.yaml").write_text(yaml.safe_dump({"calibration": {"source": str(data)}}))
    return Case(data / "b")


def _input_folder(w: World, command: str) -> Path:
    return w.project.calibration if command == "run" else w.models


FOLDER_COMMANDS = ("run", "batch")
BOTH = FOLDER_COMMANDS
# name: (the commands it applies to, (world, command) → Case)
FOLDER_DESTINATIONS: dict[str, tuple[tuple[str, ...], Callable[[World, str], Case]]] = {
    "user_folder": (BOTH, lambda w, c: Case(w.user)),
    "home": (BOTH, lambda w, c: Case(w.home)),
    "home_tilde": (("run",), lambda w, c: Case(None, config=w.project.write_config("tilde.yaml", output_dir="~"))),
    "cwd": (BOTH, lambda w, c: Case(".", cwd=w.user)),
    "cwd_empty": (BOTH, lambda w, c: Case(".", cwd=w.cwd)),
    "input_model": (("run",), lambda w, c: Case(w.project.model)),
    "input_folder": (BOTH, lambda w, c: Case(_input_folder(w, c))),
    "inside_input_folder": (BOTH, lambda w, c: Case(_input_folder(w, c) / "sub")),
    "project_root": (BOTH, lambda w, c: Case(w.project.root)),  # holds the config and the model
    "fifo": (BOTH, lambda w, c: Case(w.fifo())),
    "regular_file": (BOTH, lambda w, c: Case(w.user / "notes.txt")),
    "symlinked_lock": (BOTH, _symlinked_lock),
    "new": (BOTH, lambda w, c: Case(w.tmp / "new", codes=(0,), owned=(w.tmp / "new",))),
    "previous_run": (("run",), lambda w, c: _run_with(w, lambda out: None)),
    "previous_run_report_symlink": (("run",), lambda w, c: _run_with(w, _report_symlink)),
    "previous_run_manifest_relative": (("run",), lambda w, c: _run_with(
        w, _manifest_lists(lambda out: "../outside.txt"), codes=(0, 2))),
    "previous_run_manifest_absolute": (("run",), lambda w, c: _run_with(
        w, _manifest_lists(lambda out: str(out.parent / "outside.txt")), codes=(0, 2))),
    "previous_run_work_symlink": (("run",), lambda w, c: _run_with(w, _work_symlink, codes=(0, 2))),
    "previous_run_user_file": (("run",), lambda w, c: _run_with(
        w, _user_file, codes=(0, 2), kept=lambda out: (out / "notes.txt",))),
    "previous_run_user_file_in_work": (("run",), lambda w, c: _run_with(
        w, _user_file_in_work, codes=(0, 2), kept=lambda out: (out / "work" / "notes.txt",))),
    "previous_run_user_file_in_work_forced_twice": (("run",), lambda w, c: _twice(_run_with(
        w, _user_file_in_work, codes=(0, 2), kept=lambda out: (out / "work" / "notes.txt",)))),
    "previous_run_stage_folder_symlinked": (("run",), lambda w, c: _run_with(w, _stage_folder_symlinked)),
    "killed_run_user_files_in_work_and_stages": (("run",), lambda w, c: _run_with(
        w, _killed_with_user_files, codes=(0, 2),
        kept=lambda out: (out / "work" / "mine.txt", out / "stages" / "notes.txt"))),
    "previous_run_user_folder_at_a_listed_file": (("run",), lambda w, c: _run_with(
        w, _user_folder_at_report_md, codes=(0, 2), kept=lambda out: (out / "report.md" / "notes.txt",))),
    "user_folder_with_a_copied_manifest": (("run",), lambda w, c: Case(_copied_manifest(w))),
    "previous_run_listing_itself": (("run",), lambda w, c: _run_with(w, _manifest_lists(lambda out: "."),
                                                                     codes=(0, 2))),
    "inside_a_config_data_folder": (("batch",), lambda w, c: Case(w.project.calibration / "b")),
    "previous_run_holding_a_listed_sample": (("run",), _previous_run_holding_a_listed_sample),
    "symlink_loop": (BOTH, lambda w, c: Case(_symlink_loop(w))),
    "not_utf8": (BOTH, lambda w, c: Case(w.tmp / os.fsdecode(b"r\xff"))),  # ONNX Runtime takes UTF-8 paths only
    "previous_run_with_user_names_like_temporary_ones": (("run",), lambda w, c: _run_with(
        w, _temporary_like, codes=(0, 2), kept=lambda out: (out / ".tmp-photos", out / ".notes.tmp"))),
    "inside_a_sidecar_data_folder": (("batch",), _inside_sidecar_data),
    "previous_batch_user_folder": (("batch",), _previous_batch_with_user_folder),
    "previous_batch_run_dir_symlink": (("batch",), _previous_batch_run_dir_symlink),
}

FILE_COMMANDS = ("compare_markdown", "compare_html", "evaluate_json", "init")
COMPARE = ("compare_markdown", "compare_html")
READS_A_RUN = (*COMPARE, "evaluate_json")


def _input_summary(w: World, command: str) -> Case:
    batch = w.batch_copy()
    return Case(batch / "summary.json", inputs=(batch,))


def _listed_sample(w: World, command: str) -> Case:
    """--samples is a list file naming samples in a folder of the user's; --json names one of them."""
    folder = w.user / "heldout"
    folder.mkdir()
    for sample in w.project.evaluation.glob("*.npy"):
        shutil.copy(sample, folder / sample.name)
    listing = w.user / "heldout.txt"
    listing.write_text("".join(f"{p}\n" for p in sorted(folder.glob("*.npy"))))
    return Case(sorted(folder.glob("*.npy"))[0], samples=listing)


def _run_with_fifo_manifest(w: World, command: str) -> Case:
    """A copy of the finished run whose manifest.json is a FIFO: read, it would block evaluate forever."""
    run = w.tmp / "fifo_run"
    shutil.copytree(w.run, run, symlinks=True)
    (run / "manifest.json").unlink()
    os.mkfifo(run / "manifest.json")
    return Case(w.user / "eval.json", run=run)


def _new_file(w: World, command: str) -> Case:
    path = w.user / {"compare_markdown": "table.md", "compare_html": "table.html", "evaluate_json": "eval.json",
                     "init": "starter.yaml"}[command]
    return Case(path, codes=(0,), owned=(path,))


FILE_DESTINATIONS: dict[str, tuple[tuple[str, ...], Callable[[World, str], Case]]] = {
    "input_report": (READS_A_RUN, lambda w, c: Case(w.run / "report.json")),
    "inside_input_run": (READS_A_RUN, lambda w, c: Case(w.run / "new_table")),
    "inside_a_run_given_by_its_report": (COMPARE, lambda w, c: Case(w.run / "report.md",
                                                                    inputs=(w.run / "report.json",))),
    "a_listed_sample": (("evaluate_json",), _listed_sample),
    "a_run_whose_manifest_is_a_fifo": (("evaluate_json",), _run_with_fifo_manifest),
    "input_summary": (COMPARE, _input_summary),
    "inside_samples": (("evaluate_json",), lambda w, c: Case(w.project.evaluation / "eval.json")),
    "input_model": (("init",), lambda w, c: Case(w.project.model)),
    "inside_data": (("init",), lambda w, c: Case(w.project.calibration / "starter.yaml")),
    "fifo": (FILE_COMMANDS, lambda w, c: Case(w.fifo())),
    "symlink": (FILE_COMMANDS, lambda w, c: _maybe(w.symlink("link"))),
    "samples_fifo": (("evaluate_json",), lambda w, c: Case(w.user / "eval.json", samples=w.fifo())),
    "input_external_data": (("evaluate_json", "init"), _input_external_data),
    "new": (FILE_COMMANDS, _new_file),
    "not_utf8": (FILE_COMMANDS, lambda w, c: _maybe_file(w.tmp / os.fsdecode(b"t\xff.md"))),
}


def arguments(command: str, w: World, case: Case, flags: tuple[str, ...]) -> list:
    if command == "run":
        out = [] if case.dest is None else ["--out", case.dest]
        return ["run", case.config or w.project.config, *out, "--quiet", *flags]
    if command == "batch":
        return ["batch", w.batch_config, w.models, "--out", case.dest, "--quiet", *flags]
    if command in COMPARE:
        option = command.removeprefix("compare_")
        return ["compare", *(case.inputs or (w.run,)), f"--{option}", case.dest, *flags]
    if command == "evaluate_json":
        return ["evaluate", case.run or w.run, "--samples", case.samples or w.project.evaluation, "--json", case.dest,
                "--quiet", *flags]
    if command == "init":
        return ["init", case.model or w.project.model, "--data", w.project.calibration, "--out", case.dest, "--quiet",
                *flags]
    raise AssertionError(command)


def _generate(commands, destinations) -> list:
    return [pytest.param(command, name, id=f"{command}-{name}")
            for command in commands for name, (applies, _) in destinations.items() if command in applies]


CASES = _generate(FOLDER_COMMANDS, FOLDER_DESTINATIONS) + _generate(FILE_COMMANDS, FILE_DESTINATIONS)


@pytest.mark.parametrize("command,destination", CASES)
def test_nothing_of_the_users_is_touched(world, command, destination):
    table = FOLDER_DESTINATIONS if command in FOLDER_COMMANDS else FILE_DESTINATIONS
    case = table[destination][1](world, command)
    before = tree(world.tmp)
    problems = []  # every attempt runs: what a refused first attempt left, the second one may destroy
    for flags in case.attempts(command):
        args = arguments(command, world, case, flags)
        outcome = world.qprep(*args, cwd=case.cwd, timeout=TIMEOUT.get(command, QUICK))
        for check in (lambda: assert_outcome(outcome, case.codes, args, world.tmp),
                      lambda: assert_untouched(world.tmp, before, case.owned, case.kept)):
            try:
                check()
            except AssertionError as exc:
                problems.append(f"attempt {' '.join(flags) or 'without flags'}: {str(exc).splitlines()[0]}")
    assert not problems, "\n".join(problems)
    if case.codes == (0,) and command in FOLDER_COMMANDS:  # a legitimate destination did get the result
        assert (Path(case.dest) / ("report.json" if command == "run" else "summary.json")).is_file()


# --- batch: what its model folder holds ---------------------------------------------------------------------

def _fifo_model(w: World) -> str:
    os.mkfifo(w.models / "c.onnx")
    return "c.onnx"


def _named(name: str) -> Callable[[World], str]:
    def build(w: World) -> str:
        for model in w.models.iterdir():
            model.unlink()
        _variant(w.project.model, w.models / name, name.encode("utf-8", "backslashreplace").decode())
        return name
    return build


BATCH_FOLDERS = {"fifo_model": _fifo_model, **{f"model_named_{stem}": _named(f"{stem}.onnx")
                                               for stem in ("summary.json", "summary", "summary.md")},
                 "model_named_250_characters": _named("x" * 250 + ".onnx"),  # its overlay's name: too long
                 "model_named_in_no_encoding": _named(os.fsdecode(b"bad\xff.onnx"))}  # not UTF-8


@pytest.mark.parametrize("kind", BATCH_FOLDERS, ids=[f"batch_folder-{k}" for k in BATCH_FOLDERS])
def test_batch_model_folder(world, kind):
    """A FIFO among the models is skipped, not read forever; a model named like the batch's own files gets a
    run directory that is not one of them."""
    special = BATCH_FOLDERS[kind](world)
    out = world.tmp / "batch_out"
    before = tree(world.tmp)
    quiet = [] if kind == "fifo_model" else ["--quiet"]  # the FIFO is named in a progress line
    outcome = world.qprep("batch", world.batch_config, world.models, "--out", out, *quiet, timeout=TIMEOUT["batch"])
    assert_no_crash(outcome)
    summary = json.loads((out / "summary.json").read_text())
    names = {row["model"] for row in summary["models"]}
    if kind == "fifo_model":
        assert outcome.code == 0 and "qprep: error" not in outcome.err, outcome.err
        assert special in outcome.err, outcome.err
        assert {"a.onnx", "b.onnx"} <= names, summary
    else:
        assert outcome.code in (0, 2), outcome.err
        assert names == {special}, summary
        for name in ("summary.json", "summary.csv", "summary.md", "summary.html"):
            assert (out / name).is_file(), name
        for row in summary["models"]:
            if row.get("run_dir"):
                assert Path(row["run_dir"]).name not in ("summary.json", "summary.csv", "summary.md", "summary.html")
    assert_untouched(world.tmp, before, owned=(out,))


# --- batch: interrupts and two batches at once --------------------------------------------------------------

DELAYS = [round(random.Random(57 + i).uniform(0.0, 2.5), 2) for i in range(3)]


def _slow_batch_config(w: World) -> Path:
    """The batch config with each model's latency timed 12000 times: ~3 s a model, so a signal or a second
    batch finds one running."""
    values = yaml.safe_load(w.batch_config.read_text())
    values["evaluation"]["latency"] = {"runs": 12000, "rounds": 1, "within": 0}
    path = w.project.root / "slow_batch.yaml"
    path.write_text(yaml.safe_dump(values, sort_keys=False))
    return path


def _rows_agree_with_run_dirs(summary: dict) -> None:
    for row in summary["models"]:
        assert row["status"] in STATUSES, row
        report = Path(row["run_dir"]) / "report.json" if row.get("run_dir") else None
        if report is None or not report.is_file():
            assert row["status"] in ("refused", "failed", "duplicate"), row
            continue
        status = json.loads(report.read_text()).get("status")
        if row["status"] in ("ok", "gate missed"):
            assert status == row["status"], f"{row['model']}: summary says {row['status']}, report.json {status}"
        elif row["status"] == "failed":
            assert status in ("failed", "interrupted", "running"), f"{row['model']}: summary says failed, " \
                                                                   f"report.json {status}"
        elif row["status"] == "refused":
            raise AssertionError(f"{row['model']}: summary says refused, its run directory holds a report "
                                 f"({status})")


@pytest.mark.parametrize("delay", DELAYS, ids=[f"batch-sigint_twice_after_{d}s" for d in DELAYS])
def test_batch_interrupted_twice_leaves_a_summary(world, delay):
    """Two Ctrl-C 30 ms apart, `delay` after the batch made its folder: exit 130 with a summary that says
    what finished (or 0 when the batch finished first)."""
    out = world.tmp / "batch_out"
    args = ["batch", _slow_batch_config(world), world.models, "--out", out, "--quiet"]
    before = tree(world.tmp)
    process = _popen(args, world.cwd, world.home, sigint_default=True)
    try:
        assert wait_for(lambda: out.is_dir() or process.poll() is not None, timeout=60), "the batch never began"
        time.sleep(delay)
        process.send_signal(signal.SIGINT)
        time.sleep(0.03)
        process.send_signal(signal.SIGINT)
    finally:
        outcome = _finish(process, args, TIMEOUT["batch"])
    # 130 (not -2: killed by the second SIGINT after the first was handled); 0: the batch finished first
    assert outcome.code in (0, 128 + signal.SIGINT), f"exit {outcome.code}: {outcome.err}"
    assert_no_crash(outcome)  # a "stopping" progress line may come before the interrupt's line
    summary = json.loads((out / "summary.json").read_text())
    assert {row["model"] for row in summary["models"]} == {"a.onnx", "b.onnx"}, summary
    _rows_agree_with_run_dirs(summary)
    assert_untouched(world.tmp, before, owned=(out,))


def test_two_batches_at_once_on_one_folder(world):
    """Started together (each model takes ~3 s, so their runs overlap): each exits 0 or 2 (one line), and the
    summary left at the end agrees with every run directory's report."""
    out = world.tmp / "batch_out"
    args = ["batch", _slow_batch_config(world), world.models, "--out", out, "--quiet"]
    before = tree(world.tmp)
    first, second = _popen(args, world.cwd, world.home), _popen(args, world.cwd, world.home)
    outcomes = [_finish(first, args, TIMEOUT["batch"]), _finish(second, args, TIMEOUT["batch"])]
    for outcome in outcomes:
        assert outcome.code in (0, 2), f"exit {outcome.code}: {outcome.err}"
        assert_one_line(outcome, outcome.code)
    summary = json.loads((out / "summary.json").read_text())
    assert {row["model"] for row in summary["models"]} == {"a.onnx", "b.onnx"}, summary
    _rows_agree_with_run_dirs(summary)
    assert_untouched(world.tmp, before, owned=(out,))
