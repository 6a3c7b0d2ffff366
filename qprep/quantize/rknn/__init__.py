"""The RKNN backend (rknn-toolkit2 2.5.0; the x86 simulator unless a board runs the result).

The flow of `quantize`, one module per step:
    convert.py      OPTIONS and `quantize` itself: the model made compilable (limits.py, static_graph/), the
                    builder, the search when a fallback is configured, the export
    builder.py      RknnBuilder: the builds, plain or hybrid step2 with float16 layers (IR names: names.py),
                    composed of model_file.py (model.onnx and its weights: GPTQ on the toolkit's grid, weights.py,
                    or mmse's weight ranges), step1.py (hybrid step1 once per setting, reused ranges: ranges.py),
                    rules.py (a build again without a failing toolkit rule) and sessions.py (the kept simulator
                    sessions)
    dataset.py      dataset.txt, and the normalization the NPU applies for image inputs
    toolkit.py      Toolkit: every rknn-toolkit2 call, made in the worker process (worker.py); a crash → ToolkitError
    runner.py       Runner: a build on the simulator, and accuracy_analysis as per-layer rows
    search.py       the accuracy-driven fallback with RKNN builds: phases.py (range algorithm, spread set, mmse
                    weight ranges, kl after a missed search) around the search, whose trials and ranking (by
                    accuracy_analysis) are trials.py
    contract.py     input_contract.json and run_on_board.py (package data: the board's example runner)

The rest of qprep uses only OPTIONS and quantize. They are loaded on first use: worker.py runs as
`python -m qprep.quantize.rknn.worker`, which imports this package first, and the worker must start on the
toolkit's imports alone (convert.py and builder.py pull in onnx and qprep's data stack, many times what the
package and worker.py take to import).
"""

from __future__ import annotations

__all__ = ["OPTIONS", "RknnBuilder", "quantize"]

# What a build leaves in the run directory beside model.onnx (builder.py, contract.py): claimed with the run
# directory before the run starts, so a file of the user's under one of these names is refused, never replaced.
ARTIFACTS = ("model.rknn", "input_contract.json", "run_on_board.py")


def __getattr__(name: str):
    if name == "RknnBuilder":
        from qprep.quantize.rknn import builder

        return builder.RknnBuilder
    if name in __all__:
        from qprep.quantize.rknn import convert

        return getattr(convert, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
