"""The graph handed to ONNX Runtime's quantizer, and the one it hands back, have unique names; a failure of the
whole model is qprep's, found in one call.

Issue #61's U-Net (torch dynamo export): "Duplicate definition of name (val_3589)". Dynamo names values `val_N`;
ORT's QDQ quantizer gives each further reader of a shared bias its own copy named `<bias><largest suffix + 1>`
counted over initializers only, so the copy of `val_1` becomes `val_11`, which a node output of the model may
already be.
"""

import numpy as np
import pytest
from onnx import helper

from conftest import typed
from graphs import make_model, rand
from qprep.graph.names import duplicate_names
from qprep.model.runtime import run_model
from qprep.quantize.ort.quantizer import OrtQuantizer


def dynamo_named_convs():
    """x → Conv(val_0, bias val_1) → val_2 → Conv(val_10, bias val_1) → val_11 → Relu → y, names as dynamo gives
    them: two Convs share the bias `val_1` (dynamo shares equal constants), and `val_11` is a node output."""
    nodes = [helper.make_node("Conv", ["x", "val_0", "val_1"], ["val_2"], name="node_conv2d", pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["val_2", "val_10", "val_1"], ["val_11"], name="node_conv2d_1",
                              pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["val_11"], ["y"], name="node_relu")]
    return make_model(nodes, [("x", [1, 4, 6, 6])], [("y", [1, 4, 6, 6])],
                      {"val_0": rand(4, 4, 3, 3, seed=1), "val_1": rand(4, seed=2), "val_10": rand(4, 4, 3, 3, seed=3)})


def test_a_shared_bias_on_dynamo_names_quantizes_without_a_duplicate(tmp_path):
    """Before: ORT's copy of `val_1` was named `val_11`, and ORT re-wired the reader of the Conv output `val_11`
    (the Relu) to the copy's DequantizeLinear: y was relu(bias), shape [4], without an error. On issue #61's
    U-Net the same collision gave "Duplicate definition of name" and a bisection that kept InstanceNorms float."""
    model = dynamo_named_convs()
    samples = [{"x": rand(1, 4, 6, 6, seed=s)} for s in range(8)]
    quantizer = OrtQuantizer(model, samples, typed("ort", weight_type="int8"), tmp_path)
    quantized = quantizer.build(set())
    assert quantizer.unquantizable == {}
    assert duplicate_names(quantized) == []
    dequantized = {o for n in quantized.graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    convs = [n for n in quantized.graph.node if n.op_type == "Conv"]
    assert len(convs) == 2 and all(n.input[1] in dequantized and n.input[2] in dequantized for n in convs)
    expected, actual = run_model(model, samples), run_model(quantized, samples)
    error = max(np.abs(e["y"] - a["y"]).max() / np.abs(e["y"]).max() for e, a in zip(expected, actual))
    assert error < 0.05


def test_a_step_that_defines_a_name_twice_stops_the_build_naming_it(tmp_path, monkeypatch):
    """A fix qprep makes to ORT's output that writes a second `val_2`: the build stops at once (no bisection: one
    call of ORT's quantizer) with an internal error naming that step, not exit 2 telling the user to exclude a
    node."""
    from qprep.errors import QprepError
    from qprep.quantize.ort import int32_bias
    from qprep.quantize.ort.failures import WholeModelFailure

    def fit_biases_and_break(quantized, model):
        quantized.graph.node.append(helper.make_node("Identity", ["x"], ["val_2"], name="broken"))
        return 0

    monkeypatch.setattr(int32_bias, "fit_biases", fit_biases_and_break)
    model = dynamo_named_convs()
    samples = [{"x": rand(1, 4, 6, 6, seed=s)} for s in range(4)]
    quantizer = OrtQuantizer(model, samples, typed("ort", weight_type="int8"), tmp_path)
    calls = []
    quantize = quantizer.failures.quantize
    quantizer.failures.quantize = lambda *args: calls.append(1) or quantize(*args)
    with pytest.raises(WholeModelFailure, match=r"qprep's fixes to ORT's quantized model.*value 'val_2'") as caught:
        quantizer.build(set())
    assert not isinstance(caught.value, QprepError) and len(calls) == 1 and quantizer.unquantizable == {}


def test_a_failure_of_the_whole_model_is_qprep_s_in_one_call_not_bisected(tmp_path, monkeypatch, cli):
    """ORT's quantizer failing with "Duplicate definition of name": no node's exclusion can help, so the run
    stops after that one call with exit 3 and the cause (it bisected, 454 s on issue #61's U-Net, then exit 2
    "exclude the node named in the message")."""
    import onnx

    from qprep.quantize.ort import raw_build

    calls = []

    def quantizer_fails(self, ranges, excluded, settings):
        calls.append(list(excluded))
        raise RuntimeError("[ONNXRuntimeError] : 1 : FAIL : This is an invalid model. Error: Duplicate definition "
                           "of name (val_3589).")

    monkeypatch.setattr(raw_build.RawBuild, "__call__", quantizer_fails)
    onnx.save(dynamo_named_convs(), tmp_path / "m.onnx")
    (tmp_path / "calib").mkdir()
    for i in range(4):
        np.save(tmp_path / "calib" / f"{i}.npy", rand(1, 4, 6, 6, seed=i))
    (tmp_path / "c.yaml").write_text(f"model: {tmp_path / 'm.onnx'}\ncalibration: {{source: {tmp_path / 'calib'}}}\n"
                                     "pipeline:\n  - quantize: {backend: ort, ort: {activations: static}}\n")
    code, _, err = cli("run", tmp_path / "c.yaml", "--out", tmp_path / "out", "--quiet")
    assert code == 3 and len(calls) == 1
    assert "Duplicate definition of name (val_3589)" in err and "qprep's bug" in err and "exclude" not in err


@pytest.mark.parametrize("constant", ["h_scale", "h_zero_point", "h_QuantizeLinear_Output", "h_DequantizeLinear_Output"])
def test_a_value_named_as_ort_names_what_it_adds_is_renamed_apart(tmp_path, constant):
    """Conv → h → Mul(h, <constant>) → Conv, the constant named as ORT names what it adds for `h`. Before: ORT's
    quantizer failed on the first Conv and the Mul (kept float by the bisection), or, with
    `h_DequantizeLinear_Output`, wrote a model whose Mul read ORT's tensor instead (output error 1.1, no error)."""
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["h"], name="conv_1", pads=[1, 1, 1, 1]),
             helper.make_node("Mul", ["h", constant], ["m"], name="mul"),
             helper.make_node("Conv", ["m", "w2", "b2"], ["y"], name="conv_2", pads=[1, 1, 1, 1])]
    model = make_model(nodes, [("x", [1, 4, 6, 6])], [("y", [1, 4, 6, 6])],
                       {"w1": rand(4, 4, 3, 3, seed=1), "b1": rand(4, seed=2), "w2": rand(4, 4, 3, 3, seed=3),
                        "b2": rand(4, seed=4), constant: np.full((1, 4, 1, 1), 3.0, np.float32)})
    samples = [{"x": rand(1, 4, 6, 6, seed=s)} for s in range(8)]
    quantizer = OrtQuantizer(model, samples, typed("ort", weight_type="int8"), tmp_path)
    quantized = quantizer.build(set())
    assert quantizer.unquantizable == {} and duplicate_names(quantized) == []
    expected, actual = run_model(model, samples), run_model(quantized, samples)
    error = max(np.abs(e["y"] - a["y"]).max() / np.abs(e["y"]).max() for e, a in zip(expected, actual))
    assert error < 0.05
    assert quantizer.renamed == {constant: f"{constant}/apart"}
