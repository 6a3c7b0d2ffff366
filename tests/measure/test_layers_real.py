"""The per-layer correspondence on real models: the demo models, and the zoo models fetched under zoo/ (skipped
when absent). A pair is a mismatch when the two tensors compute different things, whatever the rounding; so each
pair is measured again on the result with its rounding taken out (every QuantizeLinear of a computed tensor
replaced by the clamp its grid applies, its DequantizeLinears by the scaling from that grid to theirs; weights
stay rounded to the nearest step, biases uncorrected): a pair of
the same value is then at cosine ≥ SAME, a Relu's input paired with its output is not (≈ 0.7). Measured on the
calibration samples, whose values every range holds."""

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import qprep
import qprep.evaluate
from conftest import CALIBRATION, ROOT, demo_model
from qprep.errors import QprepError
from qprep.measure.layers import Drift, LayerComparison
from qprep.model.runtime import Intermediates
from qprep.report.layer_chart import band_counts

pytestmark = pytest.mark.slow
# the rounded weights alone leave MiniLM's deepest attention scores at 0.968; the mismatches found so far sat at
# 0.3–0.9 (a Relu's input for its output, a smoothed LayerNorm's output at another scale per channel)
SAME = 0.95

ZOO = ROOT / "zoo"
INTEGER_RANGES = {onnx.TensorProto.UINT8: (0, 255), onnx.TensorProto.INT8: (-128, 127),
                  onnx.TensorProto.UINT16: (0, 65535), onnx.TensorProto.INT16: (-32768, 32767)}
DEMO = {"efficientnet_lite0": ("imagenet", {"preprocess": {"mean": [127.0] * 3, "std": [128.0] * 3}}),
        "ppocr_cls": ("ocr_cls", {"inputs": {"x": [1, 3, 48, 192]}}), "minilm_l6_v2": ("minilm", {})}


def zoo_models() -> list[str]:
    return sorted(p.stem for p in (ZOO / "models").glob("*.onnx")
                  if (ZOO / "samples" / p.stem / "calibration").is_dir())


def config(name: str) -> dict:
    if name in DEMO:
        data, extra = DEMO[name]
        cfg = {"model": str(demo_model(f"{name}.onnx")), **{k: v for k, v in extra.items() if k != "preprocess"},
               "calibration": {"source": str(CALIBRATION / data / "calib")},
               "evaluation": {"source": str(CALIBRATION / data / "eval")}}
        if "preprocess" in extra:
            cfg["calibration"]["preprocess"] = cfg["evaluation"]["preprocess"] = extra["preprocess"]
    else:
        import yaml

        sidecar = yaml.safe_load((ZOO / "models" / f"{name}.qprep.yaml").read_text())
        cfg = {**{k: v for k, v in sidecar.items() if k not in ("calibration", "evaluation")},
               "model": str(ZOO / "models" / f"{name}.onnx"),
               "calibration": {**sidecar["calibration"], "source": str(ZOO / "samples" / name / "calibration")},
               "evaluation": {**sidecar["evaluation"], "source": str(ZOO / "samples" / name / "evaluation")}}
    # evaluated on the calibration samples themselves: the ranges hold every value, so with the rounding taken
    # out (unrounded) a clamp only ever acts as the activation it may stand for, never as a range's clipping
    cfg["evaluation"] = {**cfg["evaluation"], "source": cfg["calibration"]["source"]}
    for section in ("calibration", "evaluation"):
        cfg[section].update(max_samples=8, seed=0)
    cfg["evaluation"]["latency"] = {"runs": 0}
    cfg["pipeline"] = [{"optimize": {}}, {"keep_float": {}},
                       {"quantize": {"backend": "ort",
                                     "ort": {"weight_rounding": "nearest", "bias_correction": False}}}]
    return cfg


