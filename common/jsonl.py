"""Reading JSONL files: one JSON object per line, blank lines skipped, every bad line an error that
names the file and line. What each object must hold is the caller's to check (with the line number
this reader yields). Left out: writing, and tolerating a torn last line (evaluator/cache.py does that
for its own append-only file).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class JsonlError(ValueError):
    """A line of a JSONL file is not a JSON object; the message names path:line and what it should be."""


def read_jsonl(
    path: str | Path, expected: str = "a JSON object", error: type[ValueError] = JsonlError
) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number from 1, object) of every non-blank line of a UTF-8 JSONL file, in order.

    A line that is not valid JSON, or is JSON but not an object, raises `error` (a caller may pass its own
    ValueError subclass) with `<path>:<line>: expected <expected> (...)`; say in `expected` what a line
    must hold, so the message tells how to fix it.
    """
    with Path(path).open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise error(f"{path}:{lineno}: expected {expected} ({exc})") from None
            if not isinstance(record, dict):
                raise error(f"{path}:{lineno}: expected {expected}, got {type(record).__name__}")
            yield lineno, record
