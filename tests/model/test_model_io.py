import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from qprep.errors import ModelError
from qprep.model import runtime
from qprep.model.load import load_model
from qprep.model.io import save_model, sha256_file
from qprep.model import info as model_info
from graphs import make_graph, make_model, tiny_conv_model


def test_truncated_model_is_a_one_line_model_error(tmp_path, save):
    path = save(tiny_conv_model())
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelError, match=r"truncated or corrupt"):
        load_model(path)


def test_missing_and_non_onnx_files(tmp_path):
    with pytest.raises(ModelError, match="model file not found"):
        load_model(tmp_path / "nope.onnx")
    (tmp_path / "text.onnx").write_text("hello, I am not a model")
    with pytest.raises(ModelError):
        load_model(tmp_path / "text.onnx")


def test_external_data_loads_and_missing_data_file_is_named(tmp_path):
    model = tiny_conv_model()
    expected = numpy_helper.to_array(model.graph.initializer[0])
    path = tmp_path / "ext.onnx"
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="ext.data", size_threshold=0)
    loaded = load_model(path)
    w = {t.name: numpy_helper.to_array(t) for t in loaded.graph.initializer}["w"]
    assert np.array_equal(w, expected)
    (tmp_path / "ext.data").unlink()
    with pytest.raises(ModelError, match=r"in .ext.data.: its external data file not found: .*ext.data; keep"):
        load_model(path)


def external_model(folder, location="ext.data"):
    """tiny_conv_model saved in `folder` with its weights in `location` beside it."""
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save_model(tiny_conv_model(), str(folder / "m.onnx"), save_as_external_data=True,
                    all_tensors_to_one_file=True, location=location, size_threshold=0)
    return folder / "m.onnx"


def test_external_data_behind_a_link_out_of_the_model_folder_is_refused(tmp_path):
    """Issue #57: a downloaded model whose data file is a link to another of the user's files would put that
    file's bytes into the quantized model; only the location's text (`..`, absolute) was checked."""
    elsewhere = external_model(tmp_path / "elsewhere").parent / "ext.data"
    path = external_model(tmp_path / "model")
    (tmp_path / "model" / "ext.data").unlink()
    os.symlink(elsewhere, tmp_path / "model" / "ext.data")
    with pytest.raises(ModelError, match=r"^[^\n]*'ext.data'[^\n]*is a link to [^\n]*elsewhere/ext.data, outside "
                                         r"the model's folder[^\n]*copy the data file next to the model$"):
        load_model(path)


def read_or_refused_by_onnx(path):
    """The model loaded, or (onnx ≥ 1.19 reads no external data through a symlink itself) refused in one line
    that says so: which of the two is onnx's choice, never a crash or a read outside the folder."""
    try:
        return load_model(path).graph.initializer[0].name
    except ModelError as exc:
        assert "symbolic link" in str(exc) and "\n" not in str(exc), exc
        return "w"


def test_external_data_links_that_stay_beside_the_model_are_read(tmp_path):
    """A link to a file in the model's folder, and the Hugging Face cache layout (model and data both links
    into one blobs/ folder), are the model's own files (to qprep; newer onnx refuses links itself)."""
    path = external_model(tmp_path / "a", location="real.data")
    (tmp_path / "a" / "m.onnx").rename(tmp_path / "a" / "real.onnx")
    model = onnx.load(str(tmp_path / "a" / "real.onnx"), load_external_data=False)
    for tensor in model.graph.initializer:
        next(e for e in tensor.external_data if e.key == "location").value = "link.data"
    onnx.save(model, str(path))
    os.symlink("real.data", tmp_path / "a" / "link.data")
    assert read_or_refused_by_onnx(path) == "w"
    blobs = external_model(tmp_path / "blobs")
    (tmp_path / "snapshot").mkdir()
    for name in ("m.onnx", "ext.data"):
        os.symlink(blobs.parent / name, tmp_path / "snapshot" / name)
    assert read_or_refused_by_onnx(tmp_path / "snapshot" / "m.onnx") == "w"


