"""The one YAML reader: configs, overlays, batch sidecars and `--set` values are all parsed here.

Why one reader with limits: PyYAML composes nested collections recursively (5,000 `[` crash it with a
RecursionError, exit 3) and expands aliases when it builds Python objects, so a 1 kB file of ten aliases of ten
(`a1: &a1 [*a0, *a0, …]`) becomes 10^10 values that hang a run at gigabytes of memory. Both are refused in one
line before any object is built: the nesting while composing, the expanded size counted on the composed nodes
(each shared node once, memoized), and an alias inside the very node it names.
"""

from __future__ import annotations

from typing import IO, Any

import yaml

MAX_DEPTH = 64  # a config is a few levels deep (quantize.ort.extra_options is the deepest, at 4)
MAX_VALUES = 100_000  # every scalar, list and mapping once expanded; a long node list is a few thousand
Seen = dict[int, tuple[int, int]]  # id of a composed node → (its expanded size, its height)


class YamlLimit(Exception):
    """The YAML is deeper or expands larger than any config: what is wrong, where (`line` is 1-based or None)."""

    def __init__(self, problem: str, mark=None):
        super().__init__(problem)
        self.problem = problem
        self.line = mark.line + 1 if mark is not None else None

    def where(self) -> str:
        return f" (line {self.line})" if self.line else ""


class DuplicateKey(yaml.constructor.ConstructorError):
    """A key given twice in one mapping (UniqueKeyLoader)."""


class UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader (no Python tags), but a key given twice in one mapping is an error: plain PyYAML
    keeps the later value silently, so a forgotten earlier line would quietly stop applying. Nesting deeper
    than MAX_DEPTH is refused while composing, before Python's recursion limit is reached."""

    def __init__(self, stream):
        super().__init__(stream)
        self.depth = 0

    def compose_node(self, parent, index):
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                raise YamlLimit(f"nested deeper than {MAX_DEPTH} levels; a config is a few levels deep",
                                self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<:` merges may be overridden by design; complex keys are refused elsewhere
                key = self.construct_object(key_node)
                if key in seen:
                    raise DuplicateKey(
                        None, None, f"duplicate key '{key}' (first on line {seen[key].line + 1}); keep one of them",
                        key_node.start_mark)
                seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def load_yaml(stream: str | IO) -> Any:
    """The YAML document as Python objects (None when empty). Raises yaml.YAMLError for text that is no YAML,
    DuplicateKey (a YAMLError too) and YamlLimit for nesting or alias expansion beyond any config."""
    loader = UniqueKeyLoader(stream)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _expanded_size(node, {}, set(), 1)
        return loader.construct_document(node)
    except RecursionError:  # a limit above should come first; whatever recursed, it is the nesting
        raise YamlLimit("nested too deep to read") from None
    finally:
        loader.dispose()


def _expanded_size(node: yaml.Node, seen: Seen, open_nodes: set[int], depth: int) -> tuple[int, int]:
    """(how many values `node` becomes once its aliases are expanded, how many levels deep). A node shared by
    aliases is counted once and its figures reused (`seen`), so a bomb costs as many steps as it has nodes."""
    key = id(node)
    if key in open_nodes:
        raise YamlLimit("an alias refers to the collection it is in (the value would contain itself)",
                        node.start_mark)
    size, height = seen.get(key) or _count(node, seen, open_nodes, depth)
    if depth + height - 1 > MAX_DEPTH:
        raise YamlLimit(f"its aliases nest deeper than {MAX_DEPTH} levels; a config is a few levels deep",
                        node.start_mark)
    return size, height


def _count(node: yaml.Node, seen: Seen, open_nodes: set[int], depth: int) -> tuple[int, int]:
    if depth > MAX_DEPTH:
        raise YamlLimit(f"its aliases nest deeper than {MAX_DEPTH} levels; a config is a few levels deep",
                        node.start_mark)
    open_nodes.add(id(node))
    children = [] if isinstance(node, yaml.ScalarNode) else \
        [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else node.value
    size, height = 1, 1
    for child in children:
        child_size, child_height = _expanded_size(child, seen, open_nodes, depth + 1)
        size, height = size + child_size, max(height, child_height + 1)
        if size > MAX_VALUES:
            raise YamlLimit(f"its aliases expand to more than {MAX_VALUES:,} values; no config is that large: "
                            "write the values out or use fewer aliases", node.start_mark)
    open_nodes.discard(id(node))
    seen[id(node)] = (size, height)
    return size, height
