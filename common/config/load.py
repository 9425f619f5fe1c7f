"""Loading: a TOML file, then `SLIPSTREAM__a__b=v` environment overrides, then `--set a.b=v` overrides,
each typed by the schema, become a validated `Config`.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from common.config.coerce import ENV_PREFIX, ConfigError, _build, _is_dataclass_type, _schema_type, parse_value
from common.config.schema import Config
from common.config.validation import validate


def _set_path(data: dict[str, Any], path: Sequence[str], value: Any) -> None:
    node = data
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"'{part}' is not a table; cannot set '{'.'.join(path)}'")
        node = child
    node[path[-1]] = value


def apply_override(data: dict[str, Any], assignment: str, source: str) -> None:
    """Apply one `a.b.c=value` override to raw config data, typed by the schema."""
    key, sep, raw = assignment.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"{source}: expected KEY=VALUE, for example trainer.optim.lr=3e-4")
    parts = key.split(".")
    try:
        tp = _schema_type(Config, parts)
        if _is_dataclass_type(tp):
            raise ConfigError(f"{key}: is a section; set one of its keys, e.g. {key}.<field>=...")
        _set_path(data, parts, parse_value(raw.strip(), tp, key))
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def env_overrides(environ: Mapping[str, str]) -> list[tuple[str, str]]:
    """(variable, `a.b=v`) for every `SLIPSTREAM__a__b=v` environment variable, sorted for determinism."""
    out = []
    for name in sorted(environ):
        if name.startswith(ENV_PREFIX):
            key = name[len(ENV_PREFIX) :].replace("__", ".")
            out.append((name, f"{key}={environ[name]}"))
    return out


def from_dict(data: Mapping[str, Any]) -> Config:
    """Typed, validated config from raw TOML data."""
    cfg = _build(Config, data, "")
    validate(cfg)
    return cfg


def load_config(
    path: str | os.PathLike[str] | None,
    overrides: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Read a TOML file (None = all defaults), apply env then --set overrides, validate."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist; pass a TOML file, e.g. configs/demo.toml")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{p}: not valid TOML: {exc}") from None
    for name, assignment in env_overrides(os.environ if environ is None else environ):
        apply_override(data, assignment, source=f"environment variable {name}")
    for assignment in overrides:
        apply_override(data, assignment, source=f"--set {assignment}")
    return from_dict(data)


def add_set_argument(p: argparse.ArgumentParser, example: str = "trainer.optim.lr=3e-4") -> None:
    """`--set KEY=VALUE` (repeatable) into `overrides`: every command that reads a config takes it."""
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override a config value, e.g. --set {example} (repeatable)",
    )
