"""A batch summary's row reads what the run recorded: LayerNorms fused are the optimize stage's, never a count
difference that a failed run (no result) or a later stage turns negative."""

import json

from qprep.report.summary import summary_row


def _report(tmp_path, stages, result=None, status="ok"):
    run = tmp_path / "run"
    run.mkdir()
    (run / "report.json").write_text(json.dumps({
        "status": status, "model": {"nodes": 40, "op_counts": {"LayerNormalization": 12}},
        "result": result or {}, "stages": stages}))
    return run


def _optimize(fused, status="ok"):
    return {"name": "optimize", "passes": [{"pass": "fuse_layernorm", "status": status, "details": {"fused": fused}}]}


def test_layernorms_fused_are_the_optimize_stage_s(tmp_path):
    run = _report(tmp_path, [_optimize(3)], {"nodes": 30, "op_counts": {"LayerNormalization": 11}})
    assert summary_row("m.onnx", run, 1.0)["layernorms_fused"] == 3  # was 11 - 12 = -1


def test_a_failed_run_or_no_optimize_has_no_layernorm_figure(tmp_path):
    assert summary_row("m.onnx", _report(tmp_path, [_optimize(0, "rolled back")], status="failed"),
                       1.0)["layernorms_fused"] is None  # was -12: the model's count minus an absent result's
    (tmp_path / "run" / "report.json").unlink()
    (tmp_path / "run").rmdir()
    assert summary_row("m.onnx", _report(tmp_path, [{"name": "quantize"}]), 1.0)["layernorms_fused"] is None
