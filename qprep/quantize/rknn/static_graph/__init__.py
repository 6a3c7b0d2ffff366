"""Constructs rknn-toolkit2 cannot compile, rewritten into ones it compiles before it loads the model: exact in
math, verified with ONNX Runtime on calibration samples; what cannot be rewritten is refused in one line.

One module per construct, each with the facts about the toolkit it rests on (rknn-toolkit2 2.5.0, measured on
tiny graphs and on the zoo models named there):
    loops.py        Loop → its body once per iteration (one whose stop depends on the input is refused)
    branches.py     If → both branches and a selection (branches of different output shapes are refused)
    sequences.py    a list appended to, then concatenated → Concat (other sequence ops are refused)
    batchnorm.py    BatchNormalization over run-time statistics → arithmetic
    einsum.py       an Einsum that is one batched matmul → Transposes and a MatMul
    in_place.py     fixes that leave the node in place: an omitted optional output named, a recurrent op's
                    default `layout` dropped
    hygiene.py      graph hygiene the toolkit assumes (RULES, growing by class): unread graph inputs removed,
                    empty optional inputs dropped or given their defaults, zero peepholes dropped, a GRU's last
                    state read from its sequence; LSTM peepholes refused
    edit.py         what the rewrites share: a node found again after each rewrite, replaced in place, a
                    subgraph inlined, value shapes
This module runs them (`rewritten`), verifies the result (`static_graph`) and carries the float set over to the
replacement nodes (`carried`).
"""

from __future__ import annotations

import onnx

from qprep.errors import ModelError
from qprep.graph.verify import Tolerance, compare
from qprep.model.info import constant_names
from qprep.model.io import inferred_shapes
from qprep.model.runtime import run_model
from qprep.quantize.rknn.static_graph import hygiene, loops
from qprep.quantize.rknn.static_graph.batchnorm import batchnorms_as_arithmetic, is_runtime_batchnorm
from qprep.quantize.rknn.static_graph.branches import branch_outputs, ifs_as_both_branches, is_if
from qprep.quantize.rknn.static_graph.einsum import einsums_as_matmul, matmul_plan
from qprep.quantize.rknn.static_graph.in_place import default_layout, default_layouts_dropped, omitted_outputs_named
from qprep.quantize.rknn.static_graph.loops import is_loop, loops_unrolled, refuse_data_dependent_stop
from qprep.quantize.rknn.static_graph.sequences import refuse_sequences, sequences_as_concat


def refuse_unrewritable(model: onnx.ModelProto) -> None:
    """ModelError for a Loop whose stop depends on the input, or an If whose branches give outputs of different
    shapes, or an LSTM with peepholes: checked on the input model, before any work (BatchNormalization is judged
    at quantize time: on the input model its statistics may still be computed from constants that optimize
    folds)."""
    hygiene.refuse(model)
    for node in model.graph.node:
        if is_loop(node):
            refuse_data_dependent_stop(model, node)
        if node.op_type == "Scan" and node.domain in ("", "ai.onnx"):
            raise ModelError(f"quantize.rknn: node '{node.name}' is a Scan, and rknn-toolkit2 compiles static graphs "
                             "only; export the model with the recurrence unrolled (or as an LSTM/GRU op), or use "
                             "backend ort")
    ifs = [i for i, node in enumerate(model.graph.node) if is_if(node)]
    if ifs:
        inferred = inferred_shapes(model, shapes_only=True)
        for index in ifs:
            branches = {a.name: a.g for a in inferred.graph.node[index].attribute}
            branch_outputs(model.graph.node[index], branches["then_branch"], branches["else_branch"])


def rewritten(model: onnx.ModelProto, samples: list[dict] = ()) -> tuple[onnx.ModelProto, dict]:
    """A copy of `model` with its Loops unrolled, its If nodes and run-time BatchNormalization statistics
    rewritten and its omitted optional outputs named → (model, record {rewrite: [node names]}), unverified;
    ModelError for what cannot be. `samples`: a Loop whose stop is computed in its body runs once on the first
    to count its iterations."""
    constants = constant_names(model.graph)
    if not any(is_loop(n) or "Sequence" in n.op_type or is_if(n) or is_runtime_batchnorm(n, constants)
               or "" in n.output or default_layout(n) or matmul_plan(n) for n in model.graph.node) \
            and not hygiene.needed(model):
        return model, {}  # the common case, without copying the model
    result = onnx.ModelProto()
    result.CopyFrom(model)
    record = {"loops_unrolled": [], "sequence_as_concat": [], "if_as_both_branches": []}
    before = len(result.graph.node)
    while True:  # an inlined branch may hold a Loop, an unrolled body an If: until neither is left
        rounds = {"loops_unrolled": loops_unrolled(result, samples[:1]),
                  "sequence_as_concat": sequences_as_concat(result),
                  "if_as_both_branches": ifs_as_both_branches(result)}
        if not any(rounds.values()):
            break
        limit = loops.MAX_UNROLLED_NODES
        if len(result.graph.node) - before > limit:  # nested Loops multiply: bound them all
            raise ModelError(f"quantize.rknn: unrolling the Loops {', '.join(rounds['loops_unrolled'][:3])} "
                             f"(nested) made {len(result.graph.node) - before} more nodes (at most "
                             f"{limit}); export the model with fixed, shorter lengths, or use backend ort")
        for key, nodes in rounds.items():
            record[key] += nodes
    refuse_unrewritable(result)  # a Scan an inlined branch brought into the main graph
    record["batchnorm_as_arithmetic"] = batchnorms_as_arithmetic(result)
    for key, rule in hygiene.RULES:  # before naming omitted outputs: the last state's rule leaves one out
        record[key] = rule(result)
    record.update({"omitted_outputs_named": omitted_outputs_named(result),
                   "default_layout_dropped": default_layouts_dropped(result),
                   "einsum_as_matmul": einsums_as_matmul(result)})
    refuse_sequences(result)
    return result, {name: nodes for name, nodes in record.items() if nodes}


def static_graph(model: onnx.ModelProto, samples: list[dict], threads: int = 2) -> tuple[onnx.ModelProto, dict]:
    """`rewritten(model)`, verified on `samples` with ONNX Runtime: refused in one line when the outputs change."""
    result, record = rewritten(model, samples)
    if not record:
        return model, {}
    if samples:
        verdict = compare(run_model(model, samples, threads), run_model(result, samples, threads), Tolerance())
        if not verdict.ok:
            raise ModelError(f"quantize.rknn: rewriting {', '.join(record)} for rknn-toolkit2 changed the outputs "
                             f"({verdict.reason}); export the model without them")
    record["verified_on"] = len(samples)
    return result, record


# rewrites that replace a node (a named omitted output or a dropped default layout leaves the node itself)
REPLACED = ("loops_unrolled", "sequence_as_concat", "if_as_both_branches", "batchnorm_as_arithmetic",
            "einsum_as_matmul")


def carried(float_set: set[str], model: onnx.ModelProto, record: dict) -> set[str]:
    """`float_set` in the rewritten `model`: a rewritten node's replacement nodes (named under `<node>/`) stay
    float where it was (keep_float puts a LayerNorm's BatchNormalization there: magika)."""
    replaced = {name for key in REPLACED for name in record.get(key, ())} & float_set
    if not replaced:
        return float_set
    prefixes = tuple(f"{name}/" for name in replaced)
    return (float_set - replaced) | {n.name for n in model.graph.node if n.name.startswith(prefixes)}

