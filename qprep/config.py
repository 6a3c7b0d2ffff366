"""The qprep YAML config: its schema, loading (safe YAML), `--set` overrides and validation.

Everything is validated before any work starts; errors name the key path and the closest valid key.
Relative paths in the file resolve against the config file's folder; paths given on the command line
(`--model`, `--out`, `--set` on a path key or on evaluation.metric's module) resolve against the current
directory (`located`).
"""

from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from qprep.disk.reading import require_regular_file
from qprep.errors import ConfigError
from qprep.measure import user_metric
from qprep.measure.metrics import KINDS, OUTPUT_METRICS
from qprep.schema import Key, closest, section, settings, validate
from qprep.stage_registry import registry
from qprep.yaml_reader import DuplicateKey, YamlLimit, load_yaml


def data_source(doc: str) -> Key:
    return section(
        doc,
        nullable=True,
        source=Key("path", required=True,
                   doc="folder of .npy/.npz samples or images, or an RKNN-style dataset.txt list"),
        format=Key("str", default="auto", choices=("auto", "npy", "npz", "images", "list"),
                   doc="sample format; auto picks it from the files in the folder (a file means list)"),
        max_samples=Key("int", default=64, minimum=1,
                        doc="cap on samples used (all of them when fewer; under 32 is a warning)"),
        seed=Key("int", default=0, minimum=0, doc="seed for choosing samples when the folder holds more than max_samples"),
        preprocess=section(
            "image preprocessing (images format only); the model's input size is taken from the model",
            mean=Key("list", item=Key("float"), doc="per-channel mean in 0..255 pixel units: (x - mean) / std"),
            # a std of 0 divides every pixel by zero: the samples would be refused as NaN/Inf, blaming the data
            std=Key("list", item=Key("float", minimum=1e-6), doc="per-channel std in 0..255 pixel units (> 0)"),
            channel_order=Key("str", default="rgb", choices=("rgb", "bgr"), doc="channel order the model expects"),
            layout=Key("str", default="auto", choices=("auto", "nchw", "nhwc"),
                       doc="input layout; auto reads it from the model's input shape"),
            resize=Key("str", default="stretch", choices=("stretch", "center_crop", "none"),
                       doc="how images are brought to the model's input size"),
        ),
    )


DEFAULT_FLOOR = {"cosine_mean": 0.9}  # a collapse, not a target: INT8 results that work are far above it


# the one key whose value names a module, located like a path (`located`): a file beside where it is written
METRIC = Key("str", doc="your own metric, `module:function` (a module beside the config, a file.py path relative "
                       "to it, or an importable module): fn(outputs, samples) -> float over one model's outputs "
                       "(samples hold the inputs, the .npz's other arrays such as `label`, and `file`); "
                       "reported for FP32 and the result, judged by the gate keys `metric` and `metric_drop`")


