"""Quantized-graph (QDQ) stages: rewrites of QuantizeLinear/DequantizeLinear graphs from QAT exports and QDQ
quantizers.

    remove_redundant.py  `remove_redundant_qdq`: DQ→Q round trips, doubled pairs, pairs around data-movement ops
                         (exact: verified to 1e-6 against the stage input)
    fuse_conv/           `fuse_conv_qdq`: DQ→Conv[→Relu/Clip]→Q into QLinearConv (or ConvInteger + float rescale),
                         optionally MatMul into QLinearMatMul / MatMulInteger (within one quantization step):
                         operands.py (what the rules read from the graph), rules.py, stage.py
    float_maxpool.py     non-overlapping MaxPools after ORT quantization → Reshape + ReduceMax (exact)
    params.py            reading a Q/DQ node's scale / zero point / type / axis; quantizing constants as ORT does
    verified.py          applying a stage's rules in verified batches and rolling back the rewrites that fail

Rules follow the graph-rewrite convention of qprep/optimize/passes (onnx_ir + the onnxscript rewriter, pattern /
check / rewrite kept separate); what differs here is that every rewrite is keyed by an *anchor* node name, so a
failing rewrite can be rolled back on its own instead of the whole pass.
"""
