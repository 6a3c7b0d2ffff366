"""The accuracy-driven fallback: the search on a scripted backend, then end to end with ORT on a tiny graph
whose one outlier channel ruins a static activation range."""

import re
import time

import numpy as np
import pytest
from onnx import helper

from qprep.quantize import search
from qprep.quantize.search import rounds
from qprep.quantize.budget import Budget
from qprep.errors import ConfigError
from conftest import run_config, typed
from graphs import make_model, outlier_model

OPTIONS = {"target": {"cosine_mean": 0.99}, "max_float_nodes": 8, "time_budget_s": 60, "rank_samples": 2,
           "max_candidates": 10, "block": 1}


def _scripted(damage: dict[str, float], interaction: dict[frozenset, float] | None = None):
    """A backend whose error is the sum of the damage of the nodes not kept float (plus pair interactions)."""
    builds = []

    def evaluate(float_nodes, samples):
        builds.append(set(float_nodes))
        error = sum(d for n, d in damage.items() if n not in float_nodes)
        error += sum(v for pair, v in (interaction or {}).items() if pair <= float_nodes)
        return {"y": {"cosine_mean": 1.0 - error}}

    return evaluate, builds


class Scripted(search.SearchBackend):
    """A backend whose build is a function; optionally its own ranking (as RKNN) and a faster mode."""

    def __init__(self, evaluate, rank=None, faster=None):
        self.build, self.ranking, self.switch = evaluate, rank, faster
        self.ranks_itself = rank is not None

    def evaluate(self, float_nodes, samples):
        return self.build(float_nodes, samples)

    def rank(self, chosen):
        return self.ranking(chosen)

    def faster(self, float_nodes):
        return self.switch(float_nodes) if self.switch else False


def limits(options: dict) -> search.NodeSearch:
    """`options` (quantize.fallback's keys) as the node search reads them, with no spread phase before it."""
    return search.node_search(typed("fallback", **options))


def run_search(evaluate, names, base_float, samples, options, rank=None, faster=None, cost=None):
    """The search over `names`; `options`: a dict of quantize.fallback's keys, or the NodeSearch of a spread phase."""
    settings = options if isinstance(options, search.NodeSearch) else limits(options)
    return search.Search(Scripted(evaluate, rank, faster), search.Candidates(names, cost=cost), base_float, samples,
                         settings).run()


def test_search_promotes_the_most_harmful_nodes_until_the_target_holds():
    evaluate, _ = _scripted({"a": 0.001, "b": 0.02, "c": 0.004, "d": 0.0})
    outcome = run_search(evaluate, ["a", "b", "c", "d"], set(), [{}] * 4,
                              {**OPTIONS, "target": {"cosine_mean": 0.998}})
    assert outcome.passed and outcome.float_nodes == ["b", "c"]  # 1 - 0.001 ≥ 0.998 after b and c
    assert [r["node"] for r in outcome.record["ranking"]][:3] == ["b", "c", "a"]
    assert outcome.record["stopped"] == "target met"
    assert [t["added"] for t in outcome.record["trials"] if t["phase"] == "promote"] == [["b"], ["c"]]
    assert {n["node"]: n["gain"] for n in outcome.record["float_nodes"]} == pytest.approx({"b": 0.02, "c": 0.004})


def test_round_one_stops_ranking_once_the_gains_found_cover_twice_what_the_target_needs():
    """12 candidates in order of their local error: after 8 trials the gains found (0.014) are twice what the
    target lacks (0.0065), so the other 4 are not built; the two worst are promoted and meet the target."""
    damage = {"n0": 0.006, "n1": 0.005, **{f"n{i}": 0.0005 for i in range(2, 12)}}
    evaluate, _ = _scripted(damage)
    outcome = run_search(evaluate, list(damage), set(), [{}] * 4,
                         {**OPTIONS, "target": {"cosine_mean": 0.9905}, "max_candidates": 12})
    assert outcome.passed and outcome.float_nodes == ["n0", "n1"]
    assert outcome.record["rank_trials"] == 8 + 1  # the round's base and 8 candidates, not 12


def test_search_drops_a_node_that_hurts_in_company_and_keeps_the_best_when_the_target_is_missed():
    damage = {"a": 0.01, "b": 0.01, "c": 0.05}
    evaluate, _ = _scripted(damage, {frozenset({"a", "c"}): 0.02})  # a helps alone, hurts next to c
    outcome = run_search(evaluate, ["a", "b", "c"], {"kept"}, [{}] * 4,
                              {**OPTIONS, "target": {"cosine_mean": 0.9999}})
    assert not outcome.passed
    assert set(outcome.float_nodes) == {"kept", "b", "c"}  # a rejected: it made the outputs worse
    assert outcome.record["best"]["score"] == pytest.approx(0.99)
    assert "target not met" in outcome.record["why"]


def test_search_respects_max_float_nodes_and_blocks():
    evaluate, builds = _scripted({f"n{i}": 0.01 * (i + 1) for i in range(6)})
    outcome = run_search(evaluate, [f"n{i}" for i in range(6)], set(), [{}] * 4,
                              {**OPTIONS, "target": {"cosine_mean": 1.0}, "max_float_nodes": 4, "block": 2})
    assert len(outcome.float_nodes) == 4 and outcome.record["stopped"] == "max_float_nodes (4) reached"
    promoted = [b for b in builds[8:]]  # after base, the rank base and 6 rank trials
    assert all(len(b) % 2 == 0 for b in promoted)


