"""The fallback's config section (`quantize.fallback`), and what the node search reads of it (`NodeSearch`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qprep.schema import Key, section

SEARCHED_NODES = 32  # the node search's cap when max_float_nodes is not configured

OPTIONS = section(
    "accuracy-driven fallback: nodes kept float, most harmful first, until `target` holds",
    nullable=True,
    target=Key("mapping", item=Key("float"), required=True,
               doc="metric → threshold in the evaluation gate's form, e.g. {cosine_mean: 0.99, top1_agreement: 0.97}"),
    max_float_nodes=Key("int", minimum=1,
                        doc="at most this many nodes made float by the fallback, the spread set's included (rknn: "
                            "float16 layers of the RKNN model, which fuses e.g. a MatMul and its bias Add into one); "
                            f"unset: {SEARCHED_NODES} nodes searched one by one, beside the spread set, which its own "
                            "thresholds bound (channel_spread.py)"),
    time_budget_s=Key("float", default=600.0, minimum=1,
                      doc="the fallback ends within this many seconds (best model kept): a step that would not "
                          "finish in time, predicted from the steps measured so far, is not started"),
    rank_samples=Key("int", default=32, minimum=1,
                     doc="evaluation samples used to rank nodes (all those the search chooses on judge promotions)"),
    accept_share=Key("float", default=0.25, minimum=0,
                     doc="share of the evaluation samples (at most 0.5) kept apart from every choice of the search: "
                         "a float set that meets the target on the others is accepted only if it meets it on these "
                         "too (an agreement within its 95% interval of the threshold counts); 0: choose and accept "
                         "on the same samples"),
    max_candidates=Key("int", default=96, minimum=1,
                       doc="rank at most this many nodes by trials (those whose outputs lose the most accuracy first)"),
    block=Key("int", default=1, minimum=1, doc="nodes promoted per trial (RKNN: one build takes minutes)"),
)


@dataclass(frozen=True)
class NodeSearch:
    """What the node search reads, decided once before it starts: `quantize.fallback`'s settings (target, time
    budget, ranking) and the float-node cap left for it after the spread phase, with what that phase took (for
    the stop reason, which names the cap as the user wrote it)."""

    fallback: Any  # quantize.fallback as schema.settings
    max_float_nodes: int  # what this search may make float
    spread_nodes: int = 0  # nodes the spread phase took out of int8 before it
    spread_counted: bool = True  # False: max_float_nodes is unset, and the spread set sits beside SEARCHED_NODES


def node_search(fallback: Any, spread: dict | None = None) -> NodeSearch:
    """The node search's settings after the spread phase (`spread`, its record): max_float_nodes less the nodes
    the spread set took out of int8; max_float_nodes unset: SEARCHED_NODES beside them (a user who sets a cap
    caps everything; one who does not gets a search that may keep a recognizer's whole spread set out of int8,
    which a cap of 32 would refuse and miss the target)."""
    taken = (spread or {}).get("nodes", 0)
    if fallback.max_float_nodes is None:
        return NodeSearch(fallback, SEARCHED_NODES, taken, spread_counted=False)
    return NodeSearch(fallback, max(fallback.max_float_nodes - taken, 0), taken)
