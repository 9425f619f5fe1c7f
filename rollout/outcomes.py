"""What the GenerationController (rollout/controller.py) hands back and raises: the Outcome of each item,
its counters, the errors that stop a run, and which failures are worth a retry (`is_transient`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

import aiohttp

T = TypeVar("T")
R = TypeVar("R")


class TransientError(Exception):
    """A failure worth retrying (overload, a dropped connection, a 5xx): raise it, or a subclass, from a
    genable; an exception with a true `transient` attribute counts too."""


class ErrorBudgetExceeded(RuntimeError):
    """More items failed (after their retries) than `flow.error_budget` allows."""


class CallbackError(RuntimeError):
    """A completion callback (or a function run in the loop) raised; the original is the __cause__."""


class ControllerClosed(RuntimeError):
    """The controller was closed while the caller still waited on it."""


def is_transient(exc: BaseException) -> bool:
    """Timeouts, connection errors and exceptions marked transient are retried; anything else is not."""
    if isinstance(exc, (TransientError, TimeoutError, ConnectionError, aiohttp.ClientConnectionError)):
        return True
    return getattr(exc, "transient", False) is True


@dataclass
class Outcome(Generic[T, R]):
    """The end of one item: its result, or the error that ended it after `attempts` attempts."""

    ticket: int
    item: T
    result: R | None = None
    error: BaseException | None = None
    attempts: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class ControllerStats:
    """Counters of a controller since it started (a snapshot)."""

    submitted: int = 0
    attempts: int = 0
    succeeded: int = 0
    failed: int = 0
    retried: int = 0
    timeouts: int = 0
    cancelled: int = 0
    callback_errors: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
