"""A ranking trial's model derived from the build it adds a candidate to (quantize/ort/derived_builds.py) must be
the model ONNX Runtime's quantizer writes for that float set: compared output for output, as the search runs it."""

import numpy as np
import onnx
from onnx import helper, numpy_helper

from conftest import typed
from graphs import make_model
from qprep.model.prepare import name_nodes
from qprep.model.runtime import run_model
from qprep.quantize import search
from qprep.quantize.ort.derived_builds import Derivation
from qprep.quantize.ort.quantizer import OrtQuantizer, OrtSettings
from qprep.quantize.ort.search import edges


def _branchy_quantizer(tmp_path):
    """x → Conv → Clip (removed by ORT's quantizer: its Q/DQ clips) → Conv → Relu (removed) → Add (with the
    Clip's output) → Conv → y (a graph output ORT rounds). 8 samples."""
    rng = np.random.default_rng(3)
    weight = lambda: rng.standard_normal((4, 4, 3, 3)).astype(np.float32) * 0.4  # noqa: E731
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Clip", ["c1", "low", "high"], ["k1"]),
             helper.make_node("Conv", ["k1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c2"], ["r2"]),
             helper.make_node("Add", ["r2", "k1"], ["a"]),
             helper.make_node("Conv", ["a", "w3"], ["y"], pads=[1, 1, 1, 1])]
    model = make_model(nodes, [("x", [1, 4, 8, 8])], [("y", [1, 4, 8, 8])],
                       {"w1": weight(), "w2": weight(), "w3": weight(),
                        "b1": rng.standard_normal(4).astype(np.float32),
                        "b2": rng.standard_normal(4).astype(np.float32),
                        "low": np.float32(0), "high": np.float32(6)})
    name_nodes(model.graph)
    samples = [{"x": rng.standard_normal((1, 4, 8, 8)).astype(np.float32) * 2} for _ in range(8)]
    return _quantizer(model, samples, tmp_path), samples

def _quantizer(model, samples, tmp_path) -> OrtQuantizer:

    options = typed("ort", bias_correction=False)  # GPTQ as by default
    return OrtQuantizer(model, samples, options, tmp_path, many_builds=True)


def _from_the_base(quantizer):
    """(node names, the all-quantized build, a Derivation from it that builds where it must) at minmax ranges."""
    settings = OrtSettings("minmax", bias_correction=False)
    reference = quantizer.build(set(), settings, simplify=False)
    derivation = Derivation(quantizer.model, reference, lambda removed: quantizer.build(removed, settings,
                                                                                       simplify=False))
    return [n.name for n in quantizer.model.graph.node], reference, derivation


def test_each_edge_made_float_by_edits_gives_the_outputs_of_its_build(tmp_path):
    quantizer, samples = _branchy_quantizer(tmp_path)
    settings = OrtSettings("minmax", bias_correction=False)
    names = [n.name for n in quantizer.model.graph.node]
    for start in (set(), {names[2]}):  # from the all-quantized build, and from one with the middle Conv float
        reference = quantizer.build(start, settings, simplify=False)
        derivation = Derivation(quantizer.model, reference,
                                lambda removed: quantizer.build(start | removed, settings, simplify=False))
        assert derivation.removed, "ORT's quantizer should have removed the Clip/Relu (the case put back)"
        candidates = [set(members) - start for members in edges(quantizer.model, names).values()]
        candidates += [{name} for name in names if name not in start]
        for nodes in candidates:
            derived = derivation.derive(nodes)
            assert derived is not None, nodes
            built = quantizer.build(start | nodes, settings, simplify=False)
            for a, b in zip(run_model(built, samples, optimize=True), run_model(derived, samples, optimize=True)):
                assert np.array_equal(a["y"], b["y"]), (start, nodes)


def test_an_op_type_left_float_builds_what_its_nodes_made_float_build(tmp_path):
    """The op-type phase ranks a type as its nodes made float (derived from the base's build) and keeps it as
    the op-type setting: both must make the same model, for each op type and for all at once."""
    quantizer, samples = _branchy_quantizer(tmp_path)
    by_type: dict = {}
    for node in quantizer.model.graph.node:
        by_type.setdefault(node.op_type, set()).add(node.name)
    groups = [{t} for t in by_type] + [{"Clip", "Relu", "Add"}]
    for types in groups:
        as_type = quantizer.build(set(), OrtSettings("minmax", bias_correction=False, float_op_types=frozenset(types)),
                                  simplify=False)
        as_nodes = quantizer.build(set().union(*(by_type[t] for t in types)),
                                   OrtSettings("minmax", bias_correction=False), simplify=False)
        for a, b in zip(run_model(as_type, samples, optimize=True), run_model(as_nodes, samples, optimize=True)):
            assert np.array_equal(a["y"], b["y"]), types


