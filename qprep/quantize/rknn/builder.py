"""RKNN conversion with rknn-toolkit2: build (or hybrid build with float16 islands), simulator runner,
per-layer accuracy_analysis, and the files a board needs.

Facts this module is built on (measured with rknn-toolkit2 2.5.0, see ../shared/notes/rknn-toolkit2.md):
- calls fail three ways: an exception (its last line is the message), a non-zero return, or None; the
  reason is in the toolkit's own `E <api>: ...` log line. Every call goes through `_call`.
- the toolkit prints from C++ straight to file descriptors 1/2, writes working files into the current
  directory and aborts the process on some inputs: every call runs in a worker process (worker.py) that
  sits in the work folder with both fds on the toolkit log, so a crash becomes a one-line ToolkitError.
- mean/std in `config` apply to `.npy` calibration files too, and RGB→BGR does not: for image sources the
  raw pixels (already in the model's channel order) go to dataset.txt and the normalization to the config,
  so it runs on the NPU and becomes the deployed input contract. `.npy` files must be NCHW.
- step2 of hybrid quantization needs a fresh RKNN object and accepts only IR tensor names (names.py).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
from pathlib import Path

import numpy as np
import onnx

from qprep.quantize.backend import BackendInput, Quantized
from qprep.quantize.rknn import ranges as rknn_ranges
from qprep.quantize.rknn import worker as rknn_worker
from qprep.quantize.rknn.names import IRNames, map_float_set, parse_error_analysis, with_custom_layers
from qprep.errors import QprepError, ToolkitError
from qprep.model.info import graph_inputs, graph_outputs
from qprep.schema import Key, section

log = logging.getLogger("qprep")

PLATFORMS = ("rv1103", "rv1103b", "rv1106", "rv1106b", "rv1126b", "rk2118", "rk3562", "rk3566", "rk3568",
             "rk3576", "rk3588")
OPTIONS = section(
    "rknn-toolkit2 conversion (backend: rknn); runs on the x86 simulator unless a device is configured",
    target_platform=Key("str", default="rk3588", choices=PLATFORMS, doc="Rockchip SoC"),
    quantized_dtype=Key("str", default="w8a8", choices=("w8a8", "w4a16", "w8a16", "w16a16i"),
                        doc="weight/activation precision (w8a8 on every SoC)"),
    quantized_algorithm=Key("str", default="normal", choices=("normal", "mmse", "kl_divergence"),
                            doc="activation range algorithm (mmse is slow; kl_divergence for skewed ranges)"),
    quantized_method=Key("str", default="channel", choices=("channel", "layer"), doc="weight scale granularity"),
    optimization_level=Key("int", default=3, minimum=0, doc="toolkit graph optimization level"),
    do_quantization=Key("bool", default=True, doc="false: a float16 model (no int8)"),
    weight_rounding=Key("str", default="gptq", choices=("gptq", "nearest"),
                        doc="gptq: Conv/MatMul/Gemm weights handed to the toolkit on its own grid with GPTQ's "
                            "integers (weights.py); w8a8, per channel, normal algorithm (the one measured)"),
    analysis_samples=Key("int", default=1, minimum=0,
                         doc="evaluation samples run through accuracy_analysis for the per-layer table (~10 s each)"),
)

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STAMP = re.compile(r"^RKNN: \[[0-9:.]+\] ")  # the C++ logger's prefix: `E RKNN: [02:41:12.288] message`
_NOISE = ("Unkown op target", "rknn-toolkit2 version")
_SETUP = "run ./scripts/setup.sh (it installs rknn-toolkit2 2.5.0 with the pins it needs, CPython 3.11 x86-64)"


class _Toolkit:
    """Every rknn-toolkit2 call: made in the toolkit worker process (worker.py), which owns the RKNN
    objects (the parent holds integer handles), runs in the work folder and prints into the toolkit log. A
    failed call (exception, non-zero or None) becomes a QprepError with the toolkit's own error line; a crash
    of the worker (a signal) a ToolkitError naming the step, the signal and that line."""

    def __init__(self, work_dir: Path):
        self.work_dir = work_dir
        self.log_path = work_dir / "rknn-toolkit.log"
        self._worker: rknn_worker.Worker | None = None

    def start(self) -> None:
        """Start the worker (it imports the toolkit, ~2 s, while the parent goes on until the first call).
        Once per builder: a stopped or crashed worker is not restarted (the RKNN objects died with it)."""
        if self._worker is None:
            self._worker = rknn_worker.Worker(self.work_dir, self.log_path)
            log.info("rknn-toolkit2 worker started (pid %d)", self._worker.pid)

    def close(self) -> None:
        """Release the RKNN objects and stop the worker (terminated if it is stuck or mid-call)."""
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    def new(self) -> int:
        """A new RKNN object in the worker → its handle."""
        return self._request("RKNN()", "new")

    def call(self, step: str, rknn: int, method: str, *args, **kwargs):
        """`rknn.method(*args, **kwargs)` in the worker; its result checked (0 or a value, not None)."""
        start = self.log_path.stat().st_size if self.log_path.exists() else 0
        try:
            result = self._request(step, "call", rknn, method, args, kwargs, start)
        except QprepError:
            raise
        except Exception as exc:  # the toolkit raises bare ValueError/KeyError with its message last
            self._copy_to_run_log(start, step)
            lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
            raise QprepError(f"rknn-toolkit2 {step} failed: {self._error_line(start) or (lines[-1] if lines else type(exc).__name__)}"
                             f" (toolkit log: {self.log_path})") from None
        self._copy_to_run_log(start, step)
        if result is None or (isinstance(result, int) and result != 0):
            raise QprepError(f"rknn-toolkit2 {step} failed: {self._error_line(start) or f'returned {result}'} "
                             f"(toolkit log: {self.log_path})")
        return result

    def apply(self, step: str, rknn: int, function, *args):
        """`function(the RKNN object, *args)` in the worker (a module-level function: it is sent by name);
        what it raises is raised here."""
        return self._request(step, "apply", rknn, function, args)

    def release(self, rknn: int) -> None:
        self._request("release", "release", rknn)

    def _request(self, step: str, kind: str, rknn: int | None = None, name=None, args: tuple = (),
                 kwargs: dict | None = None, start: int | None = None):
        if self._worker is None:  # closed, or crashed before: its RKNN objects are gone
            raise RuntimeError(f"rknn-toolkit2 {step}: the toolkit worker is not running")
        if start is None:
            start = self.log_path.stat().st_size if self.log_path.exists() else 0
        try:
            return self._worker.request(kind, rknn, name, args, kwargs)
        except rknn_worker.NotInstalled as exc:
            self.close()
            raise QprepError(f"rknn-toolkit2 is not installed or does not import ({exc}); {_SETUP}") from None
        except rknn_worker.WorkerDied as exc:
            self._copy_to_run_log(start, step)
            self.close()
            why = self._error_line(start) or ("no error in its log; killed from outside (out of memory?)"
                                              if exc.how == "SIGKILL" else "no error in its log")
            raise ToolkitError(f"rknn-toolkit2 crashed ({exc.how}) in {step}: {why} (toolkit log: {self.log_path})") from None

    def _copy_to_run_log(self, start: int, step: str) -> None:
        """What the toolkit printed during one call, into qprep.log (colour codes stripped)."""
        if self.log_path.exists():
            with open(self.log_path, errors="replace") as f:
                f.seek(start)
                text = _ANSI.sub("", f.read()).strip()
            if text:
                log.info("rknn-toolkit2 %s:\n%s", step, text)

    def _error_line(self, start: int) -> str:
        if not self.log_path.exists():
            return ""
        with open(self.log_path, errors="replace") as f:
            f.seek(start)
            lines = [_ANSI.sub("", line).strip() for line in f]
        for index, line in enumerate(lines):
            if line.startswith("E ") and not any(noise in line for noise in _NOISE):
                message = _STAMP.sub("", line[2:].strip())
                if message.endswith("Traceback (most recent call last):"):  # the toolkit logged a traceback:
                    cause = next((l for l in lines[index + 1:] if re.match(r"^\w+(Error|Exception)\b", l)), "")
                    message = f"{message.split(':')[0]}: {cause}" if cause else message
                return message
        return ""


class RknnBuilder:
    """Loads the model once; every build is a fresh RKNN object. With float16 layers, hybrid step1 runs once
    (calibration) and each build is a step2 with another custom_quantize_layers list, which is what makes
    the fallback's trials affordable."""

    def __init__(self, job: BackendInput):
        self.job, self.options = job, job.options
        self.toolkit = _Toolkit(job.work_dir)
        self.inputs = graph_inputs(job.model)
        for spec in self.inputs:
            if spec.shape is None or not all(isinstance(d, int) for d in spec.shape):
                raise QprepError(f"quantize.rknn: input '{spec.name}' has dynamic dims {spec.shape}; RKNN needs "
                                 f"fixed sizes: add `inputs: {{{spec.name}: [...]}}` to the config")
        self.model_path = job.work_dir / "model.onnx"
        self._on_grid: onnx.ModelProto | None = None  # the model with GPTQ weights, made once
        self._grid_record: dict = {}
        self.normalization = _normalization(job)
        self.dataset = _write_dataset(job, job.work_dir, self.normalization)
        options = self.options
        self.config = dict(target_platform=options["target_platform"], quantized_dtype=options["quantized_dtype"],
                           quantized_algorithm=options["quantized_algorithm"],
                           quantized_method=options["quantized_method"], optimization_level=options["optimization_level"])
        if self.normalization:
            self.config.update(mean_values=[self.normalization["mean"]], std_values=[self.normalization["std"]])
        self.details = {"config": self.config, "dataset": str(self.dataset),
                        "calibration_samples": _count_lines(self.dataset)}
        self._step1: tuple[Path, str, IRNames] | None = None
        self._ranges: dict | None = None  # a build's quantization table later builds reuse (ranges.py)
        self.toolkit.start()  # its start-up (~2 s) overlaps the GPTQ weights
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

    def use_algorithm(self, algorithm: str) -> None:
        """Build with another range algorithm from now on (hybrid step1 records it, so step1 runs again)."""
        if algorithm != self.algorithm:
            self.release()
            self.config["quantized_algorithm"], self._step1, self._pinned, self._ranges = algorithm, None, None, None
            self.details.pop("ranges_reused", None)
            self._save_model()

    def reuse_ranges(self, float_set: set[str]) -> bool:
        """Later builds take the ranges of the build of `float_set` (made with the current algorithm) and search
        none (ranges.py): with mmse, a trial's step2 then takes seconds instead of minutes."""
        entry = self._sessions.get((self.algorithm, frozenset(float_set)))
        if entry is None or self.algorithm == "normal" or not self.options["do_quantization"]:
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

    def _save_model(self) -> None:
        """The ONNX file the toolkit loads: with GPTQ weights where the toolkit's weight grid is the one
        weights.py reproduces, else the model as prepared."""
        options = self.options
        rounding = (options["weight_rounding"] == "gptq" and options["do_quantization"]
                    and options["quantized_dtype"] == "w8a8" and options["quantized_method"] == "channel"
                    and self.algorithm == "normal" and self.job.samples)
        if rounding and self._on_grid is None:
            from qprep.quantize.rknn import weights as rknn_weights

            start = time.perf_counter()
            self._on_grid, layers = rknn_weights.on_grid(self.job.model, self.job.samples, self.job.threads)
            self._grid_record = {"method": "gptq", "layers": layers, "seconds": round(time.perf_counter() - start, 1)}
            log.info("rknn: GPTQ weights on the toolkit's grid for %d layers", layers)
        self.details["weight_rounding"] = (self._grid_record if rounding else
                                           {"method": self.algorithm if self.algorithm != "normal" else "nearest"})
        onnx.save_model(self._on_grid if rounding else self.job.model, str(self.model_path))

    def pin(self, float_set: set[str]) -> None:
        self._pinned = (self.algorithm, frozenset(float_set))

    def _loaded(self, algorithm: str | None = None):
        rknn = self.toolkit.new()
        self.toolkit.call("config", rknn, "config", **{**self.config, "quantized_algorithm": algorithm or self.algorithm})
        self.toolkit.call("load_onnx", rknn, "load_onnx", model=str(self.model_path), inputs=[s.name for s in self.inputs],
                          input_size_list=[s.shape for s in self.inputs])
        return rknn

    def ir_names(self) -> IRNames:
        """Hybrid step1 (once): the IR, its tensor names and the quantization cfg step2 builds from."""
        if self._step1 is None:
            rknn = self._loaded("normal" if self._ranges else None)
            self.toolkit.call("hybrid_quantization_step1", rknn, "hybrid_quantization_step1",
                              dataset=str(self.dataset), proposal=False)
            self.toolkit.release(rknn)
            stem = self.toolkit.work_dir / "model"
            cfg_text = Path(f"{stem}.quantization.cfg").read_text()
            if self._ranges:
                try:
                    cfg_text, counts = rknn_ranges.apply(stem, cfg_text, self._ranges)
                except ValueError as exc:
                    self._stop_reusing(exc)
                    return self.ir_names()
                self.details["ranges_reused"].update(counts)
            self._step1 = (stem, cfg_text, IRNames(f"{stem}.model", cfg_text))
        return self._step1[2]

    def build(self, float_set: set[str]):
        """An RKNN object built with `float_set` as float16 layers, its simulator runtime initialized."""
        if (float_set or self._ranges) and self.options["do_quantization"]:
            ir = self.ir_names()
            stem, cfg_text, _ = self._step1
            mapping, unmapped = map_float_set(self.job.model, sorted(float_set), ir)
            tensors = list(dict.fromkeys(t for m in mapping.values() for t in m["tensors"]))
            cfg_path = Path(f"{stem}.quantization.cfg")
            cfg_path.write_text(with_custom_layers(cfg_text, tensors))
            rknn = self.toolkit.new()
            self.toolkit.call("hybrid_quantization_step2", rknn, "hybrid_quantization_step2",
                              model_input=f"{stem}.model", data_input=f"{stem}.data",
                              model_quantization_cfg=str(cfg_path))
            self.details["float16_layers"] = {"requested_nodes": len(float_set), "mapped": mapping,
                                              "unmapped": unmapped, "ir_tensors": tensors}
            if unmapped:
                log.warning("rknn: %d float-set nodes have no RKNN tensor (fused or renamed): %s", len(unmapped),
                            ", ".join(unmapped[:10]))
        else:
            rknn = self._loaded()
            self.toolkit.call("build", rknn, "build", do_quantization=self.options["do_quantization"],
                              dataset=str(self.dataset))
            self.details.pop("float16_layers", None)
        return rknn

    def session(self, float_set: set[str]) -> "_Runner":
        """The build with `float_set` as float16 layers, its simulator runtime initialized. The last one and
        the pinned one are kept: the fallback evaluates, ranks (accuracy_analysis) and finally exports builds it
        has already made (its best, pinned), and with `mmse` one build takes minutes."""
        key = (self.algorithm, frozenset(float_set))
        if key not in self._sessions:
            for old in [k for k in self._sessions if k != self._pinned]:
                self.toolkit.release(self._sessions.pop(old)[0])
            rknn = self.build(float_set)
            self.toolkit.call("init_runtime (simulator)", rknn, "init_runtime")
            runner = _Runner(rknn, self.toolkit, self.job.model, self.normalization)
            self._sessions[key] = (rknn, runner, self.details.get("float16_layers"))
        rknn, runner, layers = self._sessions[key]
        if layers is None:
            self.details.pop("float16_layers", None)
        else:
            self.details["float16_layers"] = layers
        return runner

    def close(self) -> None:
        """Release every build and stop the toolkit worker."""
        self._sessions.clear()
        self.toolkit.close()

    def release(self, keep: "_Runner | None" = None) -> None:
        """Free the simulator runtimes of the kept builds (all but `keep`)."""
        for key, (rknn, runner, _) in list(self._sessions.items()):
            if runner is not keep:
                self.toolkit.release(rknn)
                del self._sessions[key]


