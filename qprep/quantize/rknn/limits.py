"""What rknn-toolkit2 cannot take, refused before any work, and the opset it wants, reached before it loads the
model.

Facts (rknn-toolkit2 2.5.0, measured here): its build stops on random ops ("Found Random node 'noise', which is
not supported, please remove it manually", logged on the line after an empty `E build:`; seen with
RandomNormalLike and RandomUniformLike); Rockchip recommends opset 19 and the toolkit fails on 21. A model above
19 is converted down with onnx's version converter and verified with ONNX Runtime before the toolkit sees it;
a model that uses an op opset 19 does not have (Gelu is 20) cannot be, and is refused at once. Constants
float16 cannot hold (attention masks: finfo.min, -inf, -1e9) are clipped first: an additive attention mask's
fill to the smallest bound its scores allow (int8 attention keeps its scores), the rest to ±10000 as the toolkit
itself does for ±3e38 at optimization_level 3, so the float16 layers that carry a mask stay finite; float-set
nodes whose finite activations float16 cannot hold stay int8. An If or a BatchNormalization the toolkit cannot
compile is rewritten by static_graph/; an If it cannot rewrite is refused here.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx

from qprep.errors import ModelError
from qprep.graph.verify import Tolerance, compare
from qprep.model.info import Links, default_opset, graph_inputs
from qprep.model.prepare import convert_down
from qprep.model.runtime import run_model
from qprep.optimize.stage import RKNN_MAX_OPSET
from qprep.quantize import nonfinite
from qprep.quantize.nonfinite import Extremes
from qprep.quantize.rknn import static_graph

log = logging.getLogger("qprep")

REFUSED_OPS = ("RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike")
# What the toolkit itself turns constants beyond ±3e38 into ("corrected to -10000 or 10000", optimization_level 3
# only); qprep clips every constant float16 cannot hold (|x| > 65504: also -1e9 masks, and at any level) to it
MASK_BOUND = 10000.0


def refuse_unsupported(model: onnx.ModelProto, at_load: bool = False) -> None:
    """A one-line ModelError for what the toolkit is known to fail on: dynamic input dims, random ops, an If
    or Loop static_graph/ cannot rewrite, an opset that cannot be converted down to RKNN_MAX_OPSET (named by the op
    that blocks it). `at_load`: the input model, before the optimize stage has taken ONNX Runtime's fused ops
    apart (the build checks again what is left)."""
    require_fixed_dims(model)
    for node in model.graph.node:
        if node.op_type in REFUSED_OPS and node.domain in ("", "ai.onnx"):
            raise ModelError(f"quantize.rknn: node '{node.name}' is {node.op_type}, and rknn-toolkit2 refuses random "
                             "ops; remove it from the export (e.g. export in eval mode, or feed the noise as an input)")
    refuse_custom_domains(model, at_load)
    refuse_uint8_inputs(model)
    static_graph.refuse_unrewritable(model)
    if default_opset(model) > RKNN_MAX_OPSET:
        try:
            convert_down(model, RKNN_MAX_OPSET)  # a dry run: the conversion used is verified in within_opset
        except ModelError as exc:
            raise ModelError(f"quantize.rknn: rknn-toolkit2 takes opset {RKNN_MAX_OPSET} at most, and {exc}") from None


def refuse_custom_domains(model: onnx.ModelProto, at_load: bool = False) -> None:
    """Ops outside the ONNX domain (ONNX Runtime's com.microsoft Attention, EmbedLayerNormalization from its
    transformer optimizer; onnxruntime-extensions ops) are ops rknn-toolkit2 has no kernel for: it fails deep in
    its build with "TypeError: 'NoneType' object is not iterable" (measured with com.microsoft Gelu), so they are
    named here instead. The fused ops the optimize stage takes apart (FusedConv, SkipLayerNormalization, ...:
    optimize/passes/split_ort_fusions.py) pass at load; at the build, one left says how to split it."""
    from qprep.graph.ir import MS_DOMAIN
    from qprep.optimize.passes.split_ort_fusions import SPLITS

    custom: dict[str, list[str]] = {}
    splittable = set()
    for node in model.graph.node:
        if node.domain not in ("", "ai.onnx"):
            if node.domain == MS_DOMAIN and node.op_type in SPLITS:
                if at_load:
                    continue
                splittable.add(node.op_type)
            custom.setdefault(f"{node.domain} {node.op_type}", []).append(node.name or node.output[0])
    if custom:
        ops = ", ".join(f"{op} ({len(names)}× e.g. '{names[0]}')" for op, names in sorted(custom.items()))
        domains = {op.split(" ")[0] for op in custom}
        raise ModelError(f"quantize.rknn: rknn-toolkit2 runs only standard ONNX ops, and the model has {ops}; "
                         f"{'; '.join(_way_out(domain, splittable) for domain in sorted(domains))}")


ML_DOMAIN = "ai.onnx.ml"


def _way_out(domain: str, splittable: set[str]) -> str:
    """The fix follows where the ops came from: com.microsoft ones from ONNX Runtime's optimizer (an optimized
    export, or fusions the optimize stage splits), ai.onnx.ml ones from a classic-ML converter (skl2onnx's Scaler,
    ZipMap, ArrayFeatureExtractor), whose pre/post-processing only ONNX Runtime runs; any other domain is a
    library's custom ops."""
    from qprep.graph.ir import MS_DOMAIN

    if domain == MS_DOMAIN and splittable:
        return ("run the optimize stage before quantize (its split_ort_fusions pass takes "
                f"{', '.join(sorted(splittable))} apart; its record says why one was left)")
    if domain == MS_DOMAIN:
        return "export it without ONNX Runtime's graph optimizations (the float export, not an ORT-optimized one)"
    if domain == ML_DOMAIN:
        return ("ai.onnx.ml ops come from a classic-ML converter (skl2onnx and the like) and rknn-toolkit2 takes "
                "only ai.onnx ops: use backend ort (ONNX Runtime runs them), or export the model without its "
                "classic-ML pre/post-processing")
    return f"{domain} ops are another library's custom ops, for which rknn-toolkit2 has no kernel: export without them"


