#!/usr/bin/env python3
"""The shape of the package, checked: what keeps qprep a house a newcomer can carry on.

Fails (exit 1, one line per finding) on
  - an import circle between qprep modules (imports under `if TYPE_CHECKING:` and inside functions count:
    a circle hidden in a function is still two modules that need each other);
  - an import against the declared layer order (`LAYERS`, bottom up: a module imports its own layer or below);
  - a qprep file over 550 lines, a function over 90 lines;
  - a private name (`_x`) imported from another package of qprep, or by a test;
  - "session N" in the product's text (qprep/, README.md, docs/, BENCHMARKS.md): code says why, git says when.

Usage: python scripts/check_shape.py [ROOT]   (ROOT defaults to this checkout)
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

MAX_FILE_LINES = 550
MAX_FUNCTION_LINES = 90

# Bottom up. A module belongs to the layer of the longest prefix that names it; it may import its own layer and
# the ones below. The stages follow the run's flow: a stage may use what an earlier stage's rewrites do to the
# graph it is handed (quantize re-applies qdq's pair removal to what ONNX Runtime writes), never a later one's.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("qprep.version", "qprep.errors", "qprep.progress", "qprep.jsonfile", "qprep.memory",
              "qprep.third_party", "qprep.schema", "qprep.yaml_reader", "qprep.disk", "qprep.stage_registry",
              "qprep.run_log")),
    ("graph library", ("qprep.graph", "qprep.model")),
    ("samples and measures", ("qprep.data", "qprep.measure")),
    ("config", ("qprep.config",)),
    ("stage contract", ("qprep.contract",)),
    ("stage: optimize", ("qprep.optimize",)),
    ("stage: qdq", ("qprep.qdq",)),
    ("stage: keep_float", ("qprep.keep_float",)),
    ("stage: quantize", ("qprep.quantize",)),
    ("evaluate", ("qprep.evaluate",)),
    ("report", ("qprep.report",)),
    ("pipeline", ("qprep.pipeline",)),
    ("commands", ("qprep.cli", "qprep.starter", "qprep.completion", "qprep.inspection", "qprep.__main__", "qprep")),
]

SESSION = re.compile(r"\bsessions? \d+", re.IGNORECASE)
PRODUCT_TEXT = ("README.md", "BENCHMARKS.md", "docs")


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    package: str  # the dotted package the module lives in


def modules(root: Path) -> dict[str, Module]:
    found = {}
    for path in sorted((root / "qprep").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
            package = ".".join(parts)
        else:
            package = ".".join(parts[:-1])
        found[".".join(parts)] = Module(".".join(parts), path, package)
    return found


def imports(tree: ast.AST, package: str, known: dict) -> list[tuple[str, str, int]]:
    """(imported module, imported name or '', line) for every qprep import in the tree, wherever it stands."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target != "qprep" and not target.startswith("qprep."):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.append((sub, "", node.lineno) if sub in known else (target, alias.name, node.lineno))
        elif isinstance(node, ast.Import):
            found += [(a.name, "", node.lineno) for a in node.names if a.name.split(".")[0] == "qprep"]
    return found


def layer_of(name: str) -> int:
    best, index = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            inside = name.startswith(prefix + ".") and prefix != "qprep"  # the package's face names itself alone
            if (name == prefix or inside) and len(prefix) > best:
                best, index = len(prefix), i
    return index


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def long_functions(tree: ast.AST) -> list[tuple[str, int, int]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append((node.name, node.lineno, length))
    return found


def check(root: Path) -> list[str]:
    root = root.resolve()
    known = modules(root)
    findings: list[str] = []
    edges: dict[str, set[str]] = {}
    for name, module in known.items():
        text = module.path.read_text()
        rel = module.path.relative_to(root)
        lines = text.count("\n")
        if lines > MAX_FILE_LINES:
            findings.append(f"{rel}: {lines} lines (at most {MAX_FILE_LINES}): split it along its seams")
        tree = ast.parse(text)
        for func, line, length in long_functions(tree):
            findings.append(f"{rel}:{line}: function {func} has {length} lines (at most {MAX_FUNCTION_LINES})")
        if layer_of(name) < 0:
            findings.append(f"{rel}: module {name} is in no layer of scripts/check_shape.py's LAYERS")
        for target, imported, line in imports(tree, module.package, known):
            owner = target if target in known else None
            if owner is None:
                findings.append(f"{rel}:{line}: imports {target}, which is no qprep module")
                continue
            if owner != name:
                edges.setdefault(name, set()).add(owner)
            if layer_of(owner) > layer_of(name):
                findings.append(f"{rel}:{line}: {name} ({LAYERS[layer_of(name)][0]}) imports {owner} "
                                f"({LAYERS[layer_of(owner)][0]}), a layer above it")
            if imported.startswith("_") and not imported.startswith("__") \
                    and known[owner].package != module.package:
                findings.append(f"{rel}:{line}: imports the private name {imported} from {owner}, another package")
    for group in circles(edges):
        findings.append("import circle: " + " -> ".join(group + group[:1]))
    findings += private_names_in_tests(root, known)
    findings += session_mentions(root)
    return findings


def private_names_in_tests(root: Path, known: dict) -> list[str]:
    found = []
    tests = root / "tests"
    for path in sorted(tests.rglob("*.py")) if tests.is_dir() else []:
        tree = ast.parse(path.read_text())
        for target, imported, line in imports(tree, "tests", known):
            if imported.startswith("_") and not imported.startswith("__"):
                found.append(f"{path.relative_to(root)}:{line}: a test imports the private name {imported} "
                             f"from {target}: test what the module offers, or make the name public")
    return found


def session_mentions(root: Path) -> list[str]:
    found = []
    paths = sorted((root / "qprep").rglob("*.py"))
    for entry in PRODUCT_TEXT:
        place = root / entry
        paths += sorted(place.rglob("*.md")) if place.is_dir() else ([place] if place.exists() else [])
    for path in paths:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            hit = SESSION.search(line)
            if hit:
                found.append(f"{path.relative_to(root)}:{number}: '{hit.group(0)}': say why, not when "
                             f"(the history is git's)")
    return found


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent.parent
    findings = check(root)
    for finding in findings:
        print(finding)
    print(f"{len(findings)} finding(s)" if findings else "the shape holds", file=sys.stderr)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