def quantize(job: BackendInput) -> Quantized:
    """The build (after the fallback's search, if on), exported; its runner stays usable for the evaluation
    until the result's `close` stops the toolkit worker (at once when this fails or is interrupted)."""
    builder = RknnBuilder(job)
    try:
        float_set = set(job.float_set)
        if job.fallback:
            outcome = _fallback(builder, float_set, job)
            float_set = set(outcome.float_nodes)
            builder.details["fallback"] = outcome.record
        runner = builder.session(float_set)
        builder.release(keep=runner)
        work, options = job.work_dir, job.options
        rknn_path = work / "model.rknn"
        builder.toolkit.call("export_rknn", runner.rknn, "export_rknn", str(rknn_path))
    except BaseException:
        builder.close()
        raise
    contract = _input_contract(builder.inputs, builder.normalization, options)
    (work / "input_contract.json").write_text(json.dumps(contract, indent=2) + "\n")
    (work / "run_on_board.py").write_text(_BOARD_SCRIPT)
    return Quantized(model=job.model, details=builder.details, runner=runner, deployable="model.rknn",
                     analyzer=(lambda samples: runner.analyze(samples[: options["analysis_samples"]]))
                     if options["analysis_samples"] else None,
                     artifacts={"model.rknn": rknn_path, "input_contract.json": work / "input_contract.json",
                                "run_on_board.py": work / "run_on_board.py"}, close=builder.close)


