"""The `optimize` stage: run the graph passes in order, prove each one kept the numbers, roll back any that
did not, and repeat while a round still changes the graph (one pass's result is often the next one's match).

Passes work on one onnx_ir model; after each pass that changed something its proto is verified (onnx.checker +
the run's Verifier: ONNX Runtime on calibration samples) and becomes the last accepted model. A rollback
rebuilds the IR from that proto. Passes must report every change as a match: an unmatched pass is not verified.
"""

from __future__ import annotations

import logging
import time

import onnx
import onnx_ir as ir

from qprep.model import info as model_info
from qprep.errors import QprepError
from qprep.optimize.passes import PassSettings, all_passes
from qprep.optimize.dynamic_samples import dynamic_variant, named_dynamic_dims
from qprep.verify import Verifier, checker_problem
from qprep.schema import Key
from qprep.third_party import forget_rewrite_matches
from qprep.pipeline.context import RunContext, StageResult
from qprep.pipeline.stages import stage

log = logging.getLogger("qprep")

RKNN_MAX_OPSET = 19  # rknn-toolkit2 recommends 19 and fails on 21


@stage(
    "optimize",
    summary="verified pre-quantization graph rewrites (folding, cleanup, BatchNorm/LayerNorm/GELU fusion)",
    passes=Key("list", item=Key("str", choices=tuple(all_passes())),
               doc="passes to run, in this order (default: every default pass)"),
    skip=Key("list", item=Key("str", choices=tuple(all_passes())), default=[],
             doc="passes to leave out of the default list"),
    fold_max_elements=Key("int", default=1 << 20, minimum=0, doc="largest tensor constant folding may create"),
    max_opset=Key("int", minimum=7, doc="highest opset a rewrite may upgrade the model to "
                  "(default: 19 when an rknn quantize stage follows, else 21)"),
    gelu=Key("str", default="auto", choices=("auto", "onnx", "microsoft", "off"),
             doc="GELU fusion target: ONNX Gelu (opset 20), ORT's com.microsoft Gelu, or none"),
    rounds=Key("int", default=3, minimum=1, doc="repeat the pass list while a round still changes the graph"),
)
def optimize(model: onnx.ModelProto, ctx: RunContext, options: dict) -> StageResult:
    """Rewrites before quantization, each proved on ctx.verifier's samples: a pass that changes the numbers is
    rolled back (listed in `rolled_back`), so the model handed on computes what the input did."""
    passes = selected_passes(options)
    settings = _settings(options, ctx.config.stages)
    verifier, dynamic = _verifier_with_dynamic_variant(ctx.verifier, model)
    records = {name: {"pass": name, "matches": 0, "accepted": 0, "nodes_removed": 0, "seconds": 0.0,
                      "verify_seconds": 0.0, "details": {}} for name in passes}
    rolled_back = []
    rounds_run = 0
    current = ir.from_proto(model)  # the IR of the last accepted model; rebuilt only after a rollback
    for round_index in range(options["rounds"]):
        rounds_run += 1
        changed = False
        for name in passes:
            if any(r["pass"] == name for r in rolled_back):
                continue  # the same input would fail the same way again
            record = records[name]
            start = time.perf_counter()
            try:
                outcome = all_passes()[name].apply(current, settings)
                candidate = ir.to_proto(current) if outcome.matches else None
            except Exception as exc:  # a pass that breaks on an unusual graph must not end the run
                reason = f"the pass raised {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
                log.warning("optimize: pass %s rolled back (round %d): %s", name, round_index + 1, reason)
                rolled_back.append({"pass": name, "round": round_index + 1, "reason": reason, "outputs": {}})
                current = ir.from_proto(model)
                continue
            record["details"] = _merge(record["details"], outcome.details)
            if outcome.matches == 0:  # passes report every change, so an unmatched pass left the model as it was
                record["seconds"] += time.perf_counter() - start
                continue
            record["seconds"] += time.perf_counter() - start
            start = time.perf_counter()
            problem = checker_problem(candidate)
            verdict = None
            if not problem:
                try:
                    verdict = verifier.check(candidate)
                except QprepError as exc:  # ORT refuses or cannot run the candidate
                    problem = str(exc)
            record["verify_seconds"] += time.perf_counter() - start
            record["matches"] += outcome.matches
            if problem or not verdict.ok:
                reason = problem or verdict.reason
                log.warning("optimize: pass %s rolled back (round %d): %s", name, round_index + 1, reason)
                rolled_back.append({"pass": name, "round": round_index + 1, "reason": reason,
                                    "outputs": verdict.outputs if verdict else {}})
                current = ir.from_proto(model)
                continue
            record["accepted"] += outcome.matches
            record["nodes_removed"] += model_info.node_count(model) - model_info.node_count(candidate)
            record["op_delta"] = _merge(record.get("op_delta", {}), _op_delta(model, candidate))
            record["verification"] = verdict.as_dict()
            model = candidate
            changed = True
        if not changed:
            break
    forget_rewrite_matches()  # else the rules keep the IR, and through it the input model, after this stage
    failed = {r["pass"] for r in rolled_back}
    for record in records.values():
        record["seconds"] = round(record["seconds"], 3)
        record["verify_seconds"] = round(record["verify_seconds"], 3)
        record["status"] = "rolled back" if record["pass"] in failed else (
            "applied" if record["accepted"] else "no match")
    return StageResult(model=model, rolled_back=rolled_back, details={
        "passes": list(records.values()),
        "rounds": rounds_run,
        "settings": {"max_opset": settings.max_opset, "gelu": settings.gelu, "backend": settings.backend,
                     "fold_max_elements": settings.fold_max_elements},
        "verified_on": verifier.source,
        "dynamic_dims_verified": dynamic,
        "rewrite_seconds": round(sum(r["seconds"] for r in records.values()), 3),
        "verify_seconds": round(sum(r["verify_seconds"] for r in records.values()), 3),
        "opset": model_info.default_opset(model),
    })


