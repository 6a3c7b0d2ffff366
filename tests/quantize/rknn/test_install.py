"""`qprep setup rknn`: the pip commands it runs (the install itself was verified in a fresh venv; BENCHMARKS.md)."""

import pytest

from qprep.cli import main
from qprep.errors import QprepError
from qprep.quantize.rknn import install


def test_the_toolkit_goes_in_last_without_its_declared_dependencies_under_the_shipped_pins():
    plan = install.plan("py", have_torch=False, version=(3, 11))
    first, torch, toolkit = plan.commands
    constraints = install.constraints_path()
    assert all(c[:3] == ["py", "-m", "pip"] and c[c.index("-c") + 1] == constraints for c in plan.commands)
    assert toolkit[-2:] == ["--no-deps", install.TOOLKIT]
    assert "torch" not in first and "opencv-python" not in first and "opencv-python-headless" in first
    assert torch[-3:] == ["torch", "--index-url", install.TORCH_CPU_INDEX]
    pins = open(constraints).read()
    for pin in ("numpy==1.26.4", "onnx==1.18.0", "protobuf==4.25.4", "setuptools<81"):
        assert pin in pins


def test_an_installed_torch_is_kept_and_an_empty_index_means_pips_own():
    assert len(install.plan("py", have_torch=True, version=(3, 12)).commands) == 2
    torch = install.plan("py", torch="torch==2.13.0", torch_index="", have_torch=False, version=(3, 11)).commands[1]
    assert torch[-1] == "torch==2.13.0" and "--index-url" not in torch


def test_a_python_without_the_pinned_wheels_is_refused_in_one_line():
    with pytest.raises(QprepError, match=r"CPython 3\.11 or 3\.12, this is 3\.13; make a venv"):
        install.plan("py", have_torch=True, version=(3, 13))


def test_dry_run_prints_the_commands_and_installs_nothing(capsys, monkeypatch):
    monkeypatch.setattr(install.subprocess, "run", lambda *a, **k: pytest.fail("dry run ran a command"))
    monkeypatch.setattr(install, "_importable", lambda python, module: True)
    assert main(["setup", "rknn", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "--no-deps rknn-toolkit2==2.5.0" in out and "torch is already installed" in out