def _fallback(builder: RknnBuilder, base_float: set[str], job: BackendInput):
    """The search with RKNN builds: one build per trial (a step2, seconds to minutes), so nodes are ranked by
    the toolkit's accuracy_analysis (the error each layer adds on its own) of the current build — all int8 in
    the first round, with the float16 layers promoted so far in later ones — not by one trial per node.
    Before any node, the range algorithm itself is measured at the outputs."""
    from qprep.quantize import search

    started = time.perf_counter()
    ops = {n.name: n.op_type for n in job.model.graph.node}
    analysis_samples = job.evaluation_samples[: max(1, job.options["analysis_samples"])]
    best_score = float("-inf")  # on all evaluation samples, so far

    def measure(float_nodes: set[str], samples: list[dict]) -> dict:
        nonlocal best_score
        outputs = job.measure(builder.session(float_nodes)(samples))
        score = search.score_of(outputs, job.fallback["target"])
        if samples is job.evaluation_samples and score > best_score:  # the build the search will return
            best_score = score
            builder.pin(float_nodes)
        return outputs

    evaluate = search.remembered(measure, lambda: builder.algorithm)

    def rank(chosen: tuple[str, ...]) -> list[dict]:
        try:
            analysis = builder.session(base_float | set(chosen)).analyze(analysis_samples)
        except ToolkitError:  # the worker crashed: every build is gone
            raise
        except QprepError as exc:
            if not chosen:
                raise
            log.warning("rknn fallback: accuracy_analysis of the build with float16 layers failed (%s); "
                        "ranking stops", exc)
            return []
        ir = builder.ir_names()
        single = {row["tensor"]: row.get("single_cosine", 1.0) for row in analysis}
        rows, seen = [], set()
        for node in job.model.graph.node:
            if node.name in base_float or node.name in chosen:
                continue
            tensors, _ = ir.map_node(node)
            key = tuple(tensors)
            if not tensors or key in seen or not any(t in single for t in tensors):
                continue
            seen.add(key)
            rows.append({"node": node.name, "gain": max(1.0 - single[t] for t in tensors if t in single)})
        return sorted(rows, key=lambda row: -row["gain"])

    # mmse searches weight and activation ranges in step2, so every later build pays it again (minutes, vs
    # seconds): measured once, kept only if it removes 15% of the error. All int8, 128 samples, against normal
    # with GPTQ weights: EfficientNet-Lite0 0.9976 → 0.9984 (its target met with no float layer), PP-OCRv4 rec
    # 0.9729 → 0.9791 (23%; its search then reaches 0.9895 in 20 minutes, the normal one was at 0.975 after 12);
    # MiniLM 0.505 → 0.533 (6%, builds 3× slower) keeps normal; cls meets its target with normal.
    # In the last quarter of the budget the trials reuse the accepted build's ranges (seconds each,
    # ranges.py). Not from the start: mmse's ranges depend on the float16 set, and a whole search on one
    # build's ranges ended lower (rec 0.9843 vs 0.9895).
    ranges = search.choose_setting(
        "quantized_algorithm", builder.algorithm,
        ["mmse"] if builder.algorithm == "normal" and job.options["do_quantization"] else [],
        builder.use_algorithm, evaluate, base_float, job.evaluation_samples, job.fallback["target"], job.progress,
        min_gain=0.15)
    candidates = [n.name for n in job.model.graph.node if n.name not in base_float]
    outcome = search.search(evaluate, candidates, base_float, job.evaluation_samples, job.fallback,
                              describe=lambda n: ops.get(n, "?"), progress=job.progress, rank=rank, started=started,
                              faster=builder.reuse_ranges)
    outcome.record["ranges"] = ranges
    return outcome