def unrounded(model: onnx.ModelProto, float_model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with each QuantizeLinear of a computed tensor a Clip to its grid's range and each DequantizeLinear
    reading one an Identity: the clamps stay (an absorbed Relu is one), the rounding goes; and each weight or bias
    that is the float model's rounded (its twin node by name reads a float constant within half a step of it) read
    unrounded, so a pair of the same value meets at cosine ~1 however deep the network."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    _float_weights(model, float_model)
    values = {t.name: t for t in model.graph.initializer}
    constant = set(values) | {o for n in model.graph.node if n.op_type == "Constant" for o in n.output}
    for node in model.graph.node:  # constants' Q/DQ (weights) stay as they are
        if all(not i or i in constant for i in node.input):
            constant.update(node.output)
    grids, nodes = {}, []  # integer tensor → (scale, zero point) of the Q that made it
    for node in model.graph.node:
        if node.op_type == "QuantizeLinear" and node.input[0] not in constant and _per_tensor(node, values):
            scale, zero = _grid(node, values)
            low, high = ((q - zero) * scale for q in INTEGER_RANGES[values[node.input[2]].data_type])
            names = [f"{node.output[0]}/low", f"{node.output[0]}/high"]
            model.graph.initializer.extend([numpy_helper.from_array(np.float32(low), names[0]),
                                            numpy_helper.from_array(np.float32(high), names[1])])
            nodes.append(helper.make_node("Clip", [node.input[0], *names], list(node.output), name=node.name))
            grids[node.output[0]] = (scale, zero)
        elif node.op_type == "DequantizeLinear" and node.input[0] in grids and _per_tensor(node, values):
            # (q - z2)·s2 with q = x/s1 + z1: x·s2/s1 + (z1 - z2)·s2 (a DQ on another grid scales, as the
            # scaled round trip of a /6 does)
            (s1, z1), (s2, z2) = grids[node.input[0]], _grid(node, values)
            names = [f"{node.output[0]}/ratio", f"{node.output[0]}/shift", f"{node.output[0]}/scaled"]
            model.graph.initializer.extend([numpy_helper.from_array(np.float32(s2 / s1), names[0]),
                                            numpy_helper.from_array(np.float32((z1 - z2) * s2), names[1])])
            nodes += [helper.make_node("Mul", [node.input[0], names[0]], [names[2]], name=f"{node.name}/mul"),
                      helper.make_node("Add", [names[2], names[1]], list(node.output), name=node.name)]
        elif node.op_type in ("DynamicQuantizeLinear", "MatMulInteger"):
            nodes += _dynamic_unrounded(node, model)
        else:
            nodes.append(node)
            data = [i for i in node.input if i and i not in constant]
            if data and all(i in grids for i in data):  # data movement on integers keeps their grid
                grids.update({o: grids[data[0]] for o in node.output})
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    del model.graph.value_info[:]  # integer tensors are float now
    return model


def _float_weights(model: onnx.ModelProto, float_model: onnx.ModelProto) -> None:
    """Point each node input that is a DequantizeLinear of a constant at the float model's constant, where the
    same-named node of the same op type reads one of the same shape that the integers round (channel padding, a
    smoothing factor or a correction change it: those stay rounded)."""
    values = {t.name: t for t in model.graph.initializer}
    floats = {t.name: t for t in float_model.graph.initializer}
    twins = {n.name: n for n in float_model.graph.node}
    dequantized = {n.output[0]: n for n in model.graph.node if n.op_type == "DequantizeLinear"
                   and n.input[0] in values and all(i in values for i in n.input[1:] if i)}
    for node in model.graph.node:
        twin = twins.get(node.name)
        if twin is None or twin.op_type != node.op_type:
            continue
        for index, name in enumerate(node.input):
            dq = dequantized.get(name)
            if dq is None or index >= len(twin.input) or twin.input[index] not in floats:
                continue
            weight = numpy_helper.to_array(floats[twin.input[index]]).astype(np.float64)
            q = numpy_helper.to_array(values[dq.input[0]]).astype(np.float64)
            if q.ndim != weight.ndim or any(a < b for a, b in zip(q.shape, weight.shape)):
                continue
            kept = tuple(slice(0, b) for b in weight.shape)  # channel padding adds channels past the float ones
            axis = next((a.i for a in dq.attribute if a.name == "axis"), 1) % max(1, q.ndim)
            shape = [1] * q.ndim
            scale = numpy_helper.to_array(values[dq.input[1]]).astype(np.float64)
            zero = (numpy_helper.to_array(values[dq.input[2]]).astype(np.float64) if len(dq.input) > 2 and dq.input[2]
                    else np.zeros_like(scale))
            if scale.size > 1:
                shape[axis] = -1
                scale, zero = scale.reshape(shape), zero.reshape(shape)
            dequantized_weight = np.broadcast_to((q - zero) * scale, q.shape).copy()
            step = np.broadcast_to(scale, q.shape)[kept]
            if np.all(np.abs(dequantized_weight[kept] - weight) <= 0.5 * step + 1e-6 * np.abs(weight)):
                dequantized_weight[kept] = weight  # the padded channels keep what they hold (zeros)
                node.input[index] = twin.input[index] + "/unrounded"
                model.graph.initializer.append(numpy_helper.from_array(dequantized_weight.astype(np.float32),
                                                                       node.input[index]))


def _dynamic_unrounded(node: onnx.NodeProto, model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """ORT's dynamic MatMul without its activation rounding: DynamicQuantizeLinear hands x on (scale 1, zero 0),
    MatMulInteger(a, b, za, zb) becomes MatMul(a - za, b - zb) in float (b keeps its rounded weights)."""
    if node.op_type == "DynamicQuantizeLinear":
        one, zero = f"{node.output[1]}/one", f"{node.output[2]}/zero"
        model.graph.initializer.extend([numpy_helper.from_array(np.float32(1), one),
                                        numpy_helper.from_array(np.float32(0), zero)])
        return [helper.make_node("Identity", [node.input[0]], [node.output[0]], name=node.name),
                helper.make_node("Identity", [one], [node.output[1]], name=f"{node.name}/scale"),
                helper.make_node("Identity", [zero], [node.output[2]], name=f"{node.name}/zero")]
    inputs = [*node.input, "", "", ""][:4]
    parts, made = [], []
    for index, name in enumerate(inputs[:2]):
        cast = helper.make_node("Cast", [name], [f"{node.name}/in{index}"], to=onnx.TensorProto.FLOAT,
                                name=f"{node.name}/cast{index}")
        made.append(cast)
        point = inputs[index + 2]
        if point:
            made += [helper.make_node("Cast", [point], [f"{node.name}/z{index}"], to=onnx.TensorProto.FLOAT,
                                      name=f"{node.name}/castz{index}"),
                     helper.make_node("Sub", [cast.output[0], f"{node.name}/z{index}"], [f"{node.name}/c{index}"],
                                      name=f"{node.name}/sub{index}")]
        parts.append(made[-1].output[0])
    return made + [helper.make_node("MatMul", parts, list(node.output), name=node.name)]


def _grid(node: onnx.NodeProto, values: dict) -> tuple[float, int]:
    return (float(numpy_helper.to_array(values[node.input[1]])), int(numpy_helper.to_array(values[node.input[2]])))


def _per_tensor(node: onnx.NodeProto, values: dict) -> bool:
    return (len(node.input) == 3 and node.input[1] in values and node.input[2] in values
            and numpy_helper.to_array(values[node.input[1]]).size == 1)


@pytest.mark.parametrize("name", [*DEMO, *zoo_models()])
def test_every_compared_pair_computes_the_same_value(tmp_path, monkeypatch, name):
    seen = {}

    class Recording(LayerComparison):
        def __init__(self, float_model, quantized, threads=2):
            seen["models"] = (onnx.ModelProto.FromString(float_model.SerializeToString()), quantized)
            super().__init__(float_model, quantized, threads)

        def errors(self, samples):
            seen["samples"] = samples[:2]  # as the run read them
            return super().errors(samples)

    monkeypatch.setattr(qprep.evaluate, "LayerComparison", Recording)
    cfg = config(name)
    try:
        report = qprep.run(cfg, force=True, output_dir=str(tmp_path / "out"))
    except QprepError as refused:  # a model the ORT backend refuses in one line has no view to check
        pytest.skip(f"{name}: refused: {refused}")
    evaluation = report["evaluation"]
    if "models" not in seen:
        pytest.skip(f"{name}: no per-layer comparison ({report['status']})")
    float_model, quantized = seen["models"]
    comparison = LayerComparison(float_model, quantized)
    pairs, factors = comparison.pairs, comparison.factors  # a smoothed tensor: times its factor per channel
    plain = unrounded(quantized, float_model)
    samples = seen["samples"]
    reference = Intermediates(float_model, [p[0] for p in pairs])
    result = Intermediates(plain, [p[1] for p in pairs])
    drifts = {p[0]: Drift() for p in pairs}
    for sample in samples:
        ref, res = reference.values(sample), result.values(sample)
        for tensor, twin, *_ in pairs:
            value = res.get(twin)
            drifts[tensor].add(ref.get(tensor), value if twin not in factors else value * factors[twin])
    mismatched = {t: round(d.figures()["cosine_mean"], 3) for t, d in drifts.items()
                  if d.comparable and d.figures()["cosine_mean"] < SAME}
    assert not mismatched, f"{name}: pairs of different values: {mismatched}"
    print(name, {k: v.get("cosine_mean") for k, v in evaluation["outputs"].items()},
          band_counts(evaluation["layers"]), evaluation.get("layers_left_out"))