def evaluation_section() -> Key:
    key = data_source("evaluation after the last stage: the result against the FP32 reference")
    key.fields.update(
        max_samples=Key("int", default=128, minimum=1, doc="cap on evaluation samples"),
        reference_model=Key("path", doc="FP32 model to compare with (default: the input model; set it for QAT input)"),
        tasks=Key("mapping", item=Key("str", choices=KINDS), default={},
                  doc="per output: its kind (" + "|".join(KINDS) + "), which decides the metrics that judge it "
                      "(default: read from the graph and the reference's values; the report says which and why)"),
        decision_threshold=Key("float", default=0.5,
                               doc="probability outputs: a decision is value >= this; decision_agreement counts "
                                   "the decisions reference and result share"),
        min_integer_share=Key("float", default=0.5, minimum=0, maximum=1,
                              doc="a met gate with less than this share of the multiply-adds (Conv, MatMul, Gemm) "
                                  "on integers reads 'met, but mostly float': the result may be no faster than "
                                  "FP32; a share in 0..1 (0.5, not 50); 0 turns the warning off"),
        padding=Key("str", default="auto",
                    doc="outputs laid out along an attention mask ([batch, sequence, ...]) are judged on the positions "
                        "it marks real: auto finds the mask input (0/1 values reaching the attention's Softmax), "
                        "an input's name names it, none judges every position (measure/padding.py)"),
        layers=Key("bool", default=True, doc="per-layer error against the prepared float model"),
        layer_samples=Key("int", default=8, minimum=1, doc="samples used for the per-layer error"),
        latency=section("latency of the original, the optimized float model and the result with ONNX Runtime "
                        "(batch 1; the float models also at ORT_ENABLE_BASIC)",
                        runs=Key("int", default=50, minimum=0,
                                 doc="timed runs per round at most (median reported; a round ends sooner once "
                                     "its median is known within `within`); 0 disables"),
                        within=Key("float", default=0.02, minimum=0,
                                   doc="a round ends once its median's 95% interval is within ± this share of it "
                                       "(at least 8 runs), and a model's runs follow its warm run (about 2 s of "
                                       "runs each, at least one a round); 0: every round times all `runs`"),
                        seconds=Key("float", default=30.0, minimum=0,
                                    doc="time budget of the timed runs (all models, every round): a round also "
                                        "ends once it used its share (at least 5 runs); the report gives the "
                                        "interval reached. 0: no budget"),
                        warmup=Key("int", default=10, minimum=0,
                                   doc="untimed runs first (those beyond the second: at most ~0.5 s of them)"),
                        rounds=Key("int", default=3, minimum=1,
                                   doc="reference and result timed in turn this many times (median of rounds)")),
        labels=Key("path", doc="ground truth: a text file of `<sample file name> <label>` lines, for task "
                                "accuracy of reference and result on classification outputs"),
        label_names=Key("list", item=Key("str"), doc="class names in output order, when labels are names "
                                                     "(e.g. ['0', '180']); default: labels are class indices"),
        metric=METRIC,
        metric_direction=Key("str", default="higher", choices=("higher", "lower"),
                             doc="whether a higher or a lower value of evaluation.metric is better (lower: an error "
                                 "rate; `metric` is then a maximum and `metric_drop` the rise)"),
        gate=Key("mapping", item=Key("float"), default={},
                 doc="metric → threshold, e.g. {cosine_mean: 0.99} or {metric_drop: 0.01} (your metric at most "
                     "that much worse than FP32); a miss exits 1 after the report"),
        floor=Key("any", default=dict(DEFAULT_FLOOR),
                  doc="used when no gate (and no fallback target) is set: thresholds in the gate's form that catch "
                      "a collapsed result (exit 1, worst tensors named); `none` disables it"),
        heldout=section(
            "held-out samples (read like `source`: same format and preprocess) that no decision sees: the fallback "
            "and every other choice use `source`; the result is also measured here and the gate is judged here",
            nullable=True,
            source=Key("path", required=True, doc="folder of samples or a dataset.txt list, disjoint from `source`"),
            labels=Key("path", doc="ground truth for the held-out samples, as evaluation.labels"),
        ),
    )
    return key


SCHEMA = section(
    model=Key("path", required=True, doc="the input ONNX model (never written to)"),
    inputs=Key("mapping", item=Key("list", item=Key("int", minimum=1)),
               doc="fix input dims, e.g. {x: [1, 3, 48, 320]}"),
    output_dir=Key("path", doc="run directory (or --out); a non-empty one is refused without --force"),
    calibration=data_source("calibration data (also the samples every rewrite is verified on)"),
    evaluation=evaluation_section(),
    verify=section(
        "numerical verification of every transform against the model before it",
        atol=Key("float", default=1e-5, minimum=0, doc="absolute tolerance: |a-b| <= atol + rtol*|a|"),
        rtol=Key("float", default=1e-4, minimum=0, doc="relative tolerance"),
        min_cosine=Key("float", default=0.99999, minimum=-1, doc="minimum cosine per output and sample"),
        noise_factor=Key("float", default=8.0, minimum=0,
                         doc="an output may also move this many times as far as float32 rounding alone moves it "
                             "(each weight one ulp away; at least this many ulps of the output's scale); "
                             "0: atol/rtol/min_cosine only"),
        max_samples=Key("int", default=8, minimum=1, doc="samples used to verify each rewrite"),
    ),
    # at most 256: each session starts its own pool, and 100000 asked for thousands of threads that stalled the
    # machine for minutes (more threads than cores only slows ONNX Runtime)
    threads=Key("int", default=2, minimum=1, maximum=256, doc="ONNX Runtime intra-op threads for every session"),
    save_stage_models=Key("bool", default=False, doc="also write the model after each stage"),
    pipeline=Key("any", default=[], doc="ordered stages, each `- <stage>: {options}` (see the stage keys below)"),
)


