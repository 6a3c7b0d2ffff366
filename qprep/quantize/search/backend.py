"""What the search asks of a backend (`SearchBackend`) and what it may make float (`Candidates`)."""

from __future__ import annotations

from dataclasses import dataclass, field


class SearchBackend:
    """What the search asks a backend. `evaluate` is required; it times each build it makes in the search's
    budget (`Budget.record`, kind "trial" on all evaluation samples, "rank" on fewer), for the predictions. A
    backend whose builds take minutes ranks the candidates from its own per-layer analysis (`ranks_itself` and
    `rank`) instead of one trial per candidate; one that can build faster, approximately, says so in `faster`."""

    ranks_itself = False

    def evaluate(self, float_nodes: set[str], samples: list[dict]) -> dict:
        """Per-output metrics of the build with `float_nodes` float, on `samples` (a prefix of the evaluation
        samples, so their number names them)."""
        raise NotImplementedError

    def evaluate_candidate(self, start: set[str], float_nodes: set[str], samples: list[dict]) -> dict:
        """A ranking or promotion trial: `float_nodes` is `start` (the float set the round ranked on) with
        candidates added. A backend may derive its model from start's build instead of building (ORT:
        derived_builds.py); by default it builds."""
        return self.evaluate(float_nodes, samples)

    def rank(self, chosen: tuple[str, ...]) -> list[dict]:
        """[{node, gain}] for the candidates not in `chosen`, most harmful first (when `ranks_itself`)."""
        raise NotImplementedError

    def count(self, float_nodes: set[str]) -> int:
        """What `max_float_nodes` counts of a float set: its nodes (RKNN: the float16 layers they make)."""
        return len(float_nodes)

    def faster(self, float_nodes: set[str]) -> bool:
        """Asked once, when the next trial would end in the last FAST_SHARE of the budget: build the faster,
        approximate way from now on, starting from the build of `float_nodes` (the accepted set)? True if so."""
        return False


@dataclass
class Candidates:
    """What the search may make float. A name is a node, or stands for the nodes `groups` lists (ORT: an
    activation edge is float only when its producer and every consumer are). `cost`: each candidate's share of
    the model's compute; given, candidates are promoted by gain per cost, so the target is met with the
    cheapest float set: the most harmful edges can be the slowest in float (BENCHMARKS.md: "activation edges,
    promoted by gain per multiply-add"). `ops`: node → op type, for the record."""

    names: list[str]
    groups: dict[str, tuple[str, ...]] = field(default_factory=dict)
    cost: dict[str, float] | None = None
    ops: dict[str, str] = field(default_factory=dict)
    group_kind: str = "edge"  # what a group is, for the record (RKNN: a LayerNorm chain)
    first: tuple[str, ...] = ()  # promoted before the ranked ones in round 1, if they help at all (RKNN: outputs)

    def nodes(self, names, base_float: set[str]) -> set[str]:
        return {n for c in names for n in self.groups.get(c, (c,))} - base_float

    def describe(self, name: str) -> str:
        if name in self.groups:
            return " + ".join(self.ops.get(n, "?") for n in self.groups[name]) + f" ({self.group_kind})"
        return self.ops.get(name, name)