def test_save_is_atomic_and_leaves_no_temp_files(tmp_path):
    target = tmp_path / "out" / "model.onnx"
    save_model(tiny_conv_model(), target)
    assert [p.name for p in target.parent.iterdir()] == ["model.onnx"]
    assert load_model(target).graph.node[0].op_type == "Conv"
    assert len(sha256_file(target)) == 64


@pytest.mark.parametrize("external", [False, True])
def test_save_returns_the_bytes_it_wrote_external_data_included(tmp_path, monkeypatch, external):
    """The report's result size comes from here (ByteSize() serialized a 1.58 GB proto once more)."""
    from qprep.model import io

    if external:  # the model counts as over protobuf's limit: its weights go to model.onnx.data
        monkeypatch.setattr(io, "PROTOBUF_LIMIT", 1024)
    model = make_model([onnx.helper.make_node("MatMul", ["x", "w"], ["y"])], [("x", [1, 64])], [("y", [1, 64])],
                       {"w": np.ones((64, 64), np.float32)})
    target = tmp_path / "model.onnx"
    written = save_model(model, target)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == (["model.onnx", "model.onnx.data"] if external else ["model.onnx"])
    assert written == sum((tmp_path / name).stat().st_size for name in files) and written > 64 * 64 * 4


def test_model_kind_classification():
    model = tiny_conv_model()
    assert model_info.model_kind(model) == "float"
    model.graph.node.append(onnx.helper.make_node("QuantizeLinear", ["y", "s"], ["q"]))
    assert model_info.model_kind(model) == "qdq"
    model.graph.node.append(onnx.helper.make_node("QLinearConv", ["q"], ["z"]))
    assert model_info.model_kind(model) == "integer"


def test_op_counts_include_subgraphs():
    then = make_graph([onnx.helper.make_node("Relu", ["x"], ["t"])], [], ["t"], name="then")
    model = tiny_conv_model()
    model.graph.node.append(onnx.helper.make_node("If", ["cond"], ["o"], then_branch=then, else_branch=then))
    counts = model_info.op_counts(model)
    assert counts["Relu"] == 3 and counts["If"] == 1
    assert model_info.has_control_flow(model)


def test_multiply_adds_of_conv_and_matmul():
    from onnx import helper as h

    model = make_model([h.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
                        h.make_node("ReduceMean", ["c"], ["r"], name="pool", axes=[2, 3], keepdims=0),
                        h.make_node("MatMul", ["r", "m"], ["y"], name="fc")],
                       [("x", ["batch", 4, 6, 6])], ["y"],
                       {"w": np.zeros((8, 4, 3, 3), np.float32), "m": np.zeros((8, 5), np.float32)},
                       infer_shapes=False)
    counts = model_info.multiply_adds(model)
    assert counts == {"conv": 8 * 6 * 6 * 4 * 3 * 3, "fc": 5 * 8}


def test_multiply_adds_after_an_op_shape_inference_has_no_rule_for_are_counted_from_a_run():
    """sklearn's exports start with an ai.onnx.ml Scaler, whose output ONNX shape inference leaves unknown: every
    MatMul after it counted 0 ("integer share not measured" on an all-MatMul model). With the input dims fixed,
    the shapes come from one run of the model; with a symbolic one, nothing is run and they stay unknown."""
    from onnx import helper as h

    def scaled_mlp(batch):
        nodes = [h.make_node("Scaler", ["x"], ["s"], name="scale", domain="ai.onnx.ml", offset=[0.5] * 4,
                             scale=[2.0] * 4),
                 h.make_node("MatMul", ["s", "w1"], ["h"], name="fc1"),
                 h.make_node("Relu", ["h"], ["r"]),
                 h.make_node("MatMul", ["r", "w2"], ["y"], name="fc2")]
        graph = make_graph(nodes, [("x", [batch, 4])], [("y", [batch, 3])],
                           {"w1": np.ones((4, 8), np.float32), "w2": np.ones((8, 3), np.float32)})
        return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 13),
                                                            onnx.helper.make_opsetid("ai.onnx.ml", 1)])

    assert model_info.multiply_adds(scaled_mlp(1)) == {"fc1": 4 * 8, "fc2": 8 * 3}
    assert model_info.multiply_adds(scaled_mlp("batch")) == {}