@dataclass
class Config:
    """A validated config: normalized values (defaults filled, absolute paths) and the ordered stages, each with
    its options as typed settings (schema.settings: what the stage reads, decided here once)."""

    values: dict
    stages: list[tuple[str, Any]]
    path: Path | None
    overlay: Path | None = None  # the file merged over the config (`run --overlay`, a batch model's sidecar)

    def __getitem__(self, key: str) -> Any:
        return self.values[key]

    def resolved(self) -> dict:
        """The full config as it runs (for the manifest and report)."""
        return {**self.values, "pipeline": [{name: opts.as_dict()} for name, opts in self.stages]}


def load_config(source: str | os.PathLike | dict, overrides: dict[str, Any] | None = None,
                cwd: Path | None = None, overlay: str | os.PathLike | None = None) -> Config:
    """Read (YAML file or dict), merge the overlay file over it, apply overrides (`{"a.b": value}`), validate.
    Raises ConfigError."""
    if isinstance(source, dict):
        raw, path, base = copy.deepcopy(source), None, Path.cwd()
    else:
        path = Path(source)
        raw, base = _read_yaml(path), path.resolve().parent
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the config must be a mapping of keys (model:, pipeline:, …)")
    if overlay:
        merge_overlay(raw, Path(overlay))
    for key_path, value in (overrides or {}).items():
        set_key(raw, key_path, value, cwd=cwd or Path.cwd())
    values = validate(raw, SCHEMA, "", base)
    _check_gate_metrics(values["evaluation"], base)
    stages = _validate_pipeline(values.pop("pipeline"), base, values["evaluation"])
    return Config(values=values, stages=stages, path=path, overlay=Path(overlay).resolve() if overlay else None)


def merge_overlay(raw: dict, overlay_path: Path) -> None:
    """Merge a second YAML file over the raw config: what one model needs on top of a shared config (its input
    dims, its own samples), e.g. the `NAME.qprep.yaml` that `batch` finds beside `NAME.onnx`.

    Mappings merge key by key, any other value replaces; a `pipeline:` list in the overlay merges each
    `- stage: {options}` into the config's stage of that name. Relative paths resolve against the overlay's
    folder (the config's own against its folder), so the overlay can live beside the model it describes."""
    overlay = _read_yaml(overlay_path, "overlay file")
    if not isinstance(overlay, dict):
        raise ConfigError(f"{overlay_path}: an overlay must be a mapping of config keys (inputs:, calibration:, …)")
    folder = overlay_path.resolve().parent
    stages = overlay.pop("pipeline", None) or []
    if not isinstance(stages, list):
        raise ConfigError(f"{overlay_path}: pipeline: expected a list of `- <stage>: {{options}}` to merge")
    _merge(raw, _absolute_paths(overlay, SCHEMA, folder))
    for item in stages:
        if not isinstance(item, dict) or len(item) != 1:
            raise ConfigError(f"{overlay_path}: pipeline: each item is a one-key mapping `- <stage>: {{options}}`")
        (name, options), = item.items()
        items = raw.setdefault("pipeline", [])
        hits = [i for i, stage in enumerate(items) if (isinstance(stage, dict) and name in stage) or stage == name]
        if len(hits) != 1:
            raise ConfigError(f"{overlay_path}: pipeline: the config has {len(hits)} '{name}' stages; an overlay "
                              "merges options into exactly one stage of that name")
        if not isinstance(items[hits[0]], dict) or not isinstance(items[hits[0]][name], dict):
            items[hits[0]] = {name: {}}
        stage = registry().get(name)
        options = _absolute_paths(options or {}, stage.options, folder) if stage else options
        _merge(items[hits[0]][name], options or {})


def _merge(target: dict, update: dict) -> None:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = copy.deepcopy(value)


def located(value: Any, key: Key, folder: Path) -> Any:
    """A value that names a file (a `path` key, or METRIC's module) resolved against the folder where it was
    written: the config's or an overlay's folder for a file's value, the current directory for `--set`. One rule
    for every such key, so a file named on the command line is the one beside the user, not beside the config."""
    if not isinstance(value, str):
        return value
    if key.kind == "path":
        return str((folder / Path(value).expanduser()).resolve())
    return user_metric.resolve(value, folder) if key is METRIC else value


def _absolute_paths(value: Any, key: Key, folder: Path) -> Any:
    """`value` with every relative path its schema declares made absolute against `folder`."""
    if key.kind == "path" or key is METRIC:
        return located(value, key, folder)
    if key.kind == "section" and isinstance(value, dict):
        return {name: _absolute_paths(sub, key.fields[name], folder) if name in key.fields else sub
                for name, sub in value.items()}
    return value


GATE_METRICS = tuple(OUTPUT_METRICS)  # per output; beside them, the user's metric's keys (user_metric.KEYS)


