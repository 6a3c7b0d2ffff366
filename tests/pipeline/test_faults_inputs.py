"""Issue #18, bad inputs: user and environment errors are one line with exit 2, never "internal error".

Every case runs the CLI in a subprocess (tests/pipeline/faults.py) and asserts the exit code, at most one stderr line
without a traceback, and that the input files are byte-identical afterwards.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import onnx
import pytest
from PIL import Image

from conftest import ROOT
from graphs import make_model, tiny_conv_model
from faults import CAN_BE_DENIED, UNPRIVILEGED, assert_one_line, digests, project, qprep

pytestmark = pytest.mark.slow  # real models or the CLI in subprocesses: `pytest -m "not slow"` skips them

ROOT_SKIP = "running as root without setpriv: chmod 000 does not deny root, so permission denied cannot be produced"


# --- item 8: user and environment errors that were "internal error" ---------------------------------------

def _non_utf8(p):
    config = p.root / "latin1.yaml"
    config.write_bytes(p.config.read_bytes() + "# caf\xe9 au lait\n".encode("latin-1"))
    return ["validate", config], ("latin1.yaml", "UTF-8")


def _negative_seed(p):
    return ["validate", p.config, "--set", "calibration.seed=-1"], ("calibration.seed",)


def _png_as_source(p):
    Image.new("RGB", (8, 8)).save(p.root / "one.png")
    return ["run", p.config, "--set", "calibration.source=one.png", "--quiet"], ("calibration.source", "one.png")


CONFIG_CASES = {"non-utf8 config": _non_utf8, "negative seed": _negative_seed, "one png as source": _png_as_source}


@pytest.mark.parametrize("case", CONFIG_CASES)
def test_config_and_data_errors_are_user_errors(tmp_path, case):
    p = project(tmp_path, pipeline=())
    args, phrases = CONFIG_CASES[case](p)
    before = p.inputs()
    outcome = qprep(*args, cwd=tmp_path)
    assert_one_line(outcome, 2, *phrases)
    assert p.inputs() == before


def test_external_data_outside_the_model_folder_is_refused(tmp_path):
    import onnx
    from onnx.external_data_helper import convert_model_to_external_data

    p = project(tmp_path / "project", pipeline=())
    model = onnx.load(str(p.model))
    convert_model_to_external_data(model, location="weights.bin", size_threshold=0)
    onnx.save(model, str(p.model))
    (tmp_path / "secret.bin").write_bytes((p.root / "weights.bin").read_bytes())
    model = onnx.load(str(p.model), load_external_data=False)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = "../secret.bin"
    onnx.save(model, str(p.model))
    before = {**p.inputs(), **digests(tmp_path / "secret.bin")}
    outcome = qprep("inspect", p.model)
    assert_one_line(outcome, 2, "../secret.bin", "outside")
    assert {**p.inputs(), **digests(tmp_path / "secret.bin")} == before


@pytest.mark.skipif(not CAN_BE_DENIED, reason=ROOT_SKIP)
@pytest.mark.parametrize("command", ["run", "compare-markdown"])
def test_permission_denied_on_an_output_path(tmp_path, command):
    p = project(tmp_path / "project", pipeline=())
    locked = tmp_path / "locked"
    locked.mkdir()
    if command == "compare-markdown":
        assert qprep("run", p.config, "--quiet").code == 0
    before = p.inputs()
    locked.chmod(0)
    try:
        if command == "run":
            outcome = qprep("run", p.config, "--out", locked / "run", "--quiet", unprivileged=True)
        else:
            outcome = qprep("compare", p.out, "--markdown", locked / "table.md", unprivileged=True)
    finally:
        locked.chmod(0o755)
    assert_one_line(outcome, 2, str(locked), "ermission denied")
    assert p.inputs() == before


def test_compare_markdown_into_a_path_that_cannot_be_a_file(tmp_path):
    """The same write error as permission denied, in a form root cannot bypass: the parent is a file."""
    p = project(tmp_path, pipeline=())
    assert qprep("run", p.config, "--quiet").code == 0
    before = {**p.inputs(), **digests(p.out)}
    outcome = qprep("compare", p.out, "--markdown", p.model / "table.md")
    assert_one_line(outcome, 2, "--markdown", "table.md")
    assert {**p.inputs(), **digests(p.out)} == before


@pytest.mark.parametrize("args", [["--jobs", "-1"], ["--jobs", "0"], ["--out-is-a-file"]],
                         ids=["jobs -1", "jobs 0", "out is a file"])
def test_batch_arguments(tmp_path, args):
    p = project(tmp_path / "models", pipeline=())
    out = tmp_path / "out"
    if args == ["--out-is-a-file"]:
        out.write_text("not a folder\n")
        args = []
    before = {**p.inputs(), **digests(out)}
    outcome = qprep("batch", p.config, p.root, "--out", out, "--quiet", *args)
    assert_one_line(outcome, 2, *(["--jobs"] if args else [str(out)]))
    assert {**p.inputs(), **digests(out)} == before


@pytest.mark.parametrize("content", ["[]", "null", "42", "metric-string"])
def test_compare_on_a_report_that_is_not_one(tmp_path, content):
    report = tmp_path / "report.json"
    if content == "metric-string":
        content = json.dumps({"evaluation": {"outputs": {"y": {"cosine_mean": "high", "mse": 0.1}}}})
    report.write_text(content)
    before = digests(report)
    outcome = qprep("compare", report)
    assert_one_line(outcome, 2, "report.json")
    assert digests(report) == before


@pytest.mark.parametrize("args", [["config", "--schema"], ["inspect", "model.onnx"]], ids=["config", "inspect"])
def test_a_closed_pipe_ends_quietly(tmp_path, args):
    """`qprep … | head -1`: the reader is gone before qprep writes; like a Unix tool killed by SIGPIPE it exits
    128 + 13 without a word (the read end is closed before qprep starts writing, so this is deterministic)."""
    p = project(tmp_path, pipeline=())
    before = p.inputs()
    process = subprocess.Popen([sys.executable, "-m", "qprep", *args], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    process.stdout.close()
    err = process.stderr.read().decode()
    process.wait(timeout=60)
    process.stderr.close()
    assert (process.returncode, err) == (141, "")
    assert p.inputs() == before


# --- item 10: `compare RUN` shows the FP32 reference as perfect ---------------------------------------------

@pytest.fixture(scope="module")
def exact_run(tmp_path_factory):
    """A run whose result is the input model (empty pipeline), evaluated: every metric is exact."""
    p = project(tmp_path_factory.mktemp("exact"), pipeline=())
    assert_one_line(qprep("run", p.config, "--quiet"), 0)
    return p


def _markdown_rows(path) -> dict[str, list[str]]:
    lines = path.read_text().splitlines()[2:]
    return {cells[0]: cells[1:] for cells in ([c.strip() for c in line.strip("|").split("|")] for line in lines)}


def test_compare_one_run_shows_the_reference_against_itself(exact_run, tmp_path):
    """Errors (lower is better) are 0 for the reference, similarities and agreement 1, SQNR infinite."""
    before = {**exact_run.inputs(), **digests(exact_run.out)}
    outcome = qprep("compare", exact_run.out, "--markdown", tmp_path / "table.md")
    assert_one_line(outcome, 0)
    rows = _markdown_rows(tmp_path / "table.md")
    assert rows["y.mse"] == ["0", "0 (+0)"] and rows["y.max_abs"] == ["0", "0 (+0)"]
    assert rows["y.cosine_mean"][0] == "1" and rows["y.sqnr_db"] == ["inf", "inf"]
    assert {**exact_run.inputs(), **digests(exact_run.out)} == before


# --- item 9: qprep writes standard JSON ---------------------------------------------------------------------

def strict_json(path):
    """Parse like a strict parser (JavaScript's JSON.parse, jq): Infinity and NaN are not JSON."""
    def refuse(constant):
        raise ValueError(f"{path}: {constant} is not standard JSON")
    return json.loads(path.read_text(), parse_constant=refuse)


def test_an_exact_result_writes_standard_json_and_compares(exact_run):
    report = strict_json(exact_run.out / "report.json")
    strict_json(exact_run.out / "manifest.json")
    assert report["evaluation"]["outputs"]["y"]["sqnr_db"] == "Infinity"
    before = {**exact_run.inputs(), **digests(exact_run.out)}
    outcome = qprep("compare", exact_run.out, exact_run.out)
    assert_one_line(outcome, 0)
    assert any(line.split()[:3] == ["y.sqnr_db", "inf", "inf"] for line in outcome.out.splitlines()), outcome.out
    assert {**exact_run.inputs(), **digests(exact_run.out)} == before


# --- item 7: one bad folder entry fails alone in a batch -----------------------------------------------------

def test_unreadable_batch_entries_fail_alone(tmp_path):
    """A symlink loop, a dangling symlink and a folder named like a model each get a failed row with a one-line
    reason; the real model still runs, and the batch exits 2 (a model refused)."""
    p = project(tmp_path / "project", pipeline=())
    models = tmp_path / "models"
    models.mkdir()
    (models / "real.onnx").write_bytes(p.model.read_bytes())
    (models / "loop.onnx").symlink_to("loop.onnx")
    (models / "dangling.onnx").symlink_to("gone.onnx")
    (models / "folder.onnx").mkdir()
    before = {**p.inputs(), **digests(models)}
    outcome = qprep("batch", p.config, models, "--out", tmp_path / "out", "--quiet")
    assert_one_line(outcome, 2)
    rows = {row["model"]: row for row in strict_json(tmp_path / "out" / "summary.json")["models"]}
    assert {name: row["status"] for name, row in rows.items()} == {
        "real.onnx": "ok", "loop.onnx": "refused", "dangling.onnx": "refused", "folder.onnx": "refused"}
    for name in ("loop.onnx", "dangling.onnx", "folder.onnx"):
        assert rows[name]["error"] and "\n" not in rows[name]["error"], rows[name]
    assert "a folder" in rows["folder.onnx"]["error"] and "symbolic link" in rows["loop.onnx"]["error"]
    assert {**p.inputs(), **digests(models)} == before


# --- item 11 (part): duplicate YAML keys, unreadable model, the checker's node name ------------------------

@pytest.mark.parametrize("text, phrases", [
    ("model: model.onnx\noutput_dir: out\nmodel: other.onnx\n", ("duplicate key 'model'", "line 3", "line 1")),
    ("model: model.onnx\ncalibration:\n  source: calib\n  source: eval\n", ("duplicate key 'source'", "line 4")),
], ids=["top level", "nested"])
def test_duplicate_config_keys_are_refused(tmp_path, text, phrases):
    p = project(tmp_path, pipeline=())
    config = tmp_path / "twice.yaml"
    config.write_text(text)
    before = {**p.inputs(), **digests(config)}
    assert_one_line(qprep("validate", config), 2, "twice.yaml", *phrases)
    assert {**p.inputs(), **digests(config)} == before


@pytest.mark.skipif(not CAN_BE_DENIED, reason=ROOT_SKIP)
def test_an_unreadable_model_is_permission_denied_not_corrupt(tmp_path):
    p = project(tmp_path, pipeline=())
    p.model.chmod(0)
    try:
        outcome = qprep("inspect", p.model, unprivileged=True)
    finally:
        p.model.chmod(0o644)
    assert_one_line(outcome, 2, f"permission denied: {p.model}")
    assert "corrupt" not in outcome.err


def test_a_checker_failure_names_the_node(tmp_path):
    """onnx.checker puts the node's name on a later line ("==> Context: … Name: relu_with_alpha"); it must
    reach the one line."""
    import onnx
    from onnx import helper

    node = helper.make_node("Relu", ["x"], ["y"], name="relu_with_alpha", alpha=1.0)  # Relu has no alpha
    model = tmp_path / "bad.onnx"
    onnx.save(make_model([node], [("x", [1, 4])], [("y", [1, 4])], name="bad", infer_shapes=False), str(model))
    before = digests(model)
    assert_one_line(qprep("inspect", model), 2, "relu_with_alpha", "alpha")
    assert digests(model) == before


def test_ids_beyond_the_embedding_table_are_refused_before_the_run_directory(tmp_path):
    """Issue #59: ids up to 300 for a 10-row table passed validate, then the run failed a second in, advising to
    keep a node float, and left a run folder without a result. Now both commands refuse them in one line naming
    the sample, the largest id and the table, and no run folder is made."""
    import numpy as np
    import onnx
    import yaml

    from graphs import two_input_model

    onnx.save(two_input_model(), str(tmp_path / "model.onnx"))
    rng = np.random.default_rng(0)
    for name, top in (("calib", 300), ("eval", 10)):
        (tmp_path / name).mkdir()
        for i in range(4):
            np.savez(tmp_path / name / f"{i}.npz", ids=rng.integers(0, top, (1, 5)).astype(np.int64),
                     mask=np.ones((1, 5), np.float32))
    np.savez(tmp_path / "calib" / "1.npz", ids=np.array([[3, 300, 7, 0, 1]], np.int64),
             mask=np.ones((1, 5), np.float32))
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"model": "model.onnx", "output_dir": "out", "calibration": {"source": "calib"},
                                      "evaluation": {"source": "eval", "latency": {"runs": 0}},
                                      "pipeline": ["optimize", {"quantize": {"backend": "ort"}}]}))
    phrases = ("calibration sample 1.npz", "input 'ids'", "id 300", "10 rows of table 'emb'")
    assert_one_line(qprep("validate", config), 2, *phrases)
    assert_one_line(qprep("run", config, "--quiet"), 2, *phrases)
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(not CAN_BE_DENIED, reason=ROOT_SKIP)
def test_batch_recursive_names_a_subfolder_it_cannot_list(tmp_path):
    """`--recursive` over a subfolder that cannot be listed: its models would be missing from the summary with
    nothing to say so; the batch names the folder as skipped instead."""
    models = tmp_path / "models"
    (models / "locked").mkdir(parents=True)
    for path in (models / "a.onnx", models / "locked" / "b.onnx"):
        onnx.save(tiny_conv_model(batch=1), str(path))
    (models / "locked").chmod(0)
    try:
        script = ("import json, sys; from pathlib import Path; from qprep.pipeline.batch import find_models; "
                  "found, skipped = find_models(Path(sys.argv[1]), True); "
                  "print(json.dumps([[p.name for p in found], skipped]))")
        done = subprocess.run([*UNPRIVILEGED, sys.executable, "-c", script, str(models)], capture_output=True, text=True,
                              cwd=ROOT, timeout=60)
    finally:
        (models / "locked").chmod(0o755)
    found, skipped = json.loads(done.stdout)
    assert found == ["a.onnx"]
    assert list(skipped) == ["locked" + os.sep] and "cannot be listed" in skipped["locked" + os.sep]


