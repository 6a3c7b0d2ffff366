"""The fallback's config section (`quantize.fallback`)."""

from __future__ import annotations

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
