"""Evaluation after the last stage: the result against the FP32 reference on evaluation samples.

Per output: its kind (kinds.py: scores, probability, state, integer, boxes, …) and the metrics that mean
something for it (metrics.py), with a 95% interval on agreements; per-layer accumulated error against the
prepared float model; latency and size; the worst samples; and the gate, or without one the accuracy floor
that turns a collapse into `gate missed`. Everything lands in report.json under `evaluation`.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx

from qprep.data.pitfalls import shared_count
from qprep.disk.reading import read_text
from qprep.errors import DataError
from qprep.measure import ctc
from qprep.measure.gate import check_gate
from qprep.measure.latency import interleaved, speedups
from qprep.measure.layers import LayerComparison
from qprep.measure.metrics import wilson_interval
from qprep.measure.outputs import output_metrics, padding_included
from qprep.measure.padding import Padding
from qprep.measure.user_metric import UserMetric, describe, with_figures
from qprep.model import info as model_info
from qprep.model.io import weights_bytes
from qprep.model.runtime import SessionRecipe, run_model

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
    if ctx.calibration is not None and (shared := shared_count(samples, ctx.calibration)):
        result["samples"]["calibration_shared"] = shared  # a run's preflight warns; `qprep evaluate` notes it
    result["min_integer_share"] = cfg["min_integer_share"]  # the verdict's mostly-float floor, as resolved
    metric = UserMetric.of(cfg)  # the user's own figure, beside the agreement with FP32 (user_metric.py)
    if metric is not None:
        result["metric"] = metric.figures(expected, actual, metric.samples_of(samples), "the evaluation samples")
        notes.append(describe(result["metric"]))
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
        if metric is not None:
            result["heldout"]["metric"] = metric.figures(heldout_expected, heldout_actual,
                                                         metric.samples_of(run.heldout), "the held-out samples")
            heldout_notes.append(describe(result["heldout"]["metric"]))
    latency = None
    if cfg["latency"]["runs"] > 0:
        with ctx.progress.step("evaluation: latency"):  # the reference's session, built for its outputs, reused
            latency = timed_latency(config, run, products, final_model, samples.samples[0])
        notes.extend(latency_notes(latency))
    elif products.runner is not None:
        latency = {"status": NO_BOARD}
    if run.as_written:
        notes.append("ONNX Runtime's graph optimizations fail on the reference model, so it ran as written: "
                     f"its outputs are exact, its latency unoptimized ({run.as_written})")
    if cfg["latency"]["runs"] == 0:  # else timed_latency released it once its session was timed
        run.release()  # the last run of the reference is done: per-layer error runs without its weights in memory
    if cfg["layers"] and products.analyzer is not None:
        with ctx.progress.step("evaluation: per-layer error (backend analysis)"):
            result["layers"] = products.analyzer(samples.samples[: cfg["layer_samples"]])
    elif cfg["layers"] and products.prepared_model is not None and products.runner is None:
        with ctx.progress.step("evaluation: per-layer error"):  # the prepared model's last user; its sessions
            comparison = LayerComparison(products.take_prepared_model(), final_model, threads)  # go as soon as
            result["layers"] = comparison.errors(samples.samples[: cfg["layer_samples"]])  # it is done
            result["layers_left_out"], comparison = comparison.left_out_counts(), None
    if latency is not None:
        result["latency"] = latency
    # the result's size is the runner's to add, from the files it wrote: ByteSize() serializes the whole proto
    # (a 1.58 GB FP16 BERT: +5 GB for a moment, the run's peak)
    result["size_bytes"] = {"reference": Path(reference_path).stat().st_size}
    gate = {**products.fallback_target, **cfg["gate"]}  # the fallback's target is checked on the final result too
    if gate or cfg["floor"]:
        judged = heldout if heldout is not None else outputs
        judged = with_figures(judged, (result["heldout"] if heldout is not None else result).get("metric"))
        result["gate"] = {**(check_gate(gate, judged) if gate else check_gate(cfg["floor"], judged, floor=True)),
                          "judged_on": "heldout" if heldout is not None else "evaluation",
                          "target": dict(gate or cfg["floor"])}  # as configured: what a fallback would aim at
        if not result["gate"]["passed"]:
            result["gate"]["worst_tensors"] = worst_tensors(result["gate"], judged, result.get("layers"))
    if products.fallback_target and heldout is None:
        notes.append("quantize.fallback chose its float nodes on these evaluation samples: give "
                     "evaluation.heldout (samples no decision sees) for an unbiased figure")
    return result


def calibration_note(result: dict) -> str | None:
    """`qprep evaluate --samples` on samples the run calibrated on: said, as for the run's own evaluation samples
    (the quantizer set its ranges on them, so the figures flatter the result)."""
    samples = result.get("samples") or {}
    shared = samples.get("calibration_shared")
    if not shared:
        return None
    which = "are" if shared == samples.get("count") else f"share {shared} of {samples.get('count', '?')} samples with"
    return (f"these samples {which} the run's calibration samples, on which the quantizer set its ranges: the "
            "figures flatter the result; give samples the run never saw")


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
            reference, result = [e[name] for e in expected], [a[name] for a in actual]
            if metrics["kind"] == "classification":
                metrics.update(task_accuracy(reference, result, labels))
            elif metrics["kind"] == "binary" and all(np.size(r) == 2 for r in reference):  # one decision a sample
                metrics.update(task_accuracy(reference, result, labels, cfg["decision_threshold"]))
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


def task_accuracy(reference: list, result: list, labels: list[int], threshold: float | None = None) -> dict:
    """Top-1 accuracy of reference and result against ground truth (one label per sample, batch 1). With a
    `threshold`, a two-class output's class is 1 where its class-1 probability reaches it: the decision its
    decision agreement counts, not the argmax (which is a threshold of 0.5)."""
    ref_hits, res_hits = _top1_hits(reference, labels, threshold), _top1_hits(result, labels, threshold)
    return {"top1_accuracy": float(res_hits.mean()),
            "top1_accuracy_ci95": list(wilson_interval(int(res_hits.sum()), res_hits.size)),
            "reference_top1_accuracy": float(ref_hits.mean()), "labelled_samples": int(res_hits.size)}


def _top1_hits(outputs: list, labels: list[int], threshold: float | None = None) -> np.ndarray:
    if threshold is not None:
        return np.array([int(np.asarray(o).reshape(-1)[1] >= threshold) == y for o, y in zip(outputs, labels)])
    return np.array([int(np.asarray(o).reshape(-1, np.asarray(o).shape[-1])[0].argmax()) == y
                     for o, y in zip(outputs, labels)])


NO_BOARD = ("not measured: the result runs on the toolkit's simulator, and its latency exists only on the board "
            "(no figure off the board)")
BASIC = "ORT_ENABLE_BASIC"  # folds constants, no LayerNorm/GELU/attention fusions: a runtime that takes the graph
# much as written (an NPU toolkit's input)


def timed_latency(config: Config, run, products: Products, final_model: onnx.ModelProto, sample: dict) -> dict:
    """The original model, the optimized float model and the result timed in turn on ORT's CPU at its default
    level, and the two float models again at ORT_ENABLE_BASIC. Why both: ORT fuses much of what `optimize`
    does by itself, a runtime that takes the graph as written (an NPU toolkit) does not, so what optimize bought
    shows at one level and may vanish at the other. Each model is timed once: the optimized float model that is
    the result, or that optimize left as it was, is not timed again."""
    cfg, threads, started = config["evaluation"]["latency"], config["threads"], time.perf_counter()
    optimized, why = optimized_float(config, products, final_model, run.model)
    deployed = {"reference": (run.session(), sample)}
    once = optimized is final_model and products.runner is None  # the result is the optimized model, run by ORT
    if optimized is not None and not once:
        deployed["optimized"] = (optimized, model_info.cast_to_inputs([sample], optimized)[0])
    if products.runner is None:
        deployed["result"] = (final_model, model_info.cast_to_inputs([sample], final_model)[0])
    latency: dict = {"settings": {"batch": 1, "threads": threads, "provider": "CPUExecutionProvider",
                                  "graph_optimization": "ORT_ENABLE_ALL", "basic": BASIC}}
    if products.runner is not None:
        latency["status"] = NO_BOARD
    if optimized is None:
        latency["optimized_status"] = why
    elif once:
        latency["optimized_status"] = "the result is the optimized float model (timed once)"
    if len(deployed) > 1:
        latency.update(_timed(deployed, threads, cfg, len(deployed) + 2 * (optimized is not None)))
    original, path = run.model, run.path
    run.release()  # its session and proto go before the float models are built again at BASIC (peak memory)
    if optimized is not None:
        latency["basic"] = _basic(original, path, optimized, sample, threads, cfg, len(deployed) + 2)
    if once:
        latency["optimized"] = latency["result"]
        latency.update({f"optimized_{key}": latency[key] for key in ("speedup", "speedup_rounds") if key in latency})
    latency["seconds"] = round(time.perf_counter() - started, 2)
    return latency


def _timed(models: dict, threads: int, cfg: dict, of: int) -> dict:
    """The models interleaved, each speed ratio against "reference"; `of`: how many models share the budget."""
    budget = cfg["seconds"] * len(models) / of if cfg["seconds"] else None
    timed = interleaved(models, threads, cfg["runs"], cfg["warmup"], cfg["rounds"], tight=cfg["within"] or None,
                        seconds=budget)
    out = dict(timed)
    for label, prefix in (("result", ""), ("optimized", "optimized_")):
        if label in timed:
            out.update({prefix + key: value for key, value in speedups(timed["reference"], timed[label]).items()})
    return out


def _basic(original: onnx.ModelProto, path: str, optimized: onnx.ModelProto, sample: dict, threads: int,
           cfg: dict, of: int) -> dict:
    """The original and the optimized float model at ORT_ENABLE_BASIC; a failure to build is recorded, not
    raised: the deployed figures stand without it. The original goes as a SessionRecipe, its proto let go
    before its session is built (a heavy one is read again from its file)."""
    try:
        models = {"reference": (SessionRecipe(with_weights(original, path)), sample, "basic"),
                  "optimized": (optimized, model_info.cast_to_inputs([sample], optimized)[0], "basic")}
        return {"level": BASIC, **_timed(models, threads, cfg, of)}
    except Exception as exc:  # noqa: BLE001 - ORT's own types; the figures at the default level stand
        return {"level": BASIC, "status": f"not timed: {str(exc).splitlines()[0][:200]}"}


def optimized_float(config: Config, products: Products, final_model: onnx.ModelProto,
                    original: onnx.ModelProto) -> tuple[onnx.ModelProto | None, str]:
    """(the optimize stage's float product, or None and why it is not timed). It is the model quantize started
    from, or the result itself when no stage quantized it."""
    if config["evaluation"]["reference_model"]:
        return None, "not timed: the reference is evaluation.reference_model, not the model optimize started from"
    if "optimize" not in [name for name, _ in config.stages]:
        return None, "no optimize stage"
    model = products.prepared_model if products.prepared_model is not None else final_model
    if model_info.model_kind(model) != model_info.FLOAT:
        return None, "not timed: the model optimize handed on is not a float model"
    if same_graph(model, original):
        return None, "optimize left the graph as it was"
    if weights_bytes(model) > THIRD_SESSION_BYTES:
        return None, (f"not timed: over {THIRD_SESSION_BYTES >> 20} MB of weights, a third session beside the "
                      "original's and the result's would add its size to the run's peak memory")
    return model, ""


# Above this, the optimized float model is not timed: its session (ORT's own copy of the weights) beside the
# original's and the result's raised a 440 MB BERT-base's latency step from 2.0 to 3.2 GB peak, against the
# big-model memory bound (BENCHMARKS.md: "Big models: time and memory against ONNX Runtime").
THIRD_SESSION_BYTES = 256 << 20


def same_graph(a: onnx.ModelProto, b: onnx.ModelProto) -> bool:
    """The same nodes in the same order (weights not compared: the reference may be a weightless skeleton)."""
    return len(a.graph.node) == len(b.graph.node) and all(
        x.SerializeToString() == y.SerializeToString() for x, y in zip(a.graph.node, b.graph.node))


def with_weights(model: onnx.ModelProto, path: str) -> onnx.ModelProto:
    """The reference with its weights: a heavy one is a weightless skeleton once its session is built
    (reference.py), so its file is read again and given the skeleton's graph (nodes named, dims fixed)."""
    if not any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer):
        return model
    whole = onnx.load(path)
    known = {t.name for t in whole.graph.initializer}
    for name in ("node", "input", "output", "value_info"):
        whole.graph.ClearField(name)
        getattr(whole.graph, name).extend(getattr(model.graph, name))
    whole.graph.initializer.extend(t for t in model.graph.initializer if t.name not in known)
    del whole.opset_import[:]
    whole.opset_import.extend(model.opset_import)
    whole.ir_version = model.ir_version
    return whole


