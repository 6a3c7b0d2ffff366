"""The `fuse_conv_qdq` stage: Conv wrapped in Q/DQ → an integer operator (QLinearConv, or ConvInteger with a
float rescale), optionally MatMul likewise (QLinearMatMul / MatMulInteger).

Rules, applied per Conv (the anchor: each one is checked and rolled back on its own):

    epilogue       Conv(DQ(x), DQ(w), b) → Div|Mul|Add|Sub(c) or BatchNormalization, c per-channel constants
                   → Conv(DQ(x), DQ'(w), b'): y·m + c folds into the weight scales (w_scale·m, the integer
                   weights are untouched) and the bias (b·m + c). PyTorch eager QAT exports leave exactly this
                   (Conv → Div(scale factor) → BatchNormalization) behind. Needs m > 0 (scales stay positive).
    qlinear        Q([Relu|Clip](Conv(DQ(x), DQ(w)[, b]))) → QLinearConv(x, …, w, …, y_scale, y_zp, b_int32)
                   [→ Clip on integers]. Q is monotone, so Q(clip(y, lo, hi)) = clip(Q(y), Q(lo), Q(hi)) exactly:
                   the activation is absorbed when Q's saturation already does it (Relu: y_zp = qmin; Clip:
                   Q(lo) = qmin and Q(hi) = qmax), else kept as an integer Clip on the quantized output.
    integer        Conv(DQ(x), DQ(w)[, b]) → Mul(Cast(ConvInteger(x, w, x_zp, w_zp) + b_int32), x_scale·w_scale)
                   for every Conv with `format: integer`, and with `format: qlinear` for Convs whose output is
                   not requantized (QLinearConv needs an output scale) or that QLinearConv cannot take (the
                   reason is recorded as `why_not_qlinear`). A following Q/Relu stays as it is. Slow on ONNX
                   Runtime's CPU kernels (BENCHMARKS.md, "INT8 speed against FP32").
    matmul         (option) Q(MatMul(DQ(a), DQ(b))) → QLinearMatMul; MatMul(DQ(a), DQ(b)) → MatMulInteger +
                   rescale where not requantized or with `format: integer`.

Bias: int32 with scale x_scale·w_scale (per output channel). A DQ'd int32 bias with exactly that scale is used
as it is; a float bias (or one with another scale) is quantized as onnxruntime.quantization does:
round(float64(b) / float64(float32(x_scale · w_scale))), clipped to int32. Weights: an integer constant, or
QuantizeLinear(float constant) (QAT exports), quantized here exactly as ORT's kernel would.

Preconditions (a miss leaves the Conv as it was, the reason in the record): per-tensor x and y parameters;
8-bit types; per-tensor or per-output-channel (axis 0) weights; y type = x type and int8 x only with int8
weights (ONNX Runtime's QLinearConv kernels); ConvInteger only with one weight zero point (its kernel has no
per-channel zero point); constant bias; no second consumer of an intermediate value.

Verification: each rewrite on its own, on the reference model's own input to that Conv (a per-node probe):
within one quantization step of its output (|Δ| <= 1 integer step at the Q output, or one int32 accumulator
step x_scale·w_scale for a float output); then the whole model against the stage input, gated by cosine per
output (`min_cosine`) and recorded in output steps. See qprep/qdq/verified.py for why both.
"""

from qprep.qdq.fuse_conv.stage import fuse_conv_qdq, output_steps

__all__ = ["fuse_conv_qdq", "output_steps"]