def test_intermediate_values_leave_out_names_the_graph_does_not_compute():
    model = tiny_conv_model()
    name = next(o for node in model.graph.node for o in node.output)
    spec = model_info.graph_inputs(model)[0]
    sample = {spec.name: np.ones([d if isinstance(d, int) else 1 for d in spec.shape], np.float32)}
    values = next(runtime.intermediate_values(model, [name, "not_in_graph", spec.name], [sample], threads=1))
    assert set(values) == {name, spec.name}


def test_shapes_of_a_heavy_model_are_inferred_on_a_skeleton_and_its_weights_stay(monkeypatch):
    """onnx's shape inference returns an empty model over 2 GB (and serializes every weight below): a heavy
    model (here: made to count as one) is inferred without its big weights, and the shapes land in the model
    itself. The checker takes the same skeleton."""
    import numpy as np
    from onnx import helper, numpy_helper

    from qprep.model import io

    weight = np.arange(64 * 512, dtype=np.float32).reshape(64, 512)  # 128 KB: above the skeleton's cut
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])], "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 64])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)], [numpy_helper.from_array(weight, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    constant = helper.make_model(helper.make_graph(
        [helper.make_node("Constant", [], ["w"], value=numpy_helper.from_array(weight, "w")),
         helper.make_node("MatMul", ["x", "w"], ["y"])], "c", graph.input, graph.output),
        opset_imports=[helper.make_opsetid("", 17)])
    monkeypatch.setattr(io, "HEAVY_BYTES", 1 << 10)  # the 128 KB weight counts as heavy
    assert io.is_heavy(model) and not io.is_heavy(constant)  # heavy: what the skeleton can strip (initializers)
    assert io.weights_bytes(constant) == weight.nbytes
    shapes_only = io.inferred_shapes(model, shapes_only=True)
    assert shapes_only.graph.initializer[0].ByteSize() < 100 and not model.graph.value_info  # model untouched
    same = io.inferred_shapes(model)
    assert same is model
    assert [d.dim_value for d in model.graph.value_info[0].type.tensor_type.shape.dim] == [2, 512]
    assert [d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim] == [2, 512]
    assert np.array_equal(numpy_helper.to_array(model.graph.initializer[0]), weight)
    assert len(model.graph.node) == 2 and model.opset_import[0].version == 17
    from qprep.graph.verify import checker_problem

    assert checker_problem(model) is None
    model.graph.node[0].op_type = "NoSuchOp"
    assert "NoSuchOp" in checker_problem(model)


