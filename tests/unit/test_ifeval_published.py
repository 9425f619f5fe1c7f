"""IFEval in its published record format (evaluator/benchmarks/ifeval_published.py): each of the paper's 25
instruction types has a response that follows it and one that does not; a file of published records with a
fixed response file scores to strict and loose figures computed by hand below; bad records name the line and
the fix. Real parts: the benchmark reads real JSONL files, langdetect detects the languages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evaluator.benchmark import BenchmarkError, load_benchmark
from evaluator.benchmarks.ifeval_published import (
    PUBLISHED_TYPES,
    PublishedInstruction,
    count_sentences,
    score_response_file,
)
from evaluator.benchmarks.instructions import follows_strict

# id -> (kwargs, a response that follows it, responses that do not)
CASES: dict[str, tuple[dict, str, list[str]]] = {
    "keywords:existence": ({"keywords": ["river", "stone"]}, "A stone by the River.", ["A stone by the lake."]),
    "keywords:frequency": (
        {"keyword": "blue", "frequency": 3, "relation": "at least"},
        "blue sky, blue sea, Blue eyes",
        ["blue sky, blue sea"],
    ),
    "keywords:forbidden_words": (
        {"forbidden_words": ["cat", "dog"]},
        "A category of concatenated things.",  # whole words only
        ["My Dog sleeps."],
    ),
    "keywords:letter_frequency": (
        {"letter": "z", "let_frequency": 3, "let_relation": "less than"},
        "zebra zone",
        ["zebra Zone zoo"],
    ),
    "language:response_language": (
        {"language": "fr"},
        "Ceci est une phrase simple en français sur le temps qu'il fait aujourd'hui.",
        ["This is a simple sentence in English about the weather today."],
    ),
    "length_constraints:number_sentences": (
        {"num_sentences": 3, "relation": "less than"},
        "Dr. Smith arrived at noon. He sat down.",  # an abbreviation does not end a sentence: 2
        ["One. Two! Three? Four."],
    ),
    "length_constraints:number_paragraphs": (
        {"num_paragraphs": 2},
        "First part.\n***\nSecond part.",
        ["Only one part.", "First.\n***\n\n***\nSecond."],  # an empty paragraph between two fails
    ),
    "length_constraints:number_words": (
        {"num_words": 5, "relation": "at least"},
        "one two three four five",
        ["one two three"],
    ),
    "length_constraints:nth_paragraph_first_word": (
        {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "however"},
        'Intro text.\n\n"However, this holds.',
        ["Intro text.\n\nBut not this.", "However, one paragraph only."],
    ),
    "detectable_content:number_placeholders": (
        {"num_placeholders": 2},
        "Dear [name], we ship to [address].",
        ["Dear [name], we ship to you."],
    ),
    "detectable_content:postscript": (
        {"postscript_marker": "P.S."},
        "Hello.\nP.S. See you soon.",
        ["Hello. PS see you soon."],
    ),
    "detectable_format:number_bullet_lists": (
        {"num_bullets": 2},
        "Items:\n* one\n* two",
        ["Items:\n* one\n* two\n- three"],
    ),
    "detectable_format:constrained_response": ({}, "I think so. My answer is yes.", ["Yes."]),
    "detectable_format:number_highlighted_sections": (
        {"num_highlights": 2},
        "*first* and **second**",
        ["*first* and ** **"],
    ),
    "detectable_format:multiple_sections": (
        {"section_spliter": "Section", "num_sections": 2},
        "Section 1\nabc\nSection 2\ndef",
        ["Section 1\nabc"],
    ),
    "detectable_format:json_format": ({}, '```json\n{"a": 1}\n```', ["{'a': 1}"]),
    "detectable_format:title": ({}, "<<My Title>>\nText.", ["<< >>\nText.", "My Title\nText."]),
    "combination:two_responses": ({}, "Answer A.\n******\nAnswer B.", ["Same.\n******\nSame.", "Only one."]),
    "combination:repeat_prompt": (
        {"prompt_to_repeat": "Write a poem about the sea."},
        "write a poem about the sea. Waves roll in.",
        ["Here is a poem about the sea."],
    ),
    "startend:end_checker": (
        {"end_phrase": "Any other questions?"},
        'That is all. Any other questions?"',
        ["Any other questions? Bye."],
    ),
    "change_case:capital_word_frequency": (
        {"capital_frequency": 2, "capital_relation": "at least"},
        "THIS is VERY good",
        ["This is Very good"],
    ),
    "change_case:english_capital": (
        {},
        "THIS IS AN ENGLISH SENTENCE ABOUT THE WEATHER TODAY.",
        ["This is an English sentence about the weather today."],
    ),
    "change_case:english_lowercase": (
        {},
        "this is an english sentence about the weather today.",
        ["This is an English sentence about the weather today.", "ceci est une phrase simple en français."],
    ),
    "punctuation:no_comma": ({}, "No commas here.", ["Yes, here."]),
    "startend:quotation": ({}, '"Quoted answer."', ['Quoted "answer".']),
}


def test_every_published_instruction_type_has_a_case():
    assert len(PUBLISHED_TYPES) == 25 and set(CASES) == set(PUBLISHED_TYPES)


@pytest.mark.parametrize("kind", sorted(CASES))
def test_each_instruction_passes_a_following_response_and_fails_the_others(kind):
    """Strictly (loose scoring, which relaxes the response, is checked on the fixed response file below)."""
    kwargs, good, bad = CASES[kind]
    instruction = PublishedInstruction.parse(kind, kwargs, "test")
    assert follows_strict(instruction, good), good
    for response in bad:
        assert not follows_strict(instruction, response), response


def test_sentences_split_after_terminal_punctuation_not_abbreviations():
    assert count_sentences("Hello there. How are you? Fine!") == 3
    assert count_sentences("Mr. Smith met Dr. Jones, e.g. at noon. Then they left.") == 2
    assert count_sentences("Version 2.5 shipped. It works") == 2
    assert count_sentences("") == 0


# Published records and a fixed response file. By hand (S = strict, L = loose, per instruction):
#   1 no_comma + title, a preamble line with a comma: S [no, yes], L [yes (first line removed), yes]
#   2 quotation, bold around the quotes:                S [no], L [yes (asterisks removed)]
#   3 number_words < 3 + end_checker "Bye.":            S [yes, yes], L [yes, yes]
#   4 keywords "zebra" + constrained_response:          S [no, yes], L [no, yes]
#   5 postscript "P.S." (a null kwarg, not given):      S [yes], L [yes]
# prompt level: S 2/5 = 0.4 (prompts 3, 5), L 4/5 = 0.8; instruction level: S 5/8 = 0.625, L 7/8 = 0.875.
RECORDS = [
    ("Write without commas, with a title.", ["punctuation:no_comma", "detectable_format:title"], [{}, {}]),
    ("Wrap your answer in double quotes.", ["startend:quotation"], [{}]),
    (
        "Answer in under 3 words and end with Bye.",
        ["length_constraints:number_words", "startend:end_checker"],
        [{"num_words": 3, "relation": "less than"}, {"end_phrase": "Bye."}],
    ),
    (
        "Mention a zebra and answer yes, no or maybe.",
        ["keywords:existence", "detectable_format:constrained_response"],
        [{"keywords": ["zebra"]}, {}],
    ),
    ("Add a postscript.", ["detectable_content:postscript"], [{"postscript_marker": "P.S.", "num_highlights": None}]),
]
RESPONSES = [
    "Sure, here it is:\n<<Title>>\nNo commas in this body.",
    '**"A quoted answer."**',
    "Fine. Bye.",
    "My answer is no.",
    "Hello.\nP.S. bye",
]


def write_records(path: Path, records: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        json.dumps({"key": 1000 + i, "prompt": p, "instruction_id_list": ids, "kwargs": kw})
        for i, (p, ids, kw) in enumerate(records)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_fixed_response_file_scores_the_hand_computed_strict_and_loose_figures(tmp_path):
    inputs = write_records(tmp_path / "input_data.jsonl", RECORDS)
    responses = tmp_path / "responses.jsonl"
    responses.write_text(
        "\n".join(json.dumps({"prompt": r[0], "response": s}) for r, s in zip(RECORDS, RESPONSES, strict=True))
    )
    m = score_response_file(inputs, responses)
    assert m["prompt_strict/mean"] == pytest.approx(0.4)
    assert m["prompt_loose/mean"] == pytest.approx(0.8)
    assert m["instruction_level_strict"] == pytest.approx(0.625)
    assert m["instruction_level_loose"] == pytest.approx(0.875)
    assert m["type/startend:quotation/strict"] == 0.0 and m["type/startend:quotation/loose"] == 1.0


def test_the_benchmark_reads_published_records_under_the_data_root(tmp_path):
    write_records(tmp_path / "ifeval" / "input_data.jsonl", RECORDS)
    bench = load_benchmark("ifeval_google", tmp_path)
    cases = bench.cases()
    assert [c.id for c in cases] == [f"ifeval-{1000 + i}" for i in range(5)]
    assert cases[0].chat and cases[0].sampling.max_tokens == 1280
    score = bench.score(cases[1], RESPONSES[1])
    assert (score.values["prompt_strict"], score.values["prompt_loose"]) == (0.0, 1.0)


def test_missing_data_says_it_is_not_shipped_and_where_it_goes(tmp_path):
    with pytest.raises(BenchmarkError, match=r"not shipped: put google-research's .*<data_root>/ifeval/input_data"):
        load_benchmark("ifeval_google", tmp_path).cases()


@pytest.mark.parametrize(
    ("ids", "kwargs", "message"),
    [
        (["detectable_format:sparkles"], [{}], r"unknown instruction id 'detectable_format:sparkles'; the published"),
        (["length_constraints:number_words"], [{"num_words": 3}], r"takes the arguments \['num_words', 'relation'\]"),
        (
            ["length_constraints:number_words"],
            [{"num_words": 3, "relation": "at most"}],
            r"relation 'at most' .* not one of \('less than', 'at least'\)",
        ),
        (["startend:quotation", "punctuation:no_comma"], [{}], r"must be equally long"),
        (
            ["detectable_format:title"],
            [{"bogus": 1}],
            r"takes the arguments \[\] \(null means not given\), got \['bogus'\]",
        ),
        (["length_constraints:number_words"], [{"num_words": "3", "relation": "at least"}], r"must be int"),
    ],
)
def test_a_bad_record_names_its_line_and_the_fix(tmp_path, ids, kwargs, message):
    write_records(tmp_path / "ifeval" / "input_data.jsonl", [RECORDS[0], ("p", ids, kwargs)])
    with pytest.raises(BenchmarkError, match=rf"input_data.jsonl:2: .*{message}"):
        load_benchmark("ifeval_google", tmp_path).cases()
