"""The wheel a pip user installs carries what qprep reads at run time and the example configs."""

import subprocess
import sys
import zipfile

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow  # builds a wheel (~10 s)


def test_the_wheel_ships_the_board_runner_the_rknn_pins_and_the_example_configs(tmp_path):
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                           str(tmp_path), str(ROOT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    wheel, = tmp_path.glob("qprep-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"qprep/quantize/rknn/run_on_board.py", "qprep/quantize/rknn/constraints.txt"} <= names
    configs = {n.rsplit("/", 1)[-1] for n in names if "/share/qprep/configs/" in n}
    assert configs == {p.name for p in (ROOT / "configs").glob("*.yaml")} and "rknn_int8.yaml" in configs
