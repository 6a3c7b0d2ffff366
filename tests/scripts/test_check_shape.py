"""The shape check (scripts/check_shape.py): it holds on this checkout, and it finds each kind of drift it
names on a small package generated here (so a check that found nothing could not pass for one that holds)."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("check_shape", ROOT / "scripts" / "check_shape.py")
check_shape = importlib.util.module_from_spec(spec)
sys.modules["check_shape"] = check_shape  # its dataclasses look their module up
spec.loader.exec_module(check_shape)


def test_the_package_keeps_its_shape():
    findings = check_shape.check(ROOT)
    assert findings == [], "\n".join(findings)


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


CLEAN = {
    "qprep/__init__.py": "",
    "qprep/errors.py": "class QprepError(Exception):\n    pass\n",
    "qprep/model/__init__.py": "",
    "qprep/model/io.py": "from qprep.errors import QprepError\n",
    "qprep/optimize/__init__.py": "",
    "qprep/optimize/stage.py": "from qprep.model.io import QprepError\n",
    "tests/test_io.py": "from qprep.model.io import QprepError\n",
    "README.md": "qprep\n",
}

DRIFTS = {
    "circle": ({"qprep/model/info.py": "from qprep.model import io\n",
                "qprep/model/io.py": "def f():\n    from qprep.model.info import g\n"}, "import circle"),
    "circle through TYPE_CHECKING": ({"qprep/model/info.py": "from qprep.model import io\n",
                                      "qprep/model/io.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                                           "    from qprep.model.info import g\n"}, "import circle"),
    "against the flow": ({"qprep/model/io.py": "from qprep.optimize.stage import x\n"}, "a layer above it"),
    "no layer": ({"qprep/newthing.py": "x = 1\n"}, "is in no layer"),
    "long file": ({"qprep/model/io.py": "x = 1\n" * 551}, "lines (at most 550)"),
    "long function": ({"qprep/model/io.py": "def f():\n" + "    x = 1\n" * 90}, "function f has 91 lines"),
    "private name across packages": ({"qprep/model/io.py": "def _hidden():\n    pass\n",
                                      "qprep/optimize/stage.py": "from qprep.model.io import _hidden\n"},
                                     "private name _hidden"),
    "private name in a test": ({"qprep/model/io.py": "def _hidden():\n    pass\n",
                                "tests/test_io.py": "from qprep.model.io import _hidden\n"}, "a test imports"),
    "session in code": ({"qprep/model/io.py": '"""Faster since session 12."""\n'}, "'session 12'"),
    "session in docs": ({"docs/x.md": "As of Sessions 3 and 4.\n"}, "'Sessions 3'"),
}


def test_a_clean_package_has_no_finding(tmp_path):
    assert check_shape.check(write(tmp_path, CLEAN)) == []


@pytest.mark.parametrize("kind", sorted(DRIFTS))
def test_each_kind_of_drift_is_found(tmp_path, kind):
    files, expected = DRIFTS[kind]
    findings = check_shape.check(write(tmp_path, {**CLEAN, **files}))
    assert any(expected in finding for finding in findings), findings


def test_a_private_name_within_its_own_package_is_fine(tmp_path):
    files = {"qprep/model/io.py": "def _hidden():\n    pass\n", "qprep/model/info.py": "from qprep.model.io import _hidden\n"}
    assert check_shape.check(write(tmp_path, {**CLEAN, **files})) == []


def test_test_files_have_unique_names():
    """tests/ has no __init__.py: pytest imports each test file by its basename, so two files of one name stop
    the whole suite at collection ("import file mismatch")."""
    seen: dict[str, Path] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        assert path.name not in seen, f"{path} and {seen[path.name]} share a name"
        seen[path.name] = path
