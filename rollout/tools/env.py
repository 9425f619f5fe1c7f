"""`rollout.episode.environment = "tools"`: a multi-turn episode in which the policy may call tools before it
answers. Each policy turn is read for `<tool_call>` blocks (rollout/tools/calls.py); a turn with calls gets their
results back as one observation (a `<tool_response>` per call, in order) and the policy writes again; a turn
without calls is the answer, scored by the task's verifier. A malformed call, an unknown tool or a failing tool
is an observation for the policy, never a lost sample. A call stopped at one of its limits (the python tool's
CPU, memory, wall or output limit) ends the episode with that observation when `end_on_tool_limit` (the task's
verdict on an empty answer is the reward). The `calculator` tool evaluates + - * and parentheses over integers
exactly, in process; `python` is the sandboxed subprocess of rollout/tools/python_tool.py.

The warm start's reference episodes (`ToolEnvironments.reference`): a `reference_tool_share` of the problems,
chosen by a hash of their id, call the first tool on the prompt's expression (the prompt less a trailing "=")
and answer with its result; the rest answer at once.
"""

from __future__ import annotations

import ast
import hashlib
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from common.config import EpisodeConfig
from rollout.episode import Environment, EnvStep, Segment, TaskEnvironment
from rollout.tasks import Problem, Task
from rollout.tools.calls import CLOSE, OPEN, parse_calls, render_response
from rollout.tools.python_tool import PythonTool, SandboxLimits
from rollout.tools.registry import Param, Tool, ToolRegistry, ToolResult

_MIB = 1 << 20
# The calculator's bounds: an expression's length, and the size of any value it computes (a product of many
# large factors would otherwise take the episode's time and memory).
MAX_EXPRESSION_CHARS = 256
MAX_DIGITS = 64


class CalculatorError(ValueError):
    """An expression the calculator does not compute; the message is the observation the policy reads."""


def calculate(expression: str) -> int:
    """The exact integer value of `expression`: integers, + - * (binary and unary + -) and parentheses."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression is {len(expression)} characters; the limit is {MAX_EXPRESSION_CHARS}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"expression is not arithmetic ({exc.msg})") from None
    return _value(tree.body)


def _value(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _value(node.operand)
        return value if isinstance(node.op, ast.UAdd) else -value
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Mult):
            return _bounded(left * right)
        return _bounded(left + right if isinstance(node.op, ast.Add) else left - right)
    raise CalculatorError("the calculator takes integers, + - * and parentheses only")


def _bounded(value: int) -> int:
    if len(str(abs(value))) > MAX_DIGITS:
        raise CalculatorError(f"a value has more than {MAX_DIGITS} digits")
    return value


class Calculator:
    """Exact integer arithmetic (+ - * and parentheses), computed in process: no subprocess, no limits to hit."""

    name = "calculator"
    description = "Compute an integer arithmetic expression exactly (+, -, * and parentheses)."
    parameters: Sequence[Param] = (Param("expression", "string", "the expression, e.g. 37*48+19"),)

    async def call(self, arguments: Mapping[str, object]) -> ToolResult:
        expression = arguments["expression"]
        assert isinstance(expression, str), "the registry checks argument types"
        try:
            return ToolResult(self.name, str(calculate(expression)), is_error=False)
        except CalculatorError as exc:
            return ToolResult(self.name, f"error: {exc}", is_error=True)


def call_text(tool: str, arguments: dict[str, object]) -> str:
    """One call in the documented format (rollout/tools/calls.py), JSON without spaces."""
    return f"{OPEN}{json.dumps({'name': tool, 'arguments': arguments}, separators=(',', ':'))}{CLOSE}"


class ToolEnvironment(TaskEnvironment):
    """One episode: the problem's prompt, then tool calls answered until the policy answers (module docstring); a
    turn without calls is scored as the one-step task environment scores its completion."""

    def __init__(self, task: Task, registry: ToolRegistry, end_on_limit: bool) -> None:
        super().__init__(task)
        self.registry, self.end_on_limit = registry, end_on_limit

    async def step(self, action: str) -> EnvStep:
        calls = parse_calls(action)
        if not calls:
            return await super().step(action)
        t0 = time.monotonic()
        results = [await self.registry.call(call) for call in calls]
        seconds = time.monotonic() - t0
        observation = "\n".join(render_response(r.text) for r in results)
        errors = sum(r.is_error for r in results)
        if self.end_on_limit and any(r.limit for r in results):
            verdict = await super().step("")  # the task's reward of no answer
            return EnvStep(observation, verdict.reward, True, len(calls), errors, seconds)
        return EnvStep(observation, 0.0, False, len(calls), errors, seconds)


@dataclass(frozen=True)
class ToolEnvironments:
    """The tools environment of a run: one registry of its tools, shared by every episode."""

    task: Task
    registry: ToolRegistry
    end_on_limit: bool
    reference_tool_share: float

    @classmethod
    def from_config(cls, cfg: EpisodeConfig, task: Task, run_dir: Path) -> ToolEnvironments:
        tools: list[Tool] = []
        for name in cfg.tools:
            if name == "calculator":
                tools.append(Calculator())
            else:
                limits = SandboxLimits(
                    cpu_s=cfg.python_cpu_s, wall_s=cfg.python_wall_s, memory_bytes=cfg.python_memory_mb * _MIB
                )
                tools.append(PythonTool(run_dir, limits))
        return cls(task, ToolRegistry(tools), cfg.end_on_tool_limit, cfg.reference_tool_share)

    def new(self) -> Environment:
        return ToolEnvironment(self.task, self.registry, self.end_on_limit)

    def reference(self, problem: Problem) -> list[Segment]:
        """The warm start's episode of `problem` (module docstring): a call and the answer, or the answer."""
        share = int.from_bytes(hashlib.sha256(problem.id.encode()).digest()[:8], "big") / 2**64
        if share >= self.reference_tool_share:
            return [Segment("policy", problem.answer)]
        expression = problem.prompt.strip().removesuffix("=").strip()
        first = "calculator" if self.registry.get("calculator") is not None else self.registry.names[0]
        arguments: dict[str, object] = (
            {"expression": expression} if first == "calculator" else {"code": f"print({expression})"}
        )
        result = problem.answer if first == "calculator" else f"{problem.answer}\n"
        return [
            Segment("policy", call_text(first, arguments)),
            Segment("env", render_response(result)),
            Segment("policy", problem.answer),
        ]