def test_the_cap_reached_is_named_as_configured_when_a_spread_set_took_part_of_it():
    """After a spread set of 2 nodes under max_float_nodes 6 the search gets 4 (search.node_search);
    its stop reason gives the configured 6 and the spread set's share, not the 4 the user never wrote."""
    evaluate, _ = _scripted({f"n{i}": 0.01 * (i + 1) for i in range(6)})
    options = search.node_search(typed("fallback", **{**OPTIONS, "target": {"cosine_mean": 1.0}, "max_float_nodes": 6,
                                                      "block": 2}), {"nodes": 2})
    outcome = run_search(evaluate, [f"n{i}" for i in range(6)], set(), [{}] * 4, options)
    assert len(outcome.float_nodes) == 4
    assert outcome.record["stopped"] == "max_float_nodes (6) reached, 2 of them the spread set's"


def test_an_unset_cap_gives_the_search_its_32_nodes_beside_the_spread_set():
    """max_float_nodes not configured: the spread set (25 nodes, say) does not eat the node search's 32."""
    evaluate, _ = _scripted({f"n{i}": 0.001 * (i + 1) for i in range(40)})
    options = search.node_search(typed("fallback", **{**OPTIONS, "target": {"cosine_mean": 1.0}, "max_float_nodes": None,
                                                      "block": 8, "max_candidates": 40}), {"nodes": 25})
    assert options.max_float_nodes == search.SEARCHED_NODES == 32
    outcome = run_search(evaluate, [f"n{i}" for i in range(40)], set(), [{}] * 4, options)
    assert len(outcome.float_nodes) == 32
    assert outcome.record["stopped"] == "32 searched nodes reached (max_float_nodes unset), beside the spread set's 25"


@pytest.mark.parametrize("switches", [True, False])
def test_when_no_slow_trial_fits_the_budget_the_rest_build_the_faster_way(monkeypatch, switches):
    """RKNN mmse: builds take minutes until the backend reuses the accepted build's ranges (seconds)."""
    clock, slow, asked = [0.0], [True], []
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    damage = {f"n{i}": 0.01 for i in range(6)}
    scripted, _ = _scripted(damage)

    def evaluate(float_nodes, samples):
        clock[0] += 40.0 if slow[0] else 1.0
        return scripted(float_nodes, samples)

    def faster(float_nodes):
        asked.append(set(float_nodes))
        slow[0] = not switches
        return switches

    outcome = run_search(evaluate, list(damage), {"kept"}, [{}] * 4,
                              {**OPTIONS, "target": {"cosine_mean": 0.999}, "time_budget_s": 100},
                              rank=lambda chosen: [{"node": n, "gain": 0.01} for n in damage if n not in chosen],
                              faster=faster)
    assert asked == [{"kept", "n0"}]  # asked once, from the accepted set, when base + one trial left 20 s
    assert search.FAST_SHARE < 0.4  # so the next 40-s trial would end in it
    if switches:
        assert outcome.passed and outcome.record["faster_from_trial"] == 2 and len(outcome.float_nodes) == 7
    else:
        assert not outcome.passed and outcome.record["stopped"] == "time budget spent"
        assert "faster_from_trial" not in outcome.record and outcome.float_nodes == ["kept", "n0"]


def test_a_search_that_starts_too_late_for_one_slow_trial_builds_the_faster_way_from_the_start(monkeypatch):
    """RKNN EfficientNet-Lite0: mmse chosen after 190 of 300 s, one mmse build 169 s. The search asks for the
    faster builds before its first trial (not 'time budget spent' at once), forgets the slow builds' times, and
    promotes with 1-s trials."""
    clock = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    budget = Budget(300.0, started=0.0)
    budget.record("trial", 169.0)
    clock[0] = 190.0
    damage = {f"n{i}": 0.01 for i in range(3)}
    scripted, _ = _scripted(damage)
    asked = []

    def evaluate(float_nodes, samples):
        with budget.timed("trial"):
            clock[0] += 1.0
        return scripted(float_nodes, samples)

    def faster(float_nodes):
        asked.append(set(float_nodes))
        return True

    backend = Scripted(evaluate, lambda chosen: [{"node": n, "gain": 0.01} for n in damage if n not in chosen],
                       faster)
    options = {**OPTIONS, "target": {"cosine_mean": 0.989}, "time_budget_s": 300.0}
    outcome = search.Search(backend, search.Candidates(list(damage)), {"kept"}, [{}] * 4, limits(options),
                            budget=budget).run()
    assert asked == [{"kept"}]
    assert outcome.passed and outcome.record["faster_from_trial"] == 1 and len(outcome.float_nodes) == 3


@pytest.fixture
def outlier_config(tmp_path):
    import onnx

    onnx.save(outlier_model(), str(tmp_path / "m.onnx"))
    for split, count in (("calib", 16), ("eval", 32)):
        (tmp_path / split).mkdir()
        rng = np.random.default_rng(len(split))
        for i in range(count):
            np.save(tmp_path / split / f"{i}.npy", rng.standard_normal((1, 16)).astype(np.float32))
    config = {"model": "m.onnx", "calibration": {"source": "calib"}, "output_dir": "out",
              "evaluation": {"source": "eval", "latency": {"runs": 0}},
              "pipeline": [{"quantize": {"backend": "ort", "fallback": {"target": {"cosine_mean": 0.99}},
                                         # the node search itself: the spread phase would take this outlier first
                                         "ort": {"spread_tensors": "off"}}}]}
    return tmp_path, config