EPILOGUES = ("Div", "Mul", "Add", "Sub", "BatchNormalization")


def refuse_qat_epilogues(model: onnx.ModelProto) -> None:
    """A QAT Conv followed by a Div or BatchNormalization outside its Q/DQ (PyTorch eager QAT exports leave
    Conv → Div(scale factor) → BatchNormalization): rknn-toolkit2 2.5.0 fails its build on it ("Invalid
    w_par['dtype'] = float16", measured), and fuse_conv_qdq's `format: qdq` folds exactly that."""
    links = Links(model)
    for node in model.graph.node:
        weight = links.producers.get(node.input[1]) if node.op_type == "Conv" and len(node.input) > 1 else None
        after = links.readers.get(node.output[0], [])
        if weight is not None and weight.op_type == "DequantizeLinear" and len(after) == 1 \
                and after[0].op_type in EPILOGUES:
            raise ModelError(f"quantize.rknn: QAT Conv '{node.name}' is followed by {after[0].op_type} "
                             f"'{after[0].name}' outside its Q/DQ, on which rknn-toolkit2's build fails; add "
                             "`- fuse_conv_qdq: {format: qdq}` before quantize (it folds it into the Conv)")


def refuse_uint8_inputs(model: onnx.ModelProto) -> None:
    """A uint8 graph input (an image model that casts its pixels itself): rknn-toolkit2 2.5.0's build aborts the
    process on it (SIGABRT, "Not Support Dtype: 2. please check precision!", measured on a Cast → Conv model);
    named here instead. The NPU takes uint8 pixels for a float32 input on the board by itself."""
    for spec in graph_inputs(model):
        if spec.dtype == "uint8":
            raise ModelError(f"quantize.rknn: input '{spec.name}' is uint8, and rknn-toolkit2 aborts on uint8 "
                             "inputs (\"Not Support Dtype\"); export the model with a float32 input (drop its Cast: "
                             "the RKNN runtime converts uint8 pixels on the board), or use backend ort")


