"""rules.py: a toolkit step made again without the graph rule it failed in."""

def test_a_toolkit_rule_that_fails_and_names_itself_is_disabled_and_the_build_made_again(tmp_path):
    """basic-pitch's CQT: the toolkit's `remove_concat_slice` rule raised IndexError in build and logged
    "You can add disable_rules=['remove_concat_slice'] in rknn.config()". The builder builds again with that rule
    disabled (once per rule) and step1's kept outputs made again, says so in the report once the build passes,
    and gives up on a crash, a failure naming no rule, or the same rule failing again — then with the rules it
    disabled on again and nothing reported."""
    from qprep.errors import ToolkitError
    from qprep.quantize.rknn.rules import FailingRules
    from qprep.quantize.rknn.toolkit import Toolkit
    from qprep.report.decisions import decision_lines

    toolkit = Toolkit(tmp_path)
    toolkit.log_path.write_text("\x1b[1;33mW\x1b[0m \x1b[1;33mYou can add disable_rules=['remove_concat_slice'] in "
                                "rknn.config() to temporarily disable the error rule!\n\x1b[0m")
    assert toolkit.failed_rule(0) == "remove_concat_slice" and toolkit.failed_rule(toolkit.log_path.stat().st_size) is None

    def attempts(*failures):
        config = {"target_platform": "rk3588"}
        details, forgotten = {"config": config}, []
        rules = FailingRules(config, details, on_disable=lambda: forgotten.append(True))
        calls = []

        def step():
            calls.append(rules.disabled)
            if len(calls) <= len(failures):
                raise failures[len(calls) - 1]
            return "built"
        try:
            return rules.retry(step), calls, config, details, forgotten
        except ToolkitError:
            return None, calls, config, details, forgotten

    rule = ToolkitError("rknn-toolkit2 build failed: build: IndexError: list index out of range", rule="remove_concat_slice")
    result, calls, config, details, forgotten = attempts(rule)
    assert result == "built" and calls == [[], ["remove_concat_slice"]]
    assert details["config"]["disable_rules"] == ["remove_concat_slice"]
    assert forgotten == [True]  # step1 made again without the rule
    line = decision_lines({"name": "quantize", "status": "ok", "backend": "rknn", **details})
    assert any("graph rule `remove_concat_slice` **disabled**: it failed on this model (rknn-toolkit2 build failed: "
               "build: IndexError" in text for text in line)
    result, calls, config, details, _ = attempts(rule, rule)  # the same rule again: no third try, the rule on again
    assert result is None and len(calls) == 2
    assert "disable_rules" not in config and "rules_disabled" not in details
    result, calls, config, _, forgotten = attempts(ToolkitError("build failed: no rule"))
    assert result is None and calls == [[]] and "disable_rules" not in config and forgotten == []
    assert attempts(ToolkitError("crashed (SIGSEGV)", crashed=True, rule="x"))[0] is None
