"""The RKNN backend's builds (its entry point `quantize` is convert.py, which hands this builder to the search).

RknnBuilder makes each build a fresh RKNN object in the toolkit worker (toolkit.py): a plain build, or with
float16 layers a hybrid build (step1 once, then one step2 per float16 set), and keeps the last build's and the
pinned build's simulator sessions (runner.py) because with `mmse` one build takes minutes.

Facts this module is built on (measured with rknn-toolkit2 2.5.0, see ../shared/notes/rknn-toolkit2.md):
- step2 of hybrid quantization needs a fresh RKNN object and accepts only IR tensor names (names.py).
- calibration is dataset.txt with the normalization moved onto the NPU where inputs are images (dataset.py).
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import onnx

from qprep.errors import QprepError, ToolkitError
from qprep.model.info import graph_inputs
from qprep.model.io import save_model
from qprep.quantize import outlier_positions
from qprep.quantize.backend import QuantizeJob
from qprep.quantize.rknn import dataset, io_names, limits
from qprep.quantize.rknn import ranges as rknn_ranges
from qprep.quantize.rknn.names import IRNames, map_float_set, with_custom_layers
from qprep.quantize.rknn.runner import Runner
from qprep.quantize.rknn.toolkit import Toolkit

log = logging.getLogger("qprep")

# calibration samples of the mmse build whose weight ranges `weight_rounding: mmse` takes. The toolkit's mmse gain
# is in its weight ranges (normal builds with them score as an mmse build does, with its activation ranges they
# do not), and a build on 8 samples gives them at a fraction of a full mmse build (fewer lose accuracy); nearest
# rounding on mmse's grid beat GPTQ on it. Which 8 matters (8 spread over the calibration lines fell below GPTQ),
# so the fallback measures the harvest against the weights as they are and keeps it only where it wins; the
# first 8 are the ones measured (BENCHMARKS.md: "mmse's weight ranges without an mmse build per trial").
MMSE_WEIGHT_SAMPLES = 8
MAX_RULES_DISABLED = 4  # toolkit graph rules a build may switch off after they failed (_without_failing_rules)


class RknnBuilder:
    """Loads the model once; every build is a fresh RKNN object. With float16 layers, hybrid step1 runs once
    (calibration) and each build is a step2 with another custom_quantize_layers list, which is what makes
    the fallback's trials affordable."""

    def __init__(self, job: QuantizeJob, split: "outlier_positions.Split | None" = None):
        self.job, self.options = job, job.options
        self.split = split or outlier_positions.Split(job.model)
        self.toolkit = Toolkit(job.work_dir)
        self.inputs = graph_inputs(job.model)
        limits.require_fixed_dims(job.model)
        self.renames = io_names.toolkit_names(job.model)  # only in the file the toolkit loads (io_names.py)
        self.model_path = job.work_dir / "model.onnx"
        self._on_grid: onnx.ModelProto | None = None  # the model with GPTQ weights, made once
        self._grid_record: dict = {}
        self.weight_rounding = self.options.weight_rounding  # the fallback may choose another (use_weight_rounding)
        self._weight_table: dict | None = None  # weight_rounding mmse: the int8 weight entries step1 is given
        self._weight_record: dict = {}
        self._written: onnx.ModelProto | None = None  # the model in model_path (_write)
        self.normalization = dataset.normalization(job)
        self.dataset = dataset.write_dataset(job, job.work_dir, self.normalization)
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
        self._step1: tuple[Path, str, IRNames] | None = None
        self._step1_kept: dict[tuple[str, str], str] = {}  # (its algorithm, its model file) → its cfg (_run_step1)
        self._step1_took: list[float] = []  # seconds of each step1 run
        self._ranges: dict | None = None  # a build's quantization table later builds reuse (ranges.py)
        self.toolkit.start()  # its start-up (importing torch) overlaps the GPTQ weights
        try:
            self._save_model()
        except BaseException:
            self.toolkit.close()
            raise
        self._sessions: dict = {}  # key → (RKNN object, runner, float16 layers): the last build and the pinned one
        self._pinned: tuple | None = None  # a build kept however many come after it (the fallback's best)

    @property
    def algorithm(self) -> str:
        return self.config["quantized_algorithm"]

    @property
    def setting(self) -> str:
        """What a build's numbers depend on besides its float16 layers (its sessions and the search's remembered
        results are keyed on it): the range algorithm and how the weights get their integers."""
        return f"{self.algorithm}, {self.weights_in_use()} weights"

    def weights_in_use(self) -> str:
        """How the weights get their integers, where chosen and measured: gptq (weights.py) under `normal`
        activation ranges, mmse (its weight ranges from a few samples, _mmse_weight_ranges) under `normal` or
        `kl_divergence` ones; else the toolkit's own: nearest, or the search of its mmse algorithm."""
        if self.rounds_weights():
            if self.weight_rounding == "mmse" and self.algorithm in ("normal", "kl_divergence"):
                return "mmse"
            if self.weight_rounding == "gptq" and self.algorithm == "normal":
                return "gptq"
        return "mmse search" if self.algorithm == "mmse" else "nearest"

    def rounds_weights(self) -> bool:
        """Is this a build whose weight grid qprep knows (w8a8, per channel, calibrated)?"""
        options = self.options
        return bool(options.do_quantization and options.quantized_dtype == "w8a8"
                    and options.quantized_method == "channel" and self.job.samples)

    def use_weight_rounding(self, method: str) -> bool:
        """Give the weights their integers another way from now on (gptq | nearest | mmse); the pinned build
        stays (as in use_algorithm). False if it cannot: mmse's build failed, the weights stay as they were."""
        if method != self.weight_rounding:
            before = self.weight_rounding
            self._release_all_but_pinned()
            self.weight_rounding, self._step1 = method, None
            self._save_model(otherwise=before)
        return self.weight_rounding == method

    def use_algorithm(self, algorithm: str) -> None:
        """Build with another range algorithm from now on (hybrid step1 records it, so step1 runs again). The
        pinned build stays: a trial of another algorithm that is not kept leaves the search's best exportable
        without building it again."""
        if algorithm != self.algorithm:
            self._release_all_but_pinned()
            self.config["quantized_algorithm"], self._step1, self._ranges = algorithm, None, None
            self.details.pop("ranges_reused", None)
            self._save_model()

    def reuse_ranges(self, float_set: set[str]) -> bool:
        """Later builds take the ranges of the build of `float_set` (made with the current algorithm) and search
        none (ranges.py): with mmse, a trial's step2 then takes seconds instead of minutes."""
        entry = self._sessions.get((self.setting, frozenset(float_set)))
        if entry is None or self.algorithm == "normal" or not self.options.do_quantization:
            return False
        try:
            self._ranges = entry[1].quantization_table()
        except ValueError as exc:
            self._stop_reusing(exc)
            return False
        self._step1 = None  # step1 again, with `normal`: the data file it writes is what step2 follows
        self.details["ranges_reused"] = {"algorithm": self.algorithm, "from_float16_nodes": len(float_set)}
        return True

    def _stop_reusing(self, reason: Exception) -> None:
        log.warning("rknn: every build searches its %s ranges again (%s)", self.algorithm, reason)
        self._ranges = None
        self.details.pop("ranges_reused", None)

    def _release_all_but_pinned(self) -> None:
        pinned = self._sessions.get(self._pinned)
        self.release(keep=pinned[1] if pinned else None)

    def _save_model(self, otherwise: str = "gptq") -> None:
        """The ONNX file the toolkit loads: with GPTQ weights where the toolkit's weight grid is the one
        weights.py reproduces, else the model as prepared (mmse weight ranges are given to step1, ir_names).
        Where mmse's weight ranges are wanted and its build fails, the weights are rounded the `otherwise` way."""
        if self.weights_in_use() == "mmse" and self._weight_table is None:
            try:
                self._weight_table = self._mmse_weight_ranges()
            except (ValueError, QprepError) as exc:
                if getattr(exc, "crashed", False):  # the worker died: nothing can be built any more
                    raise
                log.warning("rknn: mmse weight ranges unavailable (%s); the weights are rounded %s", exc, otherwise)
                self.weight_rounding = otherwise
        weights = self.weights_in_use()
        if weights == "gptq" and self._on_grid is None:
            from qprep.quantize.rknn import weights as rknn_weights

            start = time.perf_counter()
            self._on_grid, layers, left = rknn_weights.on_grid(self.job.model, self.job.samples, self.job.threads)
            self._grid_record = {"method": "gptq", "layers": layers, **left,
                                 "seconds": round(time.perf_counter() - start, 1)}
            log.info("rknn: GPTQ weights on the toolkit's grid for %d layers", layers)
        self.details["weight_rounding"] = {"gptq": self._grid_record, "mmse": self._weight_record}.get(
            weights, {"method": weights})
        self._write(self._on_grid if weights == "gptq" else self.job.model)

    def _write(self, model: onnx.ModelProto) -> None:
        """`model` where the toolkit loads it, unless it is there already (a big model's write takes seconds)."""
        if model is not self._written:
            # io.save_model: over 2 GB the weights go to external data beside it, which the toolkit reads
            # (onnx.save_model wrote a 2.2 GB single file that the toolkit's load_onnx could not parse)
            save_model(io_names.renamed(model, self.renames), self.model_path)
            self._written = model

    def _mmse_weight_ranges(self) -> dict[str, dict]:
        """The int8 weight entries of an mmse build on MMSE_WEIGHT_SAMPLES calibration samples of the model as
        prepared: mmse's gain is in its weight ranges (MMSE_WEIGHT_SAMPLES), and they come from a few samples
        at a fraction of a full mmse build. ValueError if the toolkit's table cannot be read."""
        start = time.perf_counter()
        self._write(self.job.model)
        few = self.dataset.with_name("dataset_mmse_weights.txt")
        lines = self.dataset.read_text().splitlines(keepends=True)[:MMSE_WEIGHT_SAMPLES]
        few.write_text("".join(lines))
        def mmse_table():
            rknn = self._loaded("mmse")
            try:
                self.toolkit.call("build (mmse weight ranges)", rknn, "build", do_quantization=True,
                                  dataset=str(few))
                return self.toolkit.apply("quantization table", rknn, rknn_ranges.table_of)
            finally:
                self._release(rknn)

        table = self._without_failing_rules(mmse_table)
        weights = {name: entry for name, entry in table.items()
                   if entry["qmethod"] == "channel" and entry["dtype"] == "int8"}
        if not weights:
            raise ValueError("the mmse build's table holds no per-channel int8 weights")
        self._weight_record = {"method": "mmse", "calibration_samples": len(lines), "weights": len(weights),
                               "seconds": round(time.perf_counter() - start, 1)}
        log.info("rknn: weight ranges of an mmse build on %d calibration samples for %d weights (%.0f s)",
                 len(lines), len(weights), time.perf_counter() - start)
        return weights

    def _table(self) -> dict | None:
        """The ranges step1's outputs are rewritten with (ranges.apply): a whole build's (reuse_ranges), or
        mmse's weight ranges."""
        if self._ranges:
            return self._ranges
        return self._weight_table if self.weights_in_use() == "mmse" else None

    def pin(self, float_set: set[str]) -> None:
        self._pinned = (self.setting, frozenset(float_set))

    def _loaded(self, algorithm: str | None = None):
        rknn = self.toolkit.new()
        self.toolkit.call("config", rknn, "config", **{**self.config, "quantized_algorithm": algorithm or self.algorithm})
        self.toolkit.call("load_onnx", rknn, "load_onnx", model=str(self.model_path),
                          inputs=[self.renames.get(s.name, s.name) for s in self.inputs],
                          input_size_list=[s.shape for s in self.inputs])
        return rknn

    def ir_names(self) -> IRNames:
        """Hybrid step1 (once per setting): the IR, its tensor names and the quantization cfg step2 builds from."""
        if self._step1 is None:
            stem = self.toolkit.work_dir / "model"
            algorithm = "normal" if self._ranges else self.algorithm
            cfg_text = self._without_failing_rules(lambda: self._run_step1(stem, algorithm))
            if table := self._table():
                try:
                    cfg_text, counts = rknn_ranges.apply(stem, cfg_text, table)
                except ValueError as exc:
                    if table is not self._ranges:  # read from this toolkit's own table: not expected
                        raise QprepError(f"rknn: mmse's weight ranges do not fit hybrid step1's data ({exc}); "
                                         "set quantize.rknn.weight_rounding: gptq") from None
                    self._stop_reusing(exc)
                    return self.ir_names()
                if table is self._ranges:
                    self.details["ranges_reused"].update(counts)
            self._step1 = (stem, cfg_text, IRNames(f"{stem}.model", cfg_text, self.renames))
        return self._step1[2]

    def _run_step1(self, stem: Path, algorithm: str) -> str:
        """Step1's outputs (`<stem>.model`, `<stem>.data`) for `algorithm` on the model file as written, and its
        cfg text. Its outputs are kept aside as they come out and copied back when the same step1 is wanted
        again: the fallback switches setting and back (kl tried against normal, mmse weight ranges against the
        weights as they were, ranges reused) and each step1 runs the calibration samples through the model again
        (up to a minute under kl on a large detector); ranges.apply rewrites the data file in place."""
        key = (algorithm, "gptq" if self._written is self._on_grid else "prepared")
        kept = self.toolkit.work_dir / "step1_{}_{}".format(*key)
        outputs = (Path(f"{stem}.model"), Path(f"{stem}.data"))
        if key in self._step1_kept:
            for path in outputs:
                shutil.copyfile(kept / path.name, path)
            return self._step1_kept[key]
        start = time.perf_counter()
        rknn = self._loaded(algorithm)
        try:
            self.toolkit.call("hybrid_quantization_step1", rknn, "hybrid_quantization_step1",
                              dataset=str(self.dataset), proposal=False)
        finally:
            self._release(rknn)
        self._step1_took.append(time.perf_counter() - start)
        kept.mkdir(exist_ok=True)
        for path in outputs:
            shutil.copyfile(path, kept / path.name)
        self._step1_kept[key] = Path(f"{stem}.quantization.cfg").read_text()
        return self._step1_kept[key]

    def step1_seconds(self, weights: str) -> float:
        """What a step1 with the current algorithm on the `weights` model file (gptq | prepared) would add to the
        next build: nothing where its outputs are kept, else as long as the slowest step1 so far."""
        if (self.algorithm, weights) in self._step1_kept:
            return 0.0
        return max(self._step1_took, default=0.0)

    def _without_failing_rules(self, step):
        """`step()`, made again with a graph rule of the toolkit disabled when the toolkit failed inside that rule
        and named it (ToolkitError.rule; basic-pitch's CQT: `remove_concat_slice` raised IndexError). A rule is an
        optimization of the toolkit's own graph: without it the model is the same, perhaps slower. Step1's kept
        outputs were made with the rule on, so they are made again. Each rule is disabled once (a few at most);
        the report names those a build then passed with, and rules that did not make it pass are on again."""
        added: list[tuple[str, str]] = []
        while True:
            try:
                result = step()
            except ToolkitError as exc:
                disabled = list(self.config.get("disable_rules", []))
                if exc.crashed or not exc.rule or exc.rule in disabled or len(disabled) >= MAX_RULES_DISABLED:
                    tried = {rule for rule, _ in added}
                    kept = [rule for rule in disabled if rule not in tried]
                    self._set_rules(kept)
                    raise
                self._set_rules([*disabled, exc.rule])
                added.append((exc.rule, str(exc)))
                self._step1, self._step1_kept = None, {}
                log.warning("rknn: the toolkit's graph rule %s failed on this model; building again without it "
                            "(disable_rules)", exc.rule)
                continue
            for rule, error in added:
                self.details.setdefault("rules_disabled", []).append({"rule": rule, "error": error})
            return result

    def _set_rules(self, rules: list[str]) -> None:
        if rules:
            self.config["disable_rules"] = rules
        else:
            self.config.pop("disable_rules", None)

    def _call_or_release(self, rknn: int, method: str, **kwargs) -> None:
        """`rknn.method(**kwargs)` in the toolkit; the object is released when the call fails (a build the caller
        would have kept)."""
        try:
            self.toolkit.call(method, rknn, method, **kwargs)
        except BaseException:
            self._release(rknn)
            raise

    def _release(self, rknn: int) -> None:
        """Release an RKNN object, unless the worker that held it has died (then it is gone already)."""
        if self.toolkit.running:
            self.toolkit.release(rknn)

    def build(self, float_set: set[str]):
        """An RKNN object built with `float_set` as float16 layers, its simulator runtime initialized."""
        if (float_set or self._table()) and self.options.do_quantization:
            ir = self.ir_names()
            stem, cfg_text, _ = self._step1
            mapping, unmapped = map_float_set(self.job.model, sorted(float_set), ir)
            tensors = list(dict.fromkeys(t for m in mapping.values() for t in m["tensors"]))
            cfg_path = Path(f"{stem}.quantization.cfg")
            cfg_path.write_text(with_custom_layers(cfg_text, tensors))
            rknn = self.toolkit.new()
            self._call_or_release(rknn, "hybrid_quantization_step2", model_input=f"{stem}.model",
                                  data_input=f"{stem}.data", model_quantization_cfg=str(cfg_path))
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

    def session(self, float_set: set[str]) -> "Runner":
        """The build with `float_set` as float16 layers, its simulator runtime initialized. The last one and
        the pinned one are kept: the fallback evaluates, ranks (accuracy_analysis) and finally exports builds it
        has already made (its best, pinned), and with `mmse` one build takes minutes."""
        key = (self.setting, frozenset(float_set))
        if key not in self._sessions:
            for old in [k for k in self._sessions if k != self._pinned]:
                self.toolkit.release(self._sessions.pop(old)[0])
            rknn = self._without_failing_rules(lambda: self.build(float_set))
            self.toolkit.call("init_runtime (simulator)", rknn, "init_runtime")
            runner = Runner(rknn, self.toolkit, self.job.model, self.normalization, self.renames)
            self._sessions[key] = (rknn, runner, self.details.get("float16_layers"))
        rknn, runner, layers = self._sessions[key]
        if layers is None:
            self.details.pop("float16_layers", None)
        else:
            self.details["float16_layers"] = layers
        return runner

    def close(self) -> None:
        """Release every build, stop the toolkit worker and delete the kept step1 outputs (a big model's are GBs)."""
        self._sessions.clear()
        self.toolkit.close()
        for kept in self.toolkit.work_dir.glob("step1_*"):
            shutil.rmtree(kept, ignore_errors=True)

    def release(self, keep: "Runner | None" = None) -> None:
        """Free the simulator runtimes of the kept builds (all but `keep`)."""
        for key, (rknn, runner, _) in list(self._sessions.items()):
            if runner is not keep:
                self.toolkit.release(rknn)
                del self._sessions[key]