@pytest.mark.slow
def test_ort_fallback_finds_the_outlier_edge_and_meets_the_target(outlier_config):
    tmp_path, config = outlier_config
    done, report = run_config(tmp_path, config)
    record = report["stages"][-1]["fallback"]
    assert done.returncode == 0, done.stderr
    assert record["base"]["score"] < 0.99 and record["passed"]
    assert 1 <= len(record["float_nodes"]) <= 2
    assert report["evaluation"]["gate"]["passed"]  # the target is checked again on the final result
    assert report["evaluation"]["outputs"]["y"]["cosine_mean"] >= 0.99
    # the outlier tensor m is float only when its producer and its consumer are: one candidate, one round
    # (as single nodes, "outlier" helped only once "second" was float, found by re-ranking in round 2)
    assert record["rounds"] == 1
    assert record["samples"] == {"chosen_on": 24, "kept_apart": 8}  # a quarter kept apart to accept the choice
    assert record["best"]["unseen"]["passed"]
    assert record["best"]["unseen"]["standard_error"]["y"] > 0  # the margin the kept-apart cosine_mean had to spare
    assert re.search(r"Chosen on 24 evaluation samples, accepted on 8 others \(cosine_mean [0-9.]+, mean_sqnr_db [0-9.]+, with one standard "
                     r"error \([0-9.]+\) to spare: held\)", (tmp_path / "out" / "report.md").read_text())
    assert {n["node"] for n in record["float_nodes"]} == {"outlier", "second"}
    assert all(n["via"].startswith("m (") and n["gain"] > 0.5 for n in record["float_nodes"])
    # bias correction (on by default) is not measured once the float nodes met the target
    assert record["bias_correction"]["why"] == "not measured: the target was met without it"


@pytest.mark.slow
def test_ort_fallback_that_cannot_meet_its_target_exits_1_with_the_best_model(outlier_config):
    tmp_path, config = outlier_config
    config["pipeline"][0]["quantize"]["fallback"]["target"] = {"cosine_mean": 0.9999999}
    config["pipeline"][0]["quantize"]["fallback"]["max_float_nodes"] = 1
    done, report = run_config(tmp_path, config)
    record = report["stages"][-1]["fallback"]
    assert done.returncode == 1 and "gate missed" in done.stderr
    assert not record["passed"] and "target not met" in record["why"]
    assert (tmp_path / "out" / "model.onnx").is_file()
    assert record["best"]["score"] > record["base"]["score"]


def test_fallback_config_errors_are_one_line():
    from qprep.config import load_config

    with pytest.raises(ConfigError, match=r"fallback.target.cosine_man: unknown metric 'cosine_man'; did you mean"):
        load_config({"model": "m.onnx", "pipeline": [{"quantize": {"fallback": {"target": {"cosine_man": 0.9}}}}]})
    with pytest.raises(ConfigError, match=r"fallback.target: required key is missing"):
        load_config({"model": "m.onnx", "pipeline": [{"quantize": {"fallback": {"max_float_nodes": 3}}}]})


def test_the_gains_needed_are_read_from_the_samples_the_search_chooses_on_not_the_ranking_samples():
    """The first samples (those a ranking runs on) can meet the target's cosine while all the samples do not
    (PP-OCRv4 rec: 0.99296 on 32, 0.98824 on 96): round 1 still stops once its gains cover twice what all the
    samples lack, instead of building all 12 candidates."""
    damage = {"n0": 0.006, "n1": 0.005, **{f"n{i}": 0.0005 for i in range(2, 12)}}
    on_all, _ = _scripted(damage)

    def evaluate(float_nodes, samples):  # the two ranking samples are 0.009 better than all four
        score = on_all(float_nodes, samples)["y"]["cosine_mean"]
        return {"y": {"cosine_mean": score + (0.009 if len(samples) == 2 else 0.0)}}

    outcome = run_search(evaluate, list(damage), set(), [{}] * 4,
                         {**OPTIONS, "target": {"cosine_mean": 0.9905}, "max_candidates": 12})
    assert outcome.passed and outcome.float_nodes == ["n0", "n1"]
    assert outcome.record["rank_trials"] == 8 + 1


def _nearest_quantizer(model, rng, tmp_path):
    """(OrtQuantizer for the fallback's many builds, nearest rounding and no bias correction; 4 samples of x)."""
    from qprep.model.prepare import name_nodes
    from qprep.quantize.ort.quantizer import OrtQuantizer

    name_nodes(model.graph)
    samples = [{"x": rng.standard_normal((1, 4, 8, 8)).astype(np.float32)} for _ in range(4)]
    options = typed("ort", weight_rounding="nearest", bias_correction=False)
    return OrtQuantizer(model, samples, options, tmp_path, many_builds=True), samples