def slower(latency: dict) -> bool:
    """The result slower than the reference beyond the timing's noise: under 1.00× as printed, in every timing
    round, or with one round at the edges of both timings' intervals. Why: a tiny model's 1.00× read "(slower)"
    on a ratio whose rounds went either way."""
    speedup = latency.get("speedup")
    if speedup is None or round(speedup, 2) >= 1.0:
        return False
    reference, result = latency.get("reference") or {}, latency.get("result") or {}
    rounds = latency.get("speedup_rounds")
    if rounds and len(result.get("round_ms") or []) >= 2:
        return max(rounds) < 1.0
    if reference.get("median_ms") is None or result.get("median_ms") is None:
        return True  # nothing to tell noise by: the ratio stands as measured
    fastest = (reference["median_ms"] * (1 + (reference.get("interval") or 0.0))
               / (result["median_ms"] * (1 - (result.get("interval") or 0.0))))
    return fastest < 1.0


def latency_notes(latency: dict) -> list[str]:
    """What a reader must know about the timings: a result slower than the reference, an optimized float model
    slower than the original in every round (a rewrite this runtime does not reward), rounds that disagree."""
    notes = []
    if slower(latency):  # small models: Q/DQ overhead can outweigh the int8 kernels
        notes.append(f"the result runs {latency['speedup']:.2f}× the reference's speed on this CPU "
                     "(slower): check it on the deployment CPU before shipping it for speed")
    said = latency.get("optimized") is latency.get("result")  # the result's note above says it at this level
    for timed in ((latency,) if not said else ()) + (latency.get("basic") or {},):
        rounds = timed.get("optimized_speedup_rounds")
        if rounds and max(rounds) < 1.0:
            level = timed.get("level") or latency["settings"]["graph_optimization"]
            notes.append(f"the optimized float model runs {timed['optimized_speedup']:.2f}× the original's speed at "
                         f"{level} in every timing round (slower): optimize's rewrites do not pay on this runtime")
    unstable = [t[key] for t in (latency, latency.get("basic") or {}) for key in ("unstable", "optimized_unstable")
                if key in t]
    return notes + unstable[:1]  # one says it: the machine's speed changed while timing
