"""`qprep completion bash`: the script bash sources completes commands, options and option choices."""

import shutil
import subprocess

import pytest

from qprep.cli import build_parser
from qprep.completion import bash_script


def _complete(tmp_path, words: list[str]) -> list[str]:
    script = tmp_path / "qprep.bash"
    script.write_text(bash_script(build_parser()))
    line = " ".join(f"'{w}'" for w in words)
    done = subprocess.run(["bash", "-c", f"source {script}; COMP_WORDS=({line}); COMP_CWORD={len(words) - 1}; "
                                         "_qprep; printf '%s\\n' \"${COMPREPLY[@]}\""],
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    return sorted(w for w in done.stdout.splitlines() if w)


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
def test_commands_options_and_choices_complete(tmp_path):
    assert _complete(tmp_path, ["qprep", "in"]) == ["init", "inspect"]
    assert "--backend" in _complete(tmp_path, ["qprep", "init", "--"])
    assert _complete(tmp_path, ["qprep", "init", "m.onnx", "--backend", "r"]) == ["rknn"]
    assert _complete(tmp_path, ["qprep", "setup", ""]) == ["rknn"]
    (tmp_path / "rknn_int8.yaml").write_text("")
    assert _complete(tmp_path, ["qprep", "run", "rknn"]) == ["rknn_int8.yaml"]
