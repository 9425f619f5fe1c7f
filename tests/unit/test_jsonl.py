"""The shared JSONL reader (common/jsonl.py) and the benchmarks that read their data with it."""

from __future__ import annotations

import json

import pytest

from common.jsonl import JsonlError, read_jsonl
from evaluator.benchmark import BenchmarkError
from evaluator.benchmarks.gsm8k import GSM8K
from evaluator.benchmarks.ifeval import IFEval


def test_objects_come_with_their_line_numbers_and_blank_lines_are_skipped(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"x": 1}\n\n   \n{"x": 2}\n{"x": "\u2028"}\n', encoding="utf-8")
    assert list(read_jsonl(path)) == [(1, {"x": 1}), (4, {"x": 2}), (5, {"x": "\u2028"})]


@pytest.mark.parametrize(("line", "detail"), [("{broken", r" \(Expecting property name"), ("[1, 2]", ", got list")])
def test_a_line_that_is_not_an_object_is_an_error_naming_file_line_and_what_it_should_be(tmp_path, line, detail):
    path = tmp_path / "a.jsonl"
    path.write_text(f'{{"x": 1}}\n{line}\n')
    with pytest.raises(JsonlError, match=rf"a\.jsonl:2: expected an object with 'x'{detail}"):
        list(read_jsonl(path, "an object with 'x'"))


def test_a_caller_chooses_the_error_class(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text("nope\n")
    with pytest.raises(BenchmarkError, match=r"a\.jsonl:1: expected a JSON object"):
        list(read_jsonl(path, error=BenchmarkError))


@pytest.mark.parametrize("line", ["not json", "[1]", json.dumps({"question": "q"})])
def test_a_bad_gsm8k_line_is_a_benchmark_error_naming_its_line(tmp_path, line):
    (tmp_path / "gsm8k").mkdir()
    good = json.dumps({"question": "q", "answer": "#### 7"})
    (tmp_path / "gsm8k" / "test.jsonl").write_text(f"{good}\n{line}\n")
    with pytest.raises(BenchmarkError, match=r"test\.jsonl:2: expected a JSON object with 'question' and an 'answer'"):
        GSM8K(tmp_path).cases()


def test_a_gsm8k_case_without_an_id_is_named_after_its_line(tmp_path):
    (tmp_path / "gsm8k").mkdir()
    good = json.dumps({"question": "q", "answer": "#### 7"})
    (tmp_path / "gsm8k" / "test.jsonl").write_text(f"\n{good}\n")
    assert [c.id for c in GSM8K(tmp_path).cases()] == ["gsm8k-2"]


NO_INSTRUCTIONS = '{"id": "a", "prompt": "p", "instructions": []}'


@pytest.mark.parametrize(
    ("line", "why"),
    [("not json", "Expecting value"), ("{}", "'instructions'"), (NO_INSTRUCTIONS, "case 'a' has no instructions")],
)
def test_a_bad_ifeval_line_is_a_benchmark_error_naming_its_line_and_why(tmp_path, line, why):
    (tmp_path / "ifeval").mkdir()
    (tmp_path / "ifeval" / "prompts.jsonl").write_text(f"{line}\n")
    with pytest.raises(BenchmarkError, match=r"prompts\.jsonl:1: expected an ifeval record") as err:
        IFEval(tmp_path).cases()
    assert why in str(err.value)


@pytest.mark.parametrize("cls", [GSM8K, IFEval])
def test_a_benchmark_file_without_a_record_is_an_error(tmp_path, cls):
    (tmp_path / cls.name).mkdir()
    (tmp_path / cls.name / ("test.jsonl" if cls is GSM8K else "prompts.jsonl")).write_text("\n")
    with pytest.raises(BenchmarkError, match="holds no cases"):
        cls(tmp_path).cases()
