"""Build the quantized (QDQ) fixture models in models/qdq/ (git-ignored) that the QDQ stages are tested on.

Why: remove_redundant_qdq, fuse_conv_qdq and keep_float must be proved on what users bring — quantizer output
and real QAT exports — not on hand-made graphs alone. Every model here is built from the real demo models and
the committed calibration data:

    efficientnet_lite0.qdq.onnx   ONNX Runtime quantize_static (QDQ, per-channel, U8S8, MinMax) of
                                  EfficientNet-Lite0 after qprep's optimize (BatchNorms folded), calibrated on
                                  calibration_data/imagenet/calib (RGB, (x - 127) / 128, NCHW)
    minilm_l6_v2.qdq.onnx         the same for all-MiniLM-L6-v2 after optimize (13 LayerNormalization nodes),
                                  LayerNormalization in op_types_to_quantize (ORT's default op list),
                                  calibrated on calibration_data/minilm/calib/*.npz
    qat_cnn.onnx                  a small CNN (5 Conv-BN-ReLU, one depthwise, MaxPool, Linear) trained with
                                  PyTorch eager-mode QAT (prepare_qat; FakeQuantize with MovingAverageMinMax
                                  activations and per-channel symmetric int8 weights) to reproduce
                                  EfficientNet-Lite0's top-1 on the imagenet calibration crops (distillation),
                                  observers disabled, exported with the TorchScript exporter at opset 13 — so it
                                  has the real leftovers: Conv → Div → BatchNormalization → Relu → Q/DQ,
                                  QuantizeLinear on float weights, Identity zero points
    qat_cnn.fp32.onnx             the same trained network with fake quantization disabled (its FP32 reference)
    qat_cnn.json                  the training facts (steps, loss, agreement with EfficientNet-Lite0)
    efficientnet_lite0.qdq.injected.onnx / .json
                                  a copy of the QDQ EfficientNet with redundant pairs injected on purpose (DQ→Q
                                  round trips, doubled pairs, pairs around Reshape/Transpose) and one
                                  requantization; the .json lists what was injected and the counts expected

Idempotent like scripts/fetch_models.py: a fixture whose files all exist is left alone (files are written to
temporary names and renamed into place, the .onnx last; a QAT fixture of an older recipe is built again);
`--force` rebuilds. The QAT training is seeded, single-threaded and on CPU-independent kernels (QAT_KERNELS):
the same network on any x86-64 CPU. The tests still assert structure and tolerances, not bytes (ONNX Runtime's
and the RKNN simulator's kernels, which run the fixtures, differ by CPU).

    .venv/bin/python scripts/build_qdq_fixtures.py [--force]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "models" / "qdq"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fetch_models import FetchError, require  # noqa: E402  (shared: the one-line error type and check)

IMAGENET = {"source": "calibration_data/imagenet/calib", "preprocess": {"mean": [127.0], "std": [128.0]}}
IMAGENET_EVAL = {"source": "calibration_data/imagenet/eval", "preprocess": {"mean": [127.0], "std": [128.0]}}
MINILM = {"source": "calibration_data/minilm/calib"}
QAT_STEPS = 150
QAT_BATCH = 8
# The QAT network is trained here, so it is only as reproducible as torch's CPU kernels: pinned to what every
# x86-64 CPU computes alike (issue #58: a network trained on another CPU gave another test result). ATen's own
# kernels at their portable level (it dispatches AVX2/AVX-512 code by CPU: this AVX-512 machine trained another
# network under ATEN_CPU_CAPABILITY=avx2), MKL's GEMMs in its reproducible mode, one thread (reductions split
# by thread count); oneDNN and NNPACK, which pick their code by CPU, are switched off in build_qat.
QAT_KERNELS = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "OMP_NUM_THREADS": "1",
               "MKL_NUM_THREADS": "1"}
QAT_RECIPE = 2  # recorded in qat_cnn.json: a fixture of another recipe is rebuilt (1: trained with CPU kernels)


# ------------------------------------------------------------------------------------------------- data


def samples(model_path: Path, source: dict, max_samples: int = 1000) -> list[dict]:
    """Samples through qprep's own loader (validation included), as the stages will see them."""
    import onnx

    from qprep.config import data_source
    from qprep.data import load_samples
    from qprep.model.info import graph_inputs
    from qprep.schema import validate

    cfg = validate({**source, "max_samples": max_samples}, data_source(""), "calibration", ROOT)
    return load_samples(cfg, graph_inputs(onnx.load(str(model_path), load_external_data=False))).samples


