"""Loading a model file: read it (external data only from beside it), normalize what ONNX Runtime's own
optimizer wrote (qprep/model/ort_optimized.py), and check it, or refuse it in one line.

Why apart from qprep/model/io.py: loading normalizes and checks with what the rest of the model library knows
(node iteration, ORT-only ops), while io is what that library stores and saves with.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError

from qprep.disk.reading import require_regular_file
from qprep.errors import ModelError
from qprep.model.info import iter_nodes, map_valued
from qprep.model.io import is_heavy, is_large, weightless
from qprep.model.stored_tensors import check_stored_sizes
from qprep.model.ort_optimized import (
    ORT_ONLY_ONNX_DOMAIN_OPS,
    lift_layernorm_opset,
    refuse_session_layouts,
    split_simplified_layernorm,
)
from qprep.third_party import all_tensors

log = logging.getLogger("qprep")


def load_model(path: str | os.PathLike, rewrites: bool = True) -> onnx.ModelProto:
    """Load and check a model file (external data included), or raise a one-line ModelError. `rewrites`: the
    caller's graph will be read by qprep's graph library (onnx-ir: the stages, init, inspect's fusion count), so
    what that library cannot read is refused here (`refuse_unreadable`); False only for a caller that merely runs
    the model (a run without stages, its re-evaluation)."""
    return load_model_and_data_files(path, rewrites)[0]


def load_model_and_data_files(path: str | os.PathLike, rewrites: bool = True) -> tuple[onnx.ModelProto, list[Path]]:
    """`load_model`, and the external data files it read (what must survive the run, as the model itself)."""
    path = require_regular_file(path, "model file", ModelError, "check `model:` in the config or pass --model")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except PermissionError:
        raise ModelError(f"permission denied: {path}; make the model readable (chmod +r) or copy it") from None
    except (DecodeError, RuntimeError, ValueError, OSError) as exc:
        raise ModelError(
            f"{path} is not a readable ONNX model ({_first_line(exc)}); the file may be truncated or corrupt: "
            "re-export or re-download it"
        ) from None
    if not model.graph.node and not model.graph.output:
        raise ModelError(f"{path} holds no ONNX graph (empty or not an ONNX file); re-export or re-download it")
    check_stored_sizes(model, path)  # bytes that do not fill a tensor's shape: one line, not a reshape error later
    data_files = _load_external_data(model, path)
    refuse_session_layouts(model, path)
    model = split_simplified_layernorm(lift_layernorm_opset(model, path))
    _check(model, path)
    if rewrites:
        refuse_unreadable(model)
    return model, data_files


def refuse_unreadable(model: onnx.ModelProto) -> None:
    """Refuse in one line a model qprep's graph library cannot read: a value typed as a map or a sequence of maps
    (sklearn's ZipMap; onnx-ir 1.1: "Map types are not supported yet"). Why at load: every command that goes on
    to rewrite or analyse the graph (run, validate, init, inspect) refuses it alike, before it crashes there."""
    message = unreadable(model)
    if message:
        raise ModelError(message)


def unreadable(model: onnx.ModelProto) -> str | None:
    """What `refuse_unreadable` says about `model`, or None: `qprep inspect` names it beside what it can show."""
    maps = map_valued(model)
    if not maps:
        return None
    return (f"model: '{maps[0]}' is a map or a sequence of maps (a ZipMap's output), which qprep's graph library "
            "cannot read; export without it (skl2onnx: options={'zipmap': False}) or remove the ZipMap and keep "
            "its input tensor as the output")


def _load_external_data(model: onnx.ModelProto, path: Path) -> list[Path]:
    from onnx.external_data_helper import uses_external_data

    locations = set()
    for tensor in all_tensors(model):
        if uses_external_data(tensor):
            location = next((e.value for e in tensor.external_data if e.key == "location"), "")
            if location not in locations:
                _check_data_file(path, tensor.name, location)
            locations.add(location)
    try:
        onnx.load_external_data_for_model(model, str(path.parent))
    except (OSError, ValueError, onnx.checker.ValidationError) as exc:
        raise ModelError(f"{path}: cannot read its external data ({_first_line(exc)})") from None
    return [path.parent / location for location in sorted(locations)]


def _check_data_file(path: Path, tensor: str, location: str) -> None:
    """An external data file is read only if it is a regular file in the model's folder once links are resolved:
    a downloaded model must not make qprep read other files of the user's (their bytes would become weights of
    the quantized model), whether by `..`, an absolute location or a link. The model's folder is the one it is
    named in or, for a model that is itself a link, the one it really is in (the Hugging Face cache links
    model and data into one blobs/ folder)."""
    stored = f"{path} stores tensor '{tensor}' in '{location}'"
    if Path(location).is_absolute() or ".." in Path(os.path.normpath(location)).parts:
        raise ModelError(f"{stored}, outside the model's folder; qprep reads external data only from beside the "
                         "model: re-save it with the data file next to it")
    require_regular_file(path.parent / location, f"{stored}: its external data file", ModelError,
                         "keep the data file, a regular file, next to the model")
    real = os.path.realpath(path.parent / location)
    folders = {os.path.realpath(path.parent), os.path.dirname(os.path.realpath(path))}
    if not any(os.path.commonpath([real, folder]) == folder for folder in folders):
        raise ModelError(f"{stored}, which is a link to {real}, outside the model's folder; qprep reads external "
                         "data only from beside the model: copy the data file next to the model")


def _check(model: onnx.ModelProto, path: Path) -> None:
    newest = onnx.defs.onnx_opset_version()
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx") and opset.version > newest:
            raise ModelError(
                f"{path} uses opset {opset.version}, newer than this onnx ({onnx.__version__}) knows ({newest}); "
                "export it with an older opset"
            )
    try:
        _check_model(model, path)
    except onnx.checker.ValidationError as exc:
        if not _initializers_not_inputs(model, exc):
            raise ModelError(_not_onnx_op(model, path) or
                             f"{path} is not a valid ONNX model: {_checker_message(exc)}") from None
        _raise_ir_version(model, path)


def _check_model(model: onnx.ModelProto, path: Path | None) -> None:
    """`path`: the file the model was read from, checked in its place over 2 GB (None: the model as it is now)."""
    if is_large(model) and path is not None:
        onnx.checker.check_model(str(path))
    else:  # a heavy model's weights are not serialized for it (BERT-large's load peaked at 5× its size)
        onnx.checker.check_model(weightless(model, placeholder="empty")[0] if is_heavy(model) else model)


# IR version 4 (ONNX 1.3) made listing initializers among the graph inputs optional; the opsets of IR 3 (up to 8)
# are the same under IR 4, so raising the version changes no op's meaning
INITIALIZERS_OPTIONAL_IR = 4


def _initializers_not_inputs(model: onnx.ModelProto, exc: Exception) -> bool:
    """The checker's complaint is the IR-3 rule that initializers be graph inputs (a 2016 export that ONNX
    Runtime runs: it applies the rule of the IR version it implements, not the file's)."""
    return model.ir_version < INITIALIZERS_OPTIONAL_IR and "in initializer but not in graph input" in str(exc)


def _raise_ir_version(model: onnx.ModelProto, path: Path) -> None:
    """The model's IR version raised to 4 (its opset kept), checked again, and said: what qprep writes is IR 4."""
    before = model.ir_version
    model.ir_version = INITIALIZERS_OPTIONAL_IR
    try:
        _check_model(model, None)  # not the file: it still says IR 3
    except onnx.checker.ValidationError as exc:
        raise ModelError(_not_onnx_op(model, path) or f"{path} is not a valid ONNX model (IR version {before}, "
                         f"checked as IR {INITIALIZERS_OPTIONAL_IR}): {_checker_message(exc)}") from None
    log.warning("model: IR version %d, whose rule that initializers be graph inputs the model does not follow: "
                "taken as IR version %d (opset %s kept), where the rule is gone", before, INITIALIZERS_OPTIONAL_IR,
                ", ".join(str(o.version) for o in model.opset_import if o.domain in ("", "ai.onnx")) or "-")


def _not_onnx_op(model: onnx.ModelProto, path: Path) -> str | None:
    """The refusal of the first ONNX-domain node whose op type no ONNX opset defines, saying where it comes from
    instead of the checker's "No Op registered": ONNX Runtime's transformer optimizer (its own
    SimplifiedLayerNormalization), or an exporter that left an op unconverted (tf2onnx 1.17: `Erfc`,
    `StatefulPartitionedCall` in Keras models)."""
    node = next((n for n in iter_nodes(model.graph) if n.domain in ("", "ai.onnx") and not onnx.defs.has(n.op_type)),
                None)
    if node is None:
        return None
    named = f"'{node.name or node.output[0]}' ({node.op_type})"
    if node.op_type in ORT_ONLY_ONNX_DOMAIN_OPS:
        return (f"{path} uses {named}, which ONNX Runtime's transformer optimizer writes and no ONNX opset has: "
                "quantize the export from before that optimizer")
    return (f"{path} holds {named}, which is no ONNX op at any opset: the exporter left it unconverted (tf2onnx "
            "does so for a TensorFlow op it has no handler for); re-export without it or with a newer exporter")


def _checker_message(exc: Exception) -> str:
    """onnx.checker's message on one line: its first line says what is wrong, a later "==> Context: … Name: n
    OpType: Op" line says where; the node comes first so it survives the length cap."""
    text = " ".join(str(exc).split())
    problem, _, context = text.partition(" ==> Context: ")
    node = re.search(r"Name: (\S*) OpType: (\S+)", context)
    where = f"node '{node.group(1)}' ({node.group(2)}): " if node else ""
    return (where + problem)[:400]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]
