"""Walking a config tree: its leaves with their docstrings and identity marks (`leaves`), the TOML it is
written as (`render` with docs for `slipstream show`, `to_toml` to read back), the diff of two configs and
the identity fingerprint that checkpoints store.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from common.config.coerce import field_docs
from common.config.schema import Config


@dataclass(frozen=True)
class Leaf:
    path: str
    value: Any
    doc: str
    identity: bool
    fingerprinted: bool = False
    """Part of the identity fingerprint: an identity field, unless an `added` one still at its default."""


def _sections(value: Any) -> list[tuple[str, Any]]:
    """The sections a field's value is, with the suffix of their key path: the value itself if it is a section
    (""), each entry of a non-empty dict of sections (launch.roles: ".<name>"), none if it is a plain value."""
    if dataclasses.is_dataclass(value):
        return [("", value)]
    if isinstance(value, dict) and value and all(dataclasses.is_dataclass(v) for v in value.values()):
        return [(f".{key}", sub) for key, sub in value.items()]
    return []


def leaves(obj: Any, prefix: str = "") -> Iterator[Leaf]:
    """Every scalar/list field of a config tree in declaration order, with its docstring."""
    cls: type = type(obj)
    docs = field_docs(cls)
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        path = f"{prefix}{f.name}"
        sections = _sections(value)
        for suffix, sub in sections:
            yield from leaves(sub, f"{path}{suffix}.")
        if not sections:
            ident = bool(f.metadata.get("identity"))
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            fingerprinted = ident and not (f.metadata.get("added") and value == default)
            yield Leaf(path, value, docs.get(f.name, ""), ident, fingerprinted)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml_value(v)}" for k, v in value.items()) + "}"
    if dataclasses.is_dataclass(value):  # an item of a list of tables (trainer.data.sources), inline
        items = (f"{f.name} = {_toml_value(getattr(value, f.name))}" for f in dataclasses.fields(value))
        return "{" + ", ".join(items) + "}"
    raise TypeError(f"cannot write {value!r} as TOML")


def _tables(obj: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    yield prefix, obj
    for f in dataclasses.fields(obj):
        for suffix, sub in _sections(getattr(obj, f.name)):
            yield from _tables(sub, f"{prefix}.{f.name}{suffix}" if prefix else f"{f.name}{suffix}")


def render(cfg: Config, with_docs: bool = True) -> str:
    """The resolved config as TOML; with docs, every field is preceded by its docstring."""
    lines: list[str] = []
    for table, obj in _tables(cfg, ""):
        scalars = [f for f in dataclasses.fields(obj) if not _sections(getattr(obj, f.name))]
        if not table or not scalars:
            continue
        lines.append(f"[{table}]")
        cls: type = type(obj)
        docs = field_docs(cls)
        for f in scalars:
            if with_docs:
                mark = " (identity)" if f.metadata.get("identity") else ""
                lines.append(f"# {docs.get(f.name, '')}{mark}")
            lines.append(f"{f.name} = {_toml_value(getattr(obj, f.name))}")
        lines.append("")
    return "\n".join(lines)


def diff(a: Config, b: Config) -> list[tuple[str, Any, Any]]:
    """(path, value in a, value in b) for every leaf that differs; entries only in one side included."""
    left = {leaf.path: leaf.value for leaf in leaves(a)}
    right = {leaf.path: leaf.value for leaf in leaves(b)}
    missing = object()
    out = []
    for path in list(left) + [p for p in right if p not in left]:
        va, vb = left.get(path, missing), right.get(path, missing)
        if va != vb:
            out.append((path, None if va is missing else va, None if vb is missing else vb))
    return out


def identity_diff(a: Config, b: Config) -> list[str]:
    """Paths of identity fields that differ: a non-empty list means b is a different run than a."""
    ident = {leaf.path for leaf in leaves(a) if leaf.identity}
    return [path for path, _, _ in diff(a, b) if path in ident]


def identity_fingerprint(cfg: Config) -> str:
    """Short hash of the identity fields, stored with checkpoints (`added` fields at their default left out)."""
    blob = json.dumps(
        [(leaf.path, leaf.value) for leaf in leaves(cfg) if leaf.fingerprinted], default=dataclasses.asdict
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def to_toml(cfg: Config) -> str:
    """The full config as TOML text that `load_config` reads back to an equal config."""
    return render(cfg, with_docs=False)