@contextlib.contextmanager
def scratch_cwd():
    """quantize_static may write helper files into the current directory: keep them out of the repository."""
    old = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="qdq-fixture-") as tmp:
        os.chdir(tmp)
        try:
            yield Path(tmp)
        finally:
            os.chdir(old)


def optimized(name: str, calibration: dict, tmp: Path) -> Path:
    """The demo model after qprep's optimize stage (BatchNorm folded, LayerNorm fused), as a user would run it."""
    import qprep

    out = tmp / f"optimize-{name}"
    cfg = {**calibration, "source": str(ROOT / calibration["source"]), "max_samples": 8}
    report = qprep.run({"model": str(ROOT / "models" / f"{name}.onnx"), "calibration": cfg,
                        "pipeline": [{"optimize": {}}]}, output_dir=str(out), force=True)
    require(report["status"] == "ok", f"optimize failed on {name}")
    return out / "model.onnx"


def quantize_qdq(source: Path, out: Path, calibration: dict, op_types: list[str] | None = None) -> None:
    """quantize_static: QDQ, per-channel weights, uint8 activations / int8 weights, MinMax; fed by qprep's loader."""
    from onnxruntime.quantization import (CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType,
                                          quantize_static)

    data = samples(source, calibration)

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.items = iter(data)

        def get_next(self):
            return next(self.items, None)

    with scratch_cwd():
        quantize_static(str(source), str(out), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                        calibrate_method=CalibrationMethod.MinMax, op_types_to_quantize=op_types)


# ------------------------------------------------------------------------------------------ ORT QDQ models


def build_efficientnet(files: dict[str, Path]) -> str:
    with tempfile.TemporaryDirectory(prefix="qdq-fixture-") as tmp:
        quantize_qdq(optimized("efficientnet_lite0", IMAGENET, Path(tmp)), files["model"], IMAGENET)
    return _summary(files["model"])


def build_minilm(files: dict[str, Path]) -> str:
    from onnxruntime.quantization.registry import QDQRegistry, QLinearOpsRegistry

    op_types = sorted(set(QDQRegistry) | set(QLinearOpsRegistry))  # ORT's default list, written out
    require("LayerNormalization" in op_types, "this onnxruntime does not quantize LayerNormalization")
    with tempfile.TemporaryDirectory(prefix="qdq-fixture-") as tmp:
        source = optimized("minilm_l6_v2", MINILM, Path(tmp))
        import onnx

        layernorms = sum(n.op_type == "LayerNormalization" for n in onnx.load(str(source)).graph.node)
        require(layernorms == 13, f"expected 13 LayerNormalization nodes after optimize, found {layernorms}")
        quantize_qdq(source, files["model"], MINILM, op_types)
    return _summary(files["model"])


def _summary(path: Path) -> str:
    from collections import Counter

    import onnx

    ops = Counter(n.op_type for n in onnx.load(str(path)).graph.node)
    return f"{ops['QuantizeLinear']} Q, {ops['DequantizeLinear']} DQ, {ops['Conv']} Conv, {ops['MatMul']} MatMul"


# ---------------------------------------------------------------------------------------------- QAT model


