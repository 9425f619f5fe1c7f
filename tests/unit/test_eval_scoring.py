"""The benchmark protocol and the math scorers (pure, fast): unbiased pass@k against brute force,
summaries, option overrides, the GSM8K reference and completion answer extraction through the RL
task's verifier, held-out arithmetic through the RL task's generator and verifier, case ids that never
name two different prompts, cheap imports."""

from __future__ import annotations

import dataclasses
import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from common.config import TaskConfig, load_config
from evaluator.benchmark import (
    BenchmarkError,
    EvalOptions,
    SampleScore,
    load_benchmark,
    pass_at_k,
    pass_ks,
    summarize,
)
from evaluator.benchmarks.arithmetic import HeldOutArithmetic
from evaluator.benchmarks.gsm8k import GSM8K, final_answer
from rollout.tasks.arithmetic import ArithmeticTask

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "evaluator" / "data"


def brute_pass_at_k(n: int, c: int, k: int) -> float:
    """Fraction of all k-subsets of n samples (c correct) that contain a correct one."""
    samples = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize(("n", "c", "k"), [(5, 0, 1), (5, 1, 1), (5, 2, 3), (8, 3, 4), (6, 6, 2), (7, 1, 7)])
def test_pass_at_k_equals_brute_force_over_subsets(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(n, c, k), abs=1e-12)


def test_pass_at_k_rejects_impossible_counts():
    with pytest.raises(ValueError, match="n=4, c=5"):
        pass_at_k(4, 5, 1)
    assert pass_ks(1) == [1] and pass_ks(8) == [1, 2, 4, 8] and pass_ks(6) == [1, 2, 4, 6]


def s(**values: float) -> SampleScore:
    return SampleScore(values)


def test_summarize_reports_mean_std_and_pass_at_k_of_binary_values_only():
    per_case = [[s(acc=1, frac=0.5), s(acc=0, frac=0.5)], [s(acc=0, frac=1.0), s(acc=0, frac=0.0)]]
    m = summarize(per_case)
    assert m["acc/mean"] == 0.25
    assert m["acc/std"] == pytest.approx((0.25 * 0.75) ** 0.5)
    assert m["acc/pass@1"] == 0.25 and m["acc/pass@2"] == 0.5
    assert m["frac/mean"] == 0.5 and "frac/pass@1" not in m
    assert m["cases"] == 2 and m["samples"] == 4


def test_eval_options_override_sampling_and_limit_cases():
    bench = load_benchmark("arithmetic", DATA)
    cases = EvalOptions(samples=4, temperature=0.7, max_tokens=8, seed=3, limit=5).apply(bench.cases())
    assert len(cases) == 5
    assert {(c.samples, c.sampling.temperature, c.sampling.max_tokens, c.sampling.seed) for c in cases} == {
        (4, 0.7, 8, 3)
    }
    with pytest.raises(BenchmarkError, match="samples = 0"):
        EvalOptions(samples=0)


def test_unknown_benchmark_and_missing_data_name_the_fix(tmp_path):
    with pytest.raises(BenchmarkError, match="unknown benchmark 'mmlu'.*arithmetic, arithmetic_train, gsm8k, ifeval"):
        load_benchmark("mmlu", DATA)
    bench = load_benchmark("gsm8k", tmp_path)  # constructing reads nothing
    with pytest.raises(BenchmarkError, match="gsm8k/test.jsonl does not exist; set evaluator.data_root"):
        bench.cases()


@pytest.mark.parametrize(
    ("answer", "gold"),
    [("3 + 4 = 7\n#### 7", "7"), ("big\n#### 1,250", "1250"), ("x #### 2 then\n#### -3.5", "-3.5")],
)
def test_gsm8k_reference_is_the_value_after_the_last_marker(answer, gold):
    assert final_answer(answer) == gold


def test_gsm8k_reference_without_marker_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="no final value"):
        final_answer("the answer is 7")
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "test.jsonl").write_text(json.dumps({"question": "q", "answer": "7"}) + "\n")
    with pytest.raises(BenchmarkError, match=r"test.jsonl:1: expected .*'#### N'"):
        GSM8K(tmp_path).cases()


@pytest.mark.parametrize(
    ("completion", "correct"),
    [
        ("12 + 30 = 42, so \\boxed{42}", True),
        ("first \\boxed{41} then corrected: \\boxed{42}", True),
        ("The total is 42.", True),  # no box: the last number
        ("\\boxed{42} but later I say 41", True),  # a box wins over later numbers
        ("It is 42 or maybe 43", False),
        ("\\boxed{\\frac{84}{2}}", True),  # symbolic equality through math-verify
        ("no number at all", False),
    ],
)
def test_gsm8k_completion_answer_is_boxed_else_last_number(completion, correct):
    bench = GSM8K(DATA)
    case = next(c for c in bench.cases() if c.context["answer"] == "42")
    assert bench.score(case, completion).values["accuracy"] == float(correct)


def test_shipped_gsm8k_data_parses_with_numeric_references():
    cases = GSM8K(DATA).cases()
    assert 20 <= len(cases) <= 50
    for c in cases:
        float(c.context["answer"])
        assert c.chat and "\\boxed" in c.prompt[0].content  # type: ignore[index]
        assert "####" not in c.prompt[0].content  # type: ignore[index]  # the reference never reaches the model


