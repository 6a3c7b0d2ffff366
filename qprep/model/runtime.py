"""Running models with ONNX Runtime: one place that builds sessions (threads, optimization level, logging,
models over 2 GB), runs samples through them and exposes intermediate tensors."""

from __future__ import annotations

import copy
import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnx
from onnx import numpy_helper

from qprep.errors import ModelError
from qprep.model.io import computing, is_heavy, reads, weightless


def run_model(model: onnx.ModelProto, samples: list[dict], threads: int = 2, optimize: bool = False,
              extra_outputs=(), max_extra_bytes: int | None = None) -> list[dict[str, np.ndarray]]:
    """Outputs of `model` for every sample (only the inputs the model declares are fed), with the tensors
    `extra_outputs` too — for every sample while they add up to at most `max_extra_bytes` (judged on the first
    sample), else for none. `optimize=True` runs it as deployed (ORT_ENABLE_ALL: QDQ fused into integer
    kernels); False runs the graph exactly as written."""
    workers = _side_by_side(model, samples, threads)
    try:
        session = ort_session(model, threads=1 if workers > 1 else threads, optimize=optimize,
                              extra_outputs=extra_outputs)
        if max_extra_bytes is None or not extra_outputs or not samples:
            return session_outputs(session, samples, workers)
        first = session_outputs(session, samples[:1])  # one session: the first sample tells what the rest fetch
        if sum(first[0][name].nbytes for name in extra_outputs if name in first[0]) * len(samples) <= max_extra_bytes:
            return first + session_outputs(session, samples[1:], workers)
        declared = [o.name for o in model.graph.output]
        return [{name: first[0][name] for name in declared}] + session_outputs(session, samples[1:], workers,
                                                                               fetch=declared)
    except Exception as exc:  # ORT raises its own exception types
        raise model_error(exc) from None


def _side_by_side(model: onnx.ModelProto, samples: list, threads: int) -> int:
    """How many samples run at once, one ORT thread each: a small model's run does not fill 2 cores
    (BENCHMARKS.md: "a light model's samples run side by side"); a heavy model keeps one run at a time (each
    run's memory) and its threads."""
    return threads if threads > 1 and len(samples) > 1 and not is_heavy(model) else 1


def model_error(exc: Exception) -> ModelError:
    """ORT's failure to build or run a model, in one line with what to do."""
    message = short_ort_message(str(exc).splitlines()[0])
    return ModelError(f"ONNX Runtime cannot run the model on the verification samples ({message}); "
                      f"{_advice(message)}")


def session_outputs(session, samples: list[dict], workers: int = 1, fetch=None) -> list[dict[str, np.ndarray]]:
    """Every output of a built session (or those named in `fetch`) for every sample (only the inputs it
    declares are fed), in order; `workers` runs that many samples at once (a session's run is thread-safe and
    frees the GIL)."""
    names = [i.name for i in session.get_inputs()]
    outputs = list(fetch) if fetch is not None else [o.name for o in session.get_outputs()]

    def one(sample: dict) -> dict[str, np.ndarray]:
        return dict(zip(outputs, session.run(outputs, {n: sample[n] for n in names})))

    if workers <= 1 or len(samples) <= 1:
        return [one(s) for s in samples]
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, samples))


def short_ort_message(message: str) -> str:
    """ORT's kernel errors put a source path and a C++ signature between the node's name and the sentence that
    explains: keep the start (node name) and the end (the explanation)."""
    if len(message) <= 300:
        return message
    named = message.find(" Status Message:")  # ORT: "... while running <Op> node. Name:'<node>' Status Message: ..."
    head = message[:named] if 0 < named <= 200 else message[:130]
    return f"{head} … {message[-160:]}"


SHAPE_WORDS = ("dimension", "shape", "rank", "broadcast", "index", "reshape", "size")


def _advice(message: str) -> str:
    """What to do: shape trouble comes from the samples or the input dims; a kernel that refuses the values it
    was given (e.g. "QLinearConv : zero point of per-channel filter must be same") does not."""
    if any(word in message.lower() for word in SHAPE_WORDS):
        return "fix the input dims with `inputs:` or give calibration data"
    node = failing_node(message)
    named = f"keep_float: {{nodes: [{node}]}}" if node else "keep_float: {nodes: [...]}"
    # keep_float, not a backend's own setting: it holds for every backend (the fp16 conversion's faults are
    # named by quantize/fp16.py with its settings before this runs)
    return (f"an operator's kernel refused the model (see the node named above): keep that node float ({named}) "
            "or change the setting that produced it")


