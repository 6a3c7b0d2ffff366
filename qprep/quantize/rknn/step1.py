"""Hybrid quantization's step1, run once per setting, and the ranges of one build that later builds reuse.

Why: with float16 layers every build is a hybrid step2 on step1's outputs (`<stem>.model`, `<stem>.data`, the
quantization cfg), so step1 (the calibration) runs once and each trial of the fallback is a step2 with another
list of float16 layers (names.py). Step1's outputs are also kept aside per (range algorithm, model file): the
fallback switches setting and back, and each step1 runs the calibration samples through the model again (up to a
minute under kl on a large detector). Reused ranges (ranges.py) are written into step1's outputs, so a step2 on
them searches no ranges: with mmse, a trial then takes seconds instead of minutes.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from qprep.errors import QprepError
from qprep.quantize.rknn import ranges as rknn_ranges
from qprep.quantize.rknn.names import IRNames, with_custom_layers
from qprep.quantize.rknn.runner import Runner
from qprep.quantize.rknn.toolkit import Toolkit

log = logging.getLogger("qprep")


class Step1:
    """Step1's outputs for the builds to come, made on first use (`ir_names`). `loaded(algorithm)` gives a new
    RKNN object configured and loaded with the model file; `retry` makes a step again without a failing toolkit
    rule (rules.py); `details` is the build's record (ranges_reused)."""

    def __init__(self, toolkit: Toolkit, dataset: Path, renames: dict[str, str], loaded: Callable[[str], int],
                 retry: Callable, details: dict):
        self.toolkit, self.dataset, self.renames, self.loaded = toolkit, dataset, renames, loaded
        self.retry, self.details = retry, details
        self.stem = toolkit.work_dir / "model"
        self._current: tuple[str, IRNames] | None = None  # (its cfg text, its IR names)
        self._kept: dict[tuple[str, str], str] = {}  # (its algorithm, its model file) → its cfg (run)
        self._took: list[float] = []  # seconds of each step1 run
        self._ranges: dict | None = None  # a build's quantization table later builds reuse (reuse)

    def forget(self) -> None:
        """The next build runs step1 again (the setting changed); kept outputs are copied back where they fit."""
        self._current = None

    def forget_outputs(self) -> None:
        """Step1 is made again, its kept outputs too (they were made with a toolkit rule on that is off now)."""
        self._current, self._kept = None, {}

    def table(self, weight_table: dict | None) -> dict | None:
        """The ranges step1's outputs are rewritten with (ranges.apply): a whole build's (reuse), or mmse's
        weight ranges (`weight_table`, where the build takes them)."""
        if self._ranges:
            return self._ranges
        return weight_table

    def ir_names(self, algorithm: str, model_file: str, weight_table: dict | None) -> IRNames:
        """Step1 (once per setting: `algorithm`, the `model_file` the toolkit loads — gptq | prepared — and the
        ranges it is given): the IR, its tensor names and the quantization cfg step2 builds from."""
        if self._current is None:
            ranges_algorithm = "normal" if self._ranges else algorithm
            cfg_text = self.retry(lambda: self._run(ranges_algorithm, model_file))
            if table := self.table(weight_table):
                try:
                    cfg_text, counts = rknn_ranges.apply(self.stem, cfg_text, table)
                except ValueError as exc:
                    if table is not self._ranges:  # read from this toolkit's own table: not expected
                        raise QprepError(f"rknn: mmse's weight ranges do not fit hybrid step1's data ({exc}); "
                                         "set quantize.rknn.weight_rounding: gptq") from None
                    self.stop_reusing(algorithm, exc)
                    return self.ir_names(algorithm, model_file, weight_table)
                if table is self._ranges:
                    self.details["ranges_reused"].update(counts)
            self._current = (cfg_text, IRNames(f"{self.stem}.model", cfg_text, self.renames))
        return self._current[1]

    def step2_inputs(self, tensors: list[str]) -> dict[str, str]:
        """hybrid_quantization_step2's arguments for a build with `tensors` (IR names) float16: step1's outputs
        and its cfg with those layers listed (after ir_names)."""
        cfg_path = Path(f"{self.stem}.quantization.cfg")
        cfg_path.write_text(with_custom_layers(self._current[0], tensors))
        return {"model_input": f"{self.stem}.model", "data_input": f"{self.stem}.data",
                "model_quantization_cfg": str(cfg_path)}

    def _run(self, algorithm: str, model_file: str) -> str:
        """Step1's outputs for `algorithm` on the model file as written, and its cfg text; copied back where the
        same step1 ran before (ranges.apply rewrites the data file in place, so the copies are taken as they come
        out)."""
        key = (algorithm, model_file)
        kept = self.toolkit.work_dir / "step1_{}_{}".format(*key)
        outputs = (Path(f"{self.stem}.model"), Path(f"{self.stem}.data"))
        if key in self._kept:
            for path in outputs:
                shutil.copyfile(kept / path.name, path)
            return self._kept[key]
        start = time.perf_counter()
        rknn = self.loaded(algorithm)
        try:
            self.toolkit.call("hybrid_quantization_step1", rknn, "hybrid_quantization_step1",
                              dataset=str(self.dataset), proposal=False)
        finally:
            self.toolkit.discard(rknn)
        self._took.append(time.perf_counter() - start)
        kept.mkdir(exist_ok=True)
        for path in outputs:
            shutil.copyfile(path, kept / path.name)
        self._kept[key] = Path(f"{self.stem}.quantization.cfg").read_text()
        return self._kept[key]

    def seconds(self, algorithm: str, model_file: str) -> float:
        """What a step1 with `algorithm` on `model_file` (gptq | prepared) would add to the next build: nothing
        where its outputs are kept, else as long as the slowest step1 so far."""
        if (algorithm, model_file) in self._kept:
            return 0.0
        return max(self._took, default=0.0)

    def reuse(self, runner: Runner, algorithm: str, float16_nodes: int) -> bool:
        """Later builds take the ranges of `runner`'s build (made with `algorithm`, `float16_nodes` float16) and
        search none; False where its table cannot be read."""
        try:
            self._ranges = runner.quantization_table()
        except ValueError as exc:
            self.stop_reusing(algorithm, exc)
            return False
        self._current = None  # step1 again, with `normal`: the data file it writes is what step2 follows
        self.details["ranges_reused"] = {"algorithm": algorithm, "from_float16_nodes": float16_nodes}
        return True

    def stop_reusing(self, algorithm: str, reason: Exception) -> None:
        log.warning("rknn: every build searches its %s ranges again (%s)", algorithm, reason)
        self.forget_ranges()

    def forget_ranges(self) -> None:
        """Builds search their ranges again (the range algorithm changed)."""
        self._ranges = None
        self.details.pop("ranges_reused", None)

    def clean(self) -> None:
        """Delete the kept outputs (a big model's are GBs)."""
        for kept in self.toolkit.work_dir.glob("step1_*"):
            shutil.rmtree(kept, ignore_errors=True)