@pytest.mark.parametrize("target", ["config", "metric"])
def test_evaluate_never_writes_over_what_the_run_read_from_any_directory(tmp_path, target):
    """A run started with a relative config path, then `evaluate --json` aimed at that config (or at the user's
    metric module, which evaluate imports) from another directory: the manifest's relative path resolved there
    and the config was overwritten with JSON. The manifest records every input absolute."""
    p = project(tmp_path / "project", pipeline=("quantize",))
    (p.root / "mymetric.py").write_text("import numpy as np\n\ndef agree(outputs, samples):\n"
                                        "    return float(np.mean([float(np.max(list(o.values())[0])) for o in outputs]))\n")
    p.config.write_text(p.config.read_text().replace("  latency:\n    runs: 0\n",
                                                     "  latency:\n    runs: 0\n  metric: mymetric:agree\n"))
    assert qprep("run", "config.yaml", "--quiet", cwd=p.root).code == 0
    victim = p.config if target == "config" else p.root / "mymetric.py"
    before = victim.read_bytes()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    outcome = qprep("evaluate", p.out, "--samples", p.evaluation, "--json", victim, "--quiet", cwd=elsewhere)
    assert_one_line(outcome, 2, "which the command reads")
    assert victim.read_bytes() == before


def batch_project(tmp_path, *names: str):
    """(the tiny project, a models folder holding its model under each name, the batch's --out to be)."""
    p = project(tmp_path / "project", pipeline=("quantize",))
    models = tmp_path / "models"
    models.mkdir()
    for name in names:
        shutil.copy(p.model, models / name)
    return p, models, tmp_path / "out"


