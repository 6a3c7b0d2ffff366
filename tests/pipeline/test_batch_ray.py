"""qprep batch --executor ray on a real Ray cluster (a head and a second node, each its own raylet), against the
local executor on the same folder; a Ray worker killed mid-task; results returned by a node without shared
storage; Ray missing."""

import json
import shutil
import subprocess
import sys
import time

import onnx
import pytest

from conftest import CALIBRATION, demo_model
from graphs import tiny_conv_model
from test_batch_compare import endless_loop_model
from qprep.disk import owned
from qprep.errors import QprepError
from qprep.pipeline.batch import run_batch
from qprep.pipeline.batch_ray import NOT_RETURNED, run_on_node, write_returned
from qprep.pipeline.batch_worker import RunSpec

OCR = "{channel_order: bgr, mean: [127.5], std: [127.5], resize: none}"
IMAGENET = "{mean: [127.0, 127.0, 127.0], std: [128.0, 128.0, 128.0]}"


def sidecar(data: str, preprocess: str, inputs: str = "") -> str:
    return (f"{inputs}calibration: {{source: {CALIBRATION / data / 'calib'}, preprocess: {preprocess}, "
            f"max_samples: 8}}\nevaluation: {{source: {CALIBRATION / data / 'eval'}, preprocess: {preprocess}, "
            "max_samples: 16, latency: {runs: 0}, layers: false}\n")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """Two real models (each with its samples in a sidecar) and a poisoned one (truncated)."""
    root = tmp_path_factory.mktemp("ray_batch")
    models = root / "models"
    models.mkdir()
    shutil.copy(demo_model("ppocr_cls.onnx"), models / "cls.onnx")
    (models / "cls.qprep.yaml").write_text(sidecar("ocr_cls", OCR, "inputs: {x: [1, 3, 48, 192]}\n"))
    shutil.copy(demo_model("efficientnet_lite0.onnx"), models / "effnet.onnx")
    (models / "effnet.qprep.yaml").write_text(sidecar("imagenet", IMAGENET))
    data = demo_model("ppocr_cls.onnx").read_bytes()
    (models / "poisoned.onnx").write_bytes(data[: len(data) // 3])
    config = root / "int8.yaml"
    config.write_text("model: unused.onnx\nthreads: 1\npipeline: [optimize, {quantize: {backend: ort}}]\n")
    return root, models, config


@pytest.fixture(scope="module")
def cluster():
    """A real two-node Ray cluster on this machine: the head and a second raylet, one CPU each."""
    cluster_utils = pytest.importorskip("ray.cluster_utils", reason="Ray is installed by scripts/setup.sh")
    cluster = cluster_utils.Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    yield cluster
    cluster.shutdown()


def batch(*args):
    return subprocess.Popen([sys.executable, "-m", "qprep", "batch", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def rows_of(out):
    return {r["model"]: r for r in json.loads((out / "summary.json").read_text())["models"]}


@pytest.mark.slow
def test_ray_matches_local_retries_a_lost_worker_and_isolates_a_poisoned_model(folder, cluster):
    import psutil

    root, models, config = folder
    local = batch(config, models, "--out", root / "local", "--jobs", "2", "--quiet")
    assert local.wait(timeout=600) == 2, local.stderr.read()  # the poisoned model is refused
    distributed = batch(config, models, "--out", root / "ray", "--executor", "ray", "--address", cluster.address)
    victim, deadline = None, time.time() + 300
    while victim is None and time.time() < deadline:  # the qprep run of effnet.onnx, inside a Ray task
        for proc in psutil.process_iter():  # Ray workers are the raylets' children, not the batch's
            try:
                command = proc.cmdline()
            except psutil.Error:
                continue
            if "run" in command and str(models / "effnet.onnx") in command and str(root / "ray") in " ".join(command):
                victim = proc
        time.sleep(0.5)
    assert victim is not None, "the Ray task for effnet.onnx never started its model"
    time.sleep(3)  # into its optimize stage
    ray_worker = victim.parent()
    assert ray_worker.pid != distributed.pid and victim.is_running()
    killed_at = time.time()
    ray_worker.kill()  # the Ray worker process dies mid-task: Ray must retry the task on a new one
    _, stderr = distributed.communicate(timeout=900)
    assert distributed.returncode == 2, stderr
    assert not victim.is_running() or victim.status() == psutil.STATUS_ZOMBIE  # died with its Ray worker
    assert (root / "ray" / "effnet" / "report.json").stat().st_mtime > killed_at  # so a second attempt wrote it

    ours, theirs = rows_of(root / "ray"), rows_of(root / "local")
    assert {m: r["status"] for m, r in ours.items()} == {m: r["status"] for m, r in theirs.items()} == {
        "cls.onnx": "ok", "effnet.onnx": "ok", "poisoned.onnx": "refused"}
    for name in ("cls.onnx", "effnet.onnx"):
        assert ours[name]["cosine_mean"] == pytest.approx(theirs[name]["cosine_mean"], abs=2e-3)
        assert ours[name]["nodes_after"] == theirs[name]["nodes_after"]
        assert ours[name]["note"].startswith("node ")
    assert ours["poisoned.onnx"]["error"] == theirs["poisoned.onnx"]["error"]
    summary = json.loads((root / "ray" / "summary.json").read_text())
    assert summary["executor"]["name"] == "ray" and "2 nodes" in summary["executor"]["where"]
    assert "written by the nodes on shared storage" in summary["executor"]["where"]
    assert f"Ran on {summary['executor']['where']}." in (root / "ray" / "summary.md").read_text()
    assert "[3/3]" in stderr and "ETA" in stderr

    rknn = root / "rknn.yaml"  # no node of this cluster was started with the `rknn` resource
    rknn.write_text("model: unused.onnx\npipeline: [{quantize: {backend: rknn, rknn: {target_platform: rk3588}}}]\n")
    refused = batch(rknn, models, "--out", root / "rknn", "--executor", "ray", "--address", cluster.address)
    _, stderr = refused.communicate(timeout=120)
    assert refused.returncode == 2 and "no node of the cluster declares the `rknn` resource" in stderr, stderr


@pytest.mark.slow
def test_sigterm_cancels_the_ray_tasks_and_still_writes_the_summary(tmp_path, cluster):
    import psutil

    models = tmp_path / "models"
    models.mkdir()
    onnx.save(tiny_conv_model(), str(models / "a_tiny.onnx"))
    onnx.save(endless_loop_model(), str(models / "hang.onnx"))
    config = tmp_path / "c.yaml"
    config.write_text("model: unused.onnx\nthreads: 1\npipeline: [optimize]\n")
    out = tmp_path / "out"
    distributed = batch(config, models, "--out", out, "--executor", "ray", "--address", cluster.address)
    deadline, hang = time.time() + 120, None
    while hang is None and time.time() < deadline:
        hang = next((p for p in psutil.process_iter(["cmdline"]) if str(models / "hang.onnx") in (p.info["cmdline"] or [])),
                    None)
        time.sleep(0.5)
    assert hang is not None
    while not (out / "summary.json").exists() and time.time() < deadline:  # a_tiny.onnx has finished
        time.sleep(0.5)
    distributed.terminate()
    _, stderr = distributed.communicate(timeout=120)
    assert distributed.returncode == 143, stderr
    rows = rows_of(out)
    assert rows["a_tiny.onnx"]["status"] == "ok"
    assert rows["hang.onnx"]["status"] == "failed" and rows["hang.onnx"]["error"].startswith("cancelled")
    hang.wait(timeout=30)  # its run was stopped (SIGTERM; stuck inside ONNX Runtime's Loop, SIGKILL after the grace)


@pytest.mark.slow
def test_a_node_without_shared_storage_returns_the_run_directory(tmp_path):
    """A task that cannot read the driver's token in --out runs in a folder of its own and returns the files;
    the driver's copy is a complete run directory, which --resume then reuses."""
    models = tmp_path / "models"
    models.mkdir()
    onnx.save(tiny_conv_model(), str(models / "tiny.onnx"))
    config = tmp_path / "c.yaml"
    config.write_text("model: unused.onnx\npipeline: [optimize]\n")
    out = tmp_path / "out"
    batch = owned.claim(out, "batch", "--out")  # as the driver does before any task runs
    identity = ":".join(map(str, owned.folder_identity(out)))  # the --out the task's run belongs to
    result = run_on_node(RunSpec(str(config), batch=identity), str(models / "tiny.onnx"), str(out / "tiny"),
                         probe=str(tmp_path / "elsewhere" / "token"), token="abc")
    assert result.status == "ok" and result.files and not (out / "tiny").exists()  # nothing written here
    assert {"report.json", "manifest.json", "model.onnx"} <= set(result.files)
    assert not any(name.split("/")[0] in NOT_RETURNED for name in result.files)
    batch.write_manifest({"files": ["tiny"]})
    write_returned(out / "tiny", result.files)
    batch.release()
    summary = run_batch(str(config), str(models), str(out), resume=True, quiet=True)
    assert summary["models"][0]["note"] == "resumed: result reused"


def test_ray_missing_is_one_line(tmp_path, monkeypatch):
    models = tmp_path / "models"
    models.mkdir()
    onnx.save(tiny_conv_model(), str(models / "tiny.onnx"))
    config = tmp_path / "c.yaml"
    config.write_text("model: unused.onnx\npipeline: [optimize]\n")
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(QprepError, match=r"Ray is not installed; pip install 'qprep\[ray\]'"):
        run_batch(str(config), str(models), str(tmp_path / "out"), executor="ray", quiet=True)
    with pytest.raises(QprepError, match="--executor ray"):
        run_batch(str(config), str(models), str(tmp_path / "out"), address="auto", quiet=True)
