"""The RKNN backend's builds (its entry point `quantize` is convert.py, which hands this builder to the search).

RknnBuilder makes each build a fresh RKNN object in the toolkit worker (toolkit.py): a plain build, or with
float16 layers a hybrid build (step1 once, then one step2 per float16 set). It composes the owners of each part:
the model file and its weights (model_file.py), hybrid step1 and reused ranges (step1.py), the retry without a
failing toolkit rule (rules.py) and the kept simulator sessions (sessions.py).

Facts this module is built on (measured with rknn-toolkit2 2.5.0, see ../shared/notes/rknn-toolkit2.md):
- step2 of hybrid quantization needs a fresh RKNN object and accepts only IR tensor names (names.py).
- calibration is dataset.txt with the normalization moved onto the NPU where inputs are images (dataset.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

from qprep.model.info import graph_inputs
from qprep.quantize import outlier_positions
from qprep.quantize.backend import QuantizeJob
from qprep.quantize.rknn import dataset, io_names, limits
from qprep.quantize.rknn import ranges as rknn_ranges
from qprep.quantize.rknn.model_file import ModelFile
from qprep.quantize.rknn.names import IRNames, map_float_set
from qprep.quantize.rknn.rules import FailingRules
from qprep.quantize.rknn.runner import Runner
from qprep.quantize.rknn.sessions import Session, Sessions
from qprep.quantize.rknn.step1 import Step1
from qprep.quantize.rknn.toolkit import Toolkit

log = logging.getLogger("qprep")


class RknnBuilder:
    """Loads the model once; every build is a fresh RKNN object. With float16 layers, hybrid step1 runs once
    (calibration) and each build is a step2 with another custom_quantize_layers list, which is what makes
    the fallback's trials affordable. `details` is the build's record the report shows; its parts record
    their own decisions there."""

    def __init__(self, job: QuantizeJob, split: outlier_positions.Split | None = None):
        self.job, self.options = job, job.options
        self.split = split or outlier_positions.Split(job.model)
        self.toolkit = Toolkit(job.work_dir)
        self.inputs = graph_inputs(job.model)
        limits.require_fixed_dims(job.model)
        self.renames = io_names.toolkit_names(job.model)  # only in the file the toolkit loads (io_names.py)
        self.normalization = dataset.normalization(job)
        self.dataset = dataset.write_dataset(job, job.work_dir, self.normalization)
        self.model_file = ModelFile(job, self.renames, job.work_dir / "model.onnx", self.dataset)
        options = self.options
        self.config = dict(target_platform=options.target_platform, quantized_dtype=options.quantized_dtype,
                           quantized_algorithm=options.quantized_algorithm,
                           quantized_method=options.quantized_method, optimization_level=options.optimization_level)
        if self.normalization:
            self.config.update(mean_values=[self.normalization["mean"]], std_values=[self.normalization["std"]])
        self.details = {"config": self.config, "dataset": str(self.dataset),
                        "calibration_samples": dataset.count_lines(self.dataset)}
        if self.renames:
            self.details["toolkit_io_names"] = self.renames
        self.rules = FailingRules(self.config, self.details, on_disable=lambda: self.step1.forget_outputs())
        self.step1 = Step1(self.toolkit, self.dataset, self.renames, self._loaded, self.rules.retry, self.details)
        self.sessions = Sessions(self.toolkit)
        self.toolkit.start()  # its start-up (importing torch) overlaps the GPTQ weights
        try:
            self._save_model()
        except BaseException:
            self.toolkit.close()
            raise

    @property
    def algorithm(self) -> str:
        return self.config["quantized_algorithm"]

    @property
    def weight_rounding(self) -> str:
        """The weight rounding asked for (gptq | nearest | mmse); use_weight_rounding changes it."""
        return self.model_file.weight_rounding

    @property
    def setting(self) -> str:
        """What a build's numbers depend on besides its float16 layers (its sessions and the search's remembered
        results are keyed on it): the range algorithm and how the weights get their integers."""
        return f"{self.algorithm}, {self.weights_in_use()} weights"

    def weights_in_use(self) -> str:
        """How the weights get their integers under the current range algorithm (ModelFile.weights_in_use)."""
        return self.model_file.weights_in_use(self.algorithm)

    def rounds_weights(self) -> bool:
        """Is this a build whose weight grid qprep knows (w8a8, per channel, calibrated)?"""
        return self.model_file.rounds_weights()

    def use_weight_rounding(self, method: str) -> bool:
        """Give the weights their integers another way from now on (gptq | nearest | mmse); the pinned build
        stays (as in use_algorithm). False if it cannot: mmse's build failed, the weights stay as they were."""
        if method != self.model_file.weight_rounding:
            before = self.model_file.weight_rounding
            self.sessions.release_unpinned()
            self.model_file.weight_rounding = method
            self.step1.forget()
            self._save_model(otherwise=before)
        return self.model_file.weight_rounding == method

    def use_algorithm(self, algorithm: str) -> None:
        """Build with another range algorithm from now on (hybrid step1 records it, so step1 runs again). The
        pinned build stays: a trial of another algorithm that is not kept leaves the search's best exportable
        without building it again."""
        if algorithm != self.algorithm:
            self.sessions.release_unpinned()
            self.config["quantized_algorithm"] = algorithm
            self.step1.forget()
            self.step1.forget_ranges()
            self._save_model()

    def reuse_ranges(self, float_set: set[str]) -> bool:
        """Later builds take the ranges of the build of `float_set` (made with the current algorithm) and search
        none (ranges.py): with mmse, a trial's step2 then takes seconds instead of minutes."""
        kept = self.sessions.get((self.setting, frozenset(float_set)))
        if kept is None or self.algorithm == "normal" or not self.options.do_quantization:
            return False
        return self.step1.reuse(kept.runner, self.algorithm, len(float_set))

    def step1_seconds(self, weights: str) -> float:
        """What a step1 with the current algorithm on the `weights` model file (gptq | prepared) would add to the
        next build (Step1.seconds)."""
        return self.step1.seconds(self.algorithm, weights)

    def _save_model(self, otherwise: str = "gptq") -> None:
        """The file for the current setting (ModelFile.save), and what the record says of its weights."""
        self.model_file.save(self.algorithm, self._mmse_table, otherwise)
        self.details["weight_rounding"] = self.model_file.record

    def _mmse_table(self, samples: Path) -> dict[str, dict]:
        """The quantization table of an mmse build on the `samples` dataset file (mmse's weight ranges)."""
        def mmse_table():
            rknn = self._loaded("mmse")
            try:
                self.toolkit.call("build (mmse weight ranges)", rknn, "build", do_quantization=True,
                                  dataset=str(samples))
                return self.toolkit.apply("quantization table", rknn, rknn_ranges.table_of)
            finally:
                self.toolkit.discard(rknn)

        return self.rules.retry(mmse_table)

    def _table(self) -> dict | None:
        return self.step1.table(self.model_file.weight_table(self.algorithm))

    def pin(self, float_set: set[str]) -> None:
        self.sessions.pin((self.setting, frozenset(float_set)))

    def _loaded(self, algorithm: str | None = None) -> int:
        rknn = self.toolkit.new()
        self.toolkit.call("config", rknn, "config", **{**self.config, "quantized_algorithm": algorithm or self.algorithm})
        self.toolkit.call("load_onnx", rknn, "load_onnx", model=str(self.model_file.path),
                          inputs=[self.renames.get(s.name, s.name) for s in self.inputs],
                          input_size_list=[s.shape for s in self.inputs])
        return rknn

    def ir_names(self) -> IRNames:
        """Hybrid step1 (once per setting): the IR, its tensor names and the quantization cfg step2 builds from."""
        algorithm = self.algorithm
        return self.step1.ir_names(algorithm, self.model_file.holds(), self.model_file.weight_table(algorithm))

    def _call_or_release(self, rknn: int, method: str, **kwargs) -> None:
        """`rknn.method(**kwargs)` in the toolkit; the object is released when the call fails (a build the caller
        would have kept)."""
        try:
            self.toolkit.call(method, rknn, method, **kwargs)
        except BaseException:
            self.toolkit.discard(rknn)
            raise

    def build(self, float_set: set[str]):
        """An RKNN object built with `float_set` as float16 layers, its simulator runtime initialized."""
        if (float_set or self._table()) and self.options.do_quantization:
            ir = self.ir_names()
            mapping, unmapped = map_float_set(self.job.model, sorted(float_set), ir)
            tensors = list(dict.fromkeys(t for m in mapping.values() for t in m["tensors"]))
            step2 = self.step1.step2_inputs(tensors)
            rknn = self.toolkit.new()
            self._call_or_release(rknn, "hybrid_quantization_step2", **step2)
            self.details["float16_layers"] = {"requested_nodes": len(float_set), "mapped": mapping,
                                              "unmapped": unmapped, "ir_tensors": tensors}
            if unmapped:
                log.warning("rknn: %d float-set nodes have no RKNN tensor (fused or renamed): %s", len(unmapped),
                            ", ".join(unmapped[:10]))
        else:
            rknn = self._loaded()
            self._call_or_release(rknn, "build", do_quantization=self.options.do_quantization,
                                  dataset=str(self.dataset))
            self.details.pop("float16_layers", None)
        return rknn

    def session(self, float_set: set[str]) -> Runner:
        """The build with `float_set` as float16 layers, its simulator runtime initialized. The last one and
        the pinned one are kept (sessions.py)."""
        key = (self.setting, frozenset(float_set))
        if key not in self.sessions:
            self.sessions.release_unpinned()
            rknn = self.rules.retry(lambda: self.build(float_set))
            self.toolkit.call("init_runtime (simulator)", rknn, "init_runtime")
            runner = Runner(rknn, self.toolkit, self.job.model, self.normalization, self.renames)
            self.sessions.add(key, Session(rknn, runner, self.details.get("float16_layers")))
        _, runner, layers = self.sessions[key]
        if layers is None:
            self.details.pop("float16_layers", None)
        else:
            self.details["float16_layers"] = layers
        return runner

    def close(self) -> None:
        """Release every build, stop the toolkit worker and delete the kept step1 outputs (a big model's are GBs)."""
        self.sessions.forget()
        self.toolkit.close()
        self.step1.clean()

    def release(self, keep: Runner | None = None) -> None:
        """Free the simulator runtimes of the kept builds (all but `keep`)."""
        self.sessions.release(keep)
