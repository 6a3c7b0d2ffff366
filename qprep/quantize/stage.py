"""The `quantize` stage: hand the prepared float model to the configured backend (ort | fp16 | rknn).

Refuses already-integer models (there is nothing left to quantize). A QDQ (QAT) model is skipped on ort and
fp16 (backend ort would stack a second set of Q/DQ nodes) and built from its own Q/DQ scales on rknn. A model that computes no
float tensor is skipped with a warning (ort, fp16) or refused (rknn, whose build aborts the process on it).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import logging
import time

import onnx

from qprep.contract import RunContext, StageResult
from qprep.errors import ConfigError, QprepError
from qprep.measure.user_metric import KEYS
from qprep.model import info as model_info
from qprep.quantize import float32_copy, nonfinite, search
from qprep.quantize.backend import QuantizeJob
from qprep.quantize.search import OPTIONS as FALLBACK_OPTIONS
from qprep.run_log import toolkit_logging_to_run_log
from qprep.schema import Key, Settings, closest
from qprep.stage_registry import stage

log = logging.getLogger("qprep")

BACKENDS = {"ort": "qprep.quantize.ort", "fp16": "qprep.quantize.fp16", "rknn": "qprep.quantize.rknn"}
SEARCHABLE = ("ort", "rknn")  # backends with an accuracy-driven fallback
CALIBRATED = ("ort", "rknn")  # backends that calibrate int8 ranges: extreme values must not reach them


def _backend(name: str):
    return importlib.import_module(BACKENDS[name])


def _backend_artifacts(name: str) -> tuple[str, ...]:
    return getattr(_backend(name), "ARTIFACTS", ())


def check(options: Settings, config) -> None:
    """What the run would otherwise find out after the stages before this one: data it needs, a toolkit."""
    backend = options.backend
    if not config["calibration"] and backend != "fp16":
        raise QprepError("quantize: calibration data is required; add `calibration: {source: <folder>}`")
    if options.fallback:
        if backend not in SEARCHABLE:
            raise QprepError(f"quantize.fallback: backend {backend} has nothing to fall back from; "
                             f"use it with backend {' or '.join(SEARCHABLE)}")
        if not config["evaluation"]:
            raise QprepError("quantize.fallback: needs `evaluation:` data to measure the target on; add an "
                             "evaluation section (source: <folder>)")
    if backend == "rknn" and importlib.util.find_spec("rknn") is None:
        raise QprepError("quantize: backend rknn needs rknn-toolkit2, which is not installed; run `qprep setup "
                         "rknn` (it installs rknn-toolkit2 2.5.0 with the pins it needs and a CPU torch into this "
                         "environment) or choose backend ort")


def check_model(options: Settings, model: onnx.ModelProto) -> None:
    """What the backend's toolkit is known to fail on, refused before any work (rknn: random ops, an opset
    above 19 that cannot be converted down), and node names the options give that the model lacks (a typo found
    only at the stage had already cost the user the previous run that `--force` cleared)."""
    excluded = (options.ort.nodes_to_exclude or []) if options.backend == "ort" and options.ort else []
    if excluded:
        names = {node.name for node in model_info.iter_nodes(model.graph)}
        unknown = [name for name in excluded if name not in names]
        if unknown:
            guess = closest(unknown[0], names)
            raise ConfigError(f"quantize.ort.nodes_to_exclude: no node named '{unknown[0]}' in the model"
                              f"{f'; did you mean {guess!r}?' if guess else ''} (names as loaded: `qprep inspect "
                              "--json` lists them)")
    if options.backend == "rknn":
        from qprep.quantize.rknn.limits import refuse_unsupported

        refuse_unsupported(model, at_load=True)


@stage(
    "quantize",
    check=check,
    check_model=check_model,
    fixed_dims=lambda options: options.backend == "rknn",  # the NPU model is compiled for one input size
    artifacts=lambda options: _backend_artifacts(options.backend),
    summary="quantize with ONNX Runtime (static INT8), rknn-toolkit2 (RKNN) or convert to FP16; the float set stays float",
    backend=Key("str", default="ort", choices=tuple(BACKENDS), doc="which backend quantizes"),
    max_samples=Key("int", default=64, minimum=1, doc="calibration samples used (from `calibration:`)"),
    fallback=FALLBACK_OPTIONS,
    **{name: _backend(name).OPTIONS for name in BACKENDS},
)
def quantize(model: onnx.ModelProto, ctx: RunContext, options: Settings) -> StageResult:
    """The prepared float model through the configured backend; hands back what the evaluation needs to run
    the result (the backend's runner and analyzer, the float model for per-layer error), its files and what to
    close when the run ends."""
    kind = model_info.model_kind(model)
    if kind == model_info.INTEGER:
        raise QprepError("quantize: the model is already integer-quantized (QLinear*/ConvInteger ops); "
                         "remove the quantize stage or start from the float model")
    backend = options.backend
    qat = kind == model_info.QDQ
    if qat and backend != "rknn":
        return StageResult(model=model, status="skipped",
                           reason="the model already holds Q/DQ nodes (QAT); use remove_redundant_qdq/fuse_conv_qdq "
                                  "(or backend rknn, which builds it from its own Q/DQ)")
    if qat:
        options = _from_its_own_qdq(model, options)
    started = time.perf_counter()  # the fallback's budget covers the FP32 reference outputs computed for it
    if not model_info.computes_float(model):
        if backend == "rknn" and options.rknn.do_quantization:  # the toolkit aborts on it (SIGABRT)
            raise QprepError("quantize.rknn: the model computes no float tensors, nothing to quantize; drop the "
                             "quantize stage (or set quantize.rknn.do_quantization: false for a .rknn without int8)")
        if backend != "rknn":  # ort and fp16 would return the model as it is and call it quantized
            return _passed_through(model, "nothing to quantize (the model computes no float tensors)")
    copied = None
    floats = float32_copy.other_floats(model)
    if floats:
        if backend == "fp16" and "float16" in floats:  # onnxconverter-common refuses to convert again
            return _passed_through(model, "the model already holds float16 (weights, casts or inputs): nothing "
                                          "left for the fp16 backend to convert; start from the float32 model for a "
                                          "fresh conversion")
        if backend == "fp16":  # onnxconverter-common converts float32 only: float64 weights came back unconverted
            return _passed_through(model, "the model computes in float64 and the fp16 backend converts float32 "
                                          "models: export it in float32 (or use backend ort, which quantizes a "
                                          "float32 copy)")
        model, copied = _computed_in_float32(model, ctx)
    job = _job(model, ctx, options, started, qat)
    with toolkit_logging_to_run_log():
        result = _backend(backend).quantize(job)
    extremes = result.extremes if result.extremes is not None else job.extremes
    float_set = result.float_set if result.float_set is not None else job.float_set
    searched = result.details.get("fallback")
    if searched and set(searched.get("target", {})) & set(KEYS):  # how its report line reads `metric`
        searched["metric_direction"] = ctx.config["evaluation"].get("metric_direction") or "higher"
    if extremes.tensors:
        result.details["nonfinite"] = {**extremes.record(), **result.details.get("nonfinite", {})}
    warnings = list(result.warnings)
    if copied is not None:
        result.details["float32_copy"] = copied
        if not copied["applied"]:
            warnings.append(f"quantize: the model computes in {copied['from']} and was left so: {copied['why']}")
    if backend == "ort" and result.model is not None and model_info.model_kind(result.model) == model_info.FLOAT:
        refuse_layers_only_in_bodies(model)
        warnings.append("quantize: ONNX Runtime quantized nothing (no op it quantizes lies outside the float set and "
                        "control-flow branches, which it never enters): the result runs in float, so its accuracy "
                        "figures say nothing about INT8")
    if result.details.get("float_set_unmatched"):
        warnings.append(f"quantize: {len(result.details['float_set_unmatched'])} float-set nodes no longer exist "
                        "(keep_float ran before a stage that rewrote them?) and were quantized")
    if qat:
        result.details["qat"] = {"scales": "the model's own Q/DQ (rknn-toolkit2 build with do_quantization "
                                           "false); no calibration",
                                 "layers": "rknn-toolkit2's per-layer analysis needs a board for a QAT model"}
    return StageResult(model=result.model if result.model is not None else model,
                       details={"backend": backend, "float_set_size": len(float_set), **result.details},
                       warnings=warnings, prepared_model=model, runner=result.runner, analyzer=result.analyzer,
                       deployable=result.deployable, artifacts=result.artifacts,
                       closers=[result.close] if result.close is not None else [],
                       float_set=set(extremes.nodes),
                       fallback_target=dict(job.fallback.target) if job.fallback else {})


def _job(model: onnx.ModelProto, ctx: RunContext, options: Settings, started: float, qat: bool) -> QuantizeJob:
    """Every setting the backends and the search read, decided here once: the backend's section and the
    fallback's (typed settings, from the config), the calibration samples, the float set with the nodes extreme values keep
    float, and (with the fallback) the samples it chooses on, those kept apart and how a trial is measured."""
    backend = options.backend
    job = QuantizeJob(model=model, calibration=ctx.calibration, max_samples=options.max_samples,
                      float_set=frozenset(ctx.float_set), work_dir=ctx.work_dir(backend), progress=ctx.progress,
                      options=getattr(options, backend), fallback=options.fallback,
                      threads=ctx.config["threads"], started=started)
    if backend in CALIBRATED and job.samples and not qat:
        extremes = _kept_out_of_calibration(job)
        job = job.but(extremes=extremes, float_set=job.float_set | set(extremes.nodes))
    if job.fallback:
        job = job.but(**_fallback_inputs(job.fallback, ctx))
    return job


def _from_its_own_qdq(model: onnx.ModelProto, options: Settings) -> Settings:
    """A QAT (QDQ) model on rknn: the toolkit builds it from the model's own Q/DQ scales (do_quantization
    false: the simulator's figures against the float network are ONNX Runtime's for the QDQ model, BENCHMARKS.md
    "QDQ and QAT models"). Nothing is calibrated, so no fallback."""
    from qprep.quantize.rknn.limits import refuse_qat_epilogues

    if options.fallback:
        raise QprepError("quantize.fallback: the model is QAT (it holds Q/DQ nodes), whose scales were trained: "
                         "there is nothing to search; remove `fallback:` (or start from the float model)")
    refuse_qat_epilogues(model)
    # accuracy_analysis refuses a QAT model on the simulator ("The QAT model need set 'target'")
    return dataclasses.replace(options, rknn=dataclasses.replace(options.rknn, do_quantization=False,
                                                                 analysis_samples=0))


def _passed_through(model: onnx.ModelProto, reason: str) -> StageResult:
    return StageResult(model=model, status="skipped", reason=reason,
                       warnings=[f"quantize: skipped, {reason}; the model passes through unchanged"])


def refuse_layers_only_in_bodies(model: onnx.ModelProto) -> None:
    """ONNX Runtime's quantizer never enters If/Loop/Scan bodies. When it quantized nothing and the model's layers
    lie in such bodies, an INT8 run would hand back the float model as its result (Silero VAD v4/v5: its LSTMs sit
    in an If on the sample rate; the run said `ok` with 1.0000): refused, naming the control-flow nodes."""
    held = model_info.layers_in_bodies(model)
    holders = [node for node in model.graph.node if node.name in held]
    if holders:
        names = ", ".join(f"{n.op_type} '{n.name}'" for n in holders[:3]) + (" …" if len(holders) > 3 else "")
        raise QprepError(f"quantize: the model's layers lie inside control flow ({names}), which ONNX Runtime's "
                         "quantizer does not enter, so nothing was quantized; export the model without it (a fixed "
                         "loop count or branch, e.g. torch.onnx.export(..., dynamo=True)) or use backend fp16")


def _computed_in_float32(model: onnx.ModelProto, ctx: RunContext) -> tuple[onnx.ModelProto, dict]:
    """A float16 or float64 model computes in float32 before it is calibrated (float32_copy.py), checked on
    calibration samples; its inputs and outputs keep their type."""
    samples = ctx.calibration.samples if ctx.calibration is not None else []
    copy, record = float32_copy.to_float32(model, samples, ctx.config["threads"])
    log.info("quantize: %s model %s: %s", record["from"],
             "computes in float32" if record["applied"] else "left as it is", record)
    return copy, record


def _kept_out_of_calibration(job: QuantizeJob) -> nonfinite.Extremes:
    """Tensors holding ±inf, NaN or float16-overflowing values on the calibration samples (attention masks):
    their nodes join the float set before the backend calibrates anything (nonfinite.py)."""
    extremes = nonfinite.find(job.model, job.samples, job.threads)
    if extremes.nodes:
        extremes.added = set(extremes.nodes) - job.float_set
        log.info("quantize: %d tensors hold non-finite or beyond-float16 values (%s); %d nodes stay float: %s",
                 len(extremes.tensors), ", ".join(list(extremes.tensors)[:5]), len(extremes.nodes),
                 ", ".join(list(extremes.nodes)[:10]))
    return extremes


def _fallback_inputs(fallback, ctx: RunContext) -> dict:
    """The search measures every trial on the evaluation samples against the FP32 outputs; those are the run's
    shared ReferenceOutputs, computed here once (the final evaluation reuses them). The samples are split into
    those the search chooses on and those kept apart to accept its choice (search.split_samples)."""
    from qprep.measure.outputs import output_metrics
    from qprep.measure.user_metric import UserMetric, with_figures

    run = ctx.reference
    expected = run.expected
    evaluation = ctx.config["evaluation"]
    kinds, padding = run.judging(evaluation["tasks"], evaluation["padding"])  # as the final evaluation judges
    # the user's own metric, measured on each trial when the target names it (`metric_drop: 0.01`)
    metric = UserMetric.of(evaluation) if set(fallback.target) & set(KEYS) else None
    seen = metric.samples_of(run.samples) if metric else []

    position = {id(sample): i for i, sample in enumerate(run.samples.samples)}

    def measure(samples: list[dict], actual_outputs: list[dict]) -> dict:
        chosen = [expected[position[id(s)]] for s in samples]
        outputs = output_metrics(chosen, actual_outputs, kinds, evaluation["decision_threshold"], padding, samples)
        return with_figures(outputs, metric.figures(chosen, actual_outputs, [seen[position[id(s)]] for s in samples],
                                                    f"{len(samples)} evaluation samples") if metric else None)

    chosen_on, kept_apart = search.split_samples(run.samples.samples, fallback.accept_share)
    return {"evaluation_samples": tuple(chosen_on), "acceptance_samples": tuple(kept_apart), "measure": measure}
