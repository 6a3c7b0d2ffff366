"""The `optimize` stage: run the graph passes in order, prove each one kept the numbers, roll back any that
did not, and repeat while a round still changes the graph (one pass's result is often the next one's match).

Passes work on one onnx_ir model. A round runs every pass, then verifies the result once (onnx.checker + the
run's Verifier: ONNX Runtime on calibration samples); it becomes the last accepted model. Only when that check
fails (or a pass raises) is the round replayed from its start with a check after each pass that changed
something, so the culprit is rolled back alone and the rest kept. A rollback rebuilds the IR from the last
accepted proto. Passes must report every change as a match: an unmatched pass is not verified.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import onnx
import onnx_ir as ir

from qprep.contract import RunContext, StageResult
from qprep.errors import QprepError
from qprep.graph.rules import NewNames
from qprep.graph.verify import Verifier, checker_problem
from qprep.model import info as model_info
from qprep.model.prepare import drop_initializer_value_info
from qprep.optimize.dynamic_samples import dynamic_variant, named_dynamic_dims
from qprep.optimize.passes import PassSettings, all_passes
from qprep.progress import Progress
from qprep.schema import Key, Settings
from qprep.stage_registry import stage
from qprep.third_party import forget_rewrite_matches

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
def optimize(model: onnx.ModelProto, ctx: RunContext, options: Settings) -> StageResult:
    """Rewrites before quantization, each proved on ctx.verifier's samples: a pass that changes the numbers is
    rolled back (listed in `rolled_back`), so the model handed on computes what the input did."""
    passes = selected_passes(options)
    settings = _settings(options, ctx.config.stages, ctx.verifier.threads)
    verifier, dynamic = _verifier_with_dynamic_variant(ctx.verifier, model)
    records = {name: {"pass": name, "matches": 0, "accepted": 0, "nodes_removed": 0, "seconds": 0.0,
                      "verify_seconds": 0.0, "details": {}} for name in passes}
    rolled_back: list[dict] = []
    checks = {"rounds_checked_at_once": 0, "rounds_replayed": 0, "verify_seconds": 0.0}
    rounds_run = 0
    current = ir.from_proto(model)  # the IR of the last accepted model; rebuilt only after a rollback
    for round_index in range(options.rounds):
        rounds_run += 1
        # a rolled-back pass would fail the same way on the same input again
        active = [name for name in passes if all(r["pass"] != name for r in rolled_back)]
        outcome, candidate = _round_at_once(active, current, settings, verifier, records, checks, ctx.progress)
        if outcome == "replay":  # a pass raised, or the round's passes together changed the numbers
            checks["rounds_replayed"] += 1
            candidate, current = _round_pass_by_pass(active, model, settings, verifier, records, rolled_back,
                                                     round_index, checks, ctx.progress)
            outcome = "unchanged" if candidate is model else "accepted"
        if outcome == "unchanged":
            break  # the next round would match nothing either
        model = candidate
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
        "verify_seconds": round(checks["verify_seconds"], 3),
        "checks": {"rounds_checked_at_once": checks["rounds_checked_at_once"],
                   "rounds_replayed": checks["rounds_replayed"]},
        "opset": model_info.default_opset(model),
    })


def _round_at_once(active: list[str], current: ir.Model, settings: PassSettings, verifier: Verifier,
                   records: dict, checks: dict, progress: Progress | None) -> tuple[str, onnx.ModelProto | None]:
    """Run one round's passes on `current` and verify their joint result once: ("accepted", model),
    ("unchanged", None) when nothing matched, or ("replay", None) when a pass raised or the check failed (the
    caller then replays the round pass by pass to find the culprit). Why: a check builds an ORT session and
    runs every sample; one per accepted pass was most of optimize's time on big models (BERT-large: ~10 checks
    of several seconds), while a failing round is rare. Records change only when the round is accepted."""
    pending = []  # (name, outcome, op counts before, op counts after)
    counts = _ir_op_counts(current)
    for name in active:
        start = time.perf_counter()
        try:
            outcome = _apply(name, current, settings, progress)
        except Exception:  # noqa: BLE001 - the replay rolls the pass back with its reason
            return "replay", None
        finally:
            records[name]["seconds"] += time.perf_counter() - start
        after = _ir_op_counts(current) if outcome.matches else counts
        pending.append((name, outcome, counts, after))
        counts = after
    changed = [name for name, outcome, _, _ in pending if outcome.matches]
    candidate = drop_initializer_value_info(ir.to_proto(current)) if changed else None
    if changed:
        problem, verdict = _check(candidate, verifier, checks)
        if problem or not verdict.ok:
            return "replay", None
        checks["rounds_checked_at_once"] += 1
    for name, outcome, before, after in pending:
        records[name]["details"] = _merge(records[name]["details"], outcome.details)
        if outcome.matches:
            records[name]["matches"] += outcome.matches
            _accept(records[name], outcome, before, after, {**verdict.as_dict(), "checked_with": changed})
    return ("accepted", candidate) if changed else ("unchanged", None)


def _round_pass_by_pass(active: list[str], model: onnx.ModelProto, settings: PassSettings, verifier: Verifier,
                        records: dict, rolled_back: list[dict], round_index: int,
                        checks: dict, progress: Progress | None) -> tuple[onnx.ModelProto, ir.Model]:
    """One round from `model` with a check after every pass that changed something; a pass that raises or
    changes the numbers is rolled back (appended to `rolled_back`). Returns the last accepted model (`model`
    itself when nothing was accepted) and its IR."""
    current = ir.from_proto(model)
    for name in active:
        record = records[name]
        before = _ir_op_counts(current)
        start = time.perf_counter()
        try:
            outcome = _apply(name, current, settings, progress)
            candidate = drop_initializer_value_info(ir.to_proto(current)) if outcome.matches else None
        except Exception as exc:  # a pass that breaks on an unusual graph must not end the run
            record["seconds"] += time.perf_counter() - start
            reason = f"the pass raised {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            _roll_back(name, round_index, reason, {}, rolled_back)
            current = ir.from_proto(model)
            continue
        record["seconds"] += time.perf_counter() - start
        record["details"] = _merge(record["details"], outcome.details)
        if outcome.matches == 0:  # passes report every change, so an unmatched pass left the model as it was
            continue
        start = time.perf_counter()
        problem, verdict = _check(candidate, verifier, checks)
        record["verify_seconds"] += time.perf_counter() - start
        record["matches"] += outcome.matches
        if problem or not verdict.ok:
            _roll_back(name, round_index, problem or verdict.reason, verdict.outputs if verdict else {}, rolled_back)
            current = ir.from_proto(model)
            continue
        _accept(record, outcome, before, _ir_op_counts(current), verdict.as_dict())
        model = candidate
    return model, current


def _apply(name: str, model: ir.Model, settings: PassSettings, progress: Progress | None):
    """One pass on `model`; a pass still running after a few seconds says so (name, what it does, elapsed).
    What the pass adds is named unique in the whole model afterwards (rules.NewNames: onnx_ir's own names for
    unnamed outputs can repeat a dynamo export's `val_N`), so no pass is rolled back for a name it never chose."""
    graph_pass = all_passes()[name]
    names = NewNames(model)
    if progress is None:
        outcome = graph_pass.apply(model, settings)
    else:
        with progress.watch(f"optimize: pass {name} ({graph_pass.doc})"):
            outcome = graph_pass.apply(model, settings)
    names.settle()
    return outcome


def _accept(record: dict, outcome, before: Counter, after: Counter, verification: dict) -> None:
    """A pass's changes kept: what it rewrote, the nodes and op types it changed, the check that accepted it."""
    record["accepted"] += outcome.matches
    record["nodes_removed"] += sum(before.values()) - sum(after.values())
    record["op_delta"] = _merge(record.get("op_delta", {}), _count_delta(before, after))
    record["verification"] = verification


def _check(candidate: onnx.ModelProto, verifier: Verifier, checks: dict):
    """(problem, verdict): the checker's or ORT's refusal as a problem, else the verifier's verdict."""
    start = time.perf_counter()
    problem, verdict = checker_problem(candidate), None
    if not problem:
        try:
            verdict = verifier.check(candidate)
        except QprepError as exc:  # ORT refuses or cannot run the candidate
            problem = str(exc)
    checks["verify_seconds"] += time.perf_counter() - start
    return problem, verdict


def _roll_back(name: str, round_index: int, reason: str, outputs: dict, rolled_back: list[dict]) -> None:
    log.warning("optimize: pass %s rolled back (round %d): %s", name, round_index + 1, reason)
    rolled_back.append({"pass": name, "round": round_index + 1, "reason": reason, "outputs": outputs})


def _ir_op_counts(model: ir.Model) -> Counter:
    """Op types over the IR model, subgraphs included (as model_info.op_counts counts the proto)."""
    return Counter(node.op_type for node in ir.traversal.RecursiveGraphIterator(model.graph))


def _count_delta(old: Counter, new: Counter) -> dict[str, int]:
    return {op: new.get(op, 0) - old.get(op, 0) for op in sorted(set(old) | set(new))
            if new.get(op, 0) != old.get(op, 0)}


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


def selected_passes(options: Settings) -> list[str]:
    """The configured pass list (names were validated against the registry with the config)."""
    names = options.passes if options.passes is not None else [
        name for name, graph_pass in all_passes().items() if graph_pass.default]
    return [name for name in names if name not in options.skip]


def _settings(options: Settings, stages: list[tuple[str, Settings]], threads: int = 2) -> PassSettings:
    """Resolve what passes may do from the options and the quantize backend later in the pipeline."""
    backend = next((opts.backend for name, opts in stages if name == "quantize"), None)
    max_opset = options.max_opset or (RKNN_MAX_OPSET if backend == "rknn" else 21)
    return PassSettings(fold_max_elements=options.fold_max_elements, max_opset=max_opset,
                        gelu=options.gelu, backend=backend, threads=threads)


def _merge(old: dict, new: dict) -> dict:
    """Accumulate per-round details: numbers add up, anything else keeps the latest value."""
    merged = dict(old)
    for key, value in new.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and isinstance(merged.get(key), (int, float)):
            merged[key] += value
        else:
            merged[key] = value
    return merged
