from pathlib import Path

import pytest

from qprep.config import load_config, parse_set
from qprep.errors import ConfigError
from qprep.schema import Key, section
from qprep import stage_registry as stages
from qprep.contract import StageResult


@pytest.fixture
def fake_stage(monkeypatch):
    """Register a throwaway stage so pipeline validation and --set can be tested before real stages exist."""
    registry = dict(stages.registry())  # import the real stages first, then shadow `quantize`
    registry["quantize"] = stages.Stage("quantize", lambda m, c, o: StageResult(m),
                                        section(backend=Key("str", default="ort", choices=("ort", "rknn")),
                                                algorithm=Key("str", default="normal")), "test stage")
    monkeypatch.setattr(stages, "REGISTRY", registry)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_misspelt_top_level_key_names_path_and_closest(tmp_path):
    with pytest.raises(ConfigError, match=r"^calibraton: unknown key; did you mean 'calibration'\?$"):
        load_config(write(tmp_path, "model: m.onnx\ncalibraton: {source: d}\n"))


def test_misspelt_stage_option_names_its_index(tmp_path, fake_stage):
    path = write(tmp_path, "model: m.onnx\npipeline:\n  - quantize: {algoritm: mmse}\n")
    with pytest.raises(ConfigError, match=r"pipeline\[0\]\.quantize\.algoritm: unknown key; did you mean 'algorithm'"):
        load_config(path)


def test_unknown_stage_suggests_closest(tmp_path, fake_stage):
    with pytest.raises(ConfigError, match=r"pipeline\[0\]: unknown stage 'quantise'; did you mean 'quantize'"):
        load_config(write(tmp_path, "model: m.onnx\npipeline: [quantise]\n"))


def test_wrong_type_and_choice(tmp_path, fake_stage):
    with pytest.raises(ConfigError, match=r"^threads: expected an integer, got str 'two'$"):
        load_config(write(tmp_path, "model: m.onnx\nthreads: two\n"))
    with pytest.raises(ConfigError, match=r"backend: .tflite. is not allowed; choose one of: ort, rknn"):
        load_config(write(tmp_path, "model: m.onnx\npipeline: [{quantize: {backend: tflite}}]\n"))


def test_missing_required_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match=r"^model: required key is missing"):
        load_config(write(tmp_path, "output_dir: x\n"))
    with pytest.raises(ConfigError, match=r"not valid YAML \(line 2"):
        load_config(write(tmp_path, "model: m.onnx\n  bad: [\n"))


def test_relative_paths_resolve_against_config_folder(tmp_path):
    (tmp_path / "sub").mkdir()
    path = tmp_path / "sub" / "c.yaml"
    path.write_text("model: ../m.onnx\noutput_dir: runs/a\ncalibration: {source: data}\n")
    config = load_config(path)
    assert config["model"] == str(tmp_path / "m.onnx")
    assert config["output_dir"] == str(tmp_path / "sub" / "runs" / "a")
    assert config["calibration"]["source"] == str(tmp_path / "sub" / "data")
    assert config["calibration"]["max_samples"] == 64  # defaults filled


def test_set_overrides_select_stage_by_name_and_parse_yaml_values(tmp_path, fake_stage):
    path = write(tmp_path, "model: m.onnx\npipeline:\n  - quantize: {backend: rknn}\n")
    overrides = dict(parse_set(s) for s in ["pipeline.quantize.backend=ort", "inputs.x=[1, 3, 8, 8]",
                                            "calibration.source=data", "verify.atol=0.5"])
    config = load_config(path, overrides, cwd=tmp_path / "elsewhere")
    assert [(name, options.as_dict()) for name, options in config.stages] == [
        ("quantize", {"backend": "ort", "algorithm": "normal"})]
    assert config.stages[0][1].backend == "ort"  # typed: what the stage reads
    assert config["inputs"] == {"x": [1, 3, 8, 8]}
    assert config["calibration"]["source"] == str(tmp_path / "elsewhere" / "data")  # CLI paths: cwd
    assert config["verify"]["atol"] == 0.5


