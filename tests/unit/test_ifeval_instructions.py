"""IFEval-style instructions: every instruction type passes a response that follows it and fails one
that does not; loose scoring forgives a preamble line, a sign-off line and markdown asterisks, strict
does not; bad instruction records are rejected naming the problem; the shipped data parses."""

from __future__ import annotations

import json

import pytest

from evaluator.benchmarks.ifeval import IFEval
from evaluator.benchmarks.instructions import (
    INSTRUCTION_TYPES,
    Instruction,
    count_sentences,
    count_words,
    follows_loose,
    follows_strict,
    loose_variants,
)


def ins(kind: str, **kwargs) -> Instruction:
    return Instruction.parse({"id": kind, "kwargs": kwargs}, "test")


# (instruction, a response that follows it, a response that does not)
CASES = [
    (ins("length:words", relation="at_least", num_words=5), "one two three four five", "one two three four"),
    (ins("length:words", relation="at_most", num_words=3), "it's a dog", "this is a dog"),
    (ins("length:words", relation="exactly", num_words=2), "Hello, world!", "Hello there world"),
    (ins("length:sentences", relation="exactly", num_sentences=3), "One. Two! Three?", "One. Two."),
    (ins("length:sentences", relation="at_most", num_sentences=1), "Just one sentence here", "First. Second."),
    (ins("length:paragraphs", num_paragraphs=2), "First part.\n***\nSecond part.", "First.\n***\n\n***\nThird."),
    (ins("keywords:include", keywords=["river", "Bridge"]), "The bridge over the River.", "The river bank."),
    (ins("keywords:exclude", forbidden=["tree"]), "Streets and forests.", "A tall Tree."),
    (
        ins("keywords:frequency", keyword="light", relation="at_least", frequency=2),
        "light, more light",
        "light and lighter",
    ),
    (ins("keywords:frequency", keyword="bright", relation="exactly", frequency=1), "bright", "bright bright"),
    (ins("format:json"), '```json\n{"name": "Ada", "age": 36}\n```', "name: Ada"),
    (ins("format:json"), "[1, 2, 3]", "[1, 2, 3] is the list"),
    (ins("format:bullets", num_bullets=2), "* one\n- two", "* one\n**bold** two"),
    (ins("format:title"), "<<A Title>>\nBody", "<<>> no title"),
    (ins("format:end_phrase", phrase="Can you guess?"), "A riddle. Can you guess?  \n", "Can you guess? Yes."),
    (ins("format:quotation"), '  "quoted words"  ', 'almost "quoted"'),
    (ins("format:placeholders", num_placeholders=2), "Dear [name], see you at [place].", "Dear [name]."),
    (ins("punctuation:no_comma"), "no commas here", "one, two"),
    (ins("case:lowercase"), "all lower 123", "Not lower"),
    (ins("case:uppercase"), "ALL UPPER 123", "ALL UPPEr"),
]


@pytest.mark.parametrize(("instruction", "good", "bad"), CASES, ids=[f"{c[0].id}-{i}" for i, c in enumerate(CASES)])
def test_instruction_passes_a_following_response_and_fails_a_violating_one(instruction, good, bad):
    assert follows_strict(instruction, good)
    assert not follows_strict(instruction, bad)


def test_every_instruction_type_is_exercised_and_there_are_at_least_eight():
    assert {c[0].id for c in CASES} == set(INSTRUCTION_TYPES)
    assert len(INSTRUCTION_TYPES) >= 8


def test_empty_response_follows_nothing_strictly_or_loosely():
    for instruction, _, _ in CASES:
        assert not follows_strict(instruction, "")
        assert not follows_loose(instruction, "  \n ")


def test_loose_forgives_a_preamble_and_a_sign_off_line_and_asterisks_but_strict_does_not():
    lower = ins("case:lowercase")
    chatty = "Sure! Here it is:\nall lowercase text\nHope This Helps"
    assert not follows_strict(lower, chatty)
    assert follows_loose(lower, chatty)
    commas = ins("punctuation:no_comma")
    assert not follows_loose(commas, "a, b\nc, d\ne, f")  # commas on every line: no variant passes
    quoted = ins("format:quotation")
    assert not follows_strict(quoted, '**"bold quote"**')
    assert follows_loose(quoted, '**"bold quote"**')


def test_loose_variants_are_the_eight_trimmed_and_unstarred_forms():
    variants = loose_variants("first\n*mid*\nlast")
    assert len(variants) == 8
    assert {"first\n*mid*\nlast", "*mid*\nlast", "first\n*mid*", "*mid*", "mid", "first\nmid\nlast"} <= set(variants)


def test_word_and_sentence_counting():
    assert count_words("It's a well-known fact, isn't it?") == 7
    assert count_sentences("Hi. Bye") == 2
    assert count_sentences("Wait... what?! Yes.") == 3
    assert count_sentences("Version 3.5 is out.") == 1


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"id": "format:poem"}, "unknown instruction id 'format:poem'"),
        ({"id": "length:words", "kwargs": {"relation": "at_least"}}, "takes parameters"),
        ({"id": "length:words", "kwargs": {"relation": "at_least", "num_words": "5"}}, "must be int"),
        ({"id": "length:words", "kwargs": {"relation": "more", "num_words": 5}}, "relation 'more'"),
    ],
)
def test_bad_instruction_records_are_rejected_naming_the_problem(record, message):
    with pytest.raises(ValueError, match=message):
        Instruction.parse(record, "file.jsonl:3")


def test_shipped_ifeval_data_parses_and_scores_prompt_and_instruction_levels():
    bench = IFEval("evaluator/data")
    cases = bench.cases()
    assert 20 <= len(cases) <= 50
    assert all(c.chat and c.context["instructions"] for c in cases)
    kinds = {i.id for c in cases for i in c.context["instructions"]}
    assert len(kinds) >= 8
    two = next(
        c for c in cases if [i.id for i in c.context["instructions"]] == ["case:lowercase", "punctuation:no_comma"]
    )
    half = bench.score(two, "a cat, sleeping")
    assert half.values == {
        "prompt_strict": 0.0,
        "prompt_loose": 0.0,
        "instruction_strict": 0.5,
        "instruction_loose": 0.5,
    }
    full = bench.score(two, "a cat sleeping")
    assert full.values["prompt_strict"] == 1.0
    metrics = bench.summarize([[half], [full]])
    assert metrics["prompt_strict/mean"] == 0.5
    assert metrics["instruction_level_strict"] == 0.75
    assert metrics["type/punctuation:no_comma/strict"] == 0.5
    assert metrics["type/case:lowercase/strict"] == 1.0


def test_ifeval_data_error_names_file_and_line(tmp_path):
    (tmp_path / "ifeval").mkdir()
    good = {"id": "a", "prompt": "p", "instructions": [{"id": "case:lowercase"}]}
    bad = {"id": "b", "prompt": "p", "instructions": [{"id": "nope"}]}
    (tmp_path / "ifeval" / "prompts.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match=r"prompts.jsonl:2.*unknown instruction id 'nope'"):
        IFEval(tmp_path).cases()
