"""Synthetic arithmetic: a seeded generator of integer expressions and an exact answer check.

Problem i of a seed is a pure function of (seed, i), so any slice of the stream can be regenerated
and a held-out set is simply another seed. The prompt is the bare expression followed by "="
(for example "12+7="); the model answers with the integer. The verifier takes the first integer of
the completion (optionally signed) and compares it exactly: "19", " 19 and more" are right for 12+7,
"1 9" and "20" are wrong.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

from common.config import PromptSourceConfig, TaskConfig
from rollout.tasks import Problem

_LEADING_INT = re.compile(r"\s*(-?\d{1,32})(?!\d)")

GENERATOR_KNOBS = ("min_operands", "max_operands", "max_value", "operators")
"""What shapes a problem besides its seed and index, named alike in TaskConfig, PromptSourceConfig and the
evaluator's held-out spec."""


def render_prompt(expression: str) -> str:
    """The text the model sees for an expression (shared by training, warm start and evaluation)."""
    return f"{expression}="


def make_expression(rng: random.Random, operands: int, max_value: int, operators: str) -> str:
    values = [str(rng.randint(0, max_value)) for _ in range(operands)]
    ops = [rng.choice(operators) for _ in range(operands - 1)]
    return values[0] + "".join(op + v for op, v in zip(ops, values[1:], strict=True))


def evaluate(expression: str) -> int:
    """Integer value of an expression of non-negative integers and + - * with usual precedence."""
    tokens = re.findall(r"\d+|[+\-*]", expression)
    if not tokens or "".join(tokens) != expression:
        raise ValueError(f"not an arithmetic expression of integers and + - *: {expression!r}")
    # Products first, then a left-to-right sum: no eval() of generated text.
    terms: list[int] = []
    signs: list[int] = [1]
    current = int(tokens[0])
    for op, value in zip(tokens[1::2], tokens[2::2], strict=True):
        if op == "*":
            current *= int(value)
        else:
            terms.append(current)
            signs.append(1 if op == "+" else -1)
            current = int(value)
    terms.append(current)
    return sum(s * t for s, t in zip(signs, terms, strict=True))


def verify(completion: str, answer: str, max_chars: int = 4096) -> bool:
    """True when the completion's first integer equals the answer exactly."""
    match = _LEADING_INT.match(completion[:max_chars])
    return match is not None and int(match.group(1)) == int(answer)


@dataclass(frozen=True)
class ArithmeticTask:
    """Indexable source of arithmetic problems with the exact verifier as reward."""

    seed: int = 0
    num_problems: int = 100_000
    min_operands: int = 2
    max_operands: int = 2
    max_value: int = 20
    operators: str = "+-"
    max_completion_chars: int = 4096
    name: str = "arithmetic"

    @classmethod
    def from_config(cls, cfg: TaskConfig | PromptSourceConfig, **changes: Any) -> ArithmeticTask:
        """The generator a task section (kind = arithmetic) or a mixture's arithmetic source describes: its
        seed, size and knobs, then `changes` (a mixture source's name, the task's completion bound)."""
        knobs = {k: getattr(cfg, k) for k in ("seed", "num_problems", *GENERATOR_KNOBS)}
        if isinstance(cfg, TaskConfig):
            knobs["max_completion_chars"] = cfg.max_completion_chars
        return cls(**(knobs | changes))

    def __len__(self) -> int:
        return self.num_problems

    def problem(self, index: int) -> Problem:
        if not 0 <= index < self.num_problems:
            raise IndexError(f"arithmetic problem {index} is outside [0, {self.num_problems})")
        rng = random.Random(f"{self.seed}:{index}")  # str seeds hash deterministically (sha512)
        operands = rng.randint(self.min_operands, self.max_operands)
        expression = make_expression(rng, operands, self.max_value, self.operators)
        return Problem(f"arith-{self.seed}-{index}", render_prompt(expression), str(evaluate(expression)))

    def reward(self, problem: Problem, completion: str) -> float:
        return 1.0 if verify(completion, problem.answer, self.max_completion_chars) else 0.0
