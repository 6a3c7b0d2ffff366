"""The user's own metric (`evaluation.metric: module:function`): a Python function over one model's outputs.

Why: agreement with FP32 judges the result on the user's preprocessing, right or wrong; the figure a user ships
on (accuracy against labels, WER, mAP) is theirs to compute, as in NNCF's accuracy control. The function gets one
model's outputs on the samples and the samples themselves, and returns one number:

    def top1(outputs: list[dict[str, np.ndarray]], samples: list[dict]) -> float

`samples[i]` holds the model's inputs, every other array of the sample's `.npz` file (labels: `np.savez(f,
image=x, label=3)`) and `file`, the sample's path (labels kept beside it, e.g. a labels.txt). qprep calls it on the FP32
reference's outputs and on the result's, on the same samples, and reports both and the drop. The gate and the
fallback's target read `metric` (the result's own figure) and `metric_drop` (how much worse than FP32 it is, in
the metric's units: never negative for a result that is worse); `evaluation.metric_direction: lower` turns
both around for an error rate. Each figure carries its 95% interval over the samples (`spread`), so a gate the
sample count cannot decide is said to be, as for an agreement. The figures travel to the gate as one entry
(ENTRY) beside the outputs' figures.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import math
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import numpy as np

from qprep.data.arrays import Unreadable
from qprep.errors import ConfigError, QprepError
from qprep.schema import closest

KEYS = ("metric", "metric_drop")  # the gate's and the fallback target's keys
ENTRY = "evaluation.metric"  # the figures' entry beside the outputs' in what the gate reads


class MetricError(QprepError):
    """The user's metric function failed or returned something else than one number: their code to fix."""


def resolve(spec: str, folder: Path) -> str:
    """`module:function` (a module beside the config, a `path/to/file.py` relative to it, or an importable
    module) checked by importing it → the spec with a file made absolute, so it still resolves from the run's
    manifest. Raises ConfigError before the run."""
    module, function = _split(spec)
    path = _file_in(module, folder)
    normalized = f"{path}:{function}" if path else f"{module}:{function}"
    load(normalized)
    return normalized


def _split(spec: str) -> tuple[str, str]:
    module, _, function = str(spec).rpartition(":")
    if not module or not function.isidentifier():
        raise ConfigError(f"evaluation.metric: expected `module:function` (e.g. my_metric:top1), got {spec!r}")
    return module, function


def _file_in(module: str, folder: Path) -> Path | None:
    """The module's file when it is a path or lies in the config's folder; None: import it by name."""
    if module.endswith(".py") or "/" in module:
        path = (folder / Path(module).expanduser()).resolve()
        if not path.is_file():
            raise ConfigError(f"evaluation.metric: no file {path}; give `file.py:function` relative to the config "
                              "(to the current directory with --set)")
        return path
    for candidate in (folder / (module.replace(".", "/") + ".py"), folder / module.replace(".", "/") / "__init__.py"):
        if candidate.is_file():
            return candidate.resolve()
    return None


def load(spec: str) -> Callable:
    """The function a normalized spec names (resolve), imported once per process. Raises ConfigError."""
    module_name, function = _split(spec)
    with _no_bytecode():
        module = _import_file(Path(module_name)) if module_name.endswith(".py") else _import_name(module_name)
    found = getattr(module, function, None)
    if not callable(found):
        names = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]
        guess = closest(function, names)
        hint = f"did you mean '{guess}'?" if guess else f"its functions: {', '.join(names) or 'none'}"
        raise ConfigError(f"evaluation.metric: {module_name} has no function '{function}'; {hint}")
    return found


@contextmanager
def _no_bytecode():
    """No `__pycache__` written while the user's module (and what it imports) loads: qprep writes nothing
    outside the run directory, and the config's folder is the user's."""
    before = sys.dont_write_bytecode
    sys.dont_write_bytecode = True
    try:
        yield
    finally:
        sys.dont_write_bytecode = before


def _import_file(path: Path):
    """A module file, under a name of its own (two configs' `metric.py` do not meet in sys.modules), with its
    folder on sys.path while it loads (its own imports of modules beside it)."""
    name = "qprep_user_metric_" + hashlib.sha256(str(path).encode()).hexdigest()[:16]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - the user's module, any error: theirs to fix
        raise ConfigError(f"evaluation.metric: importing {path} failed: {_error_line(exc)}; fix the module "
                          "(--debug shows its traceback)") from exc
    finally:
        sys.path.remove(str(path.parent))
    sys.modules[name] = module
    return module


