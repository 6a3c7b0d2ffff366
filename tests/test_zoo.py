"""scripts/zoo.py: the manifest format (parsed and checked), the sidecar each model gets, and how qprep merges
it over the zoo's base config. The zoo runs themselves are a script (scripts/zoo.py run), not tests."""

import sys

import pytest
import yaml

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import zoo  # noqa: E402

from qprep.config import load_config  # noqa: E402

WHEEL = {"project": "p", "version": "1.0", "url": "https://files.pythonhosted.org/x/p-1.0-py3-none-any.whl",
         "sha256": "a" * 64}
ENTRY = {"name": "tiny_vad", "task": "vad", "exporter": "torchscript", "sha256": "b" * 64,
         "source": {"wheel": WHEEL, "member": "p/model.onnx"}, "samples": "zoo_samples.oww_audio",
         "config": {"inputs": {"input": [1, 16000]}}}


def write_manifest(tmp_path, entries):
    path = tmp_path / "zoo.yaml"
    path.write_text(yaml.safe_dump({"models": entries}))
    return path


def test_the_shipped_manifest_parses_with_enough_distinct_models():
    entries = zoo.load_manifest()
    assert len(entries) >= 15 and len({e.name for e in entries}) == len(entries)
    assert len({e.exporter for e in entries}) >= 4
    wheel_entries = [e for e in entries if e.wheel]
    assert all(e.member and e.pinned and e.wheel.filename.endswith(".whl") for e in wheel_entries)
    for entry in entries:  # every sampler and build the manifest names exists in scripts/
        assert entry.samples.split(".")[0] in ("zoo_samples", "zoo_exports", "zoo_families")
        assert callable(zoo.function(entry.samples)) and (entry.build is None or callable(zoo.function(entry.build)))


def test_entries_parse_wheel_and_build_sources(tmp_path):
    build = {**ENTRY, "name": "built", "source": {"build": "zoo_exports.flax_vit"}}
    wheel_entry, built = zoo.load_manifest(write_manifest(tmp_path, [ENTRY, build]))
    assert wheel_entry.wheel == zoo.Wheel("p", "1.0", WHEEL["url"], "a" * 64)
    assert wheel_entry.wheel.filename == "p-1.0-py3-none-any.whl" and wheel_entry.pinned
    assert built.build == "zoo_exports.flax_vit" and built.wheel is None and not built.pinned


@pytest.mark.parametrize("change, message", [
    ({"name": "Bad-Name"}, r"name must be \[a-z0-9_\]\+"),
    ({"exporter": "onnxmltools"}, r"\(tiny_vad\): exporter 'onnxmltools' is not one of"),
    ({"sha256": "xyz"}, r"sha256 must be 64 lowercase hex digits"),
    ({"samples": "speech"}, r"samples must be module.function"),
    ({"source": {"wheel": WHEEL}}, r"source is either"),
    ({"source": {"wheel": {"project": "p"}, "member": "m"}}, r"source.wheel needs exactly project, version, url"),
    ({"colour": "red"}, r"unknown key 'colour'"),
    ({"task": ""}, r"`task` is missing"),
])
def test_bad_entries_are_refused_in_one_line_naming_entry_and_key(tmp_path, change, message):
    with pytest.raises(zoo.ManifestError, match=message):
        zoo.load_manifest(write_manifest(tmp_path, [{**ENTRY, **change}]))


def test_duplicate_names_and_unknown_selection_are_refused(tmp_path):
    with pytest.raises(zoo.ManifestError, match="name 'tiny_vad' is used twice"):
        zoo.load_manifest(write_manifest(tmp_path, [ENTRY, ENTRY]))
    entries = zoo.load_manifest(write_manifest(tmp_path, [ENTRY]))
    with pytest.raises(zoo.ManifestError, match="no zoo model named nope"):
        zoo.select(entries, "tiny_vad,nope")


def test_sidecar_merged_by_qprep_points_at_the_models_own_samples(tmp_path):
    """The sidecar zoo.py writes beside the model, merged over the base config as `qprep batch` does."""
    entry = zoo.parse_entry({**ENTRY, "config": {"inputs": {"input": [1, 16000]},
                                                 "evaluation": {"tasks": {"output": "tensor"}}}}, "t")
    models = tmp_path / "zoo" / "models"
    models.mkdir(parents=True)
    (models / "tiny_vad.qprep.yaml").write_text(yaml.safe_dump(zoo.sidecar(entry)))
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump(zoo.base_config("ort", fallback=True)))
    config = load_config(base, {"model": str(models / "tiny_vad.onnx")}, overlay=models / "tiny_vad.qprep.yaml")
    samples = tmp_path / "zoo" / "samples" / "tiny_vad"
    assert config["calibration"]["source"] == str(samples / "calibration")
    assert config["evaluation"]["source"] == str(samples / "evaluation")
    assert config["evaluation"]["max_samples"] == zoo.SPLIT_COUNTS["evaluation"]
    assert config["evaluation"]["tasks"] == {"output": "tensor"} and config["inputs"] == {"input": [1, 16000]}
    assert [name for name, _ in config.stages] == ["optimize", "keep_float", "quantize"]
    assert config.stages[2][1].fallback.target == zoo.FALLBACK_TARGET


