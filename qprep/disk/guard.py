"""The one output guard: every path a command writes is checked here against every path it reads.

Why one place: each command used to decide for itself, so `compare --markdown RUN/report.json` destroyed the
report it compared, `init --out m.onnx --force` replaced a model with YAML and `batch --out DIR` wrote into
the models folder. A command's path arguments are typed (`path_arg`) as inputs or outputs, the CLI builds a
Guard from them before the command runs, and the command writes through `Guard.write_text`, which checks again
against the inputs it learnt since (a run's model and data, read from its config or manifest).

Paths are compared resolved (symlinks followed), except an output's own last component: a symlink there is
replaced by the written file, never written through (`os.replace` swaps the directory entry).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path

from qprep.disk.atomic import atomic_write_text
from qprep.disk.reading import special_kind
from qprep.errors import QprepError

INPUT, OUTPUT_FILE, OUTPUT_FOLDER = "input", "output file", "output folder"


class OutputError(QprepError):
    """A command was asked to write where it must not (an input, a special file, home...)."""


class PathArg(str):
    """A command-line path that says what the command does with it (role) and which option gave it."""

    role: str
    option: str


def path_arg(role: str, option: str):
    """An argparse `type=` for a path the command reads (INPUT) or writes (OUTPUT_FILE, OUTPUT_FOLDER)."""

    def make(value: str) -> PathArg:
        arg = PathArg(value)
        arg.role, arg.option = role, option
        return arg

    make.role = role  # read by the test that every path option of every command is typed
    return make


def resolved(path: str | os.PathLike, follow_last: bool = True) -> Path:
    """The absolute path with symlinks resolved; with follow_last=False a symlink at the end stays itself."""
    path = Path(path).expanduser()
    if follow_last:
        return Path(os.path.realpath(path))
    return Path(os.path.realpath(path.parent if path.name else path)) / path.name


def _personal_places() -> list[tuple[str, Path]]:
    """Home and the current directory: folders of the user's that a run must never take over (nor those above)."""
    places = []
    try:
        places.append(("your home folder", resolved(Path.home())))
    except (RuntimeError, KeyError):  # no HOME and no passwd entry
        pass
    try:
        places.append(("the current directory", resolved(Path.cwd())))
    except OSError:  # the current directory was deleted
        pass
    return places


def _shown(path: str | os.PathLike) -> str:
    """A path as a message can print it: bytes that are not UTF-8 (kept by Python as surrogates, which no
    terminal encodes) shown as U+FFFD."""
    return os.fsencode(path).decode("utf-8", "replace")


class Guard:
    """The inputs of one command (described → path), and the checks of what it may write."""

    def __init__(self, inputs: Mapping[str, str | os.PathLike] | None = None):
        self.inputs: dict[str, Path] = {}
        self.add_inputs(inputs or {})

    @classmethod
    def of_args(cls, args) -> tuple["Guard", list[PathArg]]:
        """The guard of a parsed command line (its INPUT arguments) and the outputs it names."""
        guard, outputs = cls(), []
        for value in vars(args).values():
            for item in value if isinstance(value, list) else [value]:
                if isinstance(item, PathArg):
                    if item.role == INPUT:
                        guard.add_inputs({item.option: item})
                    else:
                        outputs.append(item)
        return guard, outputs

    def add_inputs(self, inputs: Mapping[str, str | os.PathLike] | Iterable[tuple[str, str | os.PathLike]]) -> None:
        for what, path in dict(inputs).items():
            if path:
                place = resolved(path)
                if self.inputs.get(what, place) != place:  # another model's calibration data, say: keep both
                    what = f"{what} {path}"
                self.inputs[what] = place

    def check(self, outputs: Iterable[PathArg]) -> None:
        for output in outputs:
            if output.role == OUTPUT_FILE:
                self.output_file(output, output.option)
            else:
                self.output_folder(output, output.option)

    def output_file(self, path: str | os.PathLike, option: str) -> Path:
        """A file the command writes whole: not an input, not inside an input folder, not a folder or a special
        file. A symlink is fine (it gets replaced) unless it points at an input."""
        where = f"{option} {_shown(path)}"
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            mode = None
        if mode is not None:
            if stat.S_ISDIR(mode):
                raise OutputError(f"{where} is a folder; give a file name")
            kind = special_kind(mode)
            if kind:
                raise OutputError(f"{where} is {kind}, not a regular file; choose another path")
        self._not_an_input(resolved(path, follow_last=False), where)
        if mode is not None and stat.S_ISLNK(mode):
            self._not_an_input(resolved(path), where)
            try:  # /dev/stdout -> a pipe: replacing that link would break the system's, not write to it
                kind = special_kind(os.stat(path).st_mode)
            except OSError:
                kind = None
            if kind:
                raise OutputError(f"{where} is a link to {kind}, not a regular file; choose a file path")
        system = Path(os.path.realpath(Path(path).parent))
        if system.parts[:2] in (("/", "dev"), ("/", "proc"), ("/", "sys")):
            raise OutputError(f"{where} lies in {system}, the system's; choose a file path of your own")
        return Path(path)

    def output_folder(self, path: str | os.PathLike, option: str) -> Path:
        """A folder the command fills (a run or batch directory): none of the places a user keeps other things
        in, not an input, not inside an input, holding no input."""
        where = f"{option} {_shown(path)}"
        if _shown(path) != os.fspath(path):
            raise OutputError(f"{where} is not a UTF-8 path, which ONNX Runtime cannot write into; choose a name of "
                              "UTF-8 characters")
        try:
            mode = os.stat(path).st_mode
        except OSError:
            mode = None
        if mode is not None and not stat.S_ISDIR(mode):
            kind = special_kind(mode) or "a file"
            raise OutputError(f"{where} is {kind}, not a folder; choose a folder for {option}")
        target = resolved(path)
        for name, place in _personal_places():
            if target == place or target in place.parents:
                what = name if target == place else f"a folder above {name} ({place})"
                raise OutputError(f"{where} is {what}; give the run a folder of its own, e.g. {target / 'qprep-out'}")
        if target == Path(target.anchor):
            raise OutputError(f"{where} is the root folder; give the run a folder of its own")
        self._not_an_input(target, where)
        for what, source in self.inputs.items():
            if target in source.parents:
                raise OutputError(f"{where} holds {what} ({source}), which the command reads; choose {option} "
                                  "elsewhere (a folder of its own)")
        return Path(path)

    def write_text(self, path: str | os.PathLike, text: str, option: str) -> None:
        """Check `path` against every input known now, then write it atomically (a symlink there is replaced)."""
        self.output_file(path, option)
        try:
            atomic_write_text(path, text)
        except OSError as exc:  # permission denied, a file where a folder should be, disk full
            raise OutputError(f"{option} {path}: cannot write it ({exc.strerror}); choose another path") from None

    def _not_an_input(self, target: Path, where: str) -> None:
        for what, source in self.inputs.items():
            if target == source:
                raise OutputError(f"{where} is {what}, which the command reads; choose another path")
            if source in target.parents:
                raise OutputError(f"{where} lies inside {what} ({source}), which the command reads; choose a path "
                                  "outside it")
