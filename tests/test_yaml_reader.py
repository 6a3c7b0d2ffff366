"""The one YAML reader: nesting and alias expansion beyond any config are refused in one line (exit 2) wherever
qprep reads YAML (config, overlay, `--set` value), before a Python object is built; a config within the limits
reads as before."""

import pytest

from qprep.config import load_config, merge_overlay, parse_set
from qprep.errors import EXIT_USAGE, ConfigError
from qprep.yaml_reader import MAX_DEPTH, YamlLimit, load_yaml

DEEP = "[" * 5000 + "]" * 5000  # PyYAML's recursive composer: RecursionError, exit 3


def nested(levels: int) -> str:
    """`x:` holding a value `levels` deep, the mapping holding x counted: [[…[1]…]]."""
    return "x: " + "[" * (levels - 2) + "1" + "]" * (levels - 2) + "\n"


def bomb(levels: int = 9) -> str:
    """Ten aliases of ten aliases …: a kilobyte that expands to 10^(levels+1) values."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


CASES = {
    "nested": (f"x: {DEEP}\n", rf"nested deeper than {MAX_DEPTH} levels"),
    "nested mapping": ("x: " + "{a: " * 3000 + "1" + "}" * 3000 + "\n", "nested deeper than"),
    "alias bomb": (bomb(), r"aliases expand to more than 100,000 values"),
    "alias chain": ("".join(f"a{i}: &a{i} [{f'*a{i - 1}' if i else 1}]\n" for i in range(MAX_DEPTH + 5)),
                    r"aliases nest deeper than"),
    "alias in itself": ("a: &a [1, *a]\n", "refers to the collection it is in"),
}


@pytest.mark.parametrize("case", CASES)
def test_the_reader_refuses_what_no_config_is_before_building_it(case):
    text, message = CASES[case]
    with pytest.raises(YamlLimit, match=message):
        load_yaml(text)


def test_within_the_limits_yaml_reads_as_before():
    assert load_yaml(nested(MAX_DEPTH))["x"] is not None
    with pytest.raises(YamlLimit, match="nested deeper than"):
        load_yaml(nested(MAX_DEPTH + 1))
    assert len(load_yaml(bomb(3))["a3"]) == 10  # 10^4 values: aliases as YAML allows
    assert load_yaml("base: &b {a: 1}\nother: {<<: *b, c: 2}\n")["other"] == {"a": 1, "c": 2}
    assert load_yaml("") is None


@pytest.mark.parametrize("case", CASES)
def test_config_and_overlay_refuse_it_in_one_line_naming_the_file(tmp_path, case):
    text, message = CASES[case]
    (tmp_path / "c.yaml").write_text("model: m.onnx\n" + text)
    with pytest.raises(ConfigError, match=rf"^[^\n]*c\.yaml: not read \(line \d+\): [^\n]*{message}[^\n]*$") as raised:
        load_config(tmp_path / "c.yaml")
    assert raised.value.exit_code == EXIT_USAGE
    (tmp_path / "m.qprep.yaml").write_text(text)
    with pytest.raises(ConfigError, match=rf"^[^\n]*m\.qprep\.yaml: not read [^\n]*{message}[^\n]*$"):
        merge_overlay({"model": "m.onnx"}, tmp_path / "m.qprep.yaml")


def test_a_set_value_is_read_by_the_same_reader(tmp_path):
    with pytest.raises(ConfigError, match=r"^--set inputs: the value is not read: nested deeper than"):
        parse_set(f"inputs={DEEP}")
    with pytest.raises(ConfigError, match=r"^--set x: the value is not read: [^\n]*aliases expand to more than"):
        parse_set("x={" + ", ".join(bomb().splitlines()) + "}")
    with pytest.raises(ConfigError, match=r"^--set calibration: duplicate key 'a'"):
        parse_set("calibration={a: 1, a: 2}")
    assert parse_set("x=[1, 2]") == ("x", [1, 2]) and parse_set("m=a: b: c") == ("m", "a: b: c")


def test_validate_refuses_a_deep_config_with_exit_2(tmp_path, cli):
    (tmp_path / "deep.yaml").write_text(f"model: m.onnx\ninputs: {{x: {DEEP}}}\n")
    code, _, err = cli("validate", tmp_path / "deep.yaml")
    assert code == EXIT_USAGE and len(err.strip().splitlines()) == 1 and "nested deeper than" in err