def test_a_node_the_reference_does_not_have_is_not_derived(tmp_path):
    quantizer, _ = _branchy_quantizer(tmp_path)
    settings = OrtSettings("minmax", bias_correction=False)
    derivation = Derivation(quantizer.model, quantizer.build(set(), settings, simplify=False), lambda removed: None)
    assert derivation.derive({"no such node"}) is None


def test_ranking_and_promotion_trials_ask_for_candidates_on_top_of_the_set_the_round_ranked_on():
    """The search's ranking trials, and its promotions, go through evaluate_candidate with the float set the
    round ranked on as start (so one build per round serves them all); a promotion adds to what was promoted."""
    calls = []

    class Backend(search.SearchBackend):
        def evaluate(self, float_nodes, samples):
            return {"y": {"cosine_mean": 0.9 + 0.01 * len(float_nodes), "score": 0.9 + 0.01 * len(float_nodes)}}

        def evaluate_candidate(self, start, float_nodes, samples):
            calls.append((frozenset(start), frozenset(float_nodes), len(samples)))
            return self.evaluate(float_nodes, samples)

    samples = [{"x": np.zeros(1)} for _ in range(4)]
    options = {"target": {"cosine_mean": 0.935}, "time_budget_s": 60.0, "rank_samples": 2, "accept_share": 0.0,
               "max_candidates": 8, "block": 1, "max_float_nodes": 4}
    outcome = search.Search(Backend(), search.Candidates(["a", "b", "c"]), {"fixed"}, samples,
                            search.node_search(typed("fallback", **options))).run()
    assert outcome.passed and len(outcome.float_nodes) == 4  # fixed + 3: the last promotion meets 0.935
    ranking = [(start, nodes) for start, nodes, n in calls if n == 2]
    promotions = [(start, nodes) for start, nodes, n in calls if n == 4]
    assert ranking and all(start < nodes and len(nodes - start) == 1 and "fixed" in start for start, nodes in ranking)
    assert [len(nodes - start) for start, nodes in promotions] == [1, 2, 3]
    assert all(start == {"fixed"} for start, _ in promotions)


def test_a_candidate_that_decides_a_following_op_or_a_shared_weight_anew_is_built_or_derived_alike(tmp_path):
    """x → Conv(w) → {Conv(w) (the same weight), MaxPool} → Add → Conv → y. A MaxPool is quantized only while
    its input is; with both Convs float nothing else rounds the first Conv's output, and the build leaves the
    MaxPool float. The shared weight: ORT names and scales its copies in build order. Either is built (None)
    or derived to the same outputs."""
    rng = np.random.default_rng(4)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["c1", "w"], ["c2"], pads=[1, 1, 1, 1]),
             helper.make_node("MaxPool", ["c1"], ["m"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["c2", "m"], ["a"]),
             helper.make_node("Conv", ["a", "w3"], ["y"], pads=[1, 1, 1, 1])]
    model = make_model(nodes, [("x", [1, 4, 8, 8])], [("y", [1, 4, 8, 8])],
                       {"w": rng.standard_normal((4, 4, 3, 3)).astype(np.float32) * 0.4,
                        "w3": rng.standard_normal((4, 4, 3, 3)).astype(np.float32) * 0.4})
    name_nodes(model.graph)
    samples = [{"x": rng.standard_normal((1, 4, 8, 8)).astype(np.float32)} for _ in range(4)]
    quantizer = _quantizer(model, samples, tmp_path)
    names, reference, derivation = _from_the_base(quantizer)
    assert derivation.derive({"Conv_0", "Conv_1"}) is None  # the MaxPool's (and the weight's) fate changes
    for nodes in [set(m) for m in edges(quantizer.model, names).values()] + [{name} for name in names]:
        derived = derivation.derive(nodes)
        if derived is None:
            continue
        built = quantizer.build(nodes, OrtSettings("minmax", bias_correction=False), simplify=False)
        for a, b in zip(run_model(built, samples, optimize=True), run_model(derived, samples, optimize=True)):
            assert np.array_equal(a["y"], b["y"]), nodes