def test_float_sets_that_differ_only_in_nodes_no_build_quantizes_are_one_build(tmp_path):
    """Conv → Add → Conv → Sigmoid: with Add left float as an op type, excluding the Add (or the Sigmoid, whose
    type ORT quantizes) changes nothing, and the build key says so; excluding a Conv is another build."""
    from qprep.quantize.ort.quantizer import OrtSettings

    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["c1", "bias"], ["a"]),
             helper.make_node("Conv", ["a", "w2"], ["c2"], pads=[1, 1, 1, 1]),
             helper.make_node("Sigmoid", ["c2"], ["y"])]
    model = make_model(nodes, [("x", [1, 4, 8, 8])], [("y", [1, 4, 8, 8])],
                       {"w1": rng.standard_normal((4, 4, 3, 3)).astype(np.float32),
                        "bias": rng.standard_normal((1, 4, 1, 1)).astype(np.float32),
                        "w2": rng.standard_normal((4, 4, 3, 3)).astype(np.float32)}, infer_shapes=False)
    quantizer, samples = _nearest_quantizer(model, rng, tmp_path)
    settings = OrtSettings("minmax", bias_correction=False, float_op_types=frozenset({"Add"}))
    names = {n.op_type: n.name for n in model.graph.node if n.op_type != "Conv"}
    assert quantizer.build_key({names["Add"]}, settings) == quantizer.build_key(set(), settings) == frozenset()
    assert quantizer.build_key({names["Sigmoid"]}, settings) == {names["Sigmoid"]}  # ORT quantizes Sigmoid
    assert quantizer.build_key({"Conv_0", names["Add"]}, settings) == {"Conv_0"}
    as_key = quantizer.build({names["Add"]}, settings).SerializeToString()
    quantizer._last = None  # build again, not from the last build kept
    assert quantizer.build(set(), settings).SerializeToString() == as_key
    assert quantizer.build({"Conv_0"}, settings).SerializeToString() != as_key


def test_a_build_for_ranking_leaves_out_the_exact_qdq_rules_and_computes_the_same_values(tmp_path):
    """Conv → Transpose → Transpose → Conv: ORT's quantizer wraps each Transpose in Q/DQ pairs that the exact
    rules remove (remove_redundant); a ranking trial's build skips them and gives the same outputs."""
    from qprep.model.runtime import run_model

    rng = np.random.default_rng(1)
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Transpose", ["c1"], ["t1"], perm=[0, 1, 3, 2]),
             helper.make_node("Transpose", ["t1"], ["t2"], perm=[0, 1, 3, 2]),
             helper.make_node("Conv", ["t2", "w2"], ["y"], pads=[1, 1, 1, 1])]
    model = make_model(nodes, [("x", [1, 4, 8, 8])], [("y", [1, 4, 8, 8])],
                       {"w1": rng.standard_normal((4, 4, 3, 3)).astype(np.float32),
                        "w2": rng.standard_normal((4, 4, 3, 3)).astype(np.float32)}, infer_shapes=False)
    quantizer, samples = _nearest_quantizer(model, rng, tmp_path)
    plain = quantizer.build(set(), simplify=False)
    simplified = quantizer.build(set())
    count = lambda m: sum(n.op_type == "QuantizeLinear" for n in m.graph.node)  # noqa: E731
    assert count(simplified) < count(plain) and quantizer.build(set(), simplify=False) is not simplified
    for a, b in zip(run_model(plain, samples), run_model(simplified, samples)):
        assert np.array_equal(a["y"], b["y"])


def test_ort_op_type_phase_leaves_a_whole_chain_float_when_no_single_type_helps():
    """Hardswish as Add → Clip → Mul: one type left float only adds Q/DQ pairs; all of them at once pays. A
    Transpose is not ranked alone (its values are only moved: int8 or float, the same numbers) unless ORT is told
    to quantize it after float producers too; it is part of "all at once"."""
    from types import SimpleNamespace

    from qprep.quantize.ort.quantizer import OrtSettings
    from qprep.quantize.ort.search import Trials, choose_float_op_types

    chain_types = frozenset({"Add", "Clip", "Mul", "Transpose"})
    scores = {frozenset(): 0.90, frozenset({"Add"}): 0.89, frozenset({"Clip"}): 0.895, frozenset({"Mul"}): 0.89,
              chain_types: 0.95}  # no Transpose alone: ranking it fails the test
    nodes = [SimpleNamespace(name=f"n{i}", op_type=t)
             for i, t in enumerate(["Conv", "Add", "Clip", "Mul", "Transpose", "Conv"])]

    def quantizer(extra_options):
        return SimpleNamespace(model=SimpleNamespace(graph=SimpleNamespace(node=nodes)),
                               op_types=["Add", "Clip", "Conv", "Mul", "Transpose"],
                               options=typed("ort", extra_options=extra_options))

    job = SimpleNamespace(fallback=typed("fallback", target={"cosine_mean": 0.99}, rank_samples=2),
                          evaluation_samples=[{}] * 4,
                          acceptance_samples=[], progress=None)

    def float_types(float_nodes, settings):
        """The types left float, as the op-type setting or as all their nodes float (the same build)."""
        return settings.float_op_types | {t for t in chain_types
                                          if all(n.name in float_nodes for n in nodes if n.op_type == t)}

    builds = []

    def trials():
        return Trials(OrtSettings("minmax", bias_correction=False), lambda float_nodes, samples, settings: builds.append(
            settings) or {"y": {"cosine_mean": scores[frozenset(float_types(float_nodes, settings))]}})

    chain = trials()
    record = choose_float_op_types(quantizer({}), chain, set(), job, Budget(600))
    assert record["chosen"] == sorted(chain_types) and record["nodes"] == 4
    assert chain.settings.float_op_types == chain_types
    measured = len(builds)  # the kept types' measurement stands for the search's base: not built again
    assert chain.evaluate(set(), job.evaluation_samples)["y"]["cosine_mean"] == 0.95 and len(builds) == measured
    with pytest.raises(KeyError):  # told to quantize reshaping ops after float producers: Transpose is ranked
        choose_float_op_types(quantizer({"ForceQuantizeNoInputCheck": True}), trials(), set(), job, Budget(600))
    scores[chain_types] = 0.85  # worse together: nothing is left float
    assert choose_float_op_types(quantizer({}), trials(), set(), job, Budget(600))["chosen"] == []