def test_batch_resume_runs_a_model_again_when_its_data_changed_in_place(tmp_path):
    """`batch --resume` reused a result after every calibration image was edited in place (the manifest held
    the old data's digest): the run records the state of everything it read, and resume compares it."""
    p, models, out = batch_project(tmp_path, "m.onnx")
    assert qprep("batch", p.config, models, "--out", out, "--quiet").code == 0
    assert json.loads((out / "manifest.json").read_text())["status"] == "finished"  # not "running" for ever

    def note() -> str | None:
        return json.loads((out / "summary.json").read_text())["models"][0].get("note")

    assert qprep("batch", p.config, models, "--out", out, "--resume", "--quiet").code == 0
    assert note() == "resumed: result reused"
    sample = next(p.calibration.iterdir())
    np.save(sample, -np.load(sample))  # same name, same size: other values
    assert qprep("batch", p.config, models, "--out", out, "--resume", "--quiet").code == 0
    assert note() != "resumed: result reused"


def test_a_batch_never_replaces_a_run_made_by_hand_in_its_out(tmp_path):
    """A run the user made in --out/b (while the batch ran, or between two batches) was replaced by the batch's
    worker, which always passes --force: a worker replaces only runs a batch on that --out made."""
    p, models, out = batch_project(tmp_path, "b.onnx")
    assert qprep("batch", p.config, models, "--out", out, "--quiet").code == 0
    mine = qprep("run", p.config, "--model", models / "b.onnx", "--out", out / "b", "--force", "--quiet",
                 "--set", "evaluation.gate.cosine_mean=0.5")
    assert mine.code == 0
    before = (out / "b" / "manifest.json").read_bytes()
    again = qprep("batch", p.config, models, "--out", out, "--resume", "--quiet")
    row = json.loads((out / "summary.json").read_text())["models"][0]
    assert again.code == 2 and row["status"] == "refused" and "did not make" in row["error"]
    assert (out / "b" / "manifest.json").read_bytes() == before
    # the same config as the batch's: --resume took the hand-made run for its own result
    assert qprep("run", p.config, "--model", models / "b.onnx", "--out", out / "b", "--force", "--quiet").code == 0
    before = (out / "b" / "manifest.json").read_bytes()
    again = qprep("batch", p.config, models, "--out", out, "--resume", "--quiet")
    row = json.loads((out / "summary.json").read_text())["models"][0]
    assert again.code == 2 and row["status"] == "refused" and row.get("note") != "resumed: result reused"
    assert (out / "b" / "manifest.json").read_bytes() == before


