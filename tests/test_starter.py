"""`qprep init`: the starter config is valid as written and runs with no edits when the data is at hand."""

import numpy as np
import pytest
import yaml

from graphs import make_model, tiny_conv_model
from onnx import helper
from conftest import CALIBRATION, demo_model


def write_npz_splits(root, shape, count=4):
    rng = np.random.default_rng(0)
    for split in ("calib", "eval", "heldout"):
        (root / split).mkdir(parents=True)
        for i in range(count):
            np.savez(root / split / f"{i}.npz", x=rng.random(shape, dtype=np.float32))


def test_init_reads_inputs_splits_and_layernorms_into_a_valid_config(tmp_path, cli):
    import onnx

    onnx.save(tiny_conv_model(batch="N"), tmp_path / "tiny.onnx")
    write_npz_splits(tmp_path / "data", (1, 3, 8, 8))
    code, _, err = cli("init", str(tmp_path / "tiny.onnx"), "--data", str(tmp_path / "data"),
                       "--out", str(tmp_path / "cfg" / "tiny.yaml"))
    assert code == 0, err
    config = yaml.safe_load((tmp_path / "cfg" / "tiny.yaml").read_text())
    assert config["inputs"] == {"x": [1, 3, 8, 8]}
    assert config["calibration"]["source"] == "../data/calib"  # relative to the config's folder
    assert config["evaluation"]["heldout"] == {"source": "../data/heldout"}
    assert [next(iter(s)) for s in config["pipeline"]] == ["optimize", "quantize"]
    assert cli("validate", str(tmp_path / "cfg" / "tiny.yaml"))[0] == 0
    code, _, err = cli("init", str(tmp_path / "tiny.onnx"), "--out", str(tmp_path / "cfg" / "tiny.yaml"))
    assert code == 2 and "--force" in err


def test_init_keeps_layernorms_float_and_marks_what_the_user_must_fill_in(tmp_path, cli):
    import onnx

    x = ("x", ["batch", "seq", 4])
    nodes = [helper.make_node("LayerNormalization", ["x", "g", "b"], ["y"], axis=-1)]
    onnx.save(make_model(nodes, [x], [("y", ["batch", "seq", 4])], {"g": np.ones(4, np.float32),
                                                                   "b": np.zeros(4, np.float32)}, opset=17),
              tmp_path / "ln.onnx")
    assert cli("init", str(tmp_path / "ln.onnx"), "--backend", "rknn", "--out", str(tmp_path / "ln.yaml"))[0] == 0
    text = (tmp_path / "ln.yaml").read_text()
    config = yaml.safe_load(text)
    assert {"keep_float": {}} in config["pipeline"]
    assert config["inputs"] == {"x": [1, "seq", 4]} and "FILL IN: the named dims of x" in text
    assert config["calibration"]["source"] == "data/calibration" and "FILL IN" in text


@pytest.mark.slow
def test_init_then_run_works_with_no_edits(tmp_path, cli):
    """A demo model with dynamic dims and image data in calib/eval/heldout folders: init, then run as written
    (fewer samples only to keep the test short)."""
    data = tmp_path / "data"
    data.mkdir()
    for split in ("calib", "eval", "heldout"):
        (data / split).symlink_to(CALIBRATION / "ocr_cls" / split)
    assert cli("init", str(demo_model("ppocr_cls.onnx")), "--data", str(data), "--out",
               str(tmp_path / "cls.yaml"))[0] == 0
    code, _, err = cli("run", str(tmp_path / "cls.yaml"), "--set", "evaluation.max_samples=16",
                       "--set", "calibration.max_samples=16", "--set", "evaluation.latency.runs=2")
    assert code in (0, 1), err  # ok, or a gate judged and missed; never an error
    assert (tmp_path / "runs" / "cls" / "report.json").exists()  # named after the config


def test_init_asks_to_fill_in_only_the_lines_the_config_marks(tmp_path, cli):
    """Issue #59: init said "review the lines marked FILL IN" of a config that had none."""
    import onnx

    from graphs import two_input_model

    onnx.save(two_input_model(), tmp_path / "two.onnx")
    for split in ("calib", "eval"):
        (tmp_path / "data" / split).mkdir(parents=True)
        np.savez(tmp_path / "data" / split / "0.npz", ids=np.zeros((1, 5), np.int64), mask=np.ones((1, 5), np.float32))
    code, out, err = cli("init", tmp_path / "two.onnx", "--data", tmp_path / "data", "--out", tmp_path / "all.yaml")
    assert code == 0, err
    assert "FILL IN" not in (tmp_path / "all.yaml").read_text() and "FILL IN" not in out
    code, out, err = cli("init", tmp_path / "two.onnx", "--out", tmp_path / "none.yaml")
    assert code == 0, err
    assert "fill in the 2 lines marked FILL IN" in out  # the calibration and the evaluation source


def test_init_suggests_image_preprocessing_only_for_image_samples(tmp_path, cli):
    """Issue #59: with .npz samples init wrote `preprocess: {mean: [123.675, …]}` and asked to check it, and the
    run then ignored it (preprocess applies to images only). Image samples still get the suggestion."""
    import onnx
    from PIL import Image

    onnx.save(tiny_conv_model(batch=1), tmp_path / "tiny.onnx")
    write_npz_splits(tmp_path / "arrays", (1, 3, 8, 8))
    code, out, err = cli("init", tmp_path / "tiny.onnx", "--data", tmp_path / "arrays", "--out", tmp_path / "a.yaml")
    assert code == 0, err
    config = yaml.safe_load((tmp_path / "a.yaml").read_text())
    assert "preprocess" not in config["calibration"] and "preprocess" not in config["evaluation"]
    assert "preprocess" not in out and "preprocess" not in (tmp_path / "a.yaml").read_text()
    for split in ("calib", "eval"):
        (tmp_path / "images" / split).mkdir(parents=True)
        Image.new("RGB", (8, 8), (10, 20, 30)).save(tmp_path / "images" / split / "0.png")
    code, out, err = cli("init", tmp_path / "tiny.onnx", "--data", tmp_path / "images", "--out", tmp_path / "i.yaml")
    assert code == 0, err
    config = yaml.safe_load((tmp_path / "i.yaml").read_text())
    assert config["calibration"]["preprocess"]["mean"] and config["evaluation"]["preprocess"]["mean"]
    assert "check the suggested preprocess mean/std" in out


