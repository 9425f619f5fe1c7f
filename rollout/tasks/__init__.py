"""Tasks: a task is an indexable prompt source plus a verifier that turns a completion into a reward.

Problems are addressed by index, so a data cursor is one integer and a resumed run continues
exactly where it stopped. Verifiers are pure and bounded: they read at most a fixed number of
trailing characters of a completion, and symbolic comparisons run under a time limit.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class Problem:
    """One prompt of a task and the reference its verifier compares against (never sent to the model)."""

    id: str
    prompt: str
    answer: str
    source: str = ""
    """Name of the mixture source the problem came from ("" for single-source tasks)."""


@runtime_checkable
class Task(Protocol):
    @property
    def name(self) -> str:
        """The task's name in logs and the prompt ledger."""
        ...

    def __len__(self) -> int:
        """Number of problems; the data ends after the last one."""
        ...

    def problem(self, index: int) -> Problem:
        """The problem at an index in [0, len)."""
        ...

    def reward(self, problem: Problem, completion: str) -> float:
        """The reward of one completion of a problem (1.0 correct, 0.0 wrong for the built-ins)."""
        ...


def import_factory(spec: str, key: str) -> Callable[..., Any]:
    """The object `spec` ('package.module:factory') names; `key` (the config key that gave it) names it in errors."""
    module_name, _, attr = spec.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(
            f"{key} {spec!r} cannot be loaded ({exc}); "
            "it must name 'package.module:factory' importable from the trainer's environment"
        ) from None
