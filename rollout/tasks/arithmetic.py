"""Synthetic arithmetic: a seeded generator of integer expressions and an exact answer check.

Problem i of a seed is a pure function of (seed, i), so any slice of the stream can be regenerated.
A held-out set is another seed AND the other side of a fixed split of the problems themselves
(`heldout_side`): a hash of the expression text puts a `heldout_fraction` of all possible problems on the
held-out side, the training generator redraws any problem that lands there and the held-out generator any
that does not, so the two never share a problem, however small the space (two operands in 0..6 are 98). The prompt is the bare expression followed by "="
(for example "12+7="); the model answers with the integer. The verifier takes the first integer of
the completion (optionally signed) and compares it exactly: "19", " 19 and more" are right for 12+7,
"1 9" and "20" are wrong.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from typing import Any

from common.config import PromptSourceConfig, TaskConfig
from rollout.tasks import Problem

_LEADING_INT = re.compile(r"\s*(-?\d{1,32})(?!\d)")

GENERATOR_KNOBS = ("min_operands", "max_operands", "max_value", "operators", "heldout_fraction")
"""What shapes a problem besides its seed and index, named alike in TaskConfig, PromptSourceConfig and the
evaluator's held-out spec."""


def render_prompt(expression: str) -> str:
    """The text the model sees for an expression (shared by training, warm start and evaluation)."""
    return f"{expression}="


# Redraws of one problem before its side of the split is called empty: a side holding a share q of the problems
# misses all of them with probability (1 - q) ** MAX_DRAWS, about 1e-9 for q = 1 / 50.
MAX_DRAWS = 1000


def heldout_side(expression: str, fraction: float) -> bool:
    """Whether a problem is held out: the first 8 bytes of the sha256 of its expression text ("3+4"), read as a
    number in [0, 1), fall below `fraction`. Fixed for every seed, process and machine (no salted hash())."""
    share = int.from_bytes(hashlib.sha256(expression.encode()).digest()[:8], "big") / 2**64
    return share < fraction


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
    heldout_fraction: float = 0.25
    """Share of all problems (by `heldout_side`) that only the held-out generator emits."""
    heldout: bool = False
    """Emit only held-out problems (the evaluator's benchmark) instead of only training ones."""
    max_completion_chars: int = 4096
    name: str = "arithmetic"

    def __post_init__(self) -> None:
        if not 0 <= self.heldout_fraction < 1 or (self.heldout and self.heldout_fraction == 0):
            raise ValueError(
                f"heldout_fraction = {self.heldout_fraction} must be in [0, 1) for training problems and in (0, 1) "
                "for held-out ones (0 holds nothing out)"
            )

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
        for _ in range(MAX_DRAWS):
            operands = rng.randint(self.min_operands, self.max_operands)
            expression = make_expression(rng, operands, self.max_value, self.operators)
            if heldout_side(expression, self.heldout_fraction) == self.heldout:
                break
        else:
            side = "held-out" if self.heldout else "training"
            raise ValueError(
                f"{MAX_DRAWS} draws of arithmetic problem {index} found no {side} problem: heldout_fraction = "
                f"{self.heldout_fraction} leaves (almost) none of the problems of {self.min_operands}-"
                f"{self.max_operands} operands in 0..{self.max_value} with {self.operators!r} on that side; "
                "widen the problem space or move heldout_fraction away from 0 / 1"
            )
        return Problem(f"arith-{self.seed}-{index}", render_prompt(expression), str(evaluate(expression)))

    def reward(self, problem: Problem, completion: str) -> float:
        return 1.0 if verify(completion, problem.answer, self.max_completion_chars) else 0.0
