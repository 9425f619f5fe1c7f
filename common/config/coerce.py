"""Reading the schema and typing raw values by it: field docstrings (`field_docs`), the type at a dotted
key path, and the coercion of TOML values and override text (`parse_value`) with errors that name the
full key path and, for an unknown key, the close one. `ConfigError` is every config error.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import difflib
import functools
import inspect
import textwrap
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal

ENV_PREFIX = "SLIPSTREAM__"
"""Environment variables `SLIPSTREAM__a__b=v` override key a.b (load.py; validation.py reads a role's own)."""


class ConfigError(ValueError):
    """A config value is unknown, mistyped or inconsistent; the message names the key and the fix."""


def require(ok: bool, message: str) -> None:
    """A section's check: ConfigError(message) unless ok; the message names the key and the fix."""
    if not ok:
        raise ConfigError(message)


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Docstrings of a dataclass's fields: the string literal right below each annotated field."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in typing.get_args(tp))}]"
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "none"
    return getattr(tp, "__name__", str(tp))


def _suggest(key: str, options: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, list(options), n=1, cutoff=0.5)
    if close:
        return f"did you mean '{close[0]}'?"
    return f"valid keys: {', '.join(options)}"


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Check a TOML value against a schema type and return the typed value."""
    origin = typing.get_origin(tp)
    if _is_dataclass_type(tp):
        if isinstance(value, tp):  # a --set list of tables, typed (and checked) when the override was parsed
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a table ([{path}]), got {type(value).__name__} {value!r}")
        return _build(tp, value, path)
    if origin is Literal:
        options = typing.get_args(tp)
        if value not in options:
            raise ConfigError(f"{path}: {value!r} is not one of {', '.join(repr(o) for o in options)}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list ({_type_name(tp)}), got {value!r}")
        (item_tp,) = typing.get_args(tp)
        return [_coerce(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a table ({_type_name(tp)}), got {value!r}")
        _, val_tp = typing.get_args(tp)
        return {str(k): _coerce(v, val_tp, f"{path}.{k}") for k, v in value.items()}
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            with contextlib.suppress(ConfigError):  # try the next alternative; the error below names them all
                return _coerce(value, arg, path)
        raise ConfigError(f"{path}: {value!r} matches none of {_type_name(tp)}")
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f'{path}: expected a string (quote it: "{value}"), got {value!r}')
        return value
    raise TypeError(f"{path}: unsupported schema type {tp!r}")


def _build(cls: type, data: Mapping[str, Any], path: str) -> Any:
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        full = f"{path}.{key}" if path else key
        if key not in hints:
            raise ConfigError(f"unknown key '{full}': {_suggest(key, names)}")
        kwargs[key] = _coerce(value, hints[key], full)
    return cls(**kwargs)


def _schema_type(root: type, path: Sequence[str]) -> Any:
    """The schema type at a dotted key path below `root` (dict keys included), or ConfigError naming the path."""
    tp: Any = root
    walked: list[str] = []
    for part in path:
        walked.append(part)
        if _is_dataclass_type(tp):
            hints = _hints(tp)
            if part not in hints:
                names = [f.name for f in dataclasses.fields(tp)]
                raise ConfigError(f"unknown key '{'.'.join(walked)}': {_suggest(part, names)}")
            tp = hints[part]
        elif typing.get_origin(tp) is dict:
            tp = typing.get_args(tp)[1]
        else:
            raise ConfigError(f"'{'.'.join(walked[:-1])}' is a {_type_name(tp)}, it has no key '{part}'")
    return tp


def parse_value(raw: str, tp: Any, path: str) -> Any:
    """Parse an override's text by the schema type of its key."""
    origin = typing.get_origin(tp)
    if tp is str or (origin is Literal and all(isinstance(a, str) for a in typing.get_args(tp))):
        text = raw
        if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "\"'":
            text = raw[1:-1]
        return _coerce(text, tp, path)
    if tp is bool:
        lowered = raw.strip().lower()
        if lowered in ("true", "1", "yes", "on"):
            return True
        if lowered in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{path}: expected true or false, got {raw!r}")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        raise ConfigError(f"{path}: cannot read {raw!r} as {_type_name(tp)}") from None
    return _coerce(value, tp, path)