def _normalization(job: BackendInput) -> dict | None:
    """mean/std for RKNN.config when calibration comes from images (normalization then runs on the NPU)."""
    reader = job.calibration.image_reader if job.calibration is not None else None
    if reader is None:
        return None
    channels = reader.channels
    mean = reader.mean.tolist() if reader.mean is not None else [0.0] * channels
    std = reader.std.tolist() if reader.std is not None else [1.0] * channels
    return {"input": reader.input.name, "mean": mean, "std": std, "channel_order": reader.channel_order,
            "layout": reader.layout}


def _write_dataset(job: BackendInput, work: Path, normalization: dict | None) -> Path:
    """dataset.txt: one line per sample, one NCHW .npy per input (raw pixels when the NPU normalizes)."""
    if job.calibration is None:
        raise QprepError("quantize.rknn: calibration data is required; add `calibration: {source: <folder>}`")
    folder = work / "dataset"
    folder.mkdir(exist_ok=True)
    lines = []
    count = min(job.max_samples, len(job.calibration))
    for index in range(count):
        paths = []
        for spec in graph_inputs(job.model):
            if normalization and spec.name == normalization["input"]:
                array = job.calibration.image_reader.read_raw(Path(job.calibration.files[index]))
                if normalization["layout"] == "nhwc":
                    array = array.transpose(0, 3, 1, 2)
                array = np.ascontiguousarray(array)
            else:
                array = job.calibration.samples[index][spec.name]
            path = folder / f"{index:04d}_{re.sub(r'[^A-Za-z0-9_.-]', '_', spec.name)}.npy"
            np.save(path, array)
            paths.append(str(path))
        lines.append(" ".join(paths))
    dataset = work / "dataset.txt"
    dataset.write_text("\n".join(lines) + "\n")
    return dataset