def test_a_derived_model_run_from_the_tensors_of_the_one_before_gives_its_whole_run_s_outputs(tmp_path, monkeypatch):
    """derived_runs.py: each edge made float, run only from its first edit on with the reference's QuantizeLinear
    outputs, gives what the whole derived model gives, to the bit, and so does each of a chain of promotions run
    from the one before; the last Conv's edge runs only a part."""
    from qprep.quantize.ort import derived_runs
    from qprep.quantize.ort.derived_runs import DerivedRuns

    quantizer, samples = _branchy_quantizer(tmp_path)
    names, reference, derivation = _from_the_base(quantizer)
    runs, partial, run_sizes = DerivedRuns(threads=1), 0, []
    ran = derived_runs.run_model
    monkeypatch.setattr(derived_runs, "run_model", lambda model, *a, **k: run_sizes.append(
        len(model.graph.node)) or ran(model, *a, **k))
    for members in edges(quantizer.model, names).values():
        derived = derivation.derive(set(members))
        run_sizes.clear()
        whole = run_model(derived, samples, 1, optimize=True)
        for a, b in zip(whole, runs.run("reference", reference, derived, samples)):
            assert np.array_equal(a["y"], b["y"]), members
        partial += any(size < len(derived.graph.node) for size in run_sizes)  # a part of it ran
    assert partial and runs.trusted
    promoted, sizes = set(), {}
    monkeypatch.setattr(derived_runs, "run_model", lambda model, *a, **k: sizes[name].append(
        len(model.graph.node)) or ran(model, *a, **k))
    for name in names:  # promotions down the graph: each one's edit after the one before's
        promoted.add(name)
        derived = derivation.derive(set(promoted))
        sizes[name] = []
        got = runs.run("reference", reference, derived, samples, from_last=True)
        for a, b in zip(run_model(derived, samples, 1, optimize=True), got):
            assert np.array_equal(a["y"], b["y"]), promoted
    assert runs.trusted
    # Conv_1 runs from k1's QuantizeLinear output, held from the first promotion's run; Relu_0 (put back with
    # Conv_1 float already) gives the same model: only y's DequantizeLinear runs, from what Conv_1's part exposed
    assert len(sizes["Conv_1"]) == 1 and sizes["Conv_1"][0] < 15 and sizes["Relu_0"] == [1]


def test_derived_runs_whose_held_tensors_do_not_match_run_whole_from_then_on(tmp_path):
    """The first partial run of a reference is checked against the whole run: tensors held from another build
    (as if ORT's fusions differed across the cut) are caught, and every later run is whole."""
    from qprep.quantize.ort.derived_runs import DerivedRuns

    quantizer, samples = _branchy_quantizer(tmp_path)
    settings = OrtSettings("minmax", bias_correction=False)
    names = [n.name for n in quantizer.model.graph.node]
    reference = quantizer.build(set(), settings, simplify=False)
    other = onnx.ModelProto()  # the same nodes, every activation rounded on a twice coarser grid
    other.CopyFrom(reference)
    for node in other.graph.node:
        if node.op_type == "QuantizeLinear":
            scale = next(t for t in other.graph.initializer if t.name == node.input[1])
            scale.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(scale) * np.float32(2), scale.name))
    derived = Derivation(quantizer.model, reference, lambda removed: None).derive({names[-1]})
    runs = DerivedRuns(threads=1)
    got = runs.run("reference", other, derived, samples)
    assert not runs.trusted
    for a, b in zip(run_model(derived, samples, 1, optimize=True), got):
        assert np.array_equal(a["y"], b["y"])


def test_derived_runs_with_a_second_input_read_late_and_samples_of_different_sizes(tmp_path, monkeypatch):
    """x[1,4,H,W] → Conv → Relu → Mul(gain[1,4,1,1], a second graph input read only after it) → Conv → y, with
    samples of two image sizes: a part that starts after the Relu reads the held tensor of each sample's own size
    and `gain` from the sample; every partial run equals the whole one."""
    from qprep.quantize.ort import derived_runs
    from qprep.quantize.ort.derived_runs import DerivedRuns

    rng = np.random.default_rng(5)
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Mul", ["r1", "gain"], ["m"]),
             helper.make_node("Conv", ["m", "w2"], ["y"], pads=[1, 1, 1, 1])]
    model = make_model(nodes, [("x", [1, 4, "H", "W"]), ("gain", [1, 4, 1, 1])], [("y", [1, 4, "H", "W"])],
                       {"w1": rng.standard_normal((4, 4, 3, 3)).astype(np.float32) * 0.4,
                        "w2": rng.standard_normal((4, 4, 3, 3)).astype(np.float32) * 0.4})
    name_nodes(model.graph)
    samples = [{"x": rng.standard_normal((1, 4, size, size)).astype(np.float32),
                "gain": rng.uniform(0.5, 2, (1, 4, 1, 1)).astype(np.float32)} for size in (8, 12, 8, 12)]
    quantizer = _quantizer(model, samples, tmp_path)
    names, reference, derivation = _from_the_base(quantizer)
    runs, tried, sizes = DerivedRuns(threads=2), 0, []
    ran = derived_runs.run_model
    monkeypatch.setattr(derived_runs, "run_model", lambda model, *a, **k: sizes.append(len(model.graph.node)) or ran(
        model, *a, **k))
    for nodes in [set(m) for m in edges(quantizer.model, names).values()] + [{name} for name in names]:
        derived = derivation.derive(nodes)
        if derived is None:
            continue
        tried += 1
        for from_last in (False, True):
            got = runs.run("reference", reference, derived, samples, from_last=from_last)
            for a, b in zip(run_model(derived, samples, optimize=True), got):
                assert a["y"].shape == b["y"].shape and np.array_equal(a["y"], b["y"]), (nodes, from_last)
    assert tried >= 3 and runs.trusted
    assert min(sizes) < len(reference.graph.node) // 2  # parts did run (the last Conv's edge: it and what follows)
