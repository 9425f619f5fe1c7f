"""JSONL math problems: one {"prompt", "answer"} record per line; the reward compares the
completion's final answer (last \\boxed{}, else last number) with the reference through math-verify."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from common.config import TaskConfig
from rollout.tasks import Problem, sources
from rollout.tasks.mathanswer import answers_equal, extract_answer


def read_problems(path: str | Path) -> list[Problem]:
    """Problems of a JSONL file; a malformed line is an error naming the file and line."""
    return sources.read_problems(path, "jsonl")


@dataclass(frozen=True)
class JsonlMathTask:
    problems: tuple[Problem, ...]
    max_completion_chars: int = 4096
    verify_timeout_s: float = 5.0
    name: str = "jsonl_math"

    @classmethod
    def from_config(cls, cfg: TaskConfig) -> JsonlMathTask:
        return cls(tuple(read_problems(cfg.path)), cfg.max_completion_chars, cfg.verify_timeout_s)

    def __len__(self) -> int:
        return len(self.problems)

    def problem(self, index: int) -> Problem:
        return self.problems[index]

    def reward(self, problem: Problem, completion: str) -> float:
        pred = extract_answer(completion, self.max_completion_chars)
        return 1.0 if answers_equal(pred, problem.answer, self.verify_timeout_s) else 0.0