def test_choose_setting_keeps_the_better_value_and_stops_at_the_target():
    scores = {"minmax": 0.95, "mse": 0.97, "other": 0.999}
    state = {"value": "minmax"}
    used = []

    def use(value):
        used.append(value)
        state["value"] = value

    def evaluate(float_nodes, samples):
        return {"y": {"cosine_mean": scores[state["value"]]}}

    target = {"cosine_mean": 0.99}
    record = search.choose_setting("ranges", "minmax", ["mse"], use, evaluate, set(), [{}], target)
    assert record["chosen"] == "mse" and state["value"] == "mse" and record["scores"] == {"minmax": 0.95, "mse": 0.97}
    state["value"] = "minmax"
    record = search.choose_setting("ranges", "minmax", ["other", "mse"], use, evaluate, set(), [{}], target)
    assert record["chosen"] == "other" and "mse" not in record["scores"]  # the target met: nothing more is tried
    scores["mse"] = 0.95  # a tie keeps the configured value
    state["value"] = "minmax"
    assert search.choose_setting("ranges", "minmax", ["mse"], use, evaluate, set(), [{}], target)["chosen"] == "minmax"
    assert state["value"] == "minmax"
    scores["mse"] = 0.96  # removes a fifth of the error: not enough where every later trial would cost more
    assert search.choose_setting("ranges", "minmax", ["mse"], use, evaluate, set(), [{}], target,
                                   min_gain=0.25)["chosen"] == "minmax"
    used.clear()
    scores["minmax"] = 0.995  # the configured value meets the target: no alternative is built
    assert search.choose_setting("ranges", "minmax", ["mse"], use, evaluate, set(), [{}], target)["chosen"] == "minmax"
    assert used == ["minmax"]
    scores["minmax"] = 0.95  # missed, but an alternative that would not end within the budget is not built
    used.clear()
    record = search.choose_setting("ranges", "minmax", ["mse"], use, evaluate, set(), [{}], target,
                                   affordable=lambda alternative: False)
    assert record["chosen"] == "minmax" and record["scores"] == {"minmax": 0.95} and used == ["minmax"]


@pytest.mark.slow
def test_ort_calibrate_method_mse_runs_and_is_recorded(outlier_config):
    tmp_path, config = outlier_config
    config["pipeline"][0]["quantize"] = {"backend": "ort", "ort": {"calibrate_method": "mse"}}
    config["evaluation"]["gate"] = {"cosine_mean": 0.0}
    done, report = run_config(tmp_path, config)
    assert done.returncode == 0, done.stderr
    assert report["stages"][-1]["calibrate_method"] == "mse"


def test_edges_group_a_tensors_producer_and_consumers_in_ranked_order():
    from qprep.quantize.ort.search import edges

    model = outlier_model()  # x → first → h → outlier → m → second → y
    grouped = edges(model, ["second", "outlier", "first"])  # ranked: second lost most
    assert grouped == {"m": ("outlier", "second"), "y": ("second",), "h": ("first", "outlier"), "x": ("first",)}
    assert list(grouped)[:2] == ["m", "y"]  # both contain "second", m first in graph order
    assert edges(model, ["outlier"]) == {"h": ("outlier",)}  # nodes not in the list (not quantized) drop out


def test_with_costs_the_cheaper_candidate_of_equal_help_is_promoted_first():
    evaluate, builds = _scripted({"early": 0.02, "late": 0.015})
    outcome = run_search(evaluate, ["early", "late"], set(), [{}] * 4, {**OPTIONS, "target": {"cosine_mean": 0.98}},
                              cost={"early": 0.3, "late": 0.02})
    assert outcome.float_nodes == ["late"] and outcome.passed  # 0.985 ≥ 0.98 with the cheap one alone
    evaluate, builds = _scripted({"early": 0.02, "late": 0.015})
    outcome = run_search(evaluate, ["early", "late"], set(), [{}] * 4, {**OPTIONS, "target": {"cosine_mean": 0.98}})
    assert outcome.float_nodes == ["early"]  # by gain alone



def test_remembered_evaluates_each_build_once_per_setting_and_sample_count():
    calls, setting = [], {"value": "minmax"}

    def evaluate(float_nodes, samples):
        calls.append((setting["value"], frozenset(float_nodes), len(samples)))
        return {"y": {"cosine_mean": 0.9}}

    once = search.Remembered(evaluate, lambda: setting["value"])
    samples = [{}] * 4
    for _ in range(3):
        once({"a"}, samples)
    once({"a"}, samples[:2])
    once({"a"}, [{}, {}])  # as many samples as the prefix, but others (the ones kept apart)
    setting["value"] = "mse"
    once({"a"}, samples)
    assert calls == [("minmax", frozenset({"a"}), 4), ("minmax", frozenset({"a"}), 2), ("minmax", frozenset({"a"}), 2),
                     ("mse", frozenset({"a"}), 4)]


def test_split_keeps_an_even_spread_of_samples_apart_and_none_from_a_small_set():
    samples = [{"i": i} for i in range(128)]
    chosen, apart = search.split_samples(samples, 0.25)
    assert len(chosen) == 96 and len(apart) == 32
    assert {s["i"] for s in chosen} | {s["i"] for s in apart} == set(range(128))
    assert max(s["i"] for s in apart[:8]) < 40 and min(s["i"] for s in apart[-8:]) > 88  # spread, not a block
    assert search.split_samples(samples[:24], 0.25) == (samples[:24], [])  # 6 kept apart would decide nothing
    assert search.split_samples(samples, 0) == (samples, [])
    assert len(search.split_samples(samples, 0.9)[1]) == 64  # at most half


