"""The RKNN backend's entry point `quantize` and its config section OPTIONS: the model made into one the
toolkit compiles (limits.py, static_graph/, float16 ranges, the int8 rewrites), the builds (builder.py), the
fallback's search when one is configured (search.py), then model.rknn exported and the board's files written
(contract.py). The search is handed the builder here: builder.py knows nothing of the search."""

from __future__ import annotations

import dataclasses

from qprep.model.info import graph_inputs
from qprep.quantize import float16_range, outlier_positions, residual_channels, rewrites, smooth_layernorm
from qprep.quantize.backend import Quantized, QuantizeJob
from qprep.quantize.rknn import limits, static_graph
from qprep.quantize.rknn.builder import RknnBuilder
from qprep.quantize.rknn.contract import write_board_files
from qprep.quantize.rknn.model_file import MMSE_WEIGHT_SAMPLES
from qprep.quantize.rknn.search import fallback
from qprep.schema import Key, section

PLATFORMS = ("rv1103", "rv1103b", "rv1106", "rv1106b", "rv1126b", "rk2118", "rk3562", "rk3566", "rk3568",
             "rk3576", "rk3588")
OPTIONS = section(
    "rknn-toolkit2 conversion (backend: rknn); runs on the x86 simulator unless a device is configured",
    target_platform=Key("str", default="rk3588", choices=PLATFORMS, doc="Rockchip SoC"),
    quantized_dtype=Key("str", default="w8a8", choices=("w8a8", "w4a16", "w8a16", "w16a16i"),
                        doc="weight/activation precision (w8a8 on every SoC)"),
    quantized_algorithm=Key("str", default="normal", choices=("normal", "mmse", "kl_divergence"),
                            doc="activation range algorithm (mmse is slow; kl_divergence for skewed ranges)"),
    quantized_method=Key("str", default="channel", choices=("channel", "layer"), doc="weight scale granularity"),
    optimization_level=Key("int", default=3, minimum=0, doc="toolkit graph optimization level"),
    do_quantization=Key("bool", default=True, doc="false: a float16 model (no int8)"),
    weight_rounding=Key("str", default="gptq", choices=("gptq", "nearest", "mmse"),
                        doc="gptq: Conv/MatMul/Gemm weights handed to the toolkit on its own grid with GPTQ's "
                            "integers (weights.py); w8a8, per channel, normal algorithm (the one measured). mmse: "
                            f"the weight ranges an mmse build on {MMSE_WEIGHT_SAMPLES} calibration samples "
                            "chooses, nearest rounding, activation ranges as the algorithm says (normal or "
                            "kl_divergence; the fallback tries it when the target is missed)"),
    split_outlier_positions=Key("bool", default=True,
                                doc="compute LayerNorm chains apart for sequence positions whose activations stand "
                                    "far above the rest (BERT's [CLS]), so int8 ranges fit both (outlier_positions.py)"),
    smooth_layernorm=smooth_layernorm.OPTION,
    rescale_residual_channels=residual_channels.OPTION,
    analysis_samples=Key("int", default=1, minimum=0,
                         doc="evaluation samples run through accuracy_analysis for the per-layer table (~10 s each)"),
)


def quantize(job: QuantizeJob) -> Quantized:
    """The build (after the fallback's search, if on), exported; its runner stays usable for the evaluation
    until the result's `close` stops the toolkit worker (at once when this fails or is interrupted)."""
    user_inputs = graph_inputs(job.model)  # the contract keeps them, those the toolkit does not get marked ignored
    job, converted, static, clipped, scaled, overflowing = _within_toolkit_limits(job)
    job, smoothed = smooth_layernorm.smooth_job(job, "rknn")
    split = outlier_positions.Split(job.model)
    if rewrites.runs("outlier_positions", "rknn", job.options):
        split = outlier_positions.split(job.model, job.samples[:8], job.threads)
        job = job.but(model=split.model, float_set=frozenset(split.carried(set(job.float_set))))
    rescaled = {}
    if rewrites.runs("residual_channels", "rknn", job.options) and job.samples:
        result = residual_channels.rescale(job.model, job.samples[:residual_channels.SAMPLES], job.threads,
                                           keep=set(job.float_set))
        rescaled = result.record
        job = job.but(model=result.model, float_set=frozenset(result.carried(set(job.float_set))))
    builder = RknnBuilder(job, split)
    if smoothed:
        builder.details["smoothed_layernorms"] = smoothed
    if split.record:
        builder.details["outlier_positions"] = split.record
    if rescaled:
        builder.details["residual_channels"] = rescaled
    if converted:
        builder.details["opset_converted"] = converted
    if static:
        builder.details["static_graph"] = static
    if clipped or overflowing or (scaled and scaled.record):
        builder.details["nonfinite"] = {**({"float16_clip": clipped} if clipped else {}),
                                        **({"float16_range": scaled.record} if scaled and scaled.record else {}),
                                        **({"int8_not_float16": overflowing} if overflowing else {})}
    try:
        float_set = set(job.float_set)
        if job.fallback:
            outcome = fallback(builder, float_set, job)
            float_set = set(outcome.float_nodes)
            builder.details["fallback"] = outcome.record
        runner = builder.session(float_set)
        builder.release(keep=runner)
        work, options = job.work_dir, job.options
        rknn_path = work / "model.rknn"
        builder.toolkit.call("export_rknn", runner.rknn, "export_rknn", str(rknn_path))
    except BaseException:
        builder.close()
        raise
    board = write_board_files(work, user_inputs, builder.normalization, options, job.model,
                              ignored=static.get("unread_inputs_removed", ()))
    return Quantized(model=job.model, details=builder.details, runner=runner, deployable="model.rknn",
                     analyzer=(lambda samples: runner.analyze(samples[: options.analysis_samples]))
                     if options.analysis_samples else None,
                     artifacts={"model.rknn": rknn_path, **board}, close=builder.close,
                     float_set=job.float_set, extremes=job.extremes)


def _within_toolkit_limits(job: QuantizeJob):
    """(the job with its model made one the toolkit compiles — opset, static shapes, float16-safe constants and
    ranges — and its float set and extremes carried along, then what each step did for the record)."""
    limits.refuse_unsupported(job.model)
    samples = job.samples[:8]
    model, converted = limits.within_opset(job.model, samples, job.threads)
    model, static = static_graph.static_graph(model, samples, job.threads)
    float_set = static_graph.carried(set(job.float_set), model, static)
    extremes = job.extremes
    model, clipped = limits.float16_safe(model, extremes, samples, job.threads)
    scaled = float16_range.scale(model, samples, job.threads) if extremes.tensors else None
    if scaled and scaled.chain:  # float16 holds the chain now: it stays float as any float node does
        model, float_set = scaled.model, scaled.carried(set(float_set))
        extremes = dataclasses.replace(extremes, added=extremes.added - set(scaled.chain))
    float_set, overflowing = limits.without_float16_overflow(model, set(float_set), extremes, samples, job.threads)
    if overflowing:  # int8 in the result: no longer reported as kept float for their values
        extremes = dataclasses.replace(extremes, nodes={node: why for node, why in extremes.nodes.items()
                                                        if node not in overflowing})
    job = job.but(model=model, float_set=frozenset(float_set), extremes=extremes)
    return job, converted, static, clipped, scaled, overflowing