def _check_gate_metrics(evaluation: dict | None, base: Path) -> None:
    if evaluation and evaluation["metric"]:  # imported now: a wrong name fails before the run
        evaluation["metric"] = user_metric.resolve(evaluation["metric"], base)
    check_metric_names((evaluation or {}).get("gate", {}), "evaluation.gate", evaluation)
    if evaluation:
        evaluation["floor"] = _floor(evaluation["floor"], evaluation)


def _floor(value: Any, evaluation: dict) -> dict[str, float]:
    """evaluation.floor: `none` (or an empty mapping) disables it, else metric → threshold like the gate."""
    if value in ("none", {}):
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"evaluation.floor: expected a mapping like {{cosine_mean: 0.9}} or none, got {value!r}")
    floor = validate(value, Key("mapping", item=Key("float")), "evaluation.floor", Path())  # finite numbers
    check_metric_names(floor, "evaluation.floor", evaluation)
    return floor


# metrics that are cosines or shares: a threshold outside their range is a typo (cosine_mean: 2), never met
SHARE_RANGES = {"cosine_mean": (-1, 1), "cosine_min": (-1, 1),
                **{name: (0, 1) for name in ("top1_agreement", "top5_agreement", "step_agreement", "element_agreement",
                                             "text_agreement", "decision_agreement", "set_agreement", "match_rate",
                                             "detections_found", "mean_iou", "top1_accuracy")}}


def check_metric_names(thresholds: dict, where: str, evaluation: dict | None = None) -> None:
    """Gate keys are `<metric>` or `<output>.<metric>`; a misspelt metric would otherwise only fail at the end.
    With the evaluation section: `metric`/`metric_drop` need its `metric` (user_metric.check_keys)."""
    for key in thresholds:
        metric = key.rsplit(".", 1)[-1]
        if metric not in GATE_METRICS + user_metric.KEYS:
            guess = closest(metric, GATE_METRICS + user_metric.KEYS)
            hint = f"did you mean '{guess}'?" if guess else f"metrics: {', '.join(GATE_METRICS + user_metric.KEYS)}"
            raise ConfigError(f"{where}.{key}: unknown metric '{metric}'; {hint}")
        low, high = SHARE_RANGES.get(metric, (None, None))
        value = thresholds[key]
        if low is not None and isinstance(value, (int, float)) and not low <= value <= high:
            raise ConfigError(f"{where}.{key}: {value} can never be met, a {metric} lies in [{low:g}, {high:g}]; "
                              f"e.g. {metric}: 0.99")
    if evaluation is not None:
        user_metric.check_keys(thresholds, where, evaluation)


def _read_yaml(path: Path, what: str = "config file") -> Any:
    require_regular_file(path, what, ConfigError, f"check the {what}'s path")
    try:
        with open(path, encoding="utf-8") as f:
            return load_yaml(f) or {}
    except YamlLimit as exc:
        raise ConfigError(f"{path}: not read{exc.where()}: {exc.problem}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{path}: not valid YAML{where}: {problem}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}); save the config as UTF-8") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config ({exc.strerror})") from None


def _validate_pipeline(items: Any, base: Path, evaluation: dict | None = None) -> list[tuple[str, Any]]:
    if items is None:
        return []
    if not isinstance(items, list):
        raise ConfigError("pipeline: expected a list of stages, e.g. `- optimize: {}`")
    stages = registry()
    out = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            item = {item: None}
        if not isinstance(item, dict) or len(item) != 1:
            raise ConfigError(f"pipeline[{i}]: each stage is a one-key mapping `- <stage>: {{options}}`")
        (name, options), = item.items()
        if name not in stages:
            guess = closest(str(name), stages)
            hint = f"did you mean '{guess}'?" if guess else f"stages: {', '.join(sorted(stages)) or '(none yet)'}"
            raise ConfigError(f"pipeline[{i}]: unknown stage '{name}'; {hint}")
        values = validate(options, stages[name].options, f"pipeline[{i}].{name}", base)
        if isinstance(values.get("fallback"), dict):
            check_metric_names(values["fallback"]["target"], f"pipeline[{i}].{name}.fallback.target",
                               evaluation or {})
        out.append((name, settings(stages[name].options, values, name)))
    return out


_TOKEN = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