def test_a_float_set_that_meets_the_target_only_on_the_samples_it_was_chosen_on_is_not_accepted():
    """"b" fixes the samples the search chooses on; only "b" and "c" together fix those kept apart (as PP-OCR
    cls: target met on the evaluation samples, 0.9931 on others)."""
    chosen_on, kept_apart = [{}] * 8, [{}] * 8

    def evaluate(float_nodes, samples):
        if samples is kept_apart:
            return {"y": {"cosine_mean": 0.999 if {"b", "c"} <= float_nodes else 0.95}}
        error = sum(d for n, d in {"a": 0.0003, "b": 0.02, "c": 0.0004}.items() if n not in float_nodes)
        return {"y": {"cosine_mean": 1.0 - error}}

    options = {**OPTIONS, "target": {"cosine_mean": 0.998}, "rank_samples": 8}
    outcome = search.Search(Scripted(evaluate), search.Candidates(["a", "b", "c"]), set(), chosen_on, limits(options),
                            acceptance=kept_apart).run()
    assert outcome.passed and set(outcome.float_nodes) == {"b", "c"}
    first, second = [t for t in outcome.record["trials"] if t["phase"] == "promote"]
    assert first["added"] == ["b"] and not first["passed"] and first["unseen"]["metrics"]["cosine_mean"] == 0.95
    assert second["passed"] and outcome.record["best"]["unseen"]["passed"]
    assert outcome.record["samples"] == {"chosen_on": 8, "kept_apart": 8}
    # without samples kept apart, "b" alone is accepted
    alone = search.Search(Scripted(evaluate), search.Candidates(["a", "b", "c"]), set(), chosen_on, limits(options)).run()
    assert alone.passed and alone.float_nodes == ["b"]


def test_on_the_samples_kept_apart_a_cosine_mean_needs_its_standard_error_to_spare():
    """A mean that meets the target by less than its own noise on 8 samples is not accepted; the record keeps
    the measured mean and the standard error that was taken off it."""
    kept_apart = [{}] * 8

    def on_kept_apart(values):
        return {"y": {"cosine_mean": sum(values) / len(values),
                      "per_sample": {"metric": "cosine", "values": values}}}

    noisy = on_kept_apart([0.990, 0.9996, 0.9996, 0.9996, 0.9996, 0.9996, 0.9996, 0.9996])  # mean 0.99840
    steady = on_kept_apart([0.9985] * 8)
    target, passing = {"cosine_mean": 0.998}, {"y": {"cosine_mean": 0.999}}
    gate = search.judge(target, passing, set(), lambda nodes, samples: noisy, kept_apart)
    assert not gate["passed"] and gate["unseen"]["metrics"]["cosine_mean"] == pytest.approx(0.9984)
    assert gate["unseen"]["standard_error"]["y"] == pytest.approx(0.0012, abs=1e-4)
    assert search.judge(target, passing, set(), lambda nodes, samples: steady, kept_apart)["passed"]
    # without per-sample values (or on the samples the search chooses on) the mean alone decides
    assert search.judge(target, passing, set(), lambda nodes, samples: {"y": {"cosine_mean": 0.9984}},
                        kept_apart)["passed"]


def test_a_later_round_ranks_until_a_candidate_clearly_helps():
    """Round 1 ranks every candidate; round 2 stops after MIN_RANKED once one of them removes MIN_GAIN of the
    error left, and promotes from those: "n1" (second in the pool, helpful once "a" is float) rather than the
    better "z" at the end of the pool, which a full ranking would have found first."""
    names = ["a"] + [f"n{i}" for i in range(1, 11)] + ["z"]
    evaluate, builds = _scripted({"a": 0.006, "fixed": 0.003},
                                 {frozenset({"a", "n1"}): -0.0015, frozenset({"a", "z"}): -0.0025})
    outcome = run_search(evaluate, names, set(), [{}] * 4,
                         {**OPTIONS, "target": {"cosine_mean": 0.998}, "max_candidates": 12})
    assert outcome.passed and outcome.float_nodes == ["a", "n1"]
    assert outcome.record["rounds"] == 2
    assert outcome.record["rank_trials"] == (1 + 12) + (1 + rounds.MIN_RANKED)


def test_a_round_after_a_partial_ranking_goes_on_where_it_stopped():
    """Round 2 ranks n1..n8 and promotes n1; round 3 starts at n9, not again at n2 (mediapipe face detection
    re-ranked its pool's unhelpful head in each of 8 rounds: 128 ranking trials where one full round took 53)."""
    names = ["a"] + [f"n{i}" for i in range(1, 11)] + ["z"]
    evaluate, builds = _scripted({"a": 0.006, "fixed": 0.004},
                                 {frozenset({"a", "n1"}): -0.001, frozenset({"n1", "n10"}): -0.002})
    outcome = run_search(evaluate, names, set(), [{}] * 4,
                         {**OPTIONS, "target": {"cosine_mean": 0.998}, "max_candidates": 12})
    assert outcome.passed and outcome.float_nodes == ["a", "n1", "n10"]
    assert outcome.record["rounds"] == 3
    round_3 = builds[builds.index({"a", "n1"}) + 1:]  # after round 3's base (the last build of {a, n1} alone)
    while {"a", "n1"} in round_3:
        round_3 = round_3[round_3.index({"a", "n1"}) + 1:]
    assert [sorted(b - {"a", "n1"}) for b in round_3[:3]] == [["n9"], ["n10"], ["z"]]


