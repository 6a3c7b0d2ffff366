"""The report opens with a verdict (met / missed / not measured) naming the figure that decided it and the
samples it was judged on, then the task figures per output, then the warnings."""

from __future__ import annotations

from synthetic_report import judged, report

from qprep.measure.gate import check_gate
from qprep.report.html import render_html
from qprep.report.markdown import render_markdown
from qprep.report.verdict import MET, MISSED, NOT_MEASURED, check_text, deciding_check, verdict


def test_met_names_the_tightest_check_and_the_samples():
    data = judged({"cosine_mean": 0.5, "top1_agreement": 0.9})
    result = verdict(data)
    assert result.state == MET
    assert "`top1_agreement` of `logits` 0.9375 ≥ 0.9" in result.text  # 15 of 16: closer to its bar than cosine
    assert "16 evaluation samples (`data/eval`)" in result.text


def test_missed_names_the_missed_check_on_the_heldout_set():
    data = judged({"cosine_mean": 0.5, "top1_agreement": 0.95}, heldout=True)
    result = verdict(data)
    assert result.state == MISSED
    heldout = data["evaluation"]["heldout"]["outputs"]["logits"]["top1_agreement"]
    assert heldout < data["evaluation"]["outputs"]["logits"]["top1_agreement"]  # the held-out figure decides
    assert f"`top1_agreement` of `logits` {heldout:.4g} < 0.95" in result.text and "16 held-out" in result.text


def test_floor_verdict_says_it_is_the_floor_and_how_to_set_a_gate():
    result = verdict(judged({"cosine_mean": 0.5}, floor=True))
    assert result.state == MET and result.text.startswith("accuracy floor (no gate set)")
    assert "evaluation.gate" in result.text


def test_unmeasured_cases_say_why():
    no_evaluation = report()
    del no_evaluation["evaluation"]
    assert verdict(no_evaluation).state == NOT_MEASURED and "no `evaluation:`" in verdict(no_evaluation).text
    assert "floor is off" in verdict(report()).text  # evaluation without gate or floor
    failed = {**report(), "status": "failed", "error": "boom"}
    assert verdict(failed) == verdict(failed) and verdict(failed).text == "the run failed: boom"
    unmeasured = judged({"top5_agreement": 0.9})
    unmeasured["evaluation"]["gate"]["checks"][0].update(value=None, passed=False)
    unmeasured["evaluation"]["gate"]["passed"] = False
    assert "not measured" in verdict(unmeasured).text


def test_an_unmeasured_check_decides_before_a_narrow_miss():
    checks = [{"metric": "a", "threshold": 0.9, "value": 0.89, "passed": False, "kind": "minimum"},
              {"metric": "b", "threshold": 0.9, "value": None, "passed": False, "kind": "minimum"},
              {"metric": "c", "threshold": 0.1, "value": 0.5, "passed": False, "kind": "maximum"}]
    assert deciding_check(checks)["metric"] == "b"
    assert deciding_check(checks[::2])["metric"] == "c"  # 5x its maximum beats 1% under a minimum


def test_documents_open_with_verdict_then_task_figures_then_warnings():
    data = judged({"top1_agreement": 0.9})
    markdown = render_markdown(data)
    lines = [line for line in markdown.splitlines() if line]
    assert lines[1].startswith("**Verdict: met** — gate:")
    assert lines[2].startswith("- `logits` (classification): top1 agreement 93.8% (95% CI") and "n=16)" in lines[2]
    assert markdown.index("## Warnings") < markdown.index("## Accuracy against the reference")
    html = render_html(data)
    assert "<p id='verdict' class='verdict met'>" in html
    assert html.index("id='verdict'") < html.index("Warnings") < html.index("Accuracy against the reference")


def test_a_text_recognizer_leads_with_text_agreement_and_shows_what_each_side_reads():
    data = report()
    data["evaluation"]["outputs"] = {"probs": {
        "kind": "ctc", "cosine_mean": 0.97, "cosine_min": 0.86, "text_agreement": 0.75,
        "text_agreement_ci95": [0.6, 0.86], "text_count": 40, "char_error_rate": 0.031,
        "step_agreement": 0.96, "step_agreement_ci95": [0.92, 0.98], "step_count": 40,
        "worst_by": "character error rate",
        "worst_samples": [{"sample": "line7.png", "value": 0.5, "reference_text": "总价", "result_text": "总"}]}}
    markdown = render_markdown(data)
    assert ("- `probs` (ctc): text agreement 75.0% (95% CI 60.0–86.0%, n=40); character error rate 3.1%; "
            "step agreement") in markdown
    assert "| line7.png | 0.5 | “总价” | “总” |" in markdown