def build_qat(files: dict[str, Path]) -> str:
    import copy

    import numpy as np

    os.environ.update(QAT_KERNELS)  # read when torch and MKL load
    import torch

    require(torch.backends.cpu.get_cpu_capability() == "DEFAULT",
            "torch was imported before build_qat pinned its kernels: run scripts/build_qdq_fixtures.py by itself")
    import torch.ao.quantization as tq
    from torch import nn

    from qprep.model.runtime import run_model
    import onnx

    torch.manual_seed(0)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.backends.mkldnn.enabled = False
    torch.backends.nnpack.set_flags(False)
    teacher = onnx.load(str(ROOT / "models" / "efficientnet_lite0.onnx"))
    train = np.concatenate([s["input"] for s in samples(ROOT / "models" / "efficientnet_lite0.onnx", IMAGENET)])
    held_out = np.concatenate([s["input"] for s in samples(ROOT / "models" / "efficientnet_lite0.onnx",
                                                           IMAGENET_EVAL)])
    teacher_logits = run_model(teacher, [{"input": train}])[0]["logits"]
    labels = teacher_logits.argmax(1)
    # the labels come from ONNX Runtime's float kernels, which differ by CPU in the last bits: no label may be a
    # tie that close (this data's nearest: 0.037 apart)
    top_two = np.sort(teacher_logits, 1)[:, -2:]
    require(float((top_two[:, 1] - top_two[:, 0]).min()) > 1e-3, "a training label is a near tie of the teacher")
    held_out_labels = run_model(teacher, [{"input": held_out}])[0]["logits"].argmax(1)

    class ConvBNReLU(nn.Sequential):
        def __init__(self, cin, cout, kernel=3, stride=1, groups=1):
            super().__init__(nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False),
                             nn.BatchNorm2d(cout), nn.ReLU())

    class SmallCNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.quant = tq.QuantStub()
            self.b1 = ConvBNReLU(3, 16, stride=2)
            self.pool = nn.MaxPool2d(2)
            self.b2 = ConvBNReLU(16, 32, stride=2)
            self.b3 = ConvBNReLU(32, 32, groups=32)  # depthwise
            self.b4 = ConvBNReLU(32, 64, kernel=1)
            self.b5 = ConvBNReLU(64, 64, stride=2)
            self.avg = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(64, 1000)
            self.dequant = tq.DeQuantStub()

        def forward(self, x):
            x = self.pool(self.b1(self.quant(x)))
            x = self.b5(self.b4(self.b3(self.b2(x))))
            return self.dequant(self.fc(torch.flatten(self.avg(x), 1)))

    net = SmallCNN().train()
    for block in ("b1", "b2", "b3", "b4", "b5"):
        tq.fuse_modules_qat(net, [[f"{block}.0", f"{block}.1", f"{block}.2"]], inplace=True)
    activation = tq.FakeQuantize.with_args(observer=tq.MovingAverageMinMaxObserver, quant_min=0, quant_max=255,
                                           dtype=torch.quint8, qscheme=torch.per_tensor_affine)
    weight = tq.FakeQuantize.with_args(observer=tq.MovingAveragePerChannelMinMaxObserver, quant_min=-128,
                                       quant_max=127, dtype=torch.qint8, qscheme=torch.per_channel_symmetric)
    net.qconfig = tq.QConfig(activation=activation, weight=weight)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.ao.quantization: deprecated, present in 2.13
        tq.prepare_qat(net, inplace=True)

    optimizer = torch.optim.Adam(net.parameters(), 3e-3)
    x, y = torch.from_numpy(train), torch.from_numpy(labels)
    generator = torch.Generator().manual_seed(0)
    for _ in range(QAT_STEPS):
        batch = torch.randperm(len(x), generator=generator)[:QAT_BATCH]
        loss = nn.functional.cross_entropy(net(x[batch]), y[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    net.apply(tq.disable_observer)
    net.apply(torch.ao.nn.intrinsic.qat.freeze_bn_stats)
    net.eval()
    fp32 = copy.deepcopy(net)
    fp32.apply(tq.disable_fake_quant)

    facts = {"recipe": QAT_RECIPE, "steps": QAT_STEPS, "batch": QAT_BATCH, "final_loss": round(float(loss.detach()), 4),
             "teacher": "models/efficientnet_lite0.onnx top-1", "train_samples": int(len(x))}
    example = torch.from_numpy(held_out[:1])
    for key, module in (("model", net), ("fp32", fp32)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(module, (example,), str(files[key]), dynamo=False, opset_version=13,
                              input_names=["input"], output_names=["logits"],
                              dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}})
        with torch.no_grad():
            expected = module(torch.from_numpy(held_out)).numpy()
        got = run_model(onnx.load(str(files[key])), [{"input": held_out}])[0]["logits"]
        facts[f"{key}_onnx_vs_torch_max_abs"] = float(np.abs(got - expected).max())
        facts[f"{key}_top1_agreement_with_teacher"] = round(float((got.argmax(1) == held_out_labels).mean()), 4)
    exported = onnx.load(str(files["model"]))
    ops = {n.op_type for n in exported.graph.node}
    require({"QuantizeLinear", "DequantizeLinear", "BatchNormalization", "Div"} <= ops,
            f"the QAT export lacks Q/DQ or the BatchNorm/Div leftovers (ops: {sorted(ops)})")
    # torch fake-quantizes with x * (1/scale), ONNX Runtime's QuantizeLinear divides: ties round differently,
    # so the QAT model may differ by a step of its output quantization, never more than a couple.
    step = float(net.fc.activation_post_process.scale)
    facts["model_onnx_vs_torch_output_steps"] = round(facts["model_onnx_vs_torch_max_abs"] / step, 3)
    require(facts["model_onnx_vs_torch_output_steps"] <= 2.01, f"the QAT export differs from torch by "
            f"{facts['model_onnx_vs_torch_output_steps']} output steps")
    require(facts["fp32_onnx_vs_torch_max_abs"] < 1e-3, "the FP32 export differs from torch")
    files["facts"].write_text(json.dumps(facts, indent=2) + "\n")
    return f"top-1 agreement with EfficientNet-Lite0 on eval: {facts['model_top1_agreement_with_teacher']:.0%}"


# --------------------------------------------------------------------------------------- injected pairs


def build_injected(files: dict[str, Path]) -> str:
    """Redundant pairs injected into a copy of the QDQ EfficientNet at fixed, spread-out places."""
    import numpy as np
    import onnx
    import onnx_ir as ir

    base = OUT / "efficientnet_lite0.qdq.onnx"
    require(base.is_file(), f"{base} missing (built first)")
    proto = onnx.shape_inference.infer_shapes(onnx.load(str(base)))
    model = ir.from_proto(proto)
    graph = model.graph
    activation_q = [n for n in graph if n.op_type == "QuantizeLinear" and n.inputs[0].producer() is not None]
    # DQs of activations feeding a Conv, with a known 4-D shape (for the Reshape/Transpose sites)
    activation_dq = [n for n in graph if n.op_type == "DequantizeLinear" and n.inputs[0].producer() is not None
                     and any(u.node.op_type == "Conv" for u in n.outputs[0].uses())
                     and n.outputs[0].shape is not None and n.outputs[0].shape.rank() == 4]
    require(len(activation_q) >= 20 and len(activation_dq) >= 20, "too few activation Q/DQ nodes to inject into")
    sites = {"round_trip": [activation_q[i] for i in (3, 11, 19)],
             "doubled": [activation_dq[i] for i in (5, 13)],
             "reshape": [activation_dq[i] for i in (7, 15)],
             "transpose": [activation_dq[i] for i in (9, 17)],
             "requantization": [activation_dq[i] for i in (2,)]}
    counter = iter(range(10_000))
    added = 0

    def node(op_type, inputs, **attributes):
        nonlocal added
        added += op_type in ("QuantizeLinear", "DequantizeLinear")
        name = f"injected/{op_type}_{next(counter)}"
        made = ir.node(op_type, inputs, attributes=attributes, name=name)
        made.outputs[0].name = f"{name}_output"
        return made

    def after(anchor: ir.Node, chain: list[ir.Node]) -> None:
        """Put `chain` (a linear sequence reading anchor's output) between anchor and its readers."""
        value, result = anchor.outputs[0], chain[-1].outputs[0]
        readers = [(u.node, u.idx) for u in value.uses() if u.node not in chain]
        graph.insert_after(anchor, chain)
        for reader, index in readers:
            reader.replace_input_with(index, result)

    for q in sites["round_trip"]:  # Q → [DQ → Q] → readers
        dq = node("DequantizeLinear", [q.outputs[0], *q.inputs[1:]])
        after(q, [dq, node("QuantizeLinear", [dq.outputs[0], *q.inputs[1:]])])
    for dq in sites["doubled"]:  # DQ → [Q → DQ] → readers
        q = node("QuantizeLinear", [dq.outputs[0], *dq.inputs[1:]])
        after(dq, [q, node("DequantizeLinear", [q.outputs[0], *dq.inputs[1:]])])
    for kind in ("reshape", "transpose"):
        for dq in sites[kind]:  # DQ → [op → Q → DQ → inverse op → Q → DQ] → readers
            dims = [int(d) for d in dq.outputs[0].shape.dims[1:]]
            params = list(dq.inputs[1:])
            if kind == "reshape":
                flat = ir.Value(name=f"injected/flat_{next(counter)}",
                                const_value=ir.tensor(np.array([0, -1], dtype=np.int64)))
                back = ir.Value(name=f"injected/shape_{next(counter)}",
                                const_value=ir.tensor(np.array([0, *dims], dtype=np.int64)))
                graph.register_initializer(flat)
                graph.register_initializer(back)
                first = node("Reshape", [dq.outputs[0], flat])
                chain = [first]
                second_op = lambda source: node("Reshape", [source, back])  # noqa: E731
            else:
                first = node("Transpose", [dq.outputs[0]], perm=[0, 2, 3, 1])
                chain = [first]
                second_op = lambda source: node("Transpose", [source], perm=[0, 3, 1, 2])  # noqa: E731
            q1 = node("QuantizeLinear", [first.outputs[0], *params])
            dq1 = node("DequantizeLinear", [q1.outputs[0], *params])
            second = second_op(dq1.outputs[0])
            q2 = node("QuantizeLinear", [second.outputs[0], *params])
            dq2 = node("DequantizeLinear", [q2.outputs[0], *params])
            after(dq, chain + [q1, dq1, second, q2, dq2])
    for dq in sites["requantization"]:  # DQ → [Q(2·scale) → DQ(2·scale)] → readers: not redundant
        scale = dq.inputs[1].const_value.numpy() * np.float32(2)
        coarse = ir.Value(name=f"injected/requant_scale_{next(counter)}", const_value=ir.tensor(scale))
        graph.register_initializer(coarse)
        q = node("QuantizeLinear", [dq.outputs[0], coarse, dq.inputs[2]])
        after(dq, [q, node("DequantizeLinear", [q.outputs[0], coarse, dq.inputs[2]])])
    result = ir.to_proto(model)
    onnx.checker.check_model(result)
    onnx.save(result, str(files["model"]))
    expected = {
        "round_trip": len(sites["round_trip"]) + len(sites["doubled"]),
        "data_movement": 2 * (len(sites["reshape"]) + len(sites["transpose"])),
        "requantizations": len(sites["requantization"]),
        "qdq_nodes_added": added,
        "qdq_nodes_removable": added - 2 * len(sites["requantization"]),
        "reshape_added": 2 * len(sites["reshape"]), "transpose_added": 2 * len(sites["transpose"]),
        "sites": {kind: [n.name for n in nodes] for kind, nodes in sites.items()},
    }
    files["facts"].write_text(json.dumps(expected, indent=2) + "\n")
    return f"{added} Q/DQ nodes injected, {expected['qdq_nodes_removable']} of them redundant"


# ------------------------------------------------------------------------------------------ the fixtures


# name → (files relative to models/qdq, builder); built in this order (the injected copy needs the QDQ model)
FIXTURES: dict[str, tuple[dict[str, str], Callable[[dict[str, Path]], str]]] = {
    "efficientnet_lite0.qdq": ({"model": "efficientnet_lite0.qdq.onnx"}, build_efficientnet),
    "minilm_l6_v2.qdq": ({"model": "minilm_l6_v2.qdq.onnx"}, build_minilm),
    "qat_cnn": ({"fp32": "qat_cnn.fp32.onnx", "facts": "qat_cnn.json", "model": "qat_cnn.onnx"}, build_qat),
    "efficientnet_lite0.qdq.injected": ({"facts": "efficientnet_lite0.qdq.injected.json",
                                         "model": "efficientnet_lite0.qdq.injected.onnx"}, build_injected),
}


def paths(name: str) -> dict[str, Path]:
    return {key: OUT / file for key, file in FIXTURES[name][0].items()}


def present(name: str) -> bool:
    """All its files exist, and a QAT fixture was trained by this recipe (an older one is built again)."""
    files = paths(name)
    if not all(p.is_file() for p in files.values()):
        return False
    if name != "qat_cnn":
        return True
    try:
        return json.loads(files["facts"].read_text()).get("recipe") == QAT_RECIPE
    except (OSError, ValueError):
        return False


def missing() -> list[str]:
    return [name for name in FIXTURES if not present(name)]


def build(name: str, force: bool) -> None:
    final = paths(name)
    if not force and present(name):
        print(f"models/qdq/{FIXTURES[name][0]['model']}: present")
        return
    OUT.mkdir(parents=True, exist_ok=True)
    temporary = {key: path.with_name(f".{path.name}.tmp{os.getpid()}") for key, path in final.items()}
    start = time.monotonic()
    try:
        note = FIXTURES[name][1](temporary)
        for key in [k for k in final if k != "model"] + ["model"]:  # the model last: it marks completeness
            os.replace(temporary[key], final[key])
    except FetchError as e:
        raise FetchError(f"{name}: {e}") from e
    except Exception as e:  # noqa: BLE001 - a torch/ORT surprise still gets one line naming the fixture
        raise FetchError(f"{name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    finally:
        for path in temporary.values():
            path.unlink(missing_ok=True)
    print(f"models/qdq/{FIXTURES[name][0]['model']}: built ({time.monotonic() - start:.1f} s, {note})", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="rebuild every fixture even if present")
    parser.add_argument("--debug", action="store_true", help="show the traceback of a failure")
    args = parser.parse_args(argv)
    try:
        for name in FIXTURES:
            build(name, args.force)
    except FetchError as e:
        if args.debug:
            raise
        print(f"build_qdq_fixtures: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