def test_on_the_samples_chosen_on_an_agreement_needs_its_standard_error_to_spare():
    """EfficientNet-Lite0 on RKNN met 97% as 94 of 96 (97.9%, standard error 1.5%) and held 96.9% on 128
    held-out samples: two flips of 96 do not pass a 97% target on the samples chosen on, one does; the gate
    keeps the measured rate and says what margin it missed."""
    def chosen(flips, n=96):
        shares = [0.0] * flips + [1.0] * (n - flips)
        return {"y": {"top1_agreement": float(np.mean(shares)),
                      "top1_agreement_se": float(np.std(shares, ddof=1) / np.sqrt(n)), "top1_count": n}}

    target = {"top1_agreement": 0.97}
    two, one = search.judge(target, chosen(2), set(), None, []), search.judge(target, chosen(1), set(), None, [])
    assert not two["passed"] and two["margin"]["y.top1_agreement"] == pytest.approx(0.0147, abs=1e-4)
    assert search.gate_metrics(two)["top1_agreement"] == pytest.approx(94 / 96)
    assert one["passed"] and "margin" not in one
    assert search.judge(target, chosen(0), set(), None, [])["passed"]  # no flip: nothing to take off
    assert not search.judge({"top1_agreement": 1.0}, chosen(1), set(), None, [])["passed"]