def test_a_session_of_a_heavy_model_takes_its_weights_from_memory(monkeypatch):
    """A heavy model's session is built from the weightless graph with the big initializers handed to ONNX
    Runtime as arrays (over 2 GB there is no other way but a temp file); same outputs as the plain session."""
    import gc

    import numpy as np
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(0)
    weight = rng.standard_normal((64, 512)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "b"], ["y"])], "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 64])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 512])],
        [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(np.ones(512, np.float32), "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    samples = [{"x": rng.standard_normal((2, 64)).astype(np.float32)}]
    plain = runtime.run_model(model, samples)
    monkeypatch.setattr("qprep.model.io.HEAVY_BYTES", 1 << 10)  # the 128 KB weight counts as heavy
    handed, to_array = [], numpy_helper.to_array
    monkeypatch.setattr(runtime.numpy_helper, "to_array", lambda t: handed.append(t.name) or to_array(t))
    session = runtime.ort_session(model)
    assert handed == ["w"]  # w (128 KB) from memory; b (2 KB) stays in the graph
    gc.collect()  # the arrays handed over are gone: the session runs on ORT's copy
    scribble = [np.full(weight.size, np.nan, np.float32) for _ in range(8)]
    feeds = {"x": samples[0]["x"]}
    np.testing.assert_allclose(session.run(None, feeds)[0], plain[0]["y"], rtol=1e-6)
    del scribble
    np.testing.assert_allclose(runtime.run_model(model, samples)[0]["y"], plain[0]["y"], rtol=1e-6)
    inside = next(runtime.intermediate_values(model, ["h"], samples))["h"]  # an intermediate tensor, same way
    # ORT's and numpy's float32 sums of 64 products differ in order: a few ulp (3.8e-6 on values near 1 here)
    np.testing.assert_allclose(inside, samples[0]["x"] @ weight, rtol=1e-5, atol=1e-4)
    assert not any(o.name == "h" for o in model.graph.output)  # the caller's model is not changed


COMPACTED_PROBE = """
import gc
import numpy as np
import onnx
from onnx import numpy_helper
from qprep.model.io import compacted

def resident_mb():
    return int(next(line for line in open("/proc/self/status") if line.startswith("VmRSS")).split()[1]) >> 10

model = onnx.ModelProto()
model.graph.initializer.append(numpy_helper.from_array(np.ones(16 << 20, np.float32), "w"))  # 64 MB
model.graph.ClearField("initializer")  # removed, as the quantizer removes a weight it quantized
before = resident_mb()
kept = compacted(model)
del model
gc.collect()
assert not kept.graph.initializer
print(before - resident_mb())
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the resident size from /proc")
def test_a_compacted_model_lets_go_of_the_bytes_of_removed_weights():
    """ORT's quantizer removes float weights from the proto it edits, which keeps their bytes until it is freed
    whole: the quantize stage hands on io.compacted's copy instead. Measured in a fresh process: resident memory
    of this one depends on what earlier tests allocated and freed."""
    done = subprocess.run([sys.executable, "-c", COMPACTED_PROBE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[-1]) > 48  # MB given back: the 64 MB of the removed weight


def test_a_heavy_model_is_checked_at_load_without_serializing_its_weights(tmp_path, monkeypatch):
    """onnx.checker serializes the proto it is given (BERT-large's load peaked at 5× its size): a heavy model's
    checker takes the weightless skeleton, and still refuses a broken graph."""
    from qprep.model import io

    path = tmp_path / "m.onnx"
    model = tiny_conv_model(batch=1)
    save_model(model, path)
    monkeypatch.setattr(io, "HEAVY_BYTES", 1 << 6)  # the 432-byte Conv weight counts as heavy
    monkeypatch.setattr(io, "SMALL_TENSOR", 1 << 6)
    checked, check_model = [], onnx.checker.check_model
    monkeypatch.setattr(onnx.checker, "check_model", lambda m, *a, **k: checked.append(m) or check_model(m, *a, **k))
    load_model(path)
    assert checked and io.weights_bytes(checked[0]) < 64  # the weight is a stub
    model.graph.node[0].op_type = "NoSuchOp"
    save_model(model, path)
    with pytest.raises(ModelError, match="NoSuchOp"):
        load_model(path)


def test_an_op_no_onnx_opset_has_is_named_as_the_exporters_leftover(tmp_path):
    """tf2onnx 1.17 left `Erfc` (a Keras gelu) in the graph: the checker's "No Op registered" now says why."""
    from onnx import helper

    onnx.save(make_model([helper.make_node("Erfc", ["x"], ["y"], name="gelu/Erfc")], [("x", [2])], [("y", [2])],
                         infer_shapes=False), str(tmp_path / "m.onnx"))
    with pytest.raises(ModelError, match=r"'gelu/Erfc' \(Erfc\), which is no ONNX op at any opset: the exporter"):
        load_model(tmp_path / "m.onnx")


def test_content_key_tells_models_apart_by_their_bytes_and_leaves_a_large_one_unkeyed(monkeypatch):
    """Measuring a model once per content (the output check, the ORT search) keys it by this digest; a model over
    protobuf's limit gets none (serializing it would fail, or double a big model's memory) and is measured again."""
    from onnx import helper, numpy_helper

    from qprep.model import io as model_io

    def model(value: float):
        weight = numpy_helper.from_array(np.full((2,), value, np.float32), "w")
        graph = helper.make_graph([helper.make_node("Add", ["x", "w"], ["y"])], "g",
                                  [helper.make_tensor_value_info("x", 1, [2])],
                                  [helper.make_tensor_value_info("y", 1, [2])], [weight])
        return helper.make_model(graph)

    assert model_io.content_key(model(1.0)) == model_io.content_key(model(1.0)) != model_io.content_key(model(2.0))
    monkeypatch.setattr(model_io, "is_large", lambda m: True)
    assert model_io.content_key(model(1.0)) is None
