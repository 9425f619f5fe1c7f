"""Tools a policy may call in a multi-turn episode: `calls` reads the calls in a turn's text (the Hermes /
Qwen `<tool_call>` JSON format) and renders results back, `registry` holds the tools and turns every call,
however malformed, into an observation, `python_tool` is the sandboxed Python tool, `env` the environment that
plays them in an episode (rollout/episode.py)."""

from rollout.tools.calls import CallError, ToolCall, parse_calls, render_response
from rollout.tools.registry import Param, Tool, ToolRegistry, ToolResult, ToolSetupError

__all__ = [
    "CallError",
    "Param",
    "Tool",
    "ToolCall",
    "ToolRegistry",
    "ToolResult",
    "ToolSetupError",
    "parse_calls",
    "render_response",
]
