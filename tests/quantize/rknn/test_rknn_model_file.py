"""model_file.py: which model the toolkit loads and how its weights get their integers (no toolkit: the models
written land in a list, GPTQ's weights are a stand-in)."""

from types import SimpleNamespace

import pytest

from qprep.quantize.rknn import model_file
from qprep.quantize.rknn import weights as rknn_weights
from qprep.quantize.rknn.model_file import MMSE_WEIGHT_SAMPLES, ModelFile
from conftest import typed


def written_models(monkeypatch, tmp_path, rounding: str) -> tuple[ModelFile, list]:
    """A ModelFile whose writes land in the returned list; GPTQ's model is the string "on grid"."""
    saved = []
    monkeypatch.setattr(model_file, "save_model", lambda model, path: saved.append(model))
    monkeypatch.setattr(model_file.io_names, "renamed", lambda model, renames: model)
    monkeypatch.setattr(rknn_weights, "on_grid", lambda model, samples, threads: ("on grid", 3, {}))
    dataset = tmp_path / "dataset.txt"
    dataset.write_text("".join(f"sample_{i}.npy\n" for i in range(12)))
    job = SimpleNamespace(samples=[{}], model="as prepared", options=typed("rknn", weight_rounding=rounding),
                          threads=1)
    return ModelFile(job, {}, tmp_path / "model.onnx", dataset), saved


@pytest.mark.parametrize("algorithm, rounding, fetched, model", [
    ("normal", "mmse", True, "as prepared"), ("mmse", "mmse", False, "as prepared"),
    ("kl_divergence", "mmse", True, "as prepared"), ("kl_divergence", "gptq", False, "as prepared"),
    ("normal", "gptq", False, "on grid")])
def test_mmse_weight_ranges_are_fetched_only_for_normal_and_kl_builds(monkeypatch, tmp_path, algorithm, rounding,
                                                                      fetched, model):
    """`weight_rounding: mmse` means mmse's weight ranges under `normal` or `kl_divergence` activation ranges. The
    `mmse` algorithm searches its own (an mmse trial of the fallback fetched them, 53 s on the zoo's PP-OCRv3 rec,
    for nothing); GPTQ goes with normal ranges only (as measured), kl builds otherwise take the weights as they are."""
    files, saved = written_models(monkeypatch, tmp_path, rounding)
    calls = []

    def mmse_build(dataset):
        calls.append(dataset.read_text().splitlines())
        return {"w": {"qmethod": "channel", "dtype": "int8"}, "x": {"qmethod": "layer", "dtype": "int8"}}

    files.save(algorithm, mmse_build)
    assert bool(calls) is fetched and saved == [model]
    assert (files.weight_table(algorithm) is not None) is fetched
    method = {"mmse": "mmse search"}.get(algorithm, rounding if fetched or algorithm == "normal" else "nearest")
    assert files.record["method"] == method == files.weights_in_use(algorithm)
    assert files.holds() == ("gptq" if model == "on grid" else "prepared")
    if fetched:  # on the first calibration samples, its weights only
        assert calls == [[f"sample_{i}.npy" for i in range(MMSE_WEIGHT_SAMPLES)]]
        assert files.weight_table(algorithm) == {"w": {"qmethod": "channel", "dtype": "int8"}}
        assert files.record["calibration_samples"] == MMSE_WEIGHT_SAMPLES and files.record["weights"] == 1


def test_the_file_is_written_only_when_another_model_goes_there(monkeypatch, tmp_path):
    files, saved = written_models(monkeypatch, tmp_path, "gptq")
    files.save("normal", None)
    files.save("normal", None)
    assert saved == ["on grid"] and files.record == {"method": "gptq", "layers": 3, "seconds": files.record["seconds"]}
    files.save("kl_divergence", None)  # GPTQ's grid is normal's
    files.save("normal", None)  # GPTQ's weights made once
    assert saved == ["on grid", "as prepared", "on grid"] and files.record["method"] == "gptq"