def _tokens(key_path: str) -> list[str | int]:
    tokens: list[str | int] = []
    pos = 0
    for match in _TOKEN.finditer(key_path):
        if match.start() != pos and key_path[pos:match.start()] != ".":
            break
        tokens.append(match.group(1) if match.group(1) is not None else int(match.group(2)))
        pos = match.end()
    if not tokens or pos != len(key_path):
        raise ConfigError(f"--set {key_path}: not a key path (use a.b.c, pipeline[2].quantize.x or pipeline.quantize.x)")
    return tokens


def parse_set(assignment: str) -> tuple[str, Any]:
    """`key.path=value` → (path, YAML-parsed value); `x=[1, 2]` gives a list, `x=true` a bool."""
    if "=" not in assignment:
        raise ConfigError(f"--set {assignment}: expected key.path=value")
    key, text = assignment.split("=", 1)
    try:
        value = load_yaml(text) if text.strip() else ""
    except YamlLimit as exc:
        raise ConfigError(f"--set {key.strip()}: the value is not read: {exc.problem}") from None
    except DuplicateKey as exc:
        raise ConfigError(f"--set {key.strip()}: {exc.problem}") from None
    except yaml.YAMLError:  # not YAML: the text as given (a path with a colon, a name)
        value = text
    return key.strip(), value


def run_overrides(sets, model=None, out=None) -> dict[str, Any]:
    """What `qprep run CONFIG [--set k=v]… [--model M] [--out D]` overrides. One function, so `batch --resume`
    can tell whether a finished run used exactly the config a new run would."""
    overrides = dict(parse_set(s) for s in sets)
    for key, value in (("model", model), ("output_dir", out)):
        if value:
            overrides[key] = str(Path(value).resolve())
    return overrides


def set_key(raw: dict, key_path: str, value: Any, cwd: Path) -> None:
    """Apply one override to the raw config; `pipeline.<stage>.x` means the (single) stage of that name.

    Unknown keys are left for validation to report; a value that names a file resolves against `cwd` (located).
    """
    tokens = _tokens(key_path)
    if len(tokens) >= 2 and tokens[0] == "pipeline" and isinstance(tokens[1], str):
        tokens.insert(1, _stage_index(raw.setdefault("pipeline", []), tokens[1], key_path))
    key = _schema_at(tokens)
    if key is not None:
        value = located(value, key, cwd)
    node: Any = raw
    for token, following in zip(tokens, tokens[1:]):
        if isinstance(token, int):
            if not isinstance(node, list) or token >= len(node):
                raise ConfigError(f"--set {key_path}: there is no item [{token}] at that point")
            if isinstance(node[token], str):  # `- optimize` shorthand for `- optimize: {}`
                node[token] = {node[token]: {}}
            node = node[token]
            continue
        if not isinstance(node, dict):
            raise ConfigError(f"--set {key_path}: '{token}' is not inside a mapping")
        if not isinstance(node.get(token), (dict, list)):
            node[token] = [] if isinstance(following, int) else {}
        node = node[token]
    last = tokens[-1]
    if isinstance(last, int):
        if not isinstance(node, list) or last >= len(node):
            raise ConfigError(f"--set {key_path}: there is no item [{last}] at that point")
    elif not isinstance(node, dict):
        raise ConfigError(f"--set {key_path}: '{last}' is not inside a mapping")
    node[last] = value


def _schema_at(tokens: list) -> Key | None:
    """The schema Key a token path points to (None when unknown: validation will say so)."""
    key: Key | None = SCHEMA
    for i, token in enumerate(tokens):
        if key is None:
            return None
        if tokens[:1] == ["pipeline"] and i == 2:
            stage = registry().get(token)
            key = stage.options if stage else None
        elif isinstance(token, int):
            key = key.item if tokens[:1] != ["pipeline"] else key
        else:
            key = key.fields.get(token) if key.kind == "section" else key.item
    return key


def _stage_index(items: list, name: str, key_path: str) -> int:
    hits = [i for i, item in enumerate(items)
            if (isinstance(item, dict) and name in item) or item == name]
    if not hits:
        names = [next(iter(item)) if isinstance(item, dict) else str(item) for item in items]
        guess = closest(name, names)
        hint = f"; did you mean '{guess}'?" if guess else f" (stages: {', '.join(names) or 'none'})"
        raise ConfigError(f"--set {key_path}: the pipeline has no '{name}' stage{hint}")
    if len(hits) > 1:
        raise ConfigError(f"--set {key_path}: the pipeline has {len(hits)} '{name}' stages; "
                          f"use pipeline[{hits[0]}].{name}… to pick one")
    if isinstance(items[hits[0]], str):
        items[hits[0]] = {name: {}}
    return hits[0]