def _count_lines(path: Path) -> int:
    return sum(1 for line in path.read_text().splitlines() if line.strip())


class _Runner:
    """Runs evaluation samples on the simulator; undoes qprep's normalization where the NPU normalizes."""

    def __init__(self, rknn: int, toolkit: _Toolkit, model: onnx.ModelProto, normalization: dict | None):
        self.rknn, self.toolkit, self.normalization = rknn, toolkit, normalization
        self.inputs = graph_inputs(model)
        self.outputs = graph_outputs(model)

    def _feeds(self, sample: dict) -> list[np.ndarray]:
        feeds = []
        for spec in self.inputs:
            array = sample[spec.name]
            if self.normalization and spec.name == self.normalization["input"]:
                shape = (1, -1, 1, 1) if self.normalization["layout"] == "nchw" else (1, 1, 1, -1)
                mean = np.asarray(self.normalization["mean"], np.float32).reshape(shape)
                std = np.asarray(self.normalization["std"], np.float32).reshape(shape)
                array = array * std + mean
                if self.normalization["layout"] == "nhwc":
                    array = array.transpose(0, 3, 1, 2)
            feeds.append(np.ascontiguousarray(array.astype(np.float32) if array.dtype == np.float64 else array))
        return feeds

    def __call__(self, samples: list[dict]) -> list[dict]:
        results = []
        # data_format: one entry per input, and the toolkit calls .lower() on each, so no None entries;
        # 'nchw' describes our 4-D arrays and is ignored for other ranks.
        formats = ["nchw"] * len(self.inputs) if any(len(spec.shape) == 4 for spec in self.inputs) else None
        for sample in samples:
            outs = self.toolkit.call("inference", self.rknn, "inference", inputs=self._feeds(sample),
                                     data_format=formats)
            results.append({spec.name: self._shaped(out, spec) for spec, out in zip(self.outputs, outs)})
        return results

    def quantization_table(self) -> dict[str, dict]:
        """The build's quantization table (rknn_ranges.table_of, read in the worker); ValueError if unreadable."""
        return self.toolkit.apply("quantization table", self.rknn, rknn_ranges.table_of)

    @staticmethod
    def _shaped(array: np.ndarray, spec) -> np.ndarray:
        shape = spec.shape or []
        if shape and all(isinstance(d, int) for d in shape) and int(np.prod(shape)) == array.size:
            return array.reshape(shape)
        return array

    def analyze(self, samples: list[dict]) -> list[dict]:
        """accuracy_analysis per sample (one per call) → per-layer rows; the tensor dumps are deleted."""
        rows_by_tensor: dict[str, list[dict]] = {}
        order: list[str] = []
        for index, sample in enumerate(samples):
            out_dir = self.toolkit.work_dir / f"analysis_{index}"
            paths = []
            for spec, array in zip(self.inputs, self._feeds(sample)):
                path = self.toolkit.work_dir / f"analysis_{index}_{re.sub(r'[^A-Za-z0-9_.-]', '_', spec.name)}.npy"
                np.save(path, array)
                paths.append(str(path))
            self.toolkit.call("accuracy_analysis", self.rknn, "accuracy_analysis", inputs=paths,
                              output_dir=str(out_dir))
            for row in parse_error_analysis((out_dir / "error_analysis.txt").read_text()):
                if row["tensor"] not in rows_by_tensor:
                    order.append(row["tensor"])
                rows_by_tensor.setdefault(row["tensor"], []).append(row)
            shutil.rmtree(out_dir, ignore_errors=True)
        layers = []
        for position, tensor in enumerate(order):
            rows = [r for r in rows_by_tensor[tensor] if "entire_cosine" in r]
            if not rows:
                continue  # fused into a neighbour: no numbers of its own
            layers.append({"tensor": tensor, "node": tensor, "op_type": rows[0]["op_type"], "order": position,
                           "cosine_mean": float(np.mean([r["entire_cosine"] for r in rows])),
                           "single_cosine": float(np.mean([r["single_cosine"] for r in rows])),
                           "sqnr_db": None, "quantized": True, "source": "rknn accuracy_analysis"})
        return sorted(layers, key=lambda r: (r["cosine_mean"], r["order"]))


