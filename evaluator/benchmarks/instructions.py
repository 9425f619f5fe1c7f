"""Verifiable instructions of the instruction-following benchmark: each instruction type is a pure
check of a response against its parameters (word and sentence counts, paragraphs, keywords present,
forbidden or at a frequency, JSON output, no commas, all lowercase or uppercase, bullet points, a
title, an end phrase, quotation marks, placeholders). `Instruction.parse` validates an instruction
record of the data file (unknown type or parameter is an error naming it). Strict scoring checks the
response as given; loose scoring, in the spirit of IFEval, also accepts it when some variant passes:
the response without its first line, its last line, or both, each also with markdown asterisks
removed, so a chatty preamble, a sign-off or bold markup alone does not fail an instruction.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

RELATIONS = ("at_least", "at_most", "exactly")

_WORD = re.compile(r"[A-Za-z0-9]+(?:['’][A-Za-z]+)*")
# A sentence ends at . ! or ? (runs like "?!" or "..." count once) followed by whitespace or the end.
_SENTENCE_END = re.compile(r"[.!?]+(?=\s|$)")
_BULLET = re.compile(r"^\s*[*-]\s+\S", re.MULTILINE)
_TITLE = re.compile(r"<<[^\n<>]+>>")
_PLACEHOLDER = re.compile(r"\[[^\[\]\n]+\]")
_PARAGRAPH_DIVIDER = re.compile(r"^\s*\*\*\*\s*$", re.MULTILINE)
_JSON_FENCE = re.compile(r"^```(?:json|JSON)?\s*\n(.*)\n```$", re.DOTALL)


def compare(value: int, relation: str, target: int) -> bool:
    if relation == "at_least":
        return value >= target
    if relation == "at_most":
        return value <= target
    if relation == "exactly":
        return value == target
    raise ValueError(f"relation {relation!r} is not one of {RELATIONS}")


def count_words(text: str) -> int:
    return len(_WORD.findall(text))


def count_sentences(text: str) -> int:
    """Sentences: text pieces ended by . ! or ? before whitespace or the end; a trailing piece without
    final punctuation counts too, so "Hi. Bye" is two."""
    pieces = _SENTENCE_END.split(text)
    return sum(1 for piece in pieces if _WORD.search(piece))


def _keyword_pattern(keyword: str) -> re.Pattern[str]:
    return re.compile(rf"(?<!\w){re.escape(keyword)}(?!\w)", re.IGNORECASE)


def word_count(response: str, relation: str, num_words: int) -> bool:
    return compare(count_words(response), relation, num_words)


def sentence_count(response: str, relation: str, num_sentences: int) -> bool:
    return compare(count_sentences(response), relation, num_sentences)


def paragraph_count(response: str, num_paragraphs: int) -> bool:
    """Exactly num_paragraphs non-empty paragraphs separated by markdown dividers (a line of ***)."""
    parts = _PARAGRAPH_DIVIDER.split(response)
    return all(p.strip() for p in parts) and len(parts) == num_paragraphs


def keywords_present(response: str, keywords: list[str]) -> bool:
    return all(_keyword_pattern(k).search(response) for k in keywords)


def keywords_forbidden(response: str, forbidden: list[str]) -> bool:
    return not any(_keyword_pattern(k).search(response) for k in forbidden)


def keyword_frequency(response: str, keyword: str, relation: str, frequency: int) -> bool:
    return compare(len(_keyword_pattern(keyword).findall(response)), relation, frequency)


def json_output(response: str) -> bool:
    """The whole response is one JSON value (a ```json fence around it is allowed)."""
    text = response.strip()
    fenced = _JSON_FENCE.match(text)
    if fenced:
        text = fenced.group(1).strip()
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def no_comma(response: str) -> bool:
    return "," not in response


def all_lowercase(response: str) -> bool:
    """Every cased letter is lowercase (and there is at least one)."""
    return response.islower()


def all_uppercase(response: str) -> bool:
    """Every cased letter is uppercase (and there is at least one)."""
    return response.isupper()


def bullet_count(response: str, num_bullets: int) -> bool:
    """Exactly num_bullets markdown bullet lines ('* item' or '- item'); '**bold**' is not a bullet."""
    return len(_BULLET.findall(response)) == num_bullets


def has_title(response: str) -> bool:
    """A title wrapped in double angular brackets, like <<a title>>."""
    return _TITLE.search(response) is not None


def end_phrase(response: str, phrase: str) -> bool:
    """The response ends with the exact phrase (trailing whitespace ignored)."""
    return response.rstrip().endswith(phrase)


def quoted(response: str) -> bool:
    """The whole response is wrapped in double quotation marks."""
    text = response.strip()
    return len(text) > 1 and text[0] == '"' and text[-1] == '"'


def placeholder_count(response: str, num_placeholders: int) -> bool:
    """At least num_placeholders placeholders in square brackets, like [address]."""
    return len(_PLACEHOLDER.findall(response)) >= num_placeholders


@dataclass(frozen=True)
class InstructionType:
    check: Callable[..., bool]
    params: Mapping[str, type]


# id -> check and its parameters (name -> type). Ids are this repo's own, grouped by kind.
INSTRUCTION_TYPES: dict[str, InstructionType] = {
    "length:words": InstructionType(word_count, {"relation": str, "num_words": int}),
    "length:sentences": InstructionType(sentence_count, {"relation": str, "num_sentences": int}),
    "length:paragraphs": InstructionType(paragraph_count, {"num_paragraphs": int}),
    "keywords:include": InstructionType(keywords_present, {"keywords": list}),
    "keywords:exclude": InstructionType(keywords_forbidden, {"forbidden": list}),
    "keywords:frequency": InstructionType(keyword_frequency, {"keyword": str, "relation": str, "frequency": int}),
    "format:json": InstructionType(json_output, {}),
    "format:bullets": InstructionType(bullet_count, {"num_bullets": int}),
    "format:title": InstructionType(has_title, {}),
    "format:end_phrase": InstructionType(end_phrase, {"phrase": str}),
    "format:quotation": InstructionType(quoted, {}),
    "format:placeholders": InstructionType(placeholder_count, {"num_placeholders": int}),
    "punctuation:no_comma": InstructionType(no_comma, {}),
    "case:lowercase": InstructionType(all_lowercase, {}),
    "case:uppercase": InstructionType(all_uppercase, {}),
}


@dataclass(frozen=True)
class Instruction:
    """One verifiable instruction: a type id and its parameters."""

    id: str
    kwargs: Mapping[str, Any]

    @classmethod
    def parse(cls, record: Mapping[str, Any], where: str) -> Instruction:
        """An instruction from its data record {"id", "kwargs"}; `where` names the record in errors."""
        kind = record.get("id")
        spec = INSTRUCTION_TYPES.get(kind)  # type: ignore[arg-type]
        if spec is None:
            raise ValueError(f"{where}: unknown instruction id {kind!r}; known: {', '.join(sorted(INSTRUCTION_TYPES))}")
        kwargs = dict(record.get("kwargs") or {})
        if set(kwargs) != set(spec.params):
            raise ValueError(
                f"{where}: instruction {kind!r} takes parameters {sorted(spec.params)}, got {sorted(kwargs)}"
            )
        for name, tp in spec.params.items():
            if not isinstance(kwargs[name], tp) or isinstance(kwargs[name], bool):
                raise ValueError(f"{where}: parameter {name!r} of {kind!r} must be {tp.__name__}, got {kwargs[name]!r}")
        if "relation" in kwargs and kwargs["relation"] not in RELATIONS:
            raise ValueError(f"{where}: relation {kwargs['relation']!r} of {kind!r} is not one of {RELATIONS}")
        return cls(kind, kwargs)  # type: ignore[arg-type]

    def check(self, response: str) -> bool:
        return INSTRUCTION_TYPES[self.id].check(response, **self.kwargs)


def loose_variants(response: str) -> list[str]:
    """The response and its relaxed forms: first line, last line or both removed, each with and without
    markdown asterisks."""
    lines = response.split("\n")
    trimmed = [response, "\n".join(lines[1:]), "\n".join(lines[:-1]), "\n".join(lines[1:-1])]
    return [v for t in trimmed for v in (t, t.replace("*", ""))]


class Checks(Protocol):
    """An instruction that checks a response: ours (`Instruction`) or the published IFEval's."""

    def check(self, response: str) -> bool: ...


def follows_strict(instruction: Checks, response: str) -> bool:
    return bool(response.strip()) and instruction.check(response)


def follows_loose(instruction: Checks, response: str) -> bool:
    return any(v.strip() and instruction.check(v) for v in loose_variants(response))