def failing_node(message: str) -> str | None:
    """The node an ONNX Runtime error names ("… Name:'n' Status Message …", "… of node (n) …"), or None."""
    found = re.search(r"Name:'([^']+)'", message) or re.search(r"(?:of|in) node \(([^)]+)\)", message)
    return found.group(1) if found else None


def intermediate_values(model: onnx.ModelProto, names, samples: list[dict], threads: int = 2):
    """Per sample, {name: value} of the tensors `names` — graph inputs from the sample, the rest from one ORT
    session running the graph as written; names the model does not compute are left out. A generator, so a
    caller that reduces (GPTQ's input moments) never holds every sample's values at once."""
    tap = Intermediates(model, names, threads)
    for sample in samples:
        yield tap.values(sample)


class Intermediates:
    """One ORT session that exposes the tensors `names` of a model (see intermediate_values), built on first use
    from a SessionRecipe. It keeps no reference to the model: a caller may free the proto once this exists, and
    the session is then built without it (a 3 GB BERT's FP32 proto stayed beside the per-layer error's two
    sessions)."""

    def __init__(self, model: onnx.ModelProto, names, threads: int = 2):
        from qprep.model.specs import graph_inputs, input_types

        self.wanted = list(dict.fromkeys(names))
        self.inputs = {spec.name for spec in graph_inputs(model)}  # initializers listed as inputs: not in samples
        self.types = input_types(model)
        produced = {o for node in model.graph.node for o in node.output}
        self.computed = [n for n in self.wanted if n not in self.inputs and n in produced]
        self.threads = threads
        self._recipe: SessionRecipe | None = SessionRecipe(model, self.computed, only=True)
        self._session = None

    def _built(self):
        """(session, its inputs, the computed tensors it exposes), built on the first sample."""
        if self._session is None:
            session, self._recipe = ort_session(self._recipe, threads=self.threads), None
            outputs = {o.name for o in session.get_outputs()}
            self._session = (session, [i.name for i in session.get_inputs()],
                             [n for n in self.computed if n in outputs])
        return self._session

    def values(self, sample: dict) -> dict:
        """One sample's tensors (each call returns fresh arrays: hold only what you need)."""
        from qprep.model.specs import cast_to

        session, feeds, available = self._built()
        sample = cast_to(sample, self.types)
        values = dict(zip(available, session.run(available, {n: sample[n] for n in feeds}) if available else []))
        return {n: np.asarray(sample[n]) if n in self.inputs else values[n] for n in self.wanted
                if n in self.inputs or n in values}


class Stepwise:
    """A model run over samples a part at a time: `advance` runs only the nodes its targets need that no earlier
    part ran, fed with the tensors earlier parts left, and `add` changes a left tensor before later parts read
    it. Why: bias correction measures its layers wave by wave, each wave after the shifts of the layers upstream;
    running every ancestor again per wave cost waves × model (BENCHMARKS.md: "bias correction runs each node once
    per sample"), where each node now runs once per sample. Only tensors that a node not yet run reads are held."""

    def __init__(self, model: onnx.ModelProto, samples: list[dict], threads: int = 2):
        from qprep.model.specs import cast_to_inputs

        self.model = model
        self.samples = cast_to_inputs(samples, model)
        self.threads = threads
        self.readers: dict[str, set[int]] = {}
        for index, node in enumerate(model.graph.node):
            for name in reads(node):  # with what its subgraphs read
                self.readers.setdefault(name, set()).add(index)
        self.producer = {o: index for index, node in enumerate(model.graph.node) for o in node.output if o}
        self.ran: set[int] = set()
        self.held: dict[str, list[np.ndarray]] = {}  # tensor → its value per sample

    def advance(self, targets: list[str]) -> list[dict[str, np.ndarray]] | None:
        """Per sample, {target: value}. None when a part cannot continue from what is held — a target whose node
        ran already and which no later node read (so it was let go), or a value crossing parts that is not a
        tensor (a sequence): the caller runs the whole model instead."""
        wanted = [t for t in targets if t not in self.held and t in self.producer]
        if any(self.producer[t] in self.ran for t in wanted):
            return None
        given = {name: onnx.helper.np_dtype_to_tensor_dtype(values[0].dtype) for name, values in self.held.items()}
        part = computing(self.model, wanted, given)
        running = {self.producer[o] for node in part.graph.node for o in node.output if o}
        self.ran |= running
        later = [o for index in sorted(running) for o in self.model.graph.node[index].output
                 if o and o not in targets and self.readers.get(o, set()) - self.ran]
        part.graph.output.extend(onnx.ValueInfoProto(name=name) for name in later)
        workers = _side_by_side(part, self.samples, self.threads)  # (a part is often a few small ops)
        session = ort_session(part, threads=1 if workers > 1 else self.threads) if part.graph.node else None
        fed = [i.name for i in session.get_inputs()] if session is not None else []
        feeds = [{name: self.held[name][index] if name in self.held else sample[name] for name in fed}
                 for index, sample in enumerate(self.samples)]
        for result in session_outputs(session, feeds, workers) if session is not None else []:
            for name, value in result.items():
                if not isinstance(value, np.ndarray):
                    return None
                self.held.setdefault(name, []).append(value)
        values = [{name: self.held[name][index] if name in self.held else sample[name] for name in targets
                   if name in self.held or name in sample} for index, sample in enumerate(self.samples)]
        self.held = {name: held for name, held in self.held.items() if self.readers.get(name, set()) - self.ran}
        return values

    def held_bytes(self) -> int:
        return sum(value.nbytes for values in self.held.values() for value in values)

    def add(self, name: str, delta: np.ndarray, axis: int) -> None:
        """`delta` (one value per slice along `axis`) added to the held tensor `name` in every sample: what the
        parts after this read."""
        if name in self.held:
            self.held[name] = [(value + _along(delta, axis, value.ndim)).astype(value.dtype)
                               for value in self.held[name]]


