"""Evaluation after the last stage: the result against the FP32 reference on evaluation samples.

Per output: cosine (mean/min), SQNR, max abs error, MSE, agreement where the output is class or per-step
scores (with a 95% interval); per-layer accumulated error against the prepared float model; latency and
size; the worst samples; and the gate. Everything lands in report.json under `evaluation`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx

from qprep.model import info as model_info
from qprep.evaluate.gate import check_gate
from qprep.evaluate.latency import interleaved, speedups
from qprep.evaluate.layers import layer_errors
from qprep.errors import DataError
from qprep.evaluate.metrics import compare_output, is_integer, output_task, wilson_interval
from qprep.verify import is_numeric
from qprep.model.runtime import run_model

if TYPE_CHECKING:  # the pipeline imports this package
    from qprep.config import Config
    from qprep.pipeline.context import Products, RunContext

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
    reference_path, reference, samples, expected = run.path, run.model, run.samples, run.expected
    def result_on(sample_set) -> list[dict]:
        return products.runner(sample_set.samples) if products.runner else run_model(
            final_model, model_info.cast_to_inputs(sample_set.samples, final_model), threads, optimize=True)

    with ctx.progress.step(f"evaluation: {len(samples)} samples"):
        actual = result_on(samples)
    outputs = measure(samples, expected, actual, cfg, cfg["labels"], reference, notes)
    result = {"reference_model": reference_path, "samples": samples.describe(), "outputs": outputs, "notes": notes}
    heldout = None
    if run.heldout is not None:
        heldout_expected = run.heldout_expected
        with ctx.progress.step(f"evaluation: {len(run.heldout)} held-out samples"):
            heldout_actual = result_on(run.heldout)
        heldout_notes: list[str] = []
        heldout = measure(run.heldout, heldout_expected, heldout_actual, cfg, cfg["heldout"]["labels"], reference,
                          heldout_notes)
        result["heldout"] = {"samples": run.heldout.describe(), "outputs": heldout, "notes": heldout_notes}
    if cfg["layers"] and products.analyzer is not None:
        with ctx.progress.step("evaluation: per-layer error (backend analysis)"):
            result["layers"] = products.analyzer(samples.samples[: cfg["layer_samples"]])
    elif cfg["layers"] and products.prepared_model is not None and products.runner is None:
        with ctx.progress.step("evaluation: per-layer error"):
            result["layers"] = layer_errors(products.prepared_model, final_model,
                                            samples.samples[: cfg["layer_samples"]], threads)
    if products.runner is not None:
        result["latency"] = {"status": "not measured (no device): the result runs on the toolkit's simulator"}
    elif cfg["latency"]["runs"] > 0:
        with ctx.progress.step("evaluation: latency"):
            result["latency"] = _latency(reference, final_model, samples.samples[0], threads, cfg["latency"])
        if result["latency"]["speedup"] < 1.0:  # small models: Q/DQ overhead can outweigh the int8 kernels
            notes.append(f"the result runs {result['latency']['speedup']:.2f}× the reference's speed on this CPU "
                         "(slower): check it on the deployment CPU before shipping it for speed")
        if "unstable" in result["latency"]:
            notes.append(result["latency"]["unstable"])
    result["size_bytes"] = {"reference": Path(reference_path).stat().st_size,
                            "result": final_model.ByteSize()}
    gate = {**products.fallback_target, **cfg["gate"]}  # the fallback's target is checked on the final result too
    if gate:
        result["gate"] = {**check_gate(gate, heldout if heldout is not None else outputs),
                          "judged_on": "heldout" if heldout is not None else "evaluation"}
    if products.fallback_target and heldout is None:
        notes.append("quantize.fallback chose its float nodes on these evaluation samples: give "
                     "evaluation.heldout (samples no decision sees) for an unbiased figure")
    return result


def measure(samples, expected: list[dict], actual: list[dict], cfg: dict, labels_path, reference: onnx.ModelProto,
            notes: list[str]) -> dict:
    """Per-output metrics of `actual` against `expected` on one sample set (evaluation or held-out), with the
    worst samples and, given labels, task accuracy; what a reader must know goes to `notes`."""
    outputs = output_metrics(expected, actual, cfg["tasks"], reference)
    notes.extend(output_notes(outputs))
    skipped = [name for name in expected[0] if name not in outputs]
    if skipped:
        notes.append(f"output {', '.join(skipped)}: not a numeric tensor (strings, sequences, maps), not compared")
    for name, metrics in outputs.items():
        per_sample = metrics.pop("per_sample_cosine")
        metrics["worst_samples"] = sorted(
            ({"sample": Path(f).name, "cosine": c} for f, c in zip(samples.files, per_sample)),
            key=lambda row: row["cosine"])[:5]
    if labels_path:
        labels = read_labels(Path(labels_path), cfg["label_names"], samples.files)
        for name, metrics in outputs.items():
            if metrics["task"] == "classification":
                metrics.update(task_accuracy([e[name] for e in expected], [a[name] for a in actual], labels))
    return outputs


def output_metrics(expected: list[dict], actual: list[dict], tasks: dict, reference: onnx.ModelProto) -> dict:
    """Per output: compare_output over the samples, the task read from `tasks` or guessed from the output's
    shape and the reference node that produces it."""
    producers = {o: n.op_type for n in reference.graph.node for o in n.output}
    outputs = {}
    for name in expected[0]:
        values = [e[name] for e in expected]
        if not all(is_numeric(v) for v in values):
            continue  # strings, sequences, maps: no accuracy figure (evaluate() notes which)
        task = tasks.get(name) or output_task(name, expected[0][name].shape, producers.get(name), is_integer(values))
        outputs[name] = compare_output(values, [a[name] for a in actual], task)
    return outputs


def output_notes(outputs: dict) -> list[str]:
    """What a reader must know before trusting an output's figures."""
    notes = []
    for name, m in outputs.items():
        if m.get("shape_mismatch"):
            notes.append(f"output '{name}': {m['shape_mismatch']} samples changed shape (data-dependent output); "
                         f"its metrics cover the other {m['samples']} only")
        if m.get("nonfinite_samples"):
            notes.append(f"output '{name}': {m['nonfinite_samples']} samples have NaN/Inf where the reference has "
                         "none (counted as cosine 0): look for an overflow (float16, a huge mask constant)")
        if "element_agreement" in m:
            notes.append(f"output '{name}' holds integers: element_agreement ({m['element_agreement']:.4f}) is "
                         "its meaningful figure; cosine over ids or labels says little")
    return notes


def read_labels(path: Path, names: list[str] | None, files: list[str]) -> list[int]:
    """One class index per evaluation sample, from `<file name> <label>` lines."""
    if not path.is_file():
        raise DataError(f"evaluation.labels: file not found: {path}")
    table = {}
    for line in path.read_text().splitlines():
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
                        threads, cfg["runs"], cfg["warmup"], cfg["rounds"])
    ref, res = timed["reference"], timed["result"]
    return {"reference": ref, "result": res, **speedups(ref, res),
            "settings": {"batch": 1, "threads": threads, "provider": "CPUExecutionProvider",
                         "graph_optimization": "ORT_ENABLE_ALL"}}