def test_a_metric_given_with_set_is_found_where_the_user_typed_it(tmp_path):
    """`--set evaluation.metric=mine.py:f` names a file beside the user, as `--set` does for every key that names
    a file: it was looked for beside the config (and refused). In the YAML it stays beside the config."""
    (tmp_path / "cfg").mkdir()
    (tmp_path / "here").mkdir()
    function = "def f(outputs, samples):\n    return 1.0\n"
    (tmp_path / "here" / "mine.py").write_text(function)
    (tmp_path / "cfg" / "theirs.py").write_text(function)
    path = tmp_path / "cfg" / "c.yaml"
    path.write_text("model: m.onnx\nevaluation: {source: data, metric: theirs:f}\n")
    assert load_config(path)["evaluation"]["metric"] == f"{tmp_path / 'cfg' / 'theirs.py'}:f"
    for spec in ("mine.py:f", "mine:f"):
        config = load_config(path, {"evaluation.metric": spec}, cwd=tmp_path / "here")
        assert config["evaluation"]["metric"] == f"{tmp_path / 'here' / 'mine.py'}:f"
    assert load_config(path, {"evaluation.source": "d"}, cwd=tmp_path / "here")["evaluation"]["source"] == str(
        tmp_path / "here" / "d")  # the same rule as every path key's


def test_set_errors(tmp_path, fake_stage):
    path = write(tmp_path, "model: m.onnx\npipeline: [quantize, quantize]\n")
    with pytest.raises(ConfigError, match=r"2 'quantize' stages; use pipeline\[0\]\.quantize"):
        load_config(path, {"pipeline.quantize.backend": "ort"})
    with pytest.raises(ConfigError, match=r"no 'optimize' stage"):
        load_config(path, {"pipeline.optimize.x": 1})
    with pytest.raises(ConfigError, match=r"verify\.atoll: unknown key; did you mean 'atol'"):
        load_config(path, {"verify.atoll": 1})
    with pytest.raises(ConfigError, match="expected key.path=value"):
        parse_set("verify.atol")


def test_overlay_merges_over_config_with_its_own_relative_paths(tmp_path, fake_stage):
    base = write(tmp_path, "model: m.onnx\ncalibration: {source: shared, max_samples: 16}\n"
                           "pipeline: [optimize, {quantize: {backend: rknn}}]\n")
    models = tmp_path / "models"
    models.mkdir()
    overlay = models / "m.qprep.yaml"
    overlay.write_text("inputs: {x: [1, 3, 8, 8]}\ncalibration: {source: m_samples/calib}\n"
                       "evaluation: {source: m_samples/eval, tasks: {y: tensor}}\n"
                       "pipeline: [{quantize: {algorithm: mmse}}]\n")
    config = load_config(base, overlay=overlay)
    assert config["inputs"] == {"x": [1, 3, 8, 8]}
    assert config["calibration"]["source"] == str(models / "m_samples" / "calib")  # relative to the overlay
    assert config["calibration"]["max_samples"] == 16  # kept from the config: mappings merge key by key
    assert config["evaluation"]["source"] == str(models / "m_samples" / "eval")
    assert config["model"] == str(tmp_path / "m.onnx")  # the config's own paths stay relative to it
    assert (config.stages[1][0], config.stages[1][1].as_dict()) == ("quantize", {"backend": "rknn", "algorithm": "mmse"})
    assert config.overlay == overlay.resolve()
    # --set still wins over both
    assert load_config(base, {"calibration.max_samples": 4}, overlay=overlay)["calibration"]["max_samples"] == 4


def test_overlay_errors_name_the_file(tmp_path, fake_stage):
    base = write(tmp_path, "model: m.onnx\npipeline: [optimize]\n")
    overlay = tmp_path / "o.yaml"
    overlay.write_text("pipeline: [{quantize: {algorithm: mmse}}]\n")
    with pytest.raises(ConfigError, match=r"o.yaml: pipeline: the config has 0 'quantize' stages"):
        load_config(base, overlay=overlay)
    overlay.write_text("calibraton: {source: d}\n")
    with pytest.raises(ConfigError, match=r"^calibraton: unknown key; did you mean 'calibration'\?$"):
        load_config(base, overlay=overlay)
    overlay.write_text("- a list\n")
    with pytest.raises(ConfigError, match=r"o.yaml: an overlay must be a mapping"):
        load_config(base, overlay=overlay)


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf"])
@pytest.mark.parametrize("key", ["evaluation.gate.cosine_mean", "evaluation.floor.cosine_mean", "verify.atol",
                                 "evaluation.decision_threshold", "calibration.preprocess.std",
                                 "pipeline.quantize.fallback.target.top1_agreement"])