def test_each_config_init_writes_runs_in_its_own_folder(tmp_path, cli):
    """Issue #59: an rknn config and the ort one both wrote `output_dir: runs/<model>`, so `qprep run rknn.yaml
    --force` would have cleared the ort run. The run directory is named after the config."""
    import onnx

    onnx.save(tiny_conv_model(batch=1), tmp_path / "tiny.onnx")
    for backend, out in (("ort", "tiny.yaml"), ("rknn", "tiny_rknn.yaml"), ("fp16", "sub/fp16.yaml")):
        assert cli("init", tmp_path / "tiny.onnx", "--backend", backend, "--out", tmp_path / out)[0] == 0
    assert [yaml.safe_load((tmp_path / out).read_text())["output_dir"]
            for out in ("tiny.yaml", "tiny_rknn.yaml", "sub/fp16.yaml")] == ["runs/tiny", "runs/tiny_rknn", "runs/fp16"]


def test_the_readme_section_the_starter_config_points_to_exists(tmp_path, cli):
    import re

    import onnx

    from conftest import ROOT

    onnx.save(tiny_conv_model(batch=1), tmp_path / "tiny.onnx")
    assert cli("init", tmp_path / "tiny.onnx", "--out", tmp_path / "tiny.yaml")[0] == 0
    pointers = re.findall(r"README\.md, '([^']+)'", (tmp_path / "tiny.yaml").read_text())
    headings = {line.lstrip("#").strip() for line in (ROOT / "README.md").read_text().splitlines()
                if line.startswith("#")}
    assert pointers and set(pointers) <= headings
    assert "README" not in re.sub(r"README\.md, '[^']+'", "", (tmp_path / "tiny.yaml").read_text())


def test_the_default_agreement_target_is_one_a_good_int8_result_meets_on_its_sample_count(tmp_path, cli):
    """init wrote top1_agreement 0.97 whatever the sample count: on 32 samples that is 32 of 32 (one flip is
    3.1%). The target now comes from the count of the set that judges the gate, with the reason in a comment."""
    import onnx

    from qprep.measure.gate import agreement_target

    nodes = [helper.make_node("MatMul", ["x", "w"], ["logits"])]
    onnx.save(make_model(nodes, [("x", ["N", 8])], [("logits", ["N", 10])],
                         {"w": np.ones((8, 10), np.float32)}), tmp_path / "cls.onnx")
    for split, count in (("calib", 8), ("eval", 48)):
        (tmp_path / "data" / split).mkdir(parents=True)
        for i in range(count):
            np.savez(tmp_path / "data" / split / f"{i}.npz", x=np.ones((1, 8), np.float32))
    assert cli("init", tmp_path / "cls.onnx", "--data", tmp_path / "data", "--out", tmp_path / "c.yaml")[0] == 0
    text = (tmp_path / "c.yaml").read_text()
    config = yaml.safe_load(text)
    target, flips = agreement_target(48)
    assert config["evaluation"]["gate"]["top1_agreement"] == target < 0.97
    assert (48 - flips) / 48 >= target and flips >= 2  # one flip, or two, never misses it
    assert "# top1_agreement 0.93: on 48 samples (the evaluation samples found) one sample is 2.1%" in text
    assert yaml.safe_load(text)["pipeline"][-1]["quantize"]["fallback"]["target"]["top1_agreement"] == target
    assert cli("init", tmp_path / "cls.onnx", "--out", tmp_path / "none.yaml")[0] == 0  # no data: a few dozen
    assert "on 32 samples (a few dozen samples, as the README asks)" in (tmp_path / "none.yaml").read_text()
    assert agreement_target(500)[0] == 0.97 and agreement_target(32)[0] < 31 / 32


def test_init_says_what_the_mean_std_it_writes_for_a_grayscale_model_are(tmp_path, cli):
    """A 1-channel model got mean [127.5] std [127.5] under a comment that said "ImageNet-trained: the values
    below"; the comment names what the written values assume (inputs in [-1, 1])."""
    import onnx
    from PIL import Image

    model = make_model([helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])], [("x", [1, 1, 8, 8])],
                       [("y", [1, 4, 8, 8])], {"w": np.ones((4, 1, 3, 3), np.float32)})
    onnx.save(model, tmp_path / "gray.onnx")
    for split in ("calib", "eval"):
        (tmp_path / "images" / split).mkdir(parents=True)
        Image.new("L", (8, 8), 10).save(tmp_path / "images" / split / "0.png")
    code, _, err = cli("init", tmp_path / "gray.onnx", "--data", tmp_path / "images", "--out", tmp_path / "g.yaml")
    assert code == 0, err
    text = (tmp_path / "g.yaml").read_text()
    assert yaml.safe_load(text)["calibration"]["preprocess"]["mean"] == [127.5]
    assert "ImageNet" not in text and "inputs in [-1, 1]: the values below" in text
