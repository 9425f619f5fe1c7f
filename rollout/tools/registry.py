"""The tools an episode may call: each has a name, a description and typed parameters; `ToolRegistry.call`
turns one parsed call into a `ToolResult`, whatever the model wrote.

Everything the model can get wrong comes back as an error observation naming the fault (a malformed call,
an unknown tool with the list of known ones, missing, unexpected or wrongly typed arguments), and so does a
tool that fails. Only `ToolSetupError`, a fault of the machine or the config that no model output can fix
(the sandbox cannot be built here), propagates, so a run stops instead of feeding every episode an error.
`schemas()` gives the tool list in the JSON-schema shape chat templates take as `tools`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from rollout.tools.calls import CallError, ToolCall

log = logging.getLogger(__name__)

ParamType = Literal["string", "integer", "number", "boolean", "object", "array"]
_PYTHON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
}


class ToolSetupError(RuntimeError):
    """A tool cannot work on this machine or with this config; the message says why and what to change."""


@dataclass(frozen=True)
class ToolResult:
    """What one call gives back. `text` is the observation the model reads (inside `<tool_response>`);
    `is_error` marks a call that did not do its job. Process tools also fill the fields after it: the
    child's exit code (negative: the signal that killed it), its captured output, the limit it hit (e.g.
    "cpu time limit 2s exceeded") and the wall time the call took."""

    tool: str
    text: str
    is_error: bool
    exit_code: int | None = None
    stdout: str = ""
    stderr: str = ""
    limit: str | None = None
    wall_s: float | None = None


@dataclass(frozen=True)
class Param:
    """One parameter of a tool: its JSON type, what it means, whether a call must give it."""

    name: str
    type: ParamType
    description: str
    required: bool = True

    def __post_init__(self) -> None:
        if self.type not in _PYTHON_TYPES:
            raise ValueError(f"parameter {self.name!r}: type {self.type!r} is not one of {', '.join(_PYTHON_TYPES)}")


@runtime_checkable
class Tool(Protocol):
    """A tool: `call` gets arguments already checked against `parameters` and returns a result; it reports
    its own failures as a result with `is_error`, and raises only `ToolSetupError`."""

    name: str
    description: str
    parameters: Sequence[Param]

    async def call(self, arguments: Mapping[str, object]) -> ToolResult: ...


def check_arguments(tool: Tool, arguments: Mapping[str, object]) -> list[str]:
    """What is wrong with `arguments` for `tool`, one phrase per fault; empty when they fit."""
    params = {p.name: p for p in tool.parameters}
    faults = [
        f"missing argument {p.name!r} ({p.type})" for p in tool.parameters if p.required and p.name not in arguments
    ]
    for name, value in arguments.items():
        param = params.get(name)
        if param is None:
            faults.append(f"unexpected argument {name!r} (parameters: {', '.join(params) or 'none'})")
        elif not _has_type(value, param.type):
            faults.append(f"argument {name!r} must be {param.type}, got {_json_type(value)}")
    return faults


def _has_type(value: object, type_: str) -> bool:
    # bool is an int in Python but not an integer in JSON
    if isinstance(value, bool) and type_ in ("integer", "number"):
        return False
    return isinstance(value, _PYTHON_TYPES[type_])


def _json_type(value: object) -> str:
    for name, types in (("null", (type(None),)), ("boolean", (bool,)), *_PYTHON_TYPES.items()):
        if isinstance(value, types):
            return name
    return type(value).__name__


class ToolRegistry:
    """Tools by name. `call` never raises for anything a model wrote."""

    def __init__(self, tools: Sequence[Tool] = ()) -> None:
        self._tools: dict[str, Tool] = {}
        for tool in tools:
            self.add(tool)

    def add(self, tool: Tool) -> None:
        if not isinstance(tool, Tool):
            raise TypeError(f"{tool!r} is not a tool: it needs name, description, parameters and async call()")
        if tool.name in self._tools:
            raise ValueError(f"tool name {tool.name!r} is registered twice; give each tool its own name")
        self._tools[tool.name] = tool

    @property
    def names(self) -> list[str]:
        return sorted(self._tools)

    def get(self, name: str) -> Tool | None:
        return self._tools.get(name)

    def schemas(self) -> list[dict[str, object]]:
        """Each tool as {"type": "function", "function": {name, description, parameters}} (JSON schema)."""
        return [
            {
                "type": "function",
                "function": {
                    "name": tool.name,
                    "description": tool.description,
                    "parameters": {
                        "type": "object",
                        "properties": {p.name: {"type": p.type, "description": p.description} for p in tool.parameters},
                        "required": [p.name for p in tool.parameters if p.required],
                    },
                },
            }
            for tool in (self._tools[n] for n in self.names)
        ]

    async def call(self, call: ToolCall | CallError) -> ToolResult:
        """The result of one parsed call: the tool's own, or an error observation naming what was wrong."""
        if isinstance(call, CallError):
            return ToolResult("", f"error: {call.message}", is_error=True)
        tool = self._tools.get(call.name)
        if tool is None:
            return ToolResult(
                call.name, f"error: unknown tool {call.name!r}; tools: {', '.join(self.names) or 'none'}", True
            )
        faults = check_arguments(tool, call.arguments)
        if faults:
            return ToolResult(call.name, f"error: tool {call.name!r}: {'; '.join(faults)}", is_error=True)
        try:
            return await tool.call(call.arguments)
        except ToolSetupError:
            raise
        except Exception as exc:
            # A tool's own bug must not lose the sample: the model sees that the tool failed, the log the trace.
            log.exception("tool %r failed on arguments %r", call.name, call.arguments)
            return ToolResult(call.name, f"error: tool {call.name!r} failed: {type(exc).__name__}: {exc}", True)
