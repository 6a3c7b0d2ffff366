"""Does this machine's ONNX Runtime saturate in its uint8 × int8 (U8S8) kernels? Measured, not assumed.

Why: on x86-64 CPUs with AVX2 (or AVX-512) but without VNNI, ONNX Runtime's U8S8 integer GEMM multiplies with
VPMADDUBSW, which adds two uint8 × int8 products into an int16 and clips it at ±32767: 255 × 127 × 2 = 64770 does
not fit. The QDQ model is right (run unfused it matches), but the integer operators ORT fuses it into at session
time are not, on such a CPU only (BENCHMARKS.md: "ONNX Runtime's u8s8 kernels saturate").
Weights that cannot overflow the pair sum — uint8 (U8U8 runs a widening kernel) or 7-bit (reduce_range) — avoid
it on every CPU.

The probe: a QDQ MatMul and a QDQ 1×1 Conv whose quantized inputs are all 255 and weights all 127, run with ORT's
fusions (ORT_ENABLE_ALL) and without; if the results differ, the fused U8S8 kernels saturate here. Once per
process.
"""

from __future__ import annotations

import functools
import platform

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

DEPTH = 64  # products summed per output: an even count, so every VPMADDUBSW pair is 255 × 127 + 255 × 127
OUTPUT_STEP = DEPTH / 100.25  # the exact sum lands at 100.25 output steps: no rounding tie between the paths


@functools.lru_cache(maxsize=1)
def u8s8_saturates() -> bool:
    """True when ONNX Runtime's fused U8S8 kernels compute a different result than its QDQ reference here."""
    import onnxruntime as ort

    for model, feeds in (_probe_matmul(), _probe_conv()):
        results = []
        for level in (ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
            options = ort.SessionOptions()
            options.graph_optimization_level = level
            options.intra_op_num_threads = 1
            options.log_severity_level = 3
            session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
            results.append(session.run(None, feeds)[0])
        if not np.allclose(results[0], results[1], rtol=0, atol=1.01 * OUTPUT_STEP):  # saturated: about half
            return True
    return False


def this_cpu() -> str:
    """One line for the report: what this CPU does with U8S8, and why."""
    cpu = _cpu_name()
    if u8s8_saturates():
        return (f"this CPU ({cpu}) saturates ONNX Runtime's uint8 × int8 kernels (AVX2/AVX-512 without VNNI: "
                "int16 pair sums clip): measured by the probe in model/saturation.py")
    return f"this CPU ({cpu}) computes ONNX Runtime's uint8 × int8 kernels exactly (probe: no saturation)"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _qdq(name: str, scale: float, zero_point: int, dtype) -> list[TensorProto]:
    return [numpy_helper.from_array(np.array(scale, np.float32), f"{name}_scale"),
            numpy_helper.from_array(np.array(zero_point, dtype), f"{name}_zero_point")]


def _probe_matmul() -> tuple[onnx.ModelProto, dict]:
    """x[1, DEPTH] → Q(uint8, 255 everywhere) → DQ → MatMul with DQ(int8 weights of 127) → Q → DQ: the exact
    result is DEPTH (255 · 127 · DEPTH times scales 1/255 · 1/127); saturated pair sums give about half."""
    return _probe("MatMul", [1, DEPTH], (DEPTH, 8), [1, 8])


def _probe_conv() -> tuple[onnx.ModelProto, dict]:
    """The same sums as a 1×1 Conv (ORT's QLinearConv, another kernel path)."""
    return _probe("Conv", [1, DEPTH, 4, 4], (8, DEPTH, 1, 1), [1, 8, 4, 4])


def _probe(op_type: str, x_shape: list[int], w_shape: tuple, y_shape: list[int]) -> tuple[onnx.ModelProto, dict]:
    nodes = [helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zero_point"], ["x_q"]),
             helper.make_node("DequantizeLinear", ["x_q", "x_scale", "x_zero_point"], ["x_dq"]),
             helper.make_node("DequantizeLinear", ["w_q", "w_scale", "w_zero_point"], ["w_dq"]),
             helper.make_node(op_type, ["x_dq", "w_dq"], ["y"]),
             helper.make_node("QuantizeLinear", ["y", "y_scale", "y_zero_point"], ["y_q"]),
             helper.make_node("DequantizeLinear", ["y_q", "y_scale", "y_zero_point"], ["out"])]
    initializers = [numpy_helper.from_array(np.full(w_shape, 127, np.int8), "w_q"),
                    *_qdq("x", 1 / 255, 0, np.uint8), *_qdq("w", 1 / 127, 0, np.int8),
                    *_qdq("y", OUTPUT_STEP, 0, np.uint8)]
    graph = helper.make_graph(nodes, f"u8s8_probe_{op_type}",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, y_shape)], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 7
    return model, {"x": np.ones(x_shape, np.float32)}