def _verifier_with_dynamic_variant(verifier: Verifier, model: onnx.ModelProto) -> tuple[Verifier, dict | str]:
    """The run's verifier, plus (when the model has named dynamic dims) one sample at other sizes of them
    (qprep/optimize/dynamic_samples.py), with its reference set. Returns it and what the record says:
    {dim: [old, new]}, or why there is no such sample."""
    variant, sizes = dynamic_variant(model, verifier.samples[0]) if verifier.samples else (None, {})
    if variant is not None:
        extended = Verifier([*verifier.samples, variant], verifier.tol, verifier.threads,
                            source=f"{verifier.source} + 1 at other dynamic dims")
        try:
            extended.set_reference(model)
            return extended, {name: list(pair) for name, pair in sizes.items()}
        except QprepError as exc:
            reason = f"not verified at other dynamic dims: the input model does not run there ({exc})"
            log.info("optimize: %s", reason)
            verifier.set_reference(model)
            return verifier, reason
    verifier.set_reference(model)
    return verifier, "no named dynamic dims" if not named_dynamic_dims(model) else "samples disagree on a dim"


def selected_passes(options: dict) -> list[str]:
    """The configured pass list (names were validated against the registry with the config)."""
    names = options["passes"] if options["passes"] is not None else [
        name for name, graph_pass in all_passes().items() if graph_pass.default]
    return [name for name in names if name not in options["skip"]]


def _settings(options: dict, stages: list[tuple[str, dict]]) -> PassSettings:
    """Resolve what passes may do from the options and the quantize backend later in the pipeline."""
    backend = next((opts.get("backend") for name, opts in stages if name == "quantize"), None)
    max_opset = options["max_opset"] or (RKNN_MAX_OPSET if backend == "rknn" else 21)
    return PassSettings(fold_max_elements=options["fold_max_elements"], max_opset=max_opset,
                        gelu=options["gelu"], backend=backend)


def _op_delta(before: onnx.ModelProto, after: onnx.ModelProto) -> dict[str, int]:
    """Op types whose count changed, e.g. {"LayerNormalization": 13, "ReduceMean": -26}."""
    old, new = model_info.op_counts(before), model_info.op_counts(after)
    return {op: new.get(op, 0) - old.get(op, 0) for op in sorted(set(old) | set(new))
            if new.get(op, 0) != old.get(op, 0)}


def _merge(old: dict, new: dict) -> dict:
    """Accumulate per-round details: numbers add up, anything else keeps the latest value."""
    merged = dict(old)
    for key, value in new.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and isinstance(merged.get(key), (int, float)):
            merged[key] += value
        else:
            merged[key] = value
    return merged
