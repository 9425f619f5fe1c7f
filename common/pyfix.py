"""A work-around for a CPython bug that a threaded role hits: `serialize_ast_parse`, installed by every role
process (common/runs/cli.py) before its threads start."""

from __future__ import annotations

import ast
import functools
import threading
from typing import Any

_AST_LOCK = threading.RLock()  # re-entrant: a finalizer that runs during a parse may parse in the same thread


def serialize_ast_parse() -> None:
    """Run every `ast.parse` of this process under one lock (idempotent).

    CPython (3.11 here) keeps the depth counter of the AST constructor (the C code that turns a parse into
    `ast` objects) in one per-interpreter variable, set from the calling thread's stack depth when a parse
    starts. A parse that pauses midway (the garbage collector ran a finalizer, and another thread took the
    interpreter) and meanwhile another thread's parse starts, ends with the other thread's count and fails:
    SystemError "AST constructor recursion depth mismatch" (python/cpython#106905). Trainer rank 0 died of it
    in CI and restarted: torch.compile's guard code parses in the training thread while other threads parse
    too (Python 3.11 parses source lines to place the carets of every traceback it formats).
    tests/unit/test_pyfix.py races two threads into the error, and not with the lock.

    `ast.literal_eval` and the traceback module call the module's `parse`, so they are covered; code that calls
    compile() with ast.PyCF_ONLY_AST itself is not."""
    if getattr(ast.parse, "serialized", False):
        return
    unlocked = ast.parse

    @functools.wraps(unlocked)
    def parse(*args: Any, **kwargs: Any) -> Any:
        with _AST_LOCK:
            return unlocked(*args, **kwargs)

    parse.serialized = True  # type: ignore[attr-defined]
    ast.parse = parse
