"""Verifiers by name: the reward functions a prompt source chooses (`rollout.task.sources[].verifier`).

A verifier is a callable (problem, completion) -> reward. The built-ins are pure and bounded like the
tasks' own checks (they read at most `max_completion_chars` trailing characters): math compares the
final answer (last \\boxed{}, else last number) through math-verify under a time limit; arithmetic
takes the first integer and compares it exactly; exact compares the last non-empty line with the answer,
both stripped of surrounding whitespace. import calls a user factory with the source's config.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from common.config import PromptSourceConfig, TaskConfig
from rollout.tasks import Problem, import_factory
from rollout.tasks import arithmetic as arith
from rollout.tasks.mathanswer import answers_equal, extract_answer

Verifier = Callable[[Problem, str], float]


@dataclass(frozen=True)
class MathVerifier:
    """1.0 when the completion's final answer equals the reference numerically, textually or symbolically."""

    max_chars: int = 4096
    timeout_s: float = 5.0

    def __call__(self, problem: Problem, completion: str) -> float:
        pred = extract_answer(completion, self.max_chars)
        return 1.0 if answers_equal(pred, problem.answer, self.timeout_s) else 0.0


@dataclass(frozen=True)
class ArithmeticVerifier:
    """1.0 when the completion's first integer equals the (integer) reference exactly."""

    max_chars: int = 4096

    def __call__(self, problem: Problem, completion: str) -> float:
        return 1.0 if arith.verify(completion, problem.answer, self.max_chars) else 0.0


@dataclass(frozen=True)
class ExactVerifier:
    """1.0 when the completion's last non-empty line, stripped, is the reference answer, stripped."""

    max_chars: int = 4096

    def __call__(self, problem: Problem, completion: str) -> float:
        lines = [line for line in completion[-self.max_chars :].splitlines() if line.strip()]
        return 1.0 if lines and lines[-1].strip() == problem.answer.strip() else 0.0


def resolved_verifier(src: PromptSourceConfig) -> str:
    """The verifier name a source uses: its `verifier`, or for auto the one that fits its format."""
    if src.verifier != "auto":
        return src.verifier
    return "arithmetic" if src.format == "arithmetic" else "math"


def make_verifier(src: PromptSourceConfig, task: TaskConfig, config_key: str) -> Verifier:
    """The verifier of one source; `config_key` (rollout.task.sources[i]) names it in errors."""
    name = resolved_verifier(src)
    if name == "math":
        return MathVerifier(task.max_completion_chars, task.verify_timeout_s)
    if name == "arithmetic":
        return ArithmeticVerifier(task.max_completion_chars)
    if name == "exact":
        return ExactVerifier(task.max_completion_chars)
    verifier = import_factory(src.verifier_import, f"{config_key}.verifier_import")(src)
    if not callable(verifier):
        raise TypeError(
            f"{config_key}.verifier_import {src.verifier_import!r} returned {type(verifier).__name__}, which is not "
            "callable; the factory must return a function (problem, completion) -> reward"
        )
    return verifier