def test_held_out_arithmetic_uses_the_task_generator_and_verifier_with_another_seed():
    bench = HeldOutArithmetic(DATA)
    cases = bench.cases()
    spec = json.loads((DATA / "arithmetic" / "heldout.json").read_text())
    assert len(cases) == spec["count"]
    task = ArithmeticTask(
        seed=spec["seed"],
        num_problems=spec["count"],
        max_value=spec["max_value"],
        heldout_fraction=spec["heldout_fraction"],
        heldout=True,
    )
    assert [(c.prompt, c.context["answer"]) for c in cases] == [
        (p.prompt, p.answer) for p in (task.problem(i) for i in range(len(task)))
    ]
    case = cases[0]
    answer = case.context["answer"]
    assert bench.score(case, f"{answer} and more").values == {"accuracy": 1.0}
    assert bench.score(case, f"{int(answer) + 1}").values == {"accuracy": 0.0}
    assert spec["seed"] != TaskConfig().seed


def test_held_out_arithmetic_follows_the_training_knobs_and_refuses_the_training_seed():
    spec = json.loads((DATA / "arithmetic" / "heldout.json").read_text())
    train = TaskConfig(operators="*", max_value=9, min_operands=3, max_operands=3)
    cases = load_benchmark("arithmetic", DATA, train).cases()
    assert all(c.prompt.count("*") == 2 and "+" not in c.prompt for c in cases)  # type: ignore[union-attr]
    with pytest.raises(BenchmarkError, match=f"arithmetic seed {spec['seed']}.*equals rollout.task.seed"):
        load_benchmark("arithmetic", DATA, TaskConfig(seed=spec["seed"])).cases()


def test_held_out_arithmetic_follows_the_one_arithmetic_generator_of_a_prompt_mixture(tmp_path):
    from common.config import PromptSourceConfig

    words = tmp_path / "words.jsonl"
    words.write_text(json.dumps({"prompt": "two and two", "answer": "4"}) + "\n")
    gen = PromptSourceConfig(name="arith", format="arithmetic", operators="*", max_value=9)
    mixture = TaskConfig(kind="mixture", sources=[gen, PromptSourceConfig(name="words", path=str(words))])
    cases = load_benchmark("arithmetic", DATA, mixture).cases()
    assert all(c.prompt.count("*") == 1 and "+" not in c.prompt for c in cases)  # type: ignore[union-attr]
    two = TaskConfig(kind="mixture", sources=[gen, dataclasses.replace(gen, name="arith2")])
    with pytest.raises(BenchmarkError, match="has 2 sources of format 'arithmetic'"):
        load_benchmark("arithmetic", DATA, two).cases()


def test_case_ids_are_unique_and_never_name_two_different_prompts():
    demo = load_config(ROOT / "configs" / "demo.toml").rollout.task
    tasks = [
        None,
        demo,
        TaskConfig(operators="-+"),
        TaskConfig(operators="*", min_operands=3, max_operands=3),
        TaskConfig(max_value=9),
        TaskConfig(min_operands=2, max_operands=3),
    ]
    sets = [load_benchmark("arithmetic", DATA, t).cases() for t in tasks]
    sets += [load_benchmark(name, DATA).cases() for name in ("gsm8k", "ifeval")]
    prompt_of: dict[str, object] = {}
    for cases in sets:
        assert len({c.id for c in cases}) == len(cases)
        for c in cases:
            assert prompt_of.setdefault(c.id, c.prompt) == c.prompt, f"id {c.id} names two different prompts"
    # The demo's held-out set and the data file's default set share the seed, yet no id (before: arith-1000003-0).
    default, demo_set = sets[0], sets[1]
    assert default[0].prompt != demo_set[0].prompt and default[0].id != demo_set[0].id
    assert demo_set[0].id == "arith-1000003-2to2ops-max6-pm-h0.25-0"


def test_held_out_operators_outside_the_generators_are_refused_naming_the_file(tmp_path):
    (tmp_path / "arithmetic").mkdir()
    spec = json.loads((DATA / "arithmetic" / "heldout.json").read_text()) | {"operators": "+/"}
    (tmp_path / "arithmetic" / "heldout.json").write_text(json.dumps(spec))
    with pytest.raises(BenchmarkError, match=r"heldout.json: operators = '\+/'; use a non-empty subset of '\+-\*'"):
        load_benchmark("arithmetic", tmp_path).cases()


@pytest.mark.timeout(60)
def test_importing_and_constructing_benchmarks_reads_no_data_and_imports_nothing_heavy(tmp_path):
    code = (
        "import sys\n"
        "from evaluator.benchmark import load_benchmark\n"
        "import evaluator.runner, evaluator.role\n"
        f"bs = [load_benchmark(n, {str(tmp_path)!r}) for n in ('arithmetic', 'gsm8k', 'ifeval', 'tool_arithmetic')]\n"
        "heavy = [m for m in ('math_verify', 'transformers', 'torch', 'sympy') if m in sys.modules]\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"  # and the empty data root was never read (no error)