def _input_contract(inputs, normalization: dict | None, options: dict) -> dict:
    contract = {"target_platform": options["target_platform"], "inputs": []}
    for spec in inputs:
        entry = {"name": spec.name, "shape": spec.shape, "dtype": spec.dtype}
        if normalization and spec.name == normalization["input"]:
            entry.update(feed="uint8 pixels, NHWC, in this channel order; the NPU applies (x - mean) / std",
                         channel_order=normalization["channel_order"], mean=normalization["mean"],
                         std=normalization["std"])
        else:
            entry["feed"] = f"{spec.dtype} array of this shape, as given to the ONNX model"
        contract["inputs"].append(entry)
    return contract


_BOARD_SCRIPT = '''"""Run model.rknn on a Rockchip board with rknn-toolkit-lite2 (pip install rknn-toolkit-lite2 on the board).

    python3 run_on_board.py image.png        # single image-input models (see input_contract.json)
"""
import json
import sys

import numpy as np
from PIL import Image
from rknnlite.api import RKNNLite

contract = json.load(open("input_contract.json"))
spec = contract["inputs"][0]
rknn = RKNNLite()
assert rknn.load_rknn("model.rknn") == 0, "load_rknn failed"
assert rknn.init_runtime() == 0, "init_runtime failed"
n, c, h, w = spec["shape"]
image = Image.open(sys.argv[1]).convert("RGB").resize((w, h))
pixels = np.asarray(image, dtype=np.uint8)
if spec.get("channel_order") == "bgr":
    pixels = pixels[:, :, ::-1]
outputs = rknn.inference(inputs=[np.ascontiguousarray(pixels[None])])  # NHWC uint8; the NPU normalizes
for i, out in enumerate(outputs):
    print(f"output {i}: shape {out.shape}, argmax {int(np.argmax(out))}")
rknn.release()
'''
