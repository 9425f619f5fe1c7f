"""Final answers of math completions: the last \\boxed{...} found by a brace-matching scan, else the
last number; equivalence through the `math-verify` package under a hard time limit.

Extraction reads only the last `max_chars` characters (the answer is at the end), so a megabyte of
adversarial output costs the same as a short one. math-verify's own timeouts use SIGALRM, which only
works in a main thread; comparisons therefore run in one long-lived helper process that is killed
and replaced when a comparison exceeds its limit, so a pathological expression never stalls the
caller, whatever thread it is on.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.pool
import re
import threading

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_BOXED = ("\\boxed{", "\\fbox{")
MAX_ANSWER_CHARS = 256


def extract_boxed(text: str, max_chars: int = 4096) -> str | None:
    """Content of the last complete \\boxed{...} (or \\fbox{...}), braces matched; None if there is none.

    One pass over the tail with a stack of open braces: linear in max_chars whatever the nesting.
    """
    tail = text[-max_chars:]
    stack: list[int | None] = []  # for each open brace: where its box content starts, or None
    best: tuple[int, int] | None = None
    i = 0
    while i < len(tail):
        marker = next((m for m in _BOXED if tail.startswith(m, i)), None)
        if marker is not None:
            i += len(marker)
            stack.append(i)
            continue
        ch = tail[i]
        if ch == "{":
            stack.append(None)
        elif ch == "}" and stack:
            begin = stack.pop()
            if begin is not None and (best is None or begin > best[0]):
                best = (begin, i)
        i += 1
    return None if best is None else tail[best[0] : best[1]].strip()


def extract_last_number(text: str, max_chars: int = 4096) -> str | None:
    numbers = _NUMBER.findall(text[-max_chars:])
    return numbers[-1].replace(",", "") if numbers else None


def extract_answer(text: str, max_chars: int = 4096) -> str | None:
    """The final answer of a completion: last boxed content, else the last number, else None."""
    boxed = extract_boxed(text, max_chars)
    return boxed if boxed is not None else extract_last_number(text, max_chars)


def _normalise_number(value: str) -> float | None:
    try:
        return float(value.replace(",", "").strip().rstrip("."))
    except ValueError:
        return None


def _verify_in_helper(pred: str, gold: str) -> bool:
    import logging

    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)

    # Timeouts are enforced by the parent (it kills this process); math-verify's own use SIGALRM.
    gold_parsed = parse(f"${gold}$", parsing_timeout=None)
    pred_parsed = parse(f"${pred}$", parsing_timeout=None)
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))


class _Helper:
    """One spawn-started worker process for symbolic comparison, replaced after a timeout."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: multiprocessing.pool.Pool | None = None
        atexit.register(self.close)

    def compare(self, pred: str, gold: str, timeout_s: float) -> bool:
        with self._lock:
            if self._pool is None:
                self._pool = multiprocessing.get_context("spawn").Pool(1)
            pending = self._pool.apply_async(_verify_in_helper, (pred, gold))
            try:
                return pending.get(timeout=timeout_s)
            except multiprocessing.TimeoutError:
                self._pool.terminate()
                self._pool = None
                return False

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool = None


_helper = _Helper()


def answers_equal(pred: str | None, gold: str, timeout_s: float = 5.0) -> bool:
    """Whether a predicted final answer equals the reference: numerically, textually, or symbolically."""
    if pred is None:
        return False
    pred, gold = pred.strip(), gold.strip()
    if pred == gold:
        return True
    a, b = _normalise_number(pred), _normalise_number(gold)
    if a is not None and b is not None:
        return abs(a - b) <= 1e-9 * max(1.0, abs(b))
    if len(pred) > MAX_ANSWER_CHARS:
        return False  # no reference answer is this long; refuse to hand it to a symbolic parser
    return _helper.compare(pred, gold, timeout_s)
