"""ONNX node names → the RKNN IR tensor names that hybrid quantization accepts, and the cfg edit.

rknn-toolkit2 renames what it rewrites. Observed on 2.5.0 (`<model>.model` is the IR as an ONNX protobuf):
a surviving tensor keeps its ONNX name; rewrites append chained suffixes (`-rs`/`_rs` reshape, `_tp`
transpose, `_sw` moved, `_mm` MatMul as conv, `_2ln` a decomposed LayerNorm fused into exNorm and named after
its first ReduceMean, `_2sp`/`_2sdpa`/`_sdpa` split/attention, `#1` a re-created node, `_i1`, `_split`,
`_int8`, `__float16`); weights keep their names. So: strip the suffix chain and compare whole names (never
prefixes: `p2o.Add.23` is not `p2o.Add.235`), then keep only names step2 takes — listed under
`quantize_parameters:` in the cfg *and* produced by an IR node (weights and the graph input are listed too,
but rejected with "Invalid operands name").
"""

from __future__ import annotations

import re

import onnx

_SUFFIXES = re.compile(r"((?:_tp|-rs|_rs|_sw|_mm|_2ln|_2sp|_2sdpa|_sdpa|#\d+|_int8|__float16|_i\d+|_split)+)$")
CFG_KEY = re.compile(r"^    (?! )'?(.+?)'?:\s*$")  # a tensor under quantize_parameters


def base_name(name: str) -> str:
    return _SUFFIXES.sub("", name)


def cfg_tensor_names(cfg_text: str) -> set[str]:
    """Top-level keys under `quantize_parameters:` (4-space indent)."""
    _, sep, block = cfg_text.partition("\nquantize_parameters:\n")
    return {m.group(1) for line in block.splitlines() if (m := CFG_KEY.match(line))} if sep else set()


class IRNames:
    def __init__(self, ir_model_path: str, cfg_text: str, renames: dict[str, str] | None = None):
        """`renames`: the graph input/output names the toolkit was given instead of the model's (io_names.py)."""
        ir = onnx.load(ir_model_path, load_external_data=False)
        original = {new: old for old, new in (renames or {}).items()}
        self.listed = cfg_tensor_names(cfg_text)
        self.produced = {o for n in ir.graph.node for o in n.output}
        weights = {t.name for t in ir.graph.initializer}
        self.outputs_by_node_base: dict[str, list[str]] = {}
        self.tensors_by_base: dict[str, list[str]] = {}
        self.outputs_by_weight: dict[str, list[str]] = {}
        self.graph_outputs = {original.get(o.name, o.name) for o in ir.graph.output}
        for node in ir.graph.node:
            self.outputs_by_node_base.setdefault(base_name(node.name), []).extend(node.output)
            for out in node.output:
                base = base_name(out)
                self.tensors_by_base.setdefault(original.get(base, base), []).append(out)
            for name in node.input:
                if name in weights:
                    self.outputs_by_weight.setdefault(name, []).extend(node.output)

    def accepted(self, name: str) -> bool:
        return name in self.listed and name in self.produced

    def map_node(self, node: onnx.NodeProto) -> tuple[list[str], str]:
        """IR tensors for one ONNX node and the rule that found them ('' when none did)."""
        rules = (("node name", self.outputs_by_node_base.get(node.name, [])),
                 ("output name", [t for out in node.output for t in self.tensors_by_base.get(out, [])]),
                 ("weight", [t for w in node.input for t in self.outputs_by_weight.get(w, [])]))
        for rule, candidates in rules:
            found = list(dict.fromkeys(t for t in candidates if self.accepted(t)))
            if found:
                return found + self._output_copies(node, found), rule
        return [], ""

    def _output_copies(self, node: onnx.NodeProto, found: list[str]) -> list[str]:
        """The toolkit's copies of a graph output `node` computes (`logits_int8`, its reshape, and `logits`, the
        convert after it): step1 re-quantizes a model's outputs to int8 "for performance" after their float16
        layer, which puts EfficientNet-Lite0's logits on a 0.0625 grid and ties its near top-2s (the top-1s it
        changed on held-out samples were such ties); with them float16 its cosine is higher too."""
        copies = [t for out in node.output if out in self.graph_outputs
                  for t in self.tensors_by_base.get(out, []) if self.accepted(t)]
        return [t for t in dict.fromkeys(copies) if t not in found]


def map_float_set(model: onnx.ModelProto, node_names: list[str], ir: IRNames) -> tuple[dict, list[str]]:
    """{onnx node: {"tensors": [...], "rule": ...}} and the node names that map to nothing."""
    nodes = {n.name: n for n in model.graph.node}
    mapping, unmapped = {}, []
    for name in node_names:
        tensors, rule = ir.map_node(nodes[name]) if name in nodes else ([], "")
        if tensors:
            mapping[name] = {"tensors": tensors, "rule": rule}
        else:
            unmapped.append(name)
    return mapping, unmapped


def with_custom_layers(cfg_text: str, tensors: list[str], dtype: str = "float16") -> str:
    """Replace only the `custom_quantize_layers` block: rewriting the whole YAML through a dumper changes the
    scales' text, which step2 then rejects."""
    head, sep, rest = cfg_text.partition("\nquantize_parameters:\n")
    if not sep or not head.lstrip().startswith("custom_quantize_layers:"):
        raise ValueError("unexpected .quantization.cfg layout (no custom_quantize_layers/quantize_parameters)")
    if not tensors:
        return "custom_quantize_layers: {}" + sep + rest
    lines = "".join(f"    '{t}': {dtype}\n" for t in tensors)
    return ("custom_quantize_layers:\n" + lines).rstrip("\n") + sep + rest


_ANALYSIS_ROW = re.compile(r"^\[(?P<op>[^\]]+)\]\s+(?P<name>\S+)\s*(?P<rest>.*)$")
_NUMBER = re.compile(r"-?\d+\.\d{5}")


def parse_error_analysis(text: str) -> list[dict]:
    """accuracy_analysis's error_analysis.txt → rows. Numbers have 5 decimals and a wide euclidean can run
    into the next column, so they are tokenized by pattern, not whitespace; fused layers have none."""
    rows = []
    for line in text.splitlines():
        match = _ANALYSIS_ROW.match(line.strip())
        if not match:
            continue
        numbers = [float(x) for x in _NUMBER.findall(match.group("rest"))]
        row = {"op_type": match.group("op"), "tensor": match.group("name")}
        if len(numbers) >= 4:
            row.update(entire_cosine=numbers[0], entire_euclidean=numbers[1], single_cosine=numbers[2],
                       single_euclidean=numbers[3])
        rows.append(row)
    return rows
