"""qprep batch over a folder of real and broken models, --resume, a killed worker; qprep compare."""

import json
import shutil
import subprocess
import sys
import time

import numpy as np
import onnx
import pytest
from onnx import helper

from conftest import demo_model
from graphs import make_graph, make_model, tiny_conv_model

pytestmark = pytest.mark.slow  # real models or the CLI in subprocesses: `pytest -m "not slow"` skips them


def if_model() -> onnx.ModelProto:
    """y = If(sum(x) > 0) then x*2 else x-1: control flow the optimize stage must keep."""
    then = make_graph([helper.make_node("Mul", ["x", "two"], ["t"])], [], [("t", [2, 3])], {"two": np.float32(2)},
                      name="then")
    other = make_graph([helper.make_node("Sub", ["x", "one"], ["e"])], [], [("e", [2, 3])], {"one": np.float32(1)},
                       name="else")
    nodes = [helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
             helper.make_node("Greater", ["s", "zero"], ["c"]),
             helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)]
    return make_model(nodes, [("x", [2, 3])], [("y", [2, 3])], {"zero": np.float32(0)}, name="if",
                      infer_shapes=False)


def endless_loop_model() -> onnx.ModelProto:
    """A Loop with a huge trip count: its worker never finishes, so the test can kill it."""
    body = make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]), helper.make_node("Add", ["v_in", "one"], ["v_out"])],
        [("i", [], np.int64), ("cond_in", [], np.bool_), ("v_in", [1])], [("cond_out", [], np.bool_), ("v_out", [1])],
        {"one": np.ones(1, np.float32)}, name="body")
    return make_model([helper.make_node("Loop", ["trips", "cond", "x"], ["y"], body=body)], [("x", [1])], [("y", [1])],
                      {"trips": np.int64(10**15), "cond": np.bool_(True)}, name="loop", infer_shapes=False)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch")
    models = root / "models"
    models.mkdir()
    shutil.copy(demo_model("ppocr_cls.onnx"), models / "cls.onnx")
    shutil.copy(demo_model("ppocr_cls.onnx"), models / "cls_copy.onnx")  # byte-identical twin
    shutil.copy(demo_model("efficientnet_lite0.onnx"), models / "effnet.onnx")
    onnx.save(tiny_conv_model(), str(models / "tiny.onnx"))
    onnx.save(if_model(), str(models / "with_if.onnx"))
    data = (models / "tiny.onnx").read_bytes()
    (models / "truncated.onnx").write_bytes(data[: len(data) // 3])
    config = root / "optimize.yaml"
    config.write_text("model: unused.onnx\npipeline: [optimize]\n")
    return root, models, config


def run_cli(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "qprep", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


def test_batch_statuses_summary_and_resume(folder):
    root, models, config = folder
    out = root / "out"
    done = run_cli("batch", config, models, "--out", out, "--jobs", "2", "--quiet")
    assert done.returncode == 2, done.stderr
    summary = json.loads((out / "summary.json").read_text())
    rows = {r["model"]: r for r in summary["models"]}
    assert {name: r["status"] for name, r in rows.items()} == {
        "cls.onnx": "ok", "cls_copy.onnx": "ok", "effnet.onnx": "ok", "tiny.onnx": "ok", "with_if.onnx": "ok",
        "truncated.onnx": "refused"}
    assert summary["models"][0]["model"] == "truncated.onnx"  # worst first
    assert "truncated or corrupt" in rows["truncated.onnx"]["error"] and "\n" not in rows["truncated.onnx"]["error"]
    assert rows["cls_copy.onnx"]["note"] == "identical to cls.onnx"
    assert rows["effnet.onnx"]["nodes_after"] == 94
    for name in ("cls.onnx", "effnet.onnx", "with_if.onnx"):
        report = json.loads((out / name.removesuffix(".onnx") / "report.json").read_text())
        assert rows[name]["nodes_after"] == report["result"]["nodes"]
        assert rows[name]["nodes_before"] == report["model"]["nodes"]
    if_result = onnx.load(str(out / "with_if" / "model.onnx"))
    assert [n.op_type for n in if_result.graph.node].count("If") == 1  # control flow preserved
    for name in ("summary.csv", "summary.md", "summary.html"):
        assert "cls.onnx" in (out / name).read_text()
    stamp = (out / "cls" / "report.json").stat().st_mtime
    again = run_cli("batch", config, models, "--out", out, "--resume", "--quiet")
    assert again.returncode == 2  # the truncated model is still refused
    resumed = {r["model"]: r for r in json.loads((out / "summary.json").read_text())["models"]}
    assert resumed["cls.onnx"]["note"] == "resumed: result reused"
    assert (out / "cls" / "report.json").stat().st_mtime == stamp  # no model work redone
    changed = run_cli("batch", config, models, "--out", out, "--resume", "--quiet", "--set", "threads=1")
    assert changed.returncode == 2
    rerun = {r["model"]: r for r in json.loads((out / "summary.json").read_text())["models"]}
    assert rerun["cls.onnx"]["status"] == "ok" and rerun["cls.onnx"].get("note") != "resumed: result reused"
    assert (out / "cls" / "report.json").stat().st_mtime > stamp  # another config: the model ran again


def test_a_killed_worker_fails_only_its_model(tmp_path):
    import psutil

    models = tmp_path / "models"
    models.mkdir()
    onnx.save(tiny_conv_model(), str(models / "a_tiny.onnx"))
    onnx.save(endless_loop_model(), str(models / "hang.onnx"))
    config = tmp_path / "c.yaml"
    config.write_text("model: unused.onnx\npipeline: [optimize]\n")
    batch = subprocess.Popen([sys.executable, "-m", "qprep", "batch", str(config), str(models), "--out",
                              str(tmp_path / "out"), "--jobs", "2", "--quiet"], stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    victim = None
    while victim is None and time.time() < deadline:
        for proc in psutil.Process(batch.pid).children(recursive=True):
            if any("hang.onnx" in part for part in proc.cmdline()):
                victim = proc
        time.sleep(0.5)
    assert victim is not None, "worker for hang.onnx never started"
    time.sleep(2)  # let it get into the Loop
    victim.kill()
    batch.wait(timeout=300)
    assert batch.returncode == 2
    rows = {r["model"]: r for r in json.loads((tmp_path / "out" / "summary.json").read_text())["models"]}
    assert rows["hang.onnx"]["status"] == "failed" and "worker died" in rows["hang.onnx"]["error"]
    assert rows["a_tiny.onnx"]["status"] == "ok"


def test_compare_prints_deltas_and_fails_on_regression(tmp_path, cli):
    base = {"status": "ok", "result": {"nodes": 10},
            "evaluation": {"outputs": {"logits": {"cosine_mean": 0.99, "top1_agreement": 0.95}}}}
    worse = json.loads(json.dumps(base))
    worse["evaluation"]["outputs"]["logits"].update(cosine_mean=0.97, top1_agreement=0.96)
    for name, report in (("a", base), ("b", worse)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "report.json").write_text(json.dumps(report))
    code, out, _ = cli("compare", tmp_path / "a", tmp_path / "b", "--markdown", tmp_path / "c.md")
    assert code == 0
    assert "0.97 (-0.02) ▼" in out and "0.96 (+0.01)" in out and "0.96 (+0.01) ▼" not in out
    assert "**0.97 (-0.02)**" in (tmp_path / "c.md").read_text()
    code, out, _ = cli("compare", tmp_path / "a", tmp_path / "b", "--fail-on-regression", "cosine_mean=0.01")
    assert code == 1 and "REGRESSION logits.cosine_mean" in out
    code, _, _ = cli("compare", tmp_path / "a", tmp_path / "b", "--fail-on-regression", "cosine_mean=0.05")
    assert code == 0
    code, _, err = cli("compare", tmp_path / "a", tmp_path / "b", "--fail-on-regression", "cosine_maen=0.05")
    assert code == 2 and "no run reports this metric" in err  # a misspelt CI gate must not pass silently


def test_a_batch_shows_the_held_out_figure_that_decided_each_verdict(tmp_path):
    """Issue #59: the summary's cosine and agreement were the evaluation split's while the held-out split decided
    the verdict; now they are the judged set's, beside the deciding figure with its samples named, in the summary
    and on the progress line."""
    models = tmp_path / "models"
    models.mkdir()
    onnx.save(tiny_conv_model(batch=1), str(models / "tiny.onnx"))
    rng = np.random.default_rng(0)
    for split, count in (("calib", 8), ("eval", 6), ("heldout", 5)):
        (tmp_path / split).mkdir()
        for i in range(count):
            np.save(tmp_path / split / f"{i}.npy", rng.normal(size=(1, 3, 8, 8)).astype(np.float32))
    config = tmp_path / "c.yaml"
    config.write_text(f"model: unused.onnx\ncalibration: {{source: {tmp_path / 'calib'}}}\n"
                      f"evaluation: {{source: {tmp_path / 'eval'}, heldout: {{source: {tmp_path / 'heldout'}}}, "
                      "gate: {cosine_mean: 0.5}, latency: {runs: 0}, layers: false}\n"
                      "pipeline: [optimize, {quantize: {backend: ort}}]\n")
    done = run_cli("batch", config, models, "--out", tmp_path / "out", "--jobs", "1")
    assert done.returncode == 0, done.stderr
    row = json.loads((tmp_path / "out" / "summary.json").read_text())["models"][0]
    evaluation = json.loads((tmp_path / "out" / "tiny" / "report.json").read_text())["evaluation"]
    assert row["cosine_mean"] == evaluation["heldout"]["outputs"]["y"]["cosine_mean"] != \
        evaluation["outputs"]["y"]["cosine_mean"]
    assert row["decided_by"].startswith("gate: `cosine_mean` of `y` ")
    assert row["decided_by"].endswith("≥ 0.5 (held-out, 5 samples)") and row["judged_on"] == "held-out, 5 samples"
    assert row["decided_by"] in (tmp_path / "out" / "summary.md").read_text()
    assert f"tiny.onnx: ok, {row['decided_by'].replace('`', '')} (" in done.stderr


def test_models_whose_names_flatten_alike_get_their_own_run_directories():
    from qprep.pipeline.batch import dir_name

    used: set[str] = set()
    assert [dir_name(n, used) for n in ("a/b.onnx", "a__b.onnx", "c.onnx", "a__b-2.onnx")] == \
        ["a__b", "a__b-2", "c", "a__b-2-2"]


def test_compare_shows_every_metric_the_gate_accepts():
    """One metric list (measure/metrics.py): task accuracy and mse reach `compare`, and mse regresses upward."""
    from qprep.config import GATE_METRICS
    from qprep.measure.metrics import higher_is_better
    from qprep.report.compare import metrics_of

    report = {"evaluation": {"outputs": {"y": {m: 0.5 for m in GATE_METRICS}}}}
    assert {f"y.{m}" for m in GATE_METRICS} <= set(metrics_of("report", report))
    assert not higher_is_better("y.mse") and not higher_is_better("result.nodes")
    assert higher_is_better("y.top1_accuracy") and higher_is_better("m.speedup")


def test_batch_merges_each_models_sidecar(tmp_path):
    """NAME.qprep.yaml beside NAME.onnx is merged over the batch config for that model only; its paths are
    relative to it, and a broken sidecar fails its own model with a one-line reason."""
    models = tmp_path / "models"
    (models / "a_samples").mkdir(parents=True)
    onnx.save(tiny_conv_model(), str(models / "a.onnx"))
    onnx.save(tiny_conv_model(batch=2), str(models / "b.onnx"))
    rng = np.random.default_rng(0)
    for i in range(3):
        np.save(models / "a_samples" / f"{i}.npy", rng.normal(size=(1, 3, 8, 8)).astype(np.float32))
    (models / "a.qprep.yaml").write_text("inputs: {x: [1, 3, 8, 8]}\ncalibration: {source: a_samples}\n")
    (models / "b.qprep.yaml").write_text("calibraton: {source: a_samples}\n")
    config = tmp_path / "optimize.yaml"
    config.write_text("model: unused.onnx\npipeline: [optimize]\n")
    out = tmp_path / "out"
    done = run_cli("batch", config, models, "--out", out, "--jobs", "1", "--quiet")
    rows = {r["model"]: r for r in json.loads((out / "summary.json").read_text())["models"]}
    assert rows["a.onnx"]["status"] == "ok", done.stderr
    report = json.loads((out / "a" / "report.json").read_text())
    assert report["load"]["inputs_fixed"] and report["calibration"]["count"] == 3
    manifest = json.loads((out / "a" / "manifest.json").read_text())
    assert manifest["inputs"]["overlay"]["path"] == str(models / "a.qprep.yaml")
    assert rows["b.onnx"]["status"] == "refused"
    assert rows["b.onnx"]["error"] == "calibraton: unknown key; did you mean 'calibration'?"


def test_a_gate_miss_keeps_its_reason_when_what_to_do_follows_it():
    """A run that misses prints the miss, then how to run the fallback: the summary keeps the miss."""
    from qprep.pipeline.batch_worker import run_outcome

    stderr = ("qprep: gate missed: model.onnx in out (48 → 12 nodes, 35.9 s)\n"
              "qprep: accuracy floor missed: cosine_mean 0.5821 (needs >= 0.9) (report in out)\n"
              "qprep: to have qprep search which layers to keep float, run again with `--set …`\n")
    assert run_outcome(1, stderr) == ("gate missed", "accuracy floor missed: cosine_mean 0.5821 (needs >= 0.9) "
                                                     "(report in out)")