def test_a_figure_just_under_its_threshold_does_not_read_as_the_threshold():
    check = {"metric": "cosine_mean", "threshold": 1.0, "value": 0.99996, "passed": False, "kind": "minimum"}
    assert check_text(check) == "`cosine_mean` 0.99996 < 1"
    assert check_text({**check, "value": 1.0, "passed": True}) == "`cosine_mean` 1 ≥ 1"
    partly = check_gate({"cosine_mean": 0.9}, {"a": {"cosine_mean": 0.95}, "b": {"cosine_mean": None}})["checks"][0]
    assert check_text(partly) == "`cosine_mean` of `a` 0.95 ≥ 0.9, but not measured on 1 output(s)"
    assert verdict({**report(), "status": "running"}).text == "the run did not finish (killed, or still running)"


def test_the_per_output_table_and_the_gate_show_the_sqnr_per_sample_the_cosine_threshold_also_holds():
    data = judged({"cosine_mean": 0.5})
    figure = data["evaluation"]["outputs"]["logits"]["mean_sqnr_db"]
    for text in (render_markdown(data), render_html(data)):
        assert "SQNR dB per sample" in text and f"{figure:.1f}" in text
        assert "mean_sqnr_db (for cosine_mean 0.5: an error along the signal, which cosine does not see)" in text


def test_the_worst_samples_listed_are_those_of_the_set_the_verdict_is_judged_on():
    """With held-out samples the verdict is theirs, so are the worst samples shown (SLANet+ listed five exact
    evaluation samples under a verdict missed on the held-out ones)."""
    data = judged({"cosine_mean": 0.5}, heldout=True)
    evaluation = data["evaluation"]
    evaluation["outputs"]["logits"].update(worst_by="cosine", worst_samples=[{"sample": "eval3.png", "value": 0.99}])
    evaluation["heldout"]["outputs"]["logits"].update(worst_by="cosine",
                                                       worst_samples=[{"sample": "held9.png", "value": 0.41}])
    markdown = render_markdown(data)
    assert "Worst held-out samples for logits (cosine): held9.png (0.41)" in markdown
    assert "eval3.png" not in markdown
    data = judged({"cosine_mean": 0.5})
    data["evaluation"]["outputs"]["logits"].update(worst_by="cosine", worst_samples=[{"sample": "eval3.png",
                                                                                     "value": 0.99}])
    assert "Worst samples for logits (cosine): eval3.png (0.99)" in render_markdown(data)


def test_a_miss_without_the_fallback_says_how_to_run_it_and_with_it_does_not(tmp_path):
    """Resemblyzer on RKNN missed the floor at 0.58 and the run said nothing about the fallback, which reaches
    0.9995 in 70 s: the verdict and the terminal say how to turn it on, aiming at the gate as configured (all of
    it: a top-1 miss beside a cosine that holds), at cosine 0.99 for the floor, and not for fp16."""
    data = judged({"cosine_mean": 0.999})
    data["evaluation"]["gate"]["target"] = {"cosine_mean": 0.999}
    assert data["evaluation"]["gate"]["passed"] is False and not data["stages"][0].get("fallback")
    text = verdict(data).text
    assert "run again with `--set pipeline.quantize.fallback.target.cosine_mean=0.999`" in text
    both = judged({"cosine_mean": 0.5, "top1_agreement": 0.99})
    both["evaluation"]["gate"]["target"] = {"cosine_mean": 0.5, "top1_agreement": 0.99}
    assert "`--set 'pipeline.quantize.fallback.target={cosine_mean: 0.5, top1_agreement: 0.99}'`" in verdict(both).text
    floor = judged({"cosine_mean": 0.999}, floor=True)
    assert "fallback.target.cosine_mean=0.99`" in verdict(floor).text
    assert "fallback" not in verdict(judged({"cosine_mean": 0.5})).text  # met: nothing to do
    data["stages"][0]["backend"] = "fp16"
    assert "run again" not in verdict(data).text
    data["stages"][0].update(backend="ort", fallback={"target": {"cosine_mean": 0.999}})
    assert "run again" not in verdict(data).text