def test_a_run_sidecar_measures_the_held_out_split_in_the_run(tmp_path, monkeypatch):
    """zoo.py run writes each model's sidecar into the run folder: sample paths absolute (the folder moved) and
    the held-out split as evaluation.heldout, so RKNN runs, which cannot be re-evaluated later, measure it too."""
    monkeypatch.setattr(zoo, "ZOO", tmp_path / "zoo")
    entry = zoo.parse_entry(ENTRY, "t")
    run_models = tmp_path / "zoo" / "runs" / "x" / "models"
    run_models.mkdir(parents=True)
    (run_models / "tiny_vad.qprep.yaml").write_text(yaml.safe_dump(zoo.run_sidecar(entry)))
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump(zoo.base_config("rknn", fallback=False)))
    config = load_config(base, {"model": str(run_models / "tiny_vad.onnx")}, overlay=run_models / "tiny_vad.qprep.yaml")
    samples = (tmp_path / "zoo" / "samples" / "tiny_vad").resolve()
    assert config["calibration"]["source"] == str(samples / "calibration")
    assert config["evaluation"]["source"] == str(samples / "evaluation")
    assert config["evaluation"]["heldout"]["source"] == str(tmp_path / "zoo" / "samples" / "tiny_vad" / "heldout")

def test_nodes_measures_optimize_against_onnxslim_and_says_why_a_layernorm_is_left(tmp_path, monkeypatch):
    """`zoo.py nodes` on a tiny zoo: a LayerNorm whose gamma is a graph input (refused, with the reason) and a
    Slice that keeps everything (removed by cleanup); the model's sidecar and samples are used."""
    pytest.importorskip("onnxslim", reason="onnxslim is a dev dependency (.[dev]), not in the latest-stack venv")
    import numpy as np
    from onnx import helper, save

    from graphs import make_model

    shape = [2, 8, 16]
    nodes = [helper.make_node("Slice", ["x", "zero", "end", "zero"], ["xs"]),
             helper.make_node("ReduceMean", ["xs"], ["m"], axes=[-1]), helper.make_node("Sub", ["xs", "m"], ["d"]),
             helper.make_node("Mul", ["d", "d"], ["sq"]), helper.make_node("ReduceMean", ["sq"], ["v"], axes=[-1]),
             helper.make_node("Add", ["v", "eps"], ["ve"]), helper.make_node("Sqrt", ["ve"], ["s"]),
             helper.make_node("Div", ["d", "s"], ["n"]), helper.make_node("Mul", ["n", "gamma"], ["y"])]
    inits = {"eps": np.float32(1e-5), "zero": np.array([0], np.int64),
             "end": np.array([np.iinfo(np.int64).max], np.int64)}
    (tmp_path / "models").mkdir()
    save(make_model(nodes, [("x", shape), ("gamma", [16])], [("y", shape)], inits, opset=17),
         str(tmp_path / "models" / "tiny.onnx"))
    (tmp_path / "models" / "tiny.qprep.yaml").write_text(
        "calibration: {source: ../samples/tiny/calibration, max_samples: 32}\n"
        "evaluation: {source: ../samples/tiny/evaluation, max_samples: 48}\n")
    samples = tmp_path / "samples" / "tiny" / "calibration"
    samples.mkdir(parents=True)
    for i in range(3):
        rng = np.random.default_rng(i)
        np.savez(samples / f"{i:04d}.npz", x=rng.normal(size=shape).astype(np.float32),
                 gamma=rng.uniform(0.5, 1.5, 16).astype(np.float32))
    monkeypatch.setattr(zoo, "ZOO", tmp_path)
    entry = zoo.Entry(name="tiny", task="t", exporter="other", sha256="b" * 64, samples="zoo_samples.x")
    rows = zoo.nodes([entry], samples=2)
    assert "error" not in rows[0], rows[0]
    assert rows[0]["before"] == 9 and rows[0]["qprep"]["nodes"] == 8
    assert rows[0]["layernorms_left"] == {"gamma is not a constant (graph input or computed)": 1}
    text = zoo.render_nodes(rows, 2)
    assert "| tiny | 9 | 8 | " in text and "1× gamma is not a constant" in text


def test_the_table_counts_each_outcome_and_shows_refusals_whole_lines():
    rows = [{"model": m, "exporter": "tf2onnx", "task": "t", "status": s, "float set": 0, "int8 MACs": 0.9,
             "cosine eval": 0.99,
             "task metric eval": "", "cosine held-out": None, "task metric held-out": "", "INT8 speed-up": 2.0,
             "fallback s": None, "note": n}
            for m, s, n in (("a", "ok", ""), ("b", "refused", "quantize.rknn: node 'L' is a Loop"),
                            ("c", "failed", "timed out after 900 s"))]
    text = zoo.render_table(rows, "x")
    assert text.startswith(f"Zoo `x`: 3 models — 1 ok, 0 gate missed, 1 refused (one line naming what qprep does "
                           f"not take), 1 failed. Held-out: {zoo.SPLIT_COUNTS['heldout']} samples")
    assert "| b | tf2onnx | t | refused | 0 | 0.9000 | 0.9900 |" in text and "node 'L' is a Loop |" in text
