"""Tool calls in a policy turn, and tool results rendered back to the model.

The one format understood is the Hermes / Qwen convention: each call is a JSON object inside its own tag
pair, anywhere in the turn's text, calls taken in the order they appear:

    <tool_call>
    {"name": "python", "arguments": {"code": "print(2 ** 100)"}}
    </tool_call>

`name` is a non-empty string and `arguments` a JSON object (absent means `{}`); other keys are an error, so a
misspelt key is told to the model rather than ignored. A malformed call (bad JSON, a missing name, arguments
that are not an object, a tag never closed, a closing tag never opened) becomes a `CallError` in the list, in
its place: the parser never raises, because a model's malformed call is an observation for the model to
read, not a lost sample. Tags are found before the JSON is read, so a string holding a closing tag writes it
`<\\/tool_call>` (JSON's escaped slash). A result goes back as the text of one `<tool_response>` tag pair per
call, in call order, newline inside both tags (`render_response`); the chat template decides whose turn that
text is.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_TAG = re.compile(r"</?tool_call>")


@dataclass(frozen=True)
class ToolCall:
    """One well-formed call: the tool's name and its arguments, `start`/`end` its span in the turn's text."""

    name: str
    arguments: dict[str, object] = field(default_factory=dict)
    start: int = 0
    end: int = 0


@dataclass(frozen=True)
class CallError:
    """A call that could not be read: what is wrong (`message`, written for the model) and the raw text."""

    message: str
    text: str
    start: int = 0
    end: int = 0


def parse_calls(text: str) -> list[ToolCall | CallError]:
    """Every tool call in `text`, in order; a malformed one is a `CallError` in its place. Never raises."""
    calls: list[ToolCall | CallError] = []
    opened: int | None = None  # where the body of the open tag starts
    open_at = 0
    for tag in _TAG.finditer(text):
        if tag.group() == OPEN:
            if opened is not None:
                calls.append(
                    CallError(
                        f"{OPEN} at character {open_at} is not closed before the next {OPEN}; "
                        f"close each call with {CLOSE}",
                        text[open_at : tag.start()],
                        open_at,
                        tag.start(),
                    )
                )
            opened, open_at = tag.end(), tag.start()
        elif opened is None:
            calls.append(
                CallError(
                    f"{CLOSE} at character {tag.start()} closes no {OPEN}; write {OPEN}{{...}}{CLOSE}",
                    tag.group(),
                    tag.start(),
                    tag.end(),
                )
            )
        else:
            calls.append(_parse_body(text[opened : tag.start()], open_at, tag.end()))
            opened = None
    if opened is not None:
        calls.append(
            CallError(
                f"{OPEN} at character {open_at} is never closed; end the call with {CLOSE}",
                text[open_at:],
                open_at,
                len(text),
            )
        )
    return calls


def _parse_body(body: str, start: int, end: int) -> ToolCall | CallError:
    def error(message: str) -> CallError:
        return CallError(message, body, start, end)

    try:
        value = json.loads(body)
    except json.JSONDecodeError as exc:
        return error(f"tool call is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})")
    except RecursionError:
        return error("tool call is not valid JSON (nested too deeply)")
    if not isinstance(value, dict):
        return error(f'tool call must be a JSON object {{"name": ..., "arguments": {{...}}}}, got {_kind(value)}')
    extra = sorted(set(value) - {"name", "arguments"})
    if extra:
        return error(f"tool call has unknown keys {', '.join(map(repr, extra))}; only 'name' and 'arguments'")
    name = value.get("name")
    if not isinstance(name, str) or not name.strip():
        got = "no name" if name is None else f"name {_kind(name)}"
        return error(f"tool call needs a non-empty string 'name', got {got}")
    arguments = value.get("arguments", {})
    if not isinstance(arguments, dict):
        return error(f"'arguments' of tool call {name!r} must be a JSON object, got {_kind(arguments)}")
    return ToolCall(name, arguments, start, end)


def _kind(value: object) -> str:
    """A JSON value's type, as the model wrote it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def render_response(text: str) -> str:
    """One tool result as the model reads it: `text` inside a `<tool_response>` tag pair."""
    return f"<tool_response>\n{text}\n</tool_response>"