def require_fixed_dims(model: onnx.ModelProto) -> None:
    """RKNN compiles for one input size: every input dim must be a number."""
    for spec in graph_inputs(model):
        if spec.shape is None or not all(isinstance(d, int) for d in spec.shape):
            raise ModelError(f"quantize.rknn: input '{spec.name}' has dynamic dims {spec.shape}; RKNN needs fixed "
                             f"sizes: add `inputs: {{{spec.name}: [...]}}` to the config (the deployment's size)")


def within_opset(model: onnx.ModelProto, samples: list[dict], threads: int = 2) -> tuple[onnx.ModelProto, dict]:
    """`model` at opset ≤ RKNN_MAX_OPSET → (model, record); a conversion is verified on `samples` with ONNX
    Runtime (the default verification tolerance) and refused in one line when it changes the outputs."""
    opset = default_opset(model)
    if opset <= RKNN_MAX_OPSET:
        return model, {}
    converted = convert_down(model, RKNN_MAX_OPSET)
    record = {"from": opset, "to": RKNN_MAX_OPSET, "verified_on": len(samples)}
    if samples:
        verdict = compare(run_model(model, samples, threads), run_model(converted, samples, threads), Tolerance())
        if not verdict.ok:
            raise ModelError(f"quantize.rknn: converting opset {opset} → {RKNN_MAX_OPSET} for rknn-toolkit2 changed "
                             f"the outputs ({verdict.reason}); export the model at opset {RKNN_MAX_OPSET}")
    return converted, record


def float16_safe(model: onnx.ModelProto, extremes: Extremes, samples: list[dict],
                 threads: int = 2) -> tuple[onnx.ModelProto, dict]:
    """`model` with its extreme constants (nonfinite.py) clipped and their NaN set to 0 → (model, record), when
    that leaves the float32 outputs on `samples` within the verification tolerance (exp(-10000) is 0 as
    exp(-inf) is; a NaN fill is selected only for inputs the model rejects); else the model as it was and the
    reason. The fill of an additive attention mask is clipped to the smallest bound its scores allow
    (nonfinite.mask_bound: ~60 on MiniLM, whose int8 attention then keeps its scores), and each attention's
    mask scaled down to its own bound where that is lower (nonfinite.own_fills), every other constant to
    ±MASK_BOUND: float16 cannot hold HF's `(1 - mask) * -1e9` (BENCHMARKS.md: "an attention mask's fill clipped to
    the bound its scores need"). NaN: jax2tf's `jnp.take` writes a NaN-filled [1,128,384] constant for out-of-range ids
    into a Where, and the toolkit's range of that Where input is NaN ("cannot convert float NaN to integer" in
    step1)."""
    mask = nonfinite.mask_bound(model, samples, threads) if samples else None
    reference: list = []  # the float32 outputs on `samples`, run once when something is to be verified
    clipped, record = _clipped_verified(model, extremes, mask, samples, reference, threads)
    constants = sorted(name for name, stats in extremes.tensors.items() if stats["kind"] == "constant")
    if record.get("clipped") is False and len(constants) > 1:
        # not all of them: those that change the outputs alone are left, the others clipped (a mask beside a
        # Clip(x, 1e-10, +inf) before a Log, whose ceiling at ±MASK_BOUND caps the log)
        alone = {name: _clipped_verified(model, Extremes(tensors={name: extremes.tensors[name]}), None, samples,
                                         reference, threads)[1] for name in constants}
        left = {name: record["reason"] for name, record in alone.items() if record.get("clipped") is False}
        if left and len(left) < len(constants):
            rest = Extremes(tensors={n: t for n, t in extremes.tensors.items() if n not in left})
            clipped, record = _clipped_verified(model, rest, mask, samples, reference, threads, left=set(left))
            if record.get("clipped"):
                record["left"] = left
    if record.get("clipped") is False:
        log.warning("rknn: clipping the constants float16 cannot hold changed the outputs (%s); left as they are",
                    record["reason"])
    return clipped, record


def _outputs(reference: list, model: onnx.ModelProto, samples: list[dict], threads: int) -> list:
    """`model`'s outputs on `samples`, computed into `reference` on first use."""
    if not reference:
        reference.extend(run_model(model, samples, threads))
    return reference