def _along(vector: np.ndarray, axis: int, rank: int) -> np.ndarray:
    shape = [1] * rank
    shape[axis % rank] = -1
    return vector.reshape(shape)


def ort_session(model: "onnx.ModelProto | SessionRecipe", threads: int = 2, optimize: bool | str = False,
                extra_outputs=(), log_severity: int = 3):
    """An ONNX Runtime CPU session for an in-memory model (or a SessionRecipe made from one).

    `optimize=False` runs the graph exactly as written (ORT_DISABLE_ALL): verification compares what qprep
    wrote, not what ORT would have fused; "basic" (ORT_ENABLE_BASIC: constant folding, Conv+BatchNorm-like
    folds, none of the LayerNorm/GELU/attention fusions) stands for a runtime that does not rewrite the graph
    itself when the latency is timed. `extra_outputs` exposes intermediate tensors by name. `log_severity` 4
    also hides ORT's error lines (for a probe whose failure is expected and reported by the caller).
    """
    import onnxruntime as ort

    recipe = model if isinstance(model, SessionRecipe) else SessionRecipe(model, extra_outputs)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = log_severity
    options.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_BASIC if optimize == "basic"
        else ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    names, values = recipe.take_weights()
    if names:  # ORT reads them while it builds the session and keeps a copy (tests/test_third_party.py)
        options.add_external_initializers(names, values)
    session = ort.InferenceSession(recipe.graph, options, providers=["CPUExecutionProvider"])
    del values  # only now that ORT has its copy: the options keep no reference to them
    return session


class SessionRecipe:
    """What ORT needs to build one session of a model, without the model: the serialized graph and, for a heavy
    model (io.is_heavy), its big weights as arrays that ORT takes from memory. Over 2 GB the proto cannot be
    serialized (a temp file per session instead costs seconds), below it serializing costs seconds per big model,
    and exposing intermediate tensors copied every weight once more (BENCHMARKS.md: "a heavy model's weights never
    serialized").

    Made before a proto's last use, it lets the proto go before the session is built: the weights then exist
    twice while ORT copies them, not three times (BENCHMARKS.md: "a heavy model's proto let go before its
    session")."""

    def __init__(self, model: onnx.ModelProto, extra_outputs=(), only: bool = False):
        """`only`: the session computes `extra_outputs` alone (io.computing), not the model's outputs."""
        graph, weights = weightless(model) if is_heavy(model) else (model, [])
        part = computing(graph, list(extra_outputs)) if only and extra_outputs else None
        if part is not None:
            kept = {t.name for t in part.graph.initializer}
            graph, weights, extra_outputs = part, [t for t in weights if t.name in kept], ()
        if extra_outputs:
            graph = copy.deepcopy(graph) if graph is model else graph
            present = {o.name for o in graph.graph.output}
            for name in extra_outputs:
                if name not in present:
                    graph.graph.output.append(onnx.ValueInfoProto(name=name))
        self.graph = graph.SerializeToString()
        self._weights: tuple[list[str], list] | None = ([t.name for t in weights], [_ort_value(t) for t in weights])

    def take_weights(self) -> tuple[list[str], list]:
        """The weights, handed over once: the recipe keeps none, so they are freed with the session's options."""
        if self._weights is None:
            raise RuntimeError("a SessionRecipe builds one session: its weights were handed over already")
        weights, self._weights = self._weights, None
        return weights


def _ort_value(tensor: onnx.TensorProto):
    import onnxruntime as ort

    return ort.OrtValue.ortvalue_from_numpy(numpy_helper.to_array(tensor))
