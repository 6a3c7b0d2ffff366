"""Evaluation after the last stage: the result against the FP32 reference on evaluation samples.

Per output: its kind (kinds.py: scores, probability, state, integer, boxes, …) and the metrics that mean
something for it (metrics.py), with a 95% interval on agreements; per-layer accumulated error against the
prepared float model; latency and size; the worst samples; and the gate, or without one the accuracy floor
that turns a collapse into `gate missed`. Everything lands in report.json under `evaluation`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx

from qprep.disk.reading import read_text
from qprep.errors import DataError
from qprep.measure import ctc
from qprep.measure.gate import check_gate
from qprep.measure.latency import interleaved, speedups
from qprep.measure.layers import LayerComparison
from qprep.measure.metrics import wilson_interval
from qprep.measure.outputs import output_metrics, padding_included
from qprep.measure.padding import Padding
from qprep.model import info as model_info
from qprep.model.runtime import run_model

if TYPE_CHECKING:  # the pipeline imports this package
    from qprep.config import Config
    from qprep.contract import Products, RunContext

log = logging.getLogger("qprep")


def evaluate(config: Config, ctx: RunContext, products: Products, final_model: onnx.ModelProto,
             original_kind: str) -> dict:
    """The final model (or the backend's runner) against ctx.reference; `products` is what the stages handed
    back for it: runner, per-layer analyzer, prepared float model, fallback target."""
    cfg = config["evaluation"]
    threads = config["threads"]
    notes = []
    if cfg["reference_model"] is None and original_kind == model_info.QDQ:
        notes.append("the input model is QDQ and no evaluation.reference_model is set: the result is compared "
                     "with the QDQ input, not with an FP32 model")
    run = ctx.reference
    reference_path, samples, expected = run.path, run.samples, run.expected

    def result_on(sample_set) -> list[dict]:
        return products.runner(sample_set.samples) if products.runner else run_model(
            final_model, model_info.cast_to_inputs(sample_set.samples, final_model), threads, optimize=True)

    with ctx.progress.step(f"evaluation: {len(samples)} samples"):
        actual = result_on(samples)
    kinds, padding = run.judging(cfg["tasks"], cfg["padding"])  # the held-out set is judged the same way
    outputs = measure(samples, expected, actual, kinds, cfg, cfg["labels"], notes, padding)
    symbols = ctc.dictionary(run.model)
    ctc.spell_worst(outputs, symbols)
    result = {"reference_model": reference_path, "samples": samples.describe(), "outputs": outputs, "notes": notes}
    heldout = None
    if run.heldout is not None:
        heldout_expected = run.heldout_expected
        with ctx.progress.step(f"evaluation: {len(run.heldout)} held-out samples"):
            heldout_actual = result_on(run.heldout)
        heldout_notes: list[str] = []
        heldout = measure(run.heldout, heldout_expected, heldout_actual, kinds, cfg, cfg["heldout"]["labels"],
                          heldout_notes, padding)
        ctc.spell_worst(heldout, symbols)
        result["heldout"] = {"samples": run.heldout.describe(), "outputs": heldout, "notes": heldout_notes}
    latency = None
    if products.runner is not None:
        latency = {"status": "not measured (no device): the result runs on the toolkit's simulator"}
    elif cfg["latency"]["runs"] > 0:
        with ctx.progress.step("evaluation: latency"):  # the reference's session, built for its outputs, reused
            latency = _latency(run.session(), final_model, samples.samples[0], threads, cfg["latency"])
        if latency["speedup"] < 1.0:  # small models: Q/DQ overhead can outweigh the int8 kernels
            notes.append(f"the result runs {latency['speedup']:.2f}× the reference's speed on this CPU "
                         "(slower): check it on the deployment CPU before shipping it for speed")
        if "unstable" in latency:
            notes.append(latency["unstable"])
    if run.as_written:
        notes.append("ONNX Runtime's graph optimizations fail on the reference model, so it ran as written: "
                     f"its outputs are exact, its latency unoptimized ({run.as_written})")
    run.release()  # the last run of the reference is done: per-layer error runs without its weights in memory
    if cfg["layers"] and products.analyzer is not None:
        with ctx.progress.step("evaluation: per-layer error (backend analysis)"):
            result["layers"] = products.analyzer(samples.samples[: cfg["layer_samples"]])
    elif cfg["layers"] and products.prepared_model is not None and products.runner is None:
        with ctx.progress.step("evaluation: per-layer error"):  # the prepared model's last user; its sessions
            result["layers"] = LayerComparison(products.take_prepared_model(), final_model, threads).errors(
                samples.samples[: cfg["layer_samples"]])  # go as soon as it is done
    if latency is not None:
        result["latency"] = latency
    # the result's size is the runner's to add, from the files it wrote: ByteSize() serializes the whole proto
    # (a 1.58 GB FP16 BERT: +5 GB for a moment, the run's peak)
    result["size_bytes"] = {"reference": Path(reference_path).stat().st_size}
    gate = {**products.fallback_target, **cfg["gate"]}  # the fallback's target is checked on the final result too
    if gate or cfg["floor"]:
        judged = heldout if heldout is not None else outputs
        result["gate"] = {**(check_gate(gate, judged) if gate else check_gate(cfg["floor"], judged, floor=True)),
                          "judged_on": "heldout" if heldout is not None else "evaluation",
                          "target": dict(gate or cfg["floor"])}  # as configured: what a fallback would aim at
        if not result["gate"]["passed"]:
            result["gate"]["worst_tensors"] = worst_tensors(result["gate"], judged, result.get("layers"))
    if products.fallback_target and heldout is None:
        notes.append("quantize.fallback chose its float nodes on these evaluation samples: give "
                     "evaluation.heldout (samples no decision sees) for an unbiased figure")
    return result


def measure(samples, expected: list[dict], actual: list[dict], kinds: dict[str, tuple[str, str]], cfg: dict,
            labels_path, notes: list[str], padding: Padding | None = None) -> dict:
    """Per-output metrics of `actual` against `expected` on one sample set (evaluation or held-out), with the
    worst samples and, given labels, task accuracy; what a reader must know goes to `notes`."""
    outputs = output_metrics(expected, actual, kinds, cfg["decision_threshold"], padding, samples.samples)
    notes.extend(output_notes(outputs))
    if padding is not None:
        whole = padding_included(expected, actual, kinds, padding, samples.samples, cfg["decision_threshold"])
        for name, figures in whole["outputs"].items():
            outputs[name]["with_padding"] = figures
        notes.extend(padding_notes(whole))
    skipped = [name for name in expected[0] if name not in outputs]
    if skipped:
        notes.append(f"output {', '.join(skipped)}: not a numeric tensor (strings, sequences, maps), not compared")
    for metrics in outputs.values():
        metrics.update(worst_samples(metrics.pop("per_sample"), samples.files))
    if labels_path:
        labels = read_labels(Path(labels_path), cfg["label_names"], samples.files)
        for name, metrics in outputs.items():
            if metrics["kind"] == "classification":
                metrics.update(task_accuracy([e[name] for e in expected], [a[name] for a in actual], labels))
    return outputs


def padding_notes(whole: dict) -> list[str]:
    """Per output judged on real positions only: how many those are, and its figures with the padding rows."""
    return [f"output '{name}': judged on the {whole['real_positions']:,} of {whole['positions']:,} positions the "
            f"input '{whole['input']}' marks real (pooling and token heads do not use the padding rows); with the "
            f"padding rows: " + ", ".join(f"{metric} {value:.5f}" for metric, value in judged.items())
            + " (evaluation.padding: none judges every position)"
            for name, judged in whole["outputs"].items()]


def output_notes(outputs: dict) -> list[str]:
    """What a reader must know before trusting an output's figures."""
    notes = []
    for name, m in outputs.items():
        if m.get("not_measured"):
            notes.append(f"output '{name}': not measured: {m['not_measured']}")
        elif m.get("not_comparable"):
            notes.append(f"output '{name}': {m['not_comparable']} samples not comparable (the result's rank "
                         f"differs); its figures cover the other {m['samples']}")
        if m.get("shape_changed"):
            notes.append(f"output '{name}': {m['shape_changed']} of {m['samples']} samples have another shape than "
                         "the reference (the shape depends on the input): compared over their common prefix")
        if m.get("count_changed"):
            notes.append(f"output '{name}': the number of rows differs from the reference on {m['count_changed']} "
                         "samples (rows chosen by NMS/TopK): matched as sets")
        if m.get("nonfinite_samples"):
            notes.append(f"output '{name}': {m['nonfinite_samples']} samples have NaN/Inf where the reference has "
                         "none (counted as a total miss): look for an overflow (float16, a huge mask constant)")
    return notes


def worst_samples(per_sample: dict, files: list[str]) -> dict:
    """The five worst samples by the output's per-sample figure (`worst_by` names it); a sample that matches the
    reference exactly (an error of 0, an agreement or cosine of 1) is no worst sample, so none may be listed.
    Class scores also list every sample whose top-1 changed, nearest tie first (`top1_changed`, metrics._flips)."""
    higher = per_sample.get("higher_is_better", True)
    perfect = 1.0 if higher else 0.0
    texts = per_sample.get("texts") or [None] * len(files)  # ctc: (reference ids, result ids) per sample
    rated = [(v, Path(f).name, t) for f, v, t in zip(files, per_sample["values"], texts)
             if v is not None and v != perfect]
    rated.sort(key=lambda row: (row[0] if higher else -row[0], row[1]))
    flips = [{"sample": Path(f).name, **flip} for f, flip in zip(files, per_sample.get("flips") or []) if flip]
    return {"worst_by": per_sample["metric"],
            "worst_samples": [{"sample": name, "value": value,
                               **({"reference_ids": list(t[0]), "result_ids": list(t[1])} if t else {})}
                              for value, name, t in rated[:5]],
            **({"top1_changed": sorted(flips, key=lambda f: (f["float_gap"], f["sample"]))} if flips else {})}


def worst_tensors(gate: dict, outputs: dict, layers: list[dict] | None) -> list[str]:
    """What a missed gate or floor points at: the outputs that missed, then the worst layer tensors."""
    named = []
    for check in gate["checks"]:
        if not check["passed"] and check.get("worst_output"):
            value = "not measured" if check["value"] is None else f"{check['value']:.4g}"
            named.append(f"output '{check['worst_output']}' ({check['metric'].rsplit('.', 1)[-1]} {value})")
    for row in (layers or [])[:3]:
        figure = (f"SQNR {row['sqnr_db']:.1f} dB" if row.get("sqnr_db") is not None
                  else f"cosine {row['cosine_mean']:.4f}")
        named.append(f"tensor '{row['tensor']}' ({figure})")
    return list(dict.fromkeys(named))


def read_labels(path: Path, names: list[str] | None, files: list[str]) -> list[int]:
    """One class index per evaluation sample, from `<file name> <label>` lines."""
    text = read_text(path, "evaluation.labels: file", DataError, "give a UTF-8 text file of `<file name> <label>` lines")
    table = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2:
            table[parts[0]] = parts[-1]
    indices = []
    for file in files:
        label = table.get(Path(file).name)
        if label is None:
            raise DataError(f"evaluation.labels: {path} has no label for {Path(file).name}")
        if names:
            if label not in names:
                raise DataError(f"evaluation.labels: label '{label}' of {Path(file).name} is not in label_names {names}")
            indices.append(names.index(label))
        else:
            try:
                indices.append(int(label))
            except ValueError:
                raise DataError(f"evaluation.labels: label '{label}' is not a class index; set "
                                "evaluation.label_names to map names to output positions") from None
    return indices


def task_accuracy(reference: list, result: list, labels: list[int]) -> dict:
    """Top-1 accuracy of reference and result against ground truth (one label per sample, batch 1)."""
    ref_hits, res_hits = _top1_hits(reference, labels), _top1_hits(result, labels)
    return {"top1_accuracy": float(res_hits.mean()),
            "top1_accuracy_ci95": list(wilson_interval(int(res_hits.sum()), res_hits.size)),
            "reference_top1_accuracy": float(ref_hits.mean()), "labelled_samples": int(res_hits.size)}


def _top1_hits(outputs: list, labels: list[int]) -> np.ndarray:
    return np.array([int(np.asarray(o).reshape(-1, np.asarray(o).shape[-1])[0].argmax()) == y
                     for o, y in zip(outputs, labels)])


def _latency(reference, final_model, sample, threads: int, cfg: dict) -> dict:
    timed = interleaved({"reference": (reference, sample),
                         "result": (final_model, model_info.cast_to_inputs([sample], final_model)[0])},
                        threads, cfg["runs"], cfg["warmup"], cfg["rounds"], tight=cfg["within"] or None,
                        seconds=cfg["seconds"] or None)
    ref, res = timed["reference"], timed["result"]
    return {"reference": ref, "result": res, **speedups(ref, res),
            "settings": {"batch": 1, "threads": threads, "provider": "CPUExecutionProvider",
                         "graph_optimization": "ORT_ENABLE_ALL"}}
