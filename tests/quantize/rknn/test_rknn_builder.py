"""builder.py: RknnBuilder composes its parts (model_file.py, step1.py, rules.py, sessions.py); here, how a change
of setting reaches each of them, on a builder assembled from its parts around a scripted toolkit."""

from types import SimpleNamespace

import pytest

from qprep.errors import ToolkitError
from qprep.quantize import search
from qprep.quantize.rknn import model_file
from qprep.quantize.rknn.builder import RknnBuilder
from qprep.quantize.rknn.model_file import ModelFile
from qprep.quantize.rknn.rules import FailingRules
from qprep.quantize.rknn.sessions import Session, Sessions
from qprep.quantize.rknn.step1 import Step1
from conftest import typed


class ScriptedToolkit:
    """Every call passes but `build`, which fails as told; what was called and released is listed."""

    def __init__(self, work_dir, build_fails=None):
        self.work_dir, self.build_fails, self.calls, self.released = work_dir, build_fails, [], []
        self.running = True

    def new(self) -> int:
        return len(self.calls) + 1

    def call(self, step, rknn, method, **kwargs):
        self.calls.append((method, kwargs))
        if method == "build" and self.build_fails:
            raise self.build_fails

    def release(self, rknn):
        self.released.append(rknn)

    discard = release


def assembled(monkeypatch, tmp_path, toolkit, algorithm: str, rounding: str) -> tuple[RknnBuilder, list]:
    """An RknnBuilder made of its parts without a model or a worker; the models it writes land in the list."""
    saved = []
    monkeypatch.setattr(model_file, "save_model", lambda model, path: saved.append(model))
    monkeypatch.setattr(model_file.io_names, "renamed", lambda model, renames: model)
    dataset = tmp_path / "dataset.txt"
    dataset.write_text("".join(f"sample_{i}.npy\n" for i in range(12)))
    options = typed("rknn", quantized_algorithm=algorithm, weight_rounding=rounding)
    job = SimpleNamespace(samples=[{}], model="as prepared", options=options, threads=1)
    builder = RknnBuilder.__new__(RknnBuilder)
    builder.job, builder.options, builder.toolkit, builder.inputs, builder.renames = job, options, toolkit, [], {}
    builder.config, builder.details = {"quantized_algorithm": algorithm}, {}
    builder.model_file = ModelFile(job, {}, tmp_path / "model.onnx", dataset)
    builder.rules = FailingRules(builder.config, builder.details, on_disable=lambda: builder.step1.forget_outputs())
    builder.step1 = Step1(toolkit, dataset, {}, lambda algorithm: 0, builder.rules.retry, builder.details)
    builder.sessions = Sessions(toolkit)
    return builder, saved


def test_switching_the_range_algorithm_keeps_the_pinned_build_and_releases_the_rest(monkeypatch, tmp_path):
    """A trial of another algorithm (mmse, kl_divergence) that is not kept must leave the search's best build
    exportable: use_algorithm frees every other build, not the pinned one, and keeps it pinned; ranges reused
    from a build of the old algorithm are dropped."""
    toolkit = ScriptedToolkit(tmp_path)
    builder, saved = assembled(monkeypatch, tmp_path, toolkit, "normal", "nearest")
    builder.pin({"a"})
    best, last = (builder.setting, frozenset({"a"})), (builder.setting, frozenset({"a", "b"}))
    builder.sessions.add(best, Session("rknn best", "runner best", None))
    builder.sessions.add(last, Session("rknn last", "runner last", None))
    assert builder.step1.reuse(SimpleNamespace(quantization_table=lambda: {"t": {}}), "normal", 1)
    builder.use_algorithm("kl_divergence")
    assert toolkit.released == ["rknn last"] and builder.sessions.keys() == [best] and builder.sessions.pinned == best
    assert builder.algorithm == "kl_divergence" and builder.step1.table(None) is None
    assert "ranges_reused" not in builder.details and saved == ["as prepared"]
    assert builder.details["weight_rounding"] == {"method": "nearest"}


@pytest.mark.parametrize("crashed", [False, True])
def test_a_failed_mmse_weight_build_leaves_the_weights_as_they_were(monkeypatch, tmp_path, crashed):
    """The fallback's mmse weight phase is optional: when its build fails the weights stay the way they were
    rounded (here `nearest`, which a user sets to spare GPTQ's memory on a big model), the phase reports it
    could not switch and choose_setting records no score for it. A crashed toolkit worker still stops the run."""
    failure = ToolkitError("rknn-toolkit2 failed in build (mmse weight ranges)", crashed=crashed)
    toolkit = ScriptedToolkit(tmp_path, build_fails=failure)
    builder, saved = assembled(monkeypatch, tmp_path, toolkit, "normal", "nearest")
    if crashed:
        with pytest.raises(ToolkitError):
            builder.use_weight_rounding("mmse")
        return
    record = search.choose_setting("weight_rounding", "nearest", ["mmse"], builder.use_weight_rounding,
                                   lambda float_set, samples: {"y": {"cosine_mean": 0.95}}, set(), [{}],
                                   {"cosine_mean": 0.99})
    assert builder.weight_rounding == "nearest" and saved == ["as prepared"]
    assert record["chosen"] == "nearest" and list(record["scores"]) == ["nearest"]
    assert builder.details["weight_rounding"] == {"method": "nearest"}
    config, load, build = toolkit.calls  # the mmse build on the first calibration samples, released
    assert config[1]["quantized_algorithm"] == "mmse" and load[1]["model"] == str(tmp_path / "model.onnx")
    assert build[1]["dataset"].endswith("dataset_mmse_weights.txt") and toolkit.released == [1]
