"""Tasks and verifiers: arithmetic generation and exact check, final-answer extraction, bounded
symbolic comparison, JSONL and user tasks."""

from __future__ import annotations

import json
import time

import pytest

from common.config import TaskConfig, load_config
from rollout.tasks import Problem
from rollout.tasks.arithmetic import ArithmeticTask, evaluate, verify
from rollout.tasks.load import load_task
from rollout.tasks.mathanswer import answers_equal, extract_answer, extract_boxed


def test_arithmetic_problems_are_a_pure_function_of_seed_and_index():
    task = ArithmeticTask(seed=3, operators="+-*", min_operands=2, max_operands=4, max_value=30)
    first = [task.problem(i) for i in range(200)]
    assert first == [
        ArithmeticTask(seed=3, operators="+-*", min_operands=2, max_operands=4, max_value=30).problem(i)
        for i in range(200)
    ]
    assert first != [
        ArithmeticTask(seed=4, operators="+-*", min_operands=2, max_operands=4).problem(i) for i in range(200)
    ]
    for p in first:
        expression = p.prompt.removesuffix("=")
        assert p.prompt.endswith("=") and int(p.answer) == eval(expression)  # noqa: S307 - test oracle
        assert 2 <= sum(expression.count(op) for op in "+-*") + 1 <= 4
    with pytest.raises(IndexError):
        task.problem(len(task))


def test_evaluate_respects_precedence_and_rejects_other_text():
    assert evaluate("2+3*4-5") == 9
    assert evaluate("7-2-1") == 4
    with pytest.raises(ValueError, match="not an arithmetic expression"):
        evaluate("__import__('os')")


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("19", "19", True),
        (" 19 and more", "19", True),
        ("-4", "-4", True),
        ("20", "19", False),
        ("1 9", "19", False),
        ("191", "19", False),
        ("", "19", False),
        ("the answer is 19", "19", False),
    ],
)
def test_arithmetic_verifier_is_exact(completion, answer, expected):
    assert verify(completion, answer) is expected


def test_arithmetic_reward_is_one_or_zero():
    task = ArithmeticTask()
    p = task.problem(0)
    assert task.reward(p, p.answer) == 1.0
    assert task.reward(p, str(int(p.answer) + 1)) == 0.0


def test_boxed_extraction_matches_nested_braces_and_takes_the_last_box():
    assert extract_boxed(r"first \boxed{1} then \boxed{\frac{a}{b+\sqrt{2}}}") == r"\frac{a}{b+\sqrt{2}}"
    assert extract_boxed(r"\fbox{42}") == "42"
    assert extract_boxed(r"\boxed{\boxed{3}+1}") == "3"
    assert extract_boxed(r"\boxed{7} and a truncated \boxed{8") == "7"
    assert extract_boxed("no box here") is None


def test_answer_extraction_falls_back_to_the_last_number_or_none():
    assert extract_answer("so 3 apples and 1,250 pears.") == "1250"
    assert extract_answer("it is -0.5") == "-0.5"
    assert extract_answer(r"maybe 3 but \boxed{4}") == "4"
    assert extract_answer("I do not know") is None


def test_a_one_megabyte_answer_is_handled_quickly():
    huge = "\\boxed{" * 150_000 + "9" * 100_000 + "}" + " 12"
    assert len(huge) > 1_000_000
    start = time.perf_counter()
    assert extract_answer(huge) == "12"
    assert extract_boxed("{" * 1_000_000) is None
    assert answers_equal("1" * 1_000_000, "2") is False
    assert time.perf_counter() - start < 1.0


def test_answers_equal_numeric_textual_and_symbolic():
    assert answers_equal("72", "72.0")
    assert answers_equal("1,000", "1000")
    assert not answers_equal("71", "72")
    assert not answers_equal(None, "1")
    assert answers_equal(r"\frac{1}{2}", "0.5")
    assert answers_equal("(x+1)^2", "x^2+2*x+1")


@pytest.mark.timeout(60)
def test_a_pathological_expression_is_cut_off_by_the_time_limit():
    start = time.perf_counter()
    assert answers_equal("9^{9^{9^{9}}}", "1", timeout_s=1.0) is False
    assert time.perf_counter() - start < 10
    assert answers_equal(r"\frac{2}{4}", "0.5", timeout_s=30)  # the helper was replaced and still works


def test_jsonl_math_task_reads_records_and_names_bad_lines(tmp_path):
    path = tmp_path / "math.jsonl"
    path.write_text(
        json.dumps({"prompt": "What is 6*7?", "answer": "42"})
        + "\n\n"
        + json.dumps({"id": "b", "prompt": "Half of 1?", "answer": r"\frac{1}{2}"})
        + "\n"
    )
    cfg = load_config(None, ["rollout.task.kind=jsonl_math", f"rollout.task.path={path}"], environ={})
    task = load_task(cfg.rollout.task)
    assert len(task) == 2 and task.problem(1).id == "b"
    assert task.reward(task.problem(0), r"We get \boxed{42}.") == 1.0
    assert task.reward(task.problem(0), "It is 41") == 0.0
    assert task.reward(task.problem(1), "so 0.5") == 1.0
    path.write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match=r"math.jsonl:1: expected a JSON object with 'prompt' and 'answer'"):
        load_task(cfg.rollout.task)


class _Reverse:
    name = "reverse"

    def __len__(self) -> int:
        return 1

    def problem(self, index: int) -> Problem:
        return Problem("r0", "abc", "cba")

    def reward(self, problem: Problem, completion: str) -> float:
        return float(completion.strip() == problem.answer)


def make_reverse_task(cfg: TaskConfig) -> _Reverse:
    return _Reverse()


def test_user_task_is_loaded_from_an_import_path():
    task = load_task(TaskConfig(kind="import", import_path="tests.unit.test_tasks:make_reverse_task"))
    assert task.reward(task.problem(0), "cba") == 1.0
    with pytest.raises(ValueError, match="cannot be loaded"):
        load_task(TaskConfig(kind="import", import_path="tests.unit.test_tasks:missing"))
    with pytest.raises(TypeError, match="lacks"):
        load_task(TaskConfig(kind="import", import_path="tests.unit.test_tasks:TaskConfig"))