def _import_name(module_name: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (exc.name == module_name or module_name.startswith(exc.name + ".")):
            raise ConfigError(f"evaluation.metric: no module '{module_name}' beside the config nor on Python's "
                              f"path; put {module_name}.py beside the config file") from None
        raise ConfigError(f"evaluation.metric: importing {module_name} failed: {_error_line(exc)}") from exc
    except Exception as exc:  # noqa: BLE001 - the user's module, any error: theirs to fix
        raise ConfigError(f"evaluation.metric: importing {module_name} failed: {_error_line(exc)}; fix the module "
                          "(--debug shows its traceback)") from exc


def _error_line(exc: BaseException) -> str:
    text = str(exc).splitlines()[0][:200] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def check_keys(thresholds: dict, where: str, evaluation: dict | None) -> None:
    """`metric` and `metric_drop` judge the whole model (no `<output>.` before them) and need the function."""
    for key in thresholds:
        output, _, metric = key.rpartition(".")
        if metric not in KEYS:
            continue
        if output:
            raise ConfigError(f"{where}.{key}: your metric judges the whole model, not one output; write `{metric}`")
        if not (evaluation or {}).get("metric"):
            raise ConfigError(f"{where}.{key}: needs evaluation.metric (your function, `module:function`); set it "
                              "or remove the key")


class UserMetric:
    """The configured function, the samples it is given (inputs, the .npz's other arrays, the file name) and the
    FP32 reference's figure per sample subset (the search measures many trials on the same samples)."""

    def __init__(self, spec: str, direction: str = "higher"):
        self.spec, self.higher = spec, direction != "lower"
        module, function = _split(spec)
        self.name = f"{Path(module).name if module.endswith('.py') else module}:{function}"  # what reports show
        self.function = load(spec)
        self._samples: dict[int, list[dict]] = {}
        self._reference: dict[tuple, tuple[float, list[float]]] = {}

    @classmethod
    def of(cls, evaluation: dict | None) -> "UserMetric | None":
        """The evaluation section's metric, or None when none is configured."""
        if not evaluation or not evaluation.get("metric"):
            return None
        return cls(evaluation["metric"], evaluation.get("metric_direction") or "higher")

    def samples_of(self, sample_set) -> list[dict]:
        """What the function sees of each sample of a SampleSet, built once per set."""
        key = id(sample_set)
        if key not in self._samples:
            files = sample_set.files or [""] * len(sample_set.samples)
            extras = sample_set.extras or [{}] * len(sample_set.samples)  # read once, by the loader
            self._samples[key] = [{**_readable(f, more), **sample, **_name(f, sample)}
                                  for f, more, sample in zip(files, extras, sample_set.samples)]
        return self._samples[key]

    def figures(self, expected: list[dict], actual: list[dict], samples: list[dict], where: str) -> dict:
        """The function on the reference's and the result's outputs on `samples` (from samples_of): both, the
        drop, and their 95% intervals (`spread`). `where` names the samples in an error."""
        key = tuple(id(s) for s in samples)
        if key not in self._reference:
            said = f"the FP32 reference's outputs on {where}"
            self._reference[key] = (self.value(expected, samples, said), self.left_out(expected, samples, said))
        reference, reference_groups = self._reference[key]
        result = self.value(actual, samples, f"the result's outputs on {where}")
        drop = (reference - result) if self.higher else (result - reference)
        groups = self.left_out(actual, samples, f"the result's outputs on {where}")
        drops = [(r - a) if self.higher else (a - r) for r, a in zip(reference_groups, groups)]
        return {"function": self.name, "spec": self.spec, "direction": "higher" if self.higher else "lower",
                "samples": len(samples), "reference_metric": reference, "metric": result, "metric_drop": drop,
                **({"metric_ci95": spread(result, groups), "metric_drop_ci95": spread(drop, drops)}
                   if groups and reference_groups else {})}

    def left_out(self, outputs: list[dict], samples: list[dict], where: str) -> list[float]:
        """The function with each of up to GROUPS groups of samples left out (a grouped jackknife; `spread`);
        empty with fewer than 3 samples."""
        if len(samples) < 3:
            return []
        groups = np.array_split(np.arange(len(samples)), min(GROUPS, len(samples)))
        kept = [np.setdiff1d(np.arange(len(samples)), group) for group in groups]
        return [self.value([outputs[i] for i in rows], [samples[i] for i in rows], f"{where}, {len(rows)} of them")
                for rows in kept]

    def value(self, outputs: list[dict], samples: list[dict], where: str) -> float:
        """One call of the user's function; whatever goes wrong in it is reported as theirs, in one line."""
        frozen = [_Seen("outputs", {name: _read_only(v) for name, v in o.items()}) for o in outputs]  # shared
        try:
            value = self.function(frozen, [_Seen("samples", {k: _read_only(v) for k, v in s.items()}) for s in samples])
        except _Lacking as exc:  # a key the data lacks: the function may be right
            raise MetricError(f"evaluation.metric {self.name} raised KeyError: {exc.args[0]!r} on {where}: "
                              f"{exc.lacks()}") from exc
        except Exception as exc:  # noqa: BLE001 - the user's code, any error: theirs to fix
            raise MetricError(f"evaluation.metric {self.name} raised {_error_line(exc)} on {where}; fix the function "
                              "(--debug shows its traceback)") from exc
        if isinstance(value, np.ndarray) and value.size == 1:
            value = value.reshape(()).item()
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise MetricError(f"evaluation.metric {self.name} returned {type(value).__name__} on {where}; return "
                              "one number (a float), higher is better unless metric_direction: lower")
        if not math.isfinite(float(value)):
            raise MetricError(f"evaluation.metric {self.name} returned {float(value)} on {where}; return a finite "
                              "number")
        return float(value)


GROUPS = 12  # the jackknife's groups: the function runs this many more times per figure, at most


def spread(value: float, left_out: list[float]) -> list[float]:
    """The 95% interval of a figure from its grouped jackknife (the figure with each group of samples left out):
    value ± 1.96 √((g−1)/g Σ(θ_j − θ̄)²). Why: the gate marks a threshold inside it `undecided`, as for an
    agreement (on 48 samples one sample is 2.1% of an accuracy); the user's function is any figure (accuracy, WER,
    mAP), so its noise over the samples is measured, not assumed from a formula."""
    g = len(left_out)
    mean = sum(left_out) / g
    half = 1.96 * math.sqrt((g - 1) / g * sum((t - mean) ** 2 for t in left_out))
    return [value - half, value + half]


def describe(figures: dict) -> str:
    """The line the report shows beside the outputs' agreement with FP32."""
    worse = "drop" if figures["direction"] == "higher" else "rise"
    return (f"your metric {figures['function']} ({figures['direction']} is better) on {figures['samples']} samples: "
            f"FP32 {figures['reference_metric']:.4g}, result {figures['metric']:.4g} ({worse} "
            f"{figures['metric_drop']:.4g}; gate keys `metric`, `metric_drop`)")


def with_figures(outputs: dict, figures: dict | None) -> dict:
    """The outputs' figures with the metric's entry beside them: what the gate reads (check_gate)."""
    return {**outputs, ENTRY: figures} if figures is not None else outputs


def _readable(file: str, extras: dict) -> dict:
    """A sample's extras as the loader kept them; one it could not read (data.arrays.Unreadable) is the user's to
    fix, in one line naming the file."""
    for value in extras.values():
        if isinstance(value, Unreadable):
            raise MetricError(f"evaluation.metric: {file}: its arrays beside the inputs cannot be read without pickle "
                              f"({value.reason}); save labels as plain numeric or string arrays")
    return extras


def _name(file: str, sample: dict) -> dict:
    return {"file": file} if file and "file" not in sample else {}


class _Lacking(KeyError):
    """A key the function read from a sample or an output dict that lacks it (still a KeyError to the function)."""

    def __init__(self, key, kind: str, seen: dict):
        super().__init__(key)
        self.kind, self.keys, self.file = kind, [str(k) for k in seen], str(seen.get("file") or "")

    def lacks(self) -> str:
        """What the data holds, and where the key would go."""
        key = self.args[0]
        if self.kind == "outputs":
            return f"the outputs are {', '.join(self.keys)} (no {key!r}); fix the function"
        where = "add it to each .npz" if self.file.lower().endswith(".npz") else "save the samples as .npz with it"
        return f"the samples carry {', '.join(self.keys)} (no {key!r}): {where}, or fix the function"


class _Seen(dict):
    """A sample or one model's outputs as the function sees them: a key it lacks raises _Lacking, so the error
    can say that the data lacks the key rather than blame the function (a `label` not stored in the .npz)."""

    def __init__(self, kind: str, values: dict):
        super().__init__(values)
        self.kind = kind

    def __missing__(self, key):
        raise _Lacking(key, self.kind, self)


def _read_only(value):
    if isinstance(value, np.ndarray):
        value = value.view()
        value.flags.writeable = False
    return value