def _clipped_verified(model: onnx.ModelProto, extremes: Extremes, mask, samples: list[dict], reference: list,
                      threads: int, left: set[str] = frozenset()) -> tuple[onnx.ModelProto, dict]:
    """float16_safe's tries with the constants of `extremes` (a mask's constants among `left` are not
    clipped): each attention's own fill, one fill for all, ±MASK_BOUND, the first whose outputs stay → (model,
    record); the model as it was and the last reason when none does."""
    # each attention's own fill first (nonfinite.own_fills), then one fill for all, then ±MASK_BOUND
    tries = ([(mask, True)] if mask and mask.own else []) + ([(mask, False)] if mask else []) + [(None, False)]
    record = {}
    for tried, own in tries:
        bounds = {name: tried.bound for name in tried.constants if name not in left} if tried else {}
        clipped, changed = nonfinite.clip_constants(model, extremes, MASK_BOUND, nan=0.0, bounds=bounds)
        if not changed:
            return model, {}
        clipped, fills = nonfinite.own_fills(clipped, tried) if own and bounds else (clipped, {})
        record = {"bound": MASK_BOUND, "constants": changed, "verified_on": len(samples),
                  **({"mask_bound": {**tried.record(), **({"own_fills": fills} if fills else {})}} if tried else {})}
        if not samples:
            return clipped, {**record, "clipped": True}
        verdict = compare(_outputs(reference, model, samples, threads), run_model(clipped, samples, threads),
                          Tolerance())
        if verdict.ok:
            return clipped, {**record, "clipped": True}
        record = {**record, "clipped": False, "reason": verdict.reason}
        if tried:
            log.info("rknn: the attention masks' fill at ±%.4g%s changed the outputs (%s); trying %s instead",
                     tried.bound, " (each attention's own below it)" if own else "", verdict.reason,
                     "one fill for all" if own else f"±{MASK_BOUND:g}")
    return model, record


def without_float16_overflow(model: onnx.ModelProto, float_set: set[str], extremes: Extremes, samples: list[dict],
                             threads: int = 2) -> tuple[set[str], dict]:
    """`float_set` without the nodes that compute or read a finite activation beyond float16's range on `samples`
    (in `model` as the toolkit gets it, masks clipped) → (float set, {node: why}). float16 turns such values into
    inf, int8 holds them on a coarse grid, which costs less (BENCHMARKS.md: "activations beyond float16 stay
    int8"). ±inf and NaN
    (masks) stay float16, which holds them. Nodes the quantize stage made float only for their values
    (`extremes.added`) go back to int8 when the clipped model's values there stay within ±FILL: a mask clipped
    to ±60 is two int8 levels, and a float16 layer is one of the few a deployment can afford; at -10000 (a mask
    that is no Add before a Softmax: flax's softmax by hand, Max/Sub/Exp) they stay float16 (cosine 0.40 int8).
    One run of the clipped model, only when nonfinite.py found something."""
    if not extremes.tensors or not float_set:
        return float_set, {}
    found = nonfinite.find(model, samples, threads, limit=nonfinite.FILL)  # float16's limit is checked below
    dropped: dict[str, str] = {}
    for name, stats in found.tensors.items():
        if stats["kind"] != "activation" or stats["nan"] or not np.isfinite([stats["min"], stats["max"]]).all():
            continue
        if not nonfinite.extreme(stats["min"], stats["max"]):  # within float16: beyond ±FILL only
            continue
        values = nonfinite.describe(stats)
        for node in model.graph.node:
            if node.name in float_set and node.name not in dropped and (name in node.output or name in node.input):
                dropped[node.name] = f"{'computes' if name in node.output else 'reads'} '{name}' with values {values}"
    if dropped:
        log.warning("rknn: %d float-set nodes stay int8: their values overflow float16 (%s)", len(dropped),
                    ", ".join(list(dropped)[:5]))
    added = (extremes.added & float_set) - set(dropped)
    finite = sorted(added - set(found.nodes))  # within ±FILL: -10000 (flax's softmax by hand) still spreads int8
    for node in finite:
        dropped[node] = f"int8: its values are within ±{nonfinite.FILL:g} once the constants are clipped"
    if finite:
        log.info("rknn: %d nodes kept float for their values are int8 again, the constants clipped: %s", len(finite),
                 ", ".join(finite[:5]))
    return float_set - set(dropped), dropped
