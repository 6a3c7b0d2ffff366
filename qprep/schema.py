"""A small declarative schema for YAML configs: types, defaults, choices, docs, and did-you-mean errors.

Why not jsonschema/pydantic: the messages users need ("pipeline[2].quantize.algoritm: unknown key; did you
mean 'algorithm'?") and path resolution against the config file are easier to get right in 150 lines than to
coax out of a framework, and the same tree renders the key reference (`qprep config --schema`).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qprep.errors import ConfigError

_TYPE_NAMES = {"str": "a string", "int": "an integer", "float": "a number", "bool": "true or false",
               "path": "a file or folder path", "list": "a list", "mapping": "a mapping", "section": "a mapping",
               "any": "any value"}


@dataclass
class Key:
    """One config key. `kind` is one of str, int, float, bool, path, list, mapping, section, any."""

    kind: str
    doc: str = ""
    default: Any = None
    required: bool = False
    choices: tuple = ()
    minimum: float | None = None
    maximum: float | None = None  # a share (0..1) written as a percent is refused, not read as 50x
    fields: dict[str, "Key"] = field(default_factory=dict)  # section: its keys
    item: "Key | None" = None  # list: each item; mapping: each value
    nullable: bool = False


def section(doc: str = "", required: bool = False, nullable: bool = False, **fields: Key) -> Key:
    """A mapping of known keys. `nullable`: when absent it stays None instead of being filled with defaults."""
    return Key("section", doc=doc, required=required, nullable=nullable, fields=fields)


def closest(name: str, options) -> str | None:
    match = difflib.get_close_matches(name, list(options), n=1, cutoff=0.6)
    return match[0] if match else None


def unknown_key_message(path: str, name: str, options) -> str:
    where = f"{path}.{name}" if path else name
    guess = closest(name, options)
    hint = f"did you mean '{guess}'?" if guess else f"valid keys: {', '.join(sorted(options)) or '(none)'}"
    return f"{where}: unknown key; {hint}"


def validate(value: Any, key: Key, path: str, base_dir: Path) -> Any:
    """Check `value` against `key`, fill defaults, resolve paths; returns the normalized value."""
    where = path or "config"
    if value is None:
        if key.required:
            raise ConfigError(f"{where}: required key is missing{_doc_hint(key)}")
        if key.kind != "section" or key.nullable:
            return copy.deepcopy(key.default)
        value = {}
    kind = key.kind
    if kind == "section":
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping of keys, got {_describe(value)}")
        out = {}
        for name in value:
            if name not in key.fields:
                raise ConfigError(unknown_key_message(path, str(name), key.fields))
        for name, sub in key.fields.items():
            sub_path = f"{path}.{name}" if path else name
            if name not in value and sub.required:
                raise ConfigError(f"{sub_path}: required key is missing{_doc_hint(sub)}")
            out[name] = validate(value.get(name), sub, sub_path, base_dir)
        return out
    if kind == "list":
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {_describe(value)}")
        return [validate(v, key.item, f"{path}[{i}]", base_dir) for i, v in enumerate(value)] if key.item else value
    if kind == "mapping":
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {_describe(value)}")
        if key.item is None:
            return dict(value)
        return {str(k): validate(v, key.item, f"{path}.{k}", base_dir) for k, v in value.items()}
    return _scalar(value, key, where, base_dir)


def _scalar(value: Any, key: Key, where: str, base_dir: Path) -> Any:
    kind = key.kind
    if kind == "any":
        return value
    if kind == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {_describe(value)}")
        return value
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {_describe(value)}")
    elif kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {_describe(value)}")
        try:
            value = float(value)
        except OverflowError:  # an integer beyond every float
            value = math.inf
        if not math.isfinite(value):  # a NaN compares false both ways: a gate at NaN judges nothing. No key takes inf
            raise ConfigError(f"{where}: expected a finite number, got {value}; set a number (NaN and infinity "
                              "are not allowed)")
    elif kind in ("str", "path"):
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected {_TYPE_NAMES[kind]}, got {str(value).lower()}; "
                              f"{_quote_hint(value, key)}")
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{where}: expected {_TYPE_NAMES[kind]}, got {_describe(value)}")
    if key.choices and value not in key.choices:
        guess = closest(str(value), [str(c) for c in key.choices])
        hint = f"did you mean '{guess}'? " if guess else ""
        raise ConfigError(f"{where}: {value!r} is not allowed; {hint}choose one of: {', '.join(map(str, key.choices))}")
    if key.minimum is not None and value < key.minimum:
        raise ConfigError(f"{where}: {value} is below the minimum {key.minimum}")
    if key.maximum is not None and value > key.maximum:
        raise ConfigError(f"{where}: {value} is above the maximum {key.maximum}")
    if kind == "path":
        return os.path.realpath(base_dir / Path(value).expanduser())  # Path.resolve raises on a symlink loop
    return value


# What YAML 1.1 (PyYAML) reads as a bool when unquoted: a string key given one of them gets a bool.
_YAML_BOOLS = {True: ("on", "yes", "true"), False: ("off", "no", "false")}


def _quote_hint(value: bool, key: Key) -> str:
    """Why a string key got a bool (YAML reads an unquoted off/on/yes/no as one) and how to write the string:
    the choice meant, when the key has one spelt so."""
    spellings = _YAML_BOOLS[value]
    meant = next((str(c) for c in key.choices if str(c).lower() in spellings), None)
    if meant:
        return f"write '{meant}' in quotes (\"'{meant}'\" in a --set): YAML reads {meant} as {str(value).lower()}"
    return (f"write the word in quotes ('{spellings[1]}', or \"'{spellings[1]}'\" in a --set): YAML reads unquoted "
            f"{', '.join(spellings[:-1])} and {spellings[-1]} as {str(value).lower()}")


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return f"{type(value).__name__} {value!r}"


def _doc_hint(key: Key) -> str:
    return f" ({key.doc})" if key.doc else ""


Settings = Any  # a section's values as schema.settings makes them: one frozen type per section, made at run time


def settings(key: Key, values: dict | None, name: str = "settings") -> Settings:
    """A validated section (`validate`'s output: every key present) as a frozen object of its keys
    (`settings(OPTIONS, options).do_quantization`): the one declaration, the schema, gives the type; a misspelt
    key fails where it is read with the section's keys named, not as a KeyError files later; nothing is written
    back (a reader that needs another value makes its own copy: `dataclasses.replace`). Nested sections are
    settings too; lists and mappings are copied. A nullable section that is absent stays None."""
    if values is None:
        return None
    made = _settings_type(key, name)
    return made(**{field_name: settings(sub, values[field_name], field_name) if sub.kind == "section"
                   else copy.deepcopy(values[field_name]) for field_name, sub in key.fields.items()})


_SETTINGS_TYPES: dict[int, type] = {}


def _settings_type(key: Key, name: str) -> type:
    made = _SETTINGS_TYPES.get(id(key))
    if made is None:
        title = "".join(part.capitalize() for part in name.split("_")) + "Settings"
        made = dataclasses.make_dataclass(title, [(field_name, Any) for field_name in key.fields], frozen=True)
        made.__getattr__ = _unknown_setting  # only called for names the section does not have
        made.as_dict = dataclasses.asdict
        _SETTINGS_TYPES[id(key)] = made
    return made


def _unknown_setting(self, name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    raise AttributeError(unknown_key_message(type(self).__name__, name, [f.name for f in dataclasses.fields(self)]))


def reference(key: Key, path: str = "", lines: list[str] | None = None) -> list[str]:
    """Markdown-ish reference of every key: path, type, default, choices, doc."""
    lines = [] if lines is None else lines
    for name, sub in key.fields.items():
        sub_path = f"{path}.{name}" if path else name
        kind = sub.kind if sub.kind != "section" else "mapping"
        details = [kind]
        if sub.required:
            details.append("required")
        elif sub.default is not None and sub.kind != "section":
            details.append(f"default {sub.default!r}")
        if sub.choices:
            details.append("one of " + "|".join(map(str, sub.choices)))
        lines.append(f"{sub_path}  ({', '.join(details)})  {sub.doc}".rstrip())
        if sub.kind == "section":
            reference(sub, sub_path, lines)
    return lines