def test_every_threshold_is_finite(tmp_path, key, value):
    """Issue #57: `--set evaluation.gate.cosine_mean=.nan` was taken (a NaN compares false both ways, and the
    hint then offered a fallback target of nan). Every float key goes through the schema's float kind."""
    path = write(tmp_path, "model: m.onnx\ncalibration: {source: d}\nevaluation: {source: e}\n"
                           "pipeline: [{quantize: {backend: ort, fallback: {target: {cosine_mean: 0.99}}}}]\n")
    setting = f"{key}=[{value}]" if key.endswith(".std") else f"{key}={value}"
    with pytest.raises(ConfigError, match=r"^[^\n]*: expected a finite number, got [-]?(nan|inf)[^\n]*$"):
        load_config(path, dict([parse_set(setting)]))


@pytest.mark.parametrize("given", ["file", "--set"])
def test_a_yaml_bool_where_a_string_is_expected_says_to_quote_it(tmp_path, given):
    """Issue #59: `--set pipeline.quantize.ort.spread_tensors=off` said "expected a string, got bool False": YAML
    reads an unquoted off/on/yes/no as a bool. The line names the choice meant, or the spellings."""
    spread = "{spread_tensors: off}" if given == "file" else "{}"
    path = write(tmp_path, f"model: m.onnx\nevaluation: {{source: e}}\n"
                           f"pipeline: [{{quantize: {{backend: ort, ort: {spread}}}}}]\n")
    sets = dict([parse_set("pipeline.quantize.ort.spread_tensors=off")]) if given == "--set" else {}
    with pytest.raises(ConfigError, match=r"^pipeline\[0\]\.quantize\.ort\.spread_tensors: expected a string, got "
                                          r"false; write 'off' in quotes \(\"'off'\" in a --set\): YAML reads off "
                                          r"as false$"):
        load_config(path, sets)
    quoted = load_config(path, dict([parse_set("pipeline.quantize.ort.spread_tensors='off'")]))
    assert quoted.stages[0][1].ort.spread_tensors == "off"  # quoted, it is the string
    with pytest.raises(ConfigError, match=r"^evaluation\.label_names\[1\]: expected a string, got true; write the "
                                          r"word in quotes \('yes', .*YAML reads unquoted on, yes and true as true$"):
        load_config(path, dict([parse_set("evaluation.label_names=[other, yes]"), parse_set(
            "pipeline.quantize.ort.spread_tensors=float")]))


def test_threads_are_bounded(tmp_path):
    """`--set threads=100000` started thousands of threads per ONNX Runtime session and stalled the machine for
    minutes; it is refused before anything runs."""
    path = write(tmp_path, "model: m.onnx\ncalibration: {source: d}\npipeline: []\n")
    with pytest.raises(ConfigError, match=r"^threads: 100000 is above the maximum 256$"):
        load_config(path, dict([parse_set("threads=100000")]))
    assert load_config(path, dict([parse_set("threads=8")]))["threads"] == 8


@pytest.mark.parametrize("section", ["calibration", "evaluation"])
def test_a_std_of_zero_is_refused_as_the_setting_it_is(tmp_path, section):
    """`preprocess.std: [0, 0, 0]` divided every pixel by zero: a RuntimeWarning, then the samples refused as
    NaN/Inf with advice to clean data that was fine. The setting is refused, named."""
    path = write(tmp_path, "model: m.onnx\ncalibration: {source: d}\nevaluation: {source: e}\npipeline: []\n")
    with pytest.raises(ConfigError, match=rf"^{section}\.preprocess\.std\[1\]: 0\.0 is below the minimum"):
        load_config(path, dict([parse_set(f"{section}.preprocess.std=[1, 0, 1]")]))


@pytest.mark.parametrize("setting", ["evaluation.gate.cosine_mean=2", "evaluation.gate.top1_agreement=97",
                                     "pipeline.quantize.fallback.target.step_agreement=1.5"])
def test_a_threshold_no_result_can_meet_is_refused(tmp_path, setting):
    """`--set evaluation.gate.cosine_mean=2` passed validate: a gate that can never be met (97 for 0.97 alike)."""
    path = write(tmp_path, "model: m.onnx\ncalibration: {source: d}\nevaluation: {source: e}\n"
                           "pipeline: [{quantize: {backend: ort, fallback: {target: {cosine_mean: 0.99}}}}]\n")
    with pytest.raises(ConfigError, match=r"can never be met, a \w+ lies in \[(-1|0), 1\]"):
        load_config(path, dict([parse_set(setting)]))
