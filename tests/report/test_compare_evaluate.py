"""`qprep evaluate RUN --samples DIR` says the figure that decided its gate, with the samples named, in the same
words as the verdict, compare and batch summaries (compare.decided_by); its --json records it."""

from __future__ import annotations

import json

from synthetic_report import judged

from qprep.report.verdict import decided_by


def test_evaluate_prints_and_records_the_deciding_figure(tmp_path, cli, monkeypatch):
    evaluation = judged({"cosine_mean": 0.5})["evaluation"]
    result = {"run_dir": str(tmp_path / "run"), "status": "ok", **evaluation}
    monkeypatch.setattr("qprep.pipeline.run_dir.recorded_inputs", lambda run_dir: {})
    monkeypatch.setattr("qprep.pipeline.reevaluate.reevaluate", lambda *args, **kwargs: json.loads(json.dumps(result)))
    (tmp_path / "new").mkdir()
    (tmp_path / "run").mkdir()
    code, out, err = cli("evaluate", tmp_path / "run", "--samples", tmp_path / "new", "--json", tmp_path / "e.json")
    assert code == 0, err
    figure = decided_by(evaluation, split=str(tmp_path / "new"))
    line = f"qprep: met: {figure['text'].replace('`', '')}"
    assert line in out.splitlines() and line.endswith(f"({tmp_path / 'new'}, 16 samples)")
    assert json.loads((tmp_path / "e.json").read_text())["decided_by"] == figure
