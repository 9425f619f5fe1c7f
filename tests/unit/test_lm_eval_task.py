"""lm-evaluation-harness tasks as benchmarks (evaluator/benchmarks/lm_eval_task.py), without a server: names and
metrics mapped from lm-eval's results, the config refusals (a bad name, a missing include directory, a task lm-eval
does not know, lm-eval not importable, sampling overrides it cannot honour), the config field reaching the plan,
and a task of our own loaded offline from a local YAML + JSONL by the real lm-eval with its dataset cache under
the directory we give (lm-eval's `dummy` model answers: scoring against vLLM is in tests/e2e/test_eval_live.py)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from common.config import EvaluatorConfig
from evaluator.benchmark import BenchmarkError, EvalOptions, load_benchmark
from evaluator.benchmarks.lm_eval_task import LmEvalTask, apply_cache_env, cache_env, metric_name, task_metrics
from evaluator.runner import eval_plan


def write_task(root: Path) -> Path:
    (root / "qa.jsonl").write_text(
        "".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in (("1 + 1", "2"), ("2 + 2", "4")))
    )
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / "qa.yaml").write_text(
        f"task: unit_qa\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {root / 'qa.jsonl'}\n"
        'test_split: test\noutput_type: generate_until\ndoc_to_text: "{{question}} ="\ndoc_to_target: "{{answer}}"\n'
        'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 4\n'
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
    )
    return tasks


def test_lm_eval_result_keys_map_to_our_metric_names_and_the_first_metric_is_primary():
    assert metric_name("exact_match,none") == "exact_match"
    assert metric_name("acc,strict-match") == "acc/strict-match"
    assert metric_name("acc_stderr,none") == "acc/stderr"
    assert metric_name("alias") is None
    metrics, primary = task_metrics(
        {"alias": "t", "sample_len": 3, "acc,none": 0.5, "acc_stderr,none": "N/A", "acc_norm,none": 0.25}
    )
    assert metrics == {"acc": 0.5, "acc_norm": 0.25} and primary == "acc"
    with pytest.raises(BenchmarkError, match="no metric"):
        task_metrics({"alias": "t"})


def test_lm_eval_names_and_include_path_are_checked_naming_the_fix(tmp_path):
    with pytest.raises(BenchmarkError, match="lm_eval:<task>"):
        load_benchmark("lm_eval:", "evaluator/data")
    with pytest.raises(BenchmarkError, match="lm_eval_include_path = .*is not a directory"):
        load_benchmark("lm_eval:x", "evaluator/data", lm_eval_include_path=str(tmp_path / "missing"))
    with pytest.raises(BenchmarkError, match="'lm_eval:<task>' for an lm-evaluation-harness task"):
        load_benchmark("lm-eval:x", "evaluator/data")


def test_lm_eval_not_installed_is_refused_with_the_install_command(monkeypatch):
    """lm-eval is installed here: sys.modules["lm_eval"] = None makes it unimportable, as Python documents."""
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    with pytest.raises(BenchmarkError, match=r"not installed; pip install 'slipstream\[lmeval\]'"):
        load_benchmark("lm_eval:gsm8k", "evaluator/data")


def test_the_config_field_reaches_the_plan_and_an_unknown_task_is_refused(tmp_path):
    tasks = write_task(tmp_path)
    ev = EvaluatorConfig(benchmarks=["arithmetic", "lm_eval:unit_qa"], lm_eval_include_path=str(tasks))
    plan = eval_plan(ev, None)
    (task,) = [b for b in plan.benchmarks if isinstance(b, LmEvalTask)]
    assert (task.name, task.task, task.include_path) == ("lm_eval:unit_qa", "unit_qa", str(tasks))
    with pytest.raises(BenchmarkError, match="no task 'nope'.*lm_eval_include_path"):
        LmEvalTask("lm_eval:nope", str(tasks)).task_manager()
    with pytest.raises(BenchmarkError, match="samples and top_p cannot be overridden"):
        asyncio.run(task.run(None, tmp_path, None, EvalOptions(samples=4), 1, None))  # type: ignore[arg-type]


def test_a_local_task_runs_offline_with_its_caches_under_the_given_directory(tmp_path, monkeypatch):
    tasks = write_task(tmp_path)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for key in cache_env(tmp_path):
        monkeypatch.delenv(key, raising=False)  # restored afterwards: apply_cache_env sets them process-wide
    apply_cache_env(tmp_path / "cache")
    import lm_eval

    task = LmEvalTask("lm_eval:unit_qa", str(tasks))
    results = lm_eval.simple_evaluate(model="dummy", tasks=["unit_qa"], task_manager=task.task_manager())
    assert results is not None
    metrics, primary = task_metrics(results["results"]["unit_qa"])
    assert primary == "exact_match" and metrics["exact_match"] == 0.0  # the dummy model answers "lol"
    assert (tmp_path / "cache" / "hf" / "datasets" / "json").is_dir()
    assert list(home.iterdir()) == []