def test_evaluate_refuses_a_metric_module_edited_since_the_run(tmp_path):
    """evaluate imported the edited module and printed figures that belonged to neither the run nor its report."""
    p = project(tmp_path / "project", pipeline=("quantize",))
    module = p.root / "mymetric.py"
    module.write_text("def fn(outputs, samples):\n    return 0.5\n")
    p.config.write_text(p.config.read_text().replace("  latency:\n    runs: 0\n",
                                                     "  latency:\n    runs: 0\n  metric: mymetric:fn\n"))
    assert qprep("run", p.config, "--quiet").code == 0
    assert qprep("evaluate", p.out, "--samples", p.evaluation, "--quiet").code == 0
    module.write_text("def fn(outputs, samples):\n    return 1000.0\n")
    assert_one_line(qprep("evaluate", p.out, "--samples", p.evaluation, "--quiet"), 2, "metric module",
                    "changed since the run")


def test_batch_names_the_hidden_models_it_does_not_run(tmp_path):
    """`.onnx`, `..onnx` or `.draft.onnx` were left out without a word; with nothing else, the batch said there
    were no .onnx files at all."""
    from qprep.errors import QprepError
    from qprep.pipeline.batch import find_models

    for name in (".draft.onnx", "..onnx"):
        onnx.save(tiny_conv_model(batch=1), str(tmp_path / name))
    with pytest.raises(QprepError, match=r"no \.onnx files to run in .* \(skipped: \.\.onnx, \.draft\.onnx\)"):
        find_models(tmp_path, recursive=False)
    onnx.save(tiny_conv_model(batch=1), str(tmp_path / "a.onnx"))
    found, skipped = find_models(tmp_path, recursive=True)
    assert [p.name for p in found] == ["a.onnx"] and sorted(skipped) == ["..onnx", ".draft.onnx"]
    assert all("hidden" in why for why in skipped.values())


def test_a_model_with_a_sidecar_of_its_own_is_no_twin_of_the_same_bytes(tmp_path):
    """Two copies of one model, one with a sidecar (other preprocessing, stage models): the second was reported
    "identical to a.onnx" with a's figures, and its sidecar never applied."""
    p, models, out = batch_project(tmp_path, "a.onnx", "b.onnx", "c.onnx")
    (models / "b.qprep.yaml").write_text("save_stage_models: true\n")
    assert qprep("batch", p.config, models, "--out", out, "--quiet").code == 0
    rows = {row["model"]: row for row in json.loads((out / "summary.json").read_text())["models"]}
    assert rows["b.onnx"].get("note") != "identical to a.onnx" and (out / "b" / "stages").is_dir()
    assert rows["c.onnx"]["note"] == "identical to a.onnx"  # the same bytes and settings: still one run