def test_budget_predicts_a_step_from_the_slowest_recent_run_and_keeps_the_reserve(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    budget = Budget(100)
    assert budget.predict("trial") == 0.0 and budget.predict("trial", 7.0) == 7.0
    for seconds in (50.0, 10.0, 12.0, 11.0):
        budget.record("trial", seconds)
    assert budget.predict("trial") == 12.0  # the first build's calibration no longer counts
    budget.reserve_kind = "trial"
    clock[0] = 70.0
    assert budget.fits(18.0) and not budget.fits(19.0)  # 70 + 18 + 12 kept for the final build = 100
    assert not budget.allows("ranking", 19.0) and budget.skipped == ["ranking (~19 s, 18 s left)"]
    budget.reserve_factor = 2.0  # a slower variant of the kind kept (RKNN's kl_divergence build after its search)
    assert budget.fits(6.0) and not budget.fits(7.0)  # 70 + 6 + 2 x 12 = 100


def test_a_kind_not_run_yet_is_predicted_by_its_stand_in_and_bias_trials_are_their_own_kind():
    """PP-OCRv3 det: a 200 s bias-corrected build timed as a trial made every later trial look 227 s long, and
    the search never started (0 rounds within a 600 s budget)."""
    from types import SimpleNamespace

    from qprep.quantize.ort.quantizer import OrtSettings
    from qprep.quantize.ort.search import build_kind

    quantizer = SimpleNamespace(calibrated=lambda method: method == "minmax")
    plain, corrected = OrtSettings("minmax", bias_correction=False), OrtSettings("minmax", bias_correction=True)
    assert build_kind(quantizer, OrtSettings("mse", bias_correction=False), True) == "first build"
    assert build_kind(quantizer, corrected, True) == "bias trial"
    assert build_kind(quantizer, plain, True) == "trial" and build_kind(quantizer, plain, False) == "rank"
    budget = Budget(600)
    budget.stand_ins.update({"trial": "first build", "rank": "trial"})
    assert budget.predict("trial") == 0.0
    budget.record("first build", 40.0)
    assert budget.predict("trial") == 40.0 and budget.predict("rank") == 40.0  # an over-estimate until measured
    budget.record(build_kind(quantizer, corrected, True), 200.0)
    budget.record(build_kind(quantizer, plain, True), 5.0)
    assert budget.predict("trial") == 5.0 and budget.predict("rank") == 5.0


def test_the_search_starts_no_trial_that_would_end_past_the_budget(monkeypatch):
    """Trials of 30 s recorded by the backend, as ORT's and RKNN's do: with 200 s, ranking stops at half the
    budget, and the promotions that cannot finish are not started; the search ends within the budget."""
    clock = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    damage = {f"n{i}": 0.01 for i in range(6)}
    scripted, _ = _scripted(damage)
    budget = Budget(200)

    class Timed(Scripted):
        def evaluate(self, float_nodes, samples):
            with budget.timed("trial" if len(samples) == 4 else "rank"):
                clock[0] += 30.0
                return scripted(float_nodes, samples)

    outcome = search.Search(Timed(None), search.Candidates(list(damage)), set(), [{}] * 4,
                            limits({**OPTIONS, "target": {"cosine_mean": 0.999}, "time_budget_s": 200}),
                            budget=budget).run()
    assert 170.0 < clock[0] <= 200.0 and outcome.record["stopped"] == "time budget spent"
    assert outcome.record["best"]["score"] > outcome.record["base"]["score"]  # the best model found is kept


def test_bias_correction_is_tried_on_the_base_only_near_the_target():
    from qprep.quantize.ort.search import near_target

    target = {"cosine_mean": 0.998}
    assert near_target({"y": {"cosine_mean": 0.9973}}, target)  # EfficientNet-Lite0: its minutes pay
    assert not near_target({"y": {"cosine_mean": 0.56}}, target)  # PP-PicoDet: the search needs them
    # an agreement: near while it misses at most twice what the gate allows on its samples (97% on 96: 1.7%)
    agreement = {"cosine_mean": 0.998, "top1_agreement": 0.97}
    assert not near_target({"y": {"cosine_mean": 0.9973, "top1_agreement": 0.948, "top1_count": 96}}, agreement)
    assert near_target({"y": {"cosine_mean": 0.9973, "top1_agreement": 0.969, "top1_count": 96}}, agreement)
    assert not near_target({"y": {"top1_agreement": 0.99, "top1_count": 96}}, {"top1_agreement": 1.0})
    assert near_target({"y": {"top1_agreement": 0.95, "top1_count": 96}}, {"z.top1_agreement": 0.99})  # not y's
    assert search.allowed_disagreement(1.0, 96) == 0.0
    assert 1 / 96 < search.allowed_disagreement(0.97, 96) < 2 / 96  # one flip passes the gate's margin, two do not


def test_the_cap_counts_what_the_backend_counts_and_a_promoted_group_s_nodes_are_not_tried_again():
    """RKNN counts float16 layers (a MatMul and its bias Add are one): a group of 3 nodes that makes 2 layers
    fits a cap of 2. Its nodes, also ranked on their own, are not trialled again once the group is float."""
    evaluate, builds = _scripted({"mm": 0.01, "bias": 0.01, "ln": 0.01, "other": 0.001})
    ranking = [{"node": "chain", "gain": 0.03}, {"node": "mm", "gain": 0.01}, {"node": "ln", "gain": 0.01},
               {"node": "other", "gain": 0.001}]

    class Layers(Scripted):
        def count(self, float_nodes):
            return len(set(float_nodes) - {"bias"})  # the bias Add is fused into its MatMul

    backend = Layers(evaluate, rank=lambda chosen: [r for r in ranking if r["node"] not in chosen])
    candidates = search.Candidates(["chain", "mm", "bias", "ln", "other"], groups={"chain": ("mm", "bias", "ln")},
                                   group_kind="LayerNorm chain")
    outcome = search.Search(backend, candidates, set(), [{}] * 4,
                            limits({**OPTIONS, "target": {"cosine_mean": 0.9999}, "max_float_nodes": 2})).run()
    promoted = [t["added"] for t in outcome.record["trials"] if t["phase"] == "promote"]
    assert promoted == [["chain"]]  # mm and ln: already float; other: a third layer, over the cap
    assert sorted(outcome.float_nodes) == ["bias", "ln", "mm"] and "LayerNorm chain" in candidates.describe("chain")


def test_candidates_named_first_are_tried_first_and_kept_only_if_they_pay():
    """RKNN's output layers: their single-layer error ranks them low, their effect on the output is direct.
    Tried first in round 1; one that does not remove MIN_GAIN of the error is dropped like any other."""
    evaluate, _ = _scripted({"a": 0.02, "b": 0.01, "out": 0.005, "noise": 0.0})
    ranking = [{"node": "a", "gain": 0.02}, {"node": "b", "gain": 0.01}, {"node": "noise", "gain": 0.002},
               {"node": "out", "gain": 0.001}]
    backend = Scripted(evaluate, rank=lambda chosen: [r for r in ranking if r["node"] not in chosen])
    options = {**OPTIONS, "target": {"cosine_mean": 0.9999}}
    outcome = search.Search(backend, search.Candidates(["a", "b", "out", "noise"], first=("noise", "out")), set(),
                            [{}] * 4, limits(options)).run()
    promoted = [(t["added"], t["accepted"]) for t in outcome.record["trials"] if t["phase"] == "promote"]
    assert promoted[:3] == [(["noise"], False), (["out"], True), (["a"], True)]
    assert sorted(outcome.float_nodes) == ["a", "b", "out"]


def test_ort_trials_remember_derived_and_built_outputs_in_one_memo():
    """A float set measured once, derived or built: a derived result answers a later build of the same set (and
    settings, and samples), a built one a later derivation."""
    from qprep.quantize.ort.quantizer import OrtSettings
    from qprep.quantize.ort.search import Trials

    made = []
    trials = Trials(OrtSettings("minmax", bias_correction=False),
                    lambda nodes, samples, settings: made.append(("built", frozenset(nodes))) or {"y": {}},
                    measure_candidate=lambda start, nodes, samples, settings: made.append(
                        ("derived", frozenset(nodes))) or {"y": {}})
    samples = [{}] * 4
    trials.evaluate_candidate(set(), {"a"}, samples)
    trials.evaluate({"a"}, samples)
    trials.evaluate({"b"}, samples)
    trials.evaluate_candidate(set(), {"b"}, samples)
    trials.use(calibrate_method="mse")  # another setting: measured again
    trials.evaluate({"a"}, samples)
    assert made == [("derived", frozenset({"a"})), ("built", frozenset({"b"})), ("built", frozenset({"a"}))]


def test_a_target_the_sample_count_cannot_carry_is_named_as_such_not_as_a_budget_to_raise():
    """On 36 samples a 97% agreement counts as met with one standard error to spare only at 36 of 36: a search
    whose best float set disagrees on one sample says so, rather than advising a larger budget."""
    def evaluate(float_nodes, samples):
        shares = [0.0] + [1.0] * (len(samples) - 1)
        return {"y": {"top1_agreement": float(np.mean(shares)), "top1_count": len(samples),
                      "top1_agreement_se": float(np.std(shares, ddof=1) / np.sqrt(len(samples))),
                      "cosine_mean": 0.999}}

    outcome = run_search(evaluate, ["a", "b"], set(), [{"x": i} for i in range(36)],
                         {**OPTIONS, "target": {"top1_agreement": 0.97}})
    assert not outcome.passed
    assert ("on the 36 samples it chooses on, top1_agreement 0.97 counts as met with one standard error to spare "
            "only with at most 0 of 36 disagreeing: add evaluation samples, or lower the target") in outcome.record["why"]
