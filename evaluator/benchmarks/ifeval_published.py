"""IFEval in its published record format (Zhou et al., 2023, "Instruction-Following Evaluation for Large
Language Models"): the 25 verifiable instruction types of the paper under their published ids and keyword
arguments, strict and loose scoring as the paper defines them, read from the user's copy of the data.

Data: `<data_root>/ifeval/input_data.jsonl` (not shipped: the published file is google-research's
`instruction_following_eval/data/input_data.jsonl`, or the `google/IFEval` dataset exported to JSONL), one
{"key": int, "prompt": str, "instruction_id_list": [str], "kwargs": [dict]} per line, `kwargs[i]` the
arguments of `instruction_id_list[i]`; an argument whose value is null is not given. An unknown id, an
unknown or missing argument, or a relation other than "less than" / "at least" is an error naming the line.

Scores (per prompt, then pooled as `ifeval` pools them): `prompt_strict` / `prompt_loose` (every
instruction of the prompt followed) and `instruction_level_strict` / `instruction_level_loose` (followed
instructions over all instructions). Loose: an instruction counts as followed when the response or one of
its relaxed forms follows it: without its first line, its last line or both, each also with every `*`
removed (eight forms; `evaluator.benchmarks.instructions.follows_loose`). `score_response_file` scores a
file of responses offline, as the paper's own evaluation does: {"prompt", "response"} per line.

The checks are this module's own reading of the paper's definitions. Where the reference implementation
leans on NLTK (its punkt sentence splitter, which needs a download this project cannot make), the sentence
count here splits after `.`, `!` or `?` runs followed by whitespace and a capital letter, digit or quote,
or by the end, and does not split after a few common abbreviations (Mr., Dr., e.g., ...); it can differ
from punkt on unusual abbreviations and on initials. Words are runs of word characters (`\\w+`), as the
reference counts them. Language is detected with `langdetect` (seeded, so a response always gets the
same answer).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from common.jsonl import read_jsonl
from evaluator.benchmark import BenchmarkError, Case, ChatMessage, Sampling
from evaluator.benchmarks.ifeval import IFEval

DATA_FILE = "ifeval/input_data.jsonl"
RECORD = (
    'a published IFEval record {"key", "prompt", "instruction_id_list", "kwargs"} (google-research '
    "instruction_following_eval's input_data.jsonl; see evaluator/benchmarks/ifeval_published.py)"
)
RELATIONS = ("less than", "at least")
CONSTRAINED_ANSWERS = ("My answer is yes.", "My answer is no.", "My answer is maybe.")

_WORD = re.compile(r"\w+")
_ABBREVIATIONS = ("mr.", "mrs.", "ms.", "dr.", "prof.", "sr.", "jr.", "st.", "vs.", "etc.", "e.g.", "i.e.", "inc.")
_SENTENCE_END = re.compile(r"[.!?]+[\"')\]]*(?=\s+[\"'(\[]?[A-Z0-9]|\s*$)")
_PARAGRAPH_DIVIDER = re.compile(r"\s?\*\s?\*\s?\*\s?")
_PLACEHOLDER = re.compile(r"\[.*?\]")
_BULLET_STAR = re.compile(r"^\s*\*[^\*].*$", re.MULTILINE)
_BULLET_DASH = re.compile(r"^\s*-.*$", re.MULTILINE)
_HIGHLIGHT = re.compile(r"\*[^\n\*]*\*")
_BOLD = re.compile(r"\*\*[^\n\*]*\*\*")
_TITLE = re.compile(r"<<[^\n]+>>")
_FENCE = re.compile(r"^```(?:json)?\s*|\s*```$", re.IGNORECASE)


def _compare(value: int, relation: str, target: int) -> bool:
    return value < target if relation == "less than" else value >= target


def _language(text: str) -> str:
    """The ISO 639-1 code langdetect gives `text`; "" when it finds no language (e.g. no letters)."""
    try:
        from langdetect import DetectorFactory, detect
        from langdetect.lang_detect_exception import LangDetectException
    except ImportError:
        raise BenchmarkError(
            "IFEval's language checks need langdetect: pip install langdetect (a dependency of slipstream)"
        ) from None
    DetectorFactory.seed = 0
    try:
        return str(detect(text))
    except LangDetectException:
        return ""


def count_sentences(text: str) -> int:
    """Sentences in `text` (the module docstring says how they are split)."""
    count, start = 0, 0
    for m in _SENTENCE_END.finditer(text):
        words = text[start : m.end()].split()
        if words and words[-1].lower().rstrip("\"')]") in _ABBREVIATIONS:
            continue
        if text[start : m.start()].strip():
            count += 1
        start = m.end()
    return count + bool(text[start:].strip())


def _paragraphs_split_by(pattern: re.Pattern[str] | str, text: str) -> int | None:
    """Non-empty paragraphs of `text` split by `pattern`; None when an empty one sits between two others."""
    parts = re.split(pattern, text)
    for i, part in enumerate(parts):
        if not part.strip() and 0 < i < len(parts) - 1:
            return None
    return sum(1 for p in parts if p.strip())


# The checks, one per published instruction id: (response, **kwargs) -> followed.
def keywords_existence(r: str, keywords: Sequence[str]) -> bool:
    return all(re.search(re.escape(k), r, re.IGNORECASE) for k in keywords)


def keywords_frequency(r: str, keyword: str, frequency: int, relation: str) -> bool:
    return _compare(len(re.findall(re.escape(keyword), r, re.IGNORECASE)), relation, frequency)


def forbidden_words(r: str, forbidden_words: Sequence[str]) -> bool:
    return not any(re.search(rf"\b{re.escape(w)}\b", r, re.IGNORECASE) for w in forbidden_words)


def letter_frequency(r: str, letter: str, let_frequency: int, let_relation: str) -> bool:
    return _compare(r.lower().count(letter.lower()), let_relation, let_frequency)


def response_language(r: str, language: str) -> bool:
    return _language(r) == language


def number_sentences(r: str, num_sentences: int, relation: str) -> bool:
    return _compare(count_sentences(r), relation, num_sentences)


def number_paragraphs(r: str, num_paragraphs: int) -> bool:
    return _paragraphs_split_by(_PARAGRAPH_DIVIDER, r) == num_paragraphs


def number_words(r: str, num_words: int, relation: str) -> bool:
    return _compare(len(_WORD.findall(r)), relation, num_words)


def nth_paragraph_first_word(r: str, num_paragraphs: int, nth_paragraph: int, first_word: str) -> bool:
    parts = re.split(r"\n\n", r)
    if _paragraphs_split_by(r"\n\n", r) != num_paragraphs:
        return False
    paragraphs = [p for p in parts if p.strip()]
    if not 1 <= nth_paragraph <= len(paragraphs):
        return False
    word = paragraphs[nth_paragraph - 1].split()[0].lstrip("\"'").rstrip(".,?!;:\"'")
    return word.lower() == first_word.lower()


def number_placeholders(r: str, num_placeholders: int) -> bool:
    return len(_PLACEHOLDER.findall(r)) >= num_placeholders


def postscript(r: str, postscript_marker: str) -> bool:
    marker = postscript_marker.strip().lower()
    if marker == "p.p.s":
        pattern = r"\s*p\.\s?p\.\s?s.*$"
    elif marker == "p.s.":
        pattern = r"\s*p\.\s?s\..*$"
    else:
        pattern = r"\s*" + re.escape(marker) + r".*$"
    return re.search(pattern, r.lower(), re.MULTILINE) is not None


def number_bullet_lists(r: str, num_bullets: int) -> bool:
    return len(_BULLET_STAR.findall(r)) + len(_BULLET_DASH.findall(r)) == num_bullets


def constrained_response(r: str) -> bool:
    return any(answer in r.strip() for answer in CONSTRAINED_ANSWERS)


def number_highlighted_sections(r: str, num_highlights: int) -> bool:
    single = [h for h in _HIGHLIGHT.findall(r) if h.strip("*").strip()]
    double = [h for h in _BOLD.findall(r) if h.removeprefix("**").removesuffix("**").strip()]
    return len(single) + len(double) >= num_highlights


def multiple_sections(r: str, section_spliter: str, num_sections: int) -> bool:
    return len(re.split(rf"\s?{re.escape(section_spliter)}\s?\d+\s?", r)) - 1 >= num_sections


def json_format(r: str) -> bool:
    try:
        json.loads(_FENCE.sub("", r.strip()))
    except ValueError:
        return False
    return True


def title(r: str) -> bool:
    return any(t[2:-2].strip() for t in _TITLE.findall(r))


def two_responses(r: str) -> bool:
    parts = r.split("******")
    kept = []
    for i, part in enumerate(parts):
        if not part.strip():
            if 0 < i < len(parts) - 1:
                return False
        else:
            kept.append(part.strip())
    return len(kept) == 2 and kept[0] != kept[1]


def repeat_prompt(r: str, prompt_to_repeat: str) -> bool:
    return r.strip().lower().startswith(prompt_to_repeat.strip().lower())


def end_checker(r: str, end_phrase: str) -> bool:
    return r.strip().strip('"').lower().endswith(end_phrase.strip().lower())


def capital_word_frequency(r: str, capital_frequency: int, capital_relation: str) -> bool:
    return _compare(sum(w.isupper() for w in _WORD.findall(r)), capital_relation, capital_frequency)


def english_capital(r: str) -> bool:
    return r.isupper() and _language(r) == "en"


def english_lowercase(r: str) -> bool:
    return r.islower() and _language(r) == "en"


def no_comma(r: str) -> bool:
    return "," not in r


def quotation(r: str) -> bool:
    s = r.strip()
    return len(s) > 1 and s[0] == '"' and s[-1] == '"'


@dataclass(frozen=True)
class InstructionType:
    check: Callable[..., bool]
    params: Mapping[str, type]


# The paper's 25 instruction types, under their published ids, with their arguments (name -> type).
PUBLISHED_TYPES: dict[str, InstructionType] = {
    "keywords:existence": InstructionType(keywords_existence, {"keywords": list}),
    "keywords:frequency": InstructionType(keywords_frequency, {"keyword": str, "frequency": int, "relation": str}),
    "keywords:forbidden_words": InstructionType(forbidden_words, {"forbidden_words": list}),
    "keywords:letter_frequency": InstructionType(
        letter_frequency, {"letter": str, "let_frequency": int, "let_relation": str}
    ),
    "language:response_language": InstructionType(response_language, {"language": str}),
    "length_constraints:number_sentences": InstructionType(number_sentences, {"num_sentences": int, "relation": str}),
    "length_constraints:number_paragraphs": InstructionType(number_paragraphs, {"num_paragraphs": int}),
    "length_constraints:number_words": InstructionType(number_words, {"num_words": int, "relation": str}),
    "length_constraints:nth_paragraph_first_word": InstructionType(
        nth_paragraph_first_word, {"num_paragraphs": int, "nth_paragraph": int, "first_word": str}
    ),
    "detectable_content:number_placeholders": InstructionType(number_placeholders, {"num_placeholders": int}),
    "detectable_content:postscript": InstructionType(postscript, {"postscript_marker": str}),
    "detectable_format:number_bullet_lists": InstructionType(number_bullet_lists, {"num_bullets": int}),
    "detectable_format:constrained_response": InstructionType(constrained_response, {}),
    "detectable_format:number_highlighted_sections": InstructionType(
        number_highlighted_sections, {"num_highlights": int}
    ),
    "detectable_format:multiple_sections": InstructionType(
        multiple_sections, {"section_spliter": str, "num_sections": int}
    ),
    "detectable_format:json_format": InstructionType(json_format, {}),
    "detectable_format:title": InstructionType(title, {}),
    "combination:two_responses": InstructionType(two_responses, {}),
    "combination:repeat_prompt": InstructionType(repeat_prompt, {"prompt_to_repeat": str}),
    "startend:end_checker": InstructionType(end_checker, {"end_phrase": str}),
    "change_case:capital_word_frequency": InstructionType(
        capital_word_frequency, {"capital_frequency": int, "capital_relation": str}
    ),
    "change_case:english_capital": InstructionType(english_capital, {}),
    "change_case:english_lowercase": InstructionType(english_lowercase, {}),
    "punctuation:no_comma": InstructionType(no_comma, {}),
    "startend:quotation": InstructionType(quotation, {}),
}


@dataclass(frozen=True)
class PublishedInstruction:
    """One instruction of a published record: its id and the arguments it was given."""

    id: str
    kwargs: Mapping[str, Any]

    @classmethod
    def parse(cls, kind: Any, kwargs: Any, where: str) -> PublishedInstruction:
        """`kind` with `kwargs` (null values dropped) from the record at `where`, checked against PUBLISHED_TYPES."""
        spec = PUBLISHED_TYPES.get(kind) if isinstance(kind, str) else None
        if spec is None:
            raise ValueError(
                f"{where}: unknown instruction id {kind!r}; the published ids are {', '.join(sorted(PUBLISHED_TYPES))}"
            )
        if not isinstance(kwargs, dict):
            raise ValueError(f"{where}: the kwargs of {kind!r} must be an object, got {kwargs!r}")
        given = {k: v for k, v in kwargs.items() if v is not None}
        if set(given) != set(spec.params):
            raise ValueError(
                f"{where}: instruction {kind!r} takes the arguments {sorted(spec.params)} (null means not given), "
                f"got {sorted(given)}"
            )
        for name, tp in spec.params.items():
            value = given[name]
            if tp is int and isinstance(value, float) and value.is_integer():
                given[name] = value = int(value)  # exported data can carry counts as floats
            if not isinstance(value, tp) or isinstance(value, bool):
                raise ValueError(f"{where}: argument {name!r} of {kind!r} must be {tp.__name__}, got {value!r}")
        for name in ("relation", "let_relation", "capital_relation"):
            if name in given and given[name] not in RELATIONS:
                raise ValueError(f"{where}: {name} {given[name]!r} of {kind!r} is not one of {RELATIONS}")
        return cls(kind, given)

    def check(self, response: str) -> bool:
        return PUBLISHED_TYPES[self.id].check(response, **self.kwargs)


def parse_record(record: dict, where: str) -> tuple[str, tuple[PublishedInstruction, ...]]:
    """The prompt and instructions of one published record."""
    ids, kwargs = record["instruction_id_list"], record["kwargs"]
    if not isinstance(record["prompt"], str) or not isinstance(ids, list) or not isinstance(kwargs, list):
        raise ValueError(f"{where}: prompt must be a string, instruction_id_list and kwargs lists")
    if len(ids) != len(kwargs) or not ids:
        raise ValueError(
            f"{where}: instruction_id_list ({len(ids)}) and kwargs ({len(kwargs)}) must be equally long and not empty"
        )
    return record["prompt"], tuple(PublishedInstruction.parse(i, k, where) for i, k in zip(ids, kwargs, strict=True))


class IFEvalPublished(IFEval):
    """The published IFEval (the module docstring); scored and summarised by `ifeval`'s own score and summarize
    (follows_strict / follows_loose over the published instructions)."""

    name = "ifeval_google"
    # The paper's responses are long (essays of 300+ words); lm-evaluation-harness's ifeval task allows 1280 tokens.
    sampling = Sampling(temperature=0.0, max_tokens=1280)
    input_file = DATA_FILE  # under the data root

    @cached_property
    def _cases(self) -> list[Case]:
        try:
            return self.jsonl_cases(self.input_file, RECORD, self._published_case)
        except BenchmarkError as exc:
            if "does not exist" not in str(exc):
                raise
            raise BenchmarkError(
                f"{exc}. The published IFEval data is not shipped: put google-research's "
                f"instruction_following_eval/data/input_data.jsonl (or google/IFEval exported as JSONL) at "
                f"<data_root>/{DATA_FILE} (evaluator.data_root, or --data-root)"
            ) from None

    def _published_case(self, record: dict, lineno: int, where: str) -> Case:
        prompt, instructions = parse_record(record, where)
        return Case(
            f"ifeval-{record['key']}", (ChatMessage("user", prompt),), self.sampling, 1, {"instructions": instructions}
        )


def score_response_file(input_path: str | Path, responses_path: str | Path) -> dict[str, float]:
    """The published evaluation offline: the records of `input_path` against a JSONL of {"prompt", "response"}
    (matched by prompt text; a prompt without a response is an error), summarised as the benchmark does."""
    input_path, responses_path = Path(input_path), Path(responses_path)
    bench = IFEvalPublished(input_path.parent)
    bench.input_file = input_path.name
    responses: dict[str, str] = {}
    for lineno, record in read_jsonl(responses_path, '{"prompt", "response"}', BenchmarkError):
        if not isinstance(record.get("prompt"), str) or not isinstance(record.get("response"), str):
            raise BenchmarkError(f'{responses_path}:{lineno}: expected {{"prompt": str, "response": str}}')
        responses[record["prompt"]] = record["response"]
    scores = []
    for case in bench.cases():
        prompt = case.prompt[0].content if isinstance(case.prompt, tuple) else case.prompt
        if prompt not in responses:
            raise BenchmarkError(f"{responses_path}: no response to the prompt of {case.id}: {prompt[:80]!r}")
        scores.append([bench.score(case, responses[prompt])])
    return bench.summarize(scores)


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m evaluator.benchmarks.ifeval_published INPUT_JSONL RESPONSES_JSONL`: the summary as JSON."""
    import argparse

    parser = argparse.ArgumentParser(description="Score a file of IFEval responses (the published format) offline.")
    parser.add_argument("input", help="the published records, e.g. input_data.jsonl")
    parser.add_argument("responses", help='one {"prompt", "response"} per line')
    args = parser.parse_args(argv)
    print(json.dumps(score_response_file(args.input, args.responses), indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
