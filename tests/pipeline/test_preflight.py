"""What `qprep validate` and `qprep run` check and say before any stage runs (qprep/pipeline/preflight.py)."""

import numpy as np
import onnx
import yaml
from PIL import Image

from graphs import tiny_conv_model


def test_image_preprocess_on_array_samples_is_said_to_be_ignored_by_validate_and_run(tmp_path, cli):
    """Issue #59: `preprocess: {layout: nhwc, mean: [0], std: [1]}` on .npz samples of an NCHW model passed
    validate, and the run recorded `preprocess: null`: set, it changed nothing, silently. Now one warning line
    per section that sets it; a section left at the defaults, or read as images, says nothing."""
    onnx.save(tiny_conv_model(batch=1), tmp_path / "m.onnx")
    for split in ("calib", "eval", "images"):
        (tmp_path / split).mkdir()
    for i in range(2):
        np.savez(tmp_path / "calib" / f"{i}.npz", x=np.ones((1, 3, 8, 8), np.float32))
        np.savez(tmp_path / "eval" / f"{i}.npz", x=np.ones((1, 3, 8, 8), np.float32))
        Image.new("RGB", (8, 8), (i, 2, 3)).save(tmp_path / "images" / f"{i}.png")
    preprocess = {"layout": "nhwc", "mean": [0], "std": [1]}
    config = {"model": "m.onnx", "output_dir": "run", "pipeline": [],
              "calibration": {"source": "calib", "preprocess": preprocess},
              "evaluation": {"source": "eval", "preprocess": {"channel_order": "rgb"}, "latency": {"runs": 0}}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    said = ("qprep: warning: calibration.preprocess (mean, std, layout) is ignored: the samples are not images "
            "(.npz arrays go into the model as stored); remove it, or point calibration.source at images")
    code, _, err = cli("validate", tmp_path / "c.yaml")
    assert code == 0 and [line for line in err.splitlines() if "preprocess" in line] == [said]
    code, _, err = cli("run", tmp_path / "c.yaml")
    assert code == 0 and [line for line in err.splitlines() if "preprocess" in line] == [said]
    config["calibration"]["source"] = "images"  # read as images: it applies
    config["calibration"]["preprocess"]["layout"] = "nchw"
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    code, _, err = cli("validate", tmp_path / "c.yaml")
    assert code == 0 and "is ignored" not in err
