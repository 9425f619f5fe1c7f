"""lm-evaluation-harness tasks as benchmarks (evaluator/benchmarks/lm_eval_task.py), without a server: names and
metrics mapped from lm-eval's results, the config refusals (a bad name, a missing include directory, a task lm-eval
does not know, lm-eval not importable, sampling overrides it cannot honour), the config field reaching the plan,
a task of our own loaded offline from a local YAML + JSONL by the real lm-eval with its dataset cache under
the directory we give (lm-eval's `dummy` model answers), `slipstream eval --benchmark lm_eval:<task>`, and
`evaluate` of a task against an OpenAI-compatible stand-in for vLLM over real HTTP (what lm-eval sends, the score
from the answers, the per-case file, and a version that moves mid-task recorded nowhere). Against real vLLM:
tests/e2e/test_eval_live.py."""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from transformers import AutoTokenizer

from common.config import EvaluatorConfig
from evaluator.backend import Backend
from evaluator.benchmark import BenchmarkError, EvalOptions, load_benchmark
from evaluator.benchmarks.lm_eval_task import LmEvalTask, apply_cache_env, cache_env, metric_name, task_metrics
from evaluator.cache import ResultCache
from evaluator.cli import build_parser, cli_plan
from evaluator.runner import VersionMoved, WeightInfoProbe, eval_plan, evaluate
from tests.support.rl_routes import serve_app
from trainer.tinykit import build_tokenizer


@pytest.fixture
def hf_settings(monkeypatch):
    """apply_cache_env sets environment variables and library constants process-wide; put them back afterwards."""
    import datasets.config
    import huggingface_hub.constants

    for key in cache_env(Path(".")):
        monkeypatch.delenv(key, raising=False)
    for name in ("HF_DATASETS_CACHE", "HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setattr(datasets.config, name, getattr(datasets.config, name))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", huggingface_hub.constants.HF_HUB_OFFLINE)


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


def test_a_local_task_runs_offline_with_its_caches_under_the_given_directory(tmp_path, monkeypatch, hf_settings):
    tasks = write_task(tmp_path)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    apply_cache_env(tmp_path / "cache")
    import lm_eval

    task = LmEvalTask("lm_eval:unit_qa", str(tasks))
    results = lm_eval.simple_evaluate(
        model="dummy", tasks=["unit_qa"], task_manager=task.task_manager(), bootstrap_iters=0
    )
    assert results is not None
    metrics, primary = task_metrics(results["results"]["unit_qa"])
    assert primary == "exact_match" and metrics["exact_match"] == 0.0  # the dummy model answers "lol"
    assert (tmp_path / "cache" / "hf" / "datasets" / "json").is_dir()
    assert list(home.iterdir()) == []


def test_slipstream_eval_takes_lm_eval_tasks_and_their_include_path(tmp_path):
    tasks = write_task(tmp_path)
    args = build_parser().parse_args(
        ["--url", "http://x", "--benchmark", "lm_eval:unit_qa", "--lm-eval-include-path", str(tasks)]
    )
    (task,) = cli_plan(args, None).benchmarks
    assert isinstance(task, LmEvalTask) and task.include_path == str(tasks)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--url", "http://x", "--benchmark", "lm_eval:"])


@dataclass
class Server:
    """An OpenAI-compatible stand-in for vLLM (in-process aiohttp over loopback): lm-eval's requests are what is
    checked here, and a version that moves on request; its completion is always "2"."""

    tokenizer: str
    version: int = 0
    bump_after: int | None = None
    bodies: list[dict] = field(default_factory=list)
    auth: list[str] = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/weight_info", self.weight_info)
        app.router.add_post("/v1/completions", self.complete)
        return app

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "policy", "max_model_len": 256, "root": self.tokenizer}]})

    async def weight_info(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": str(self.version)})

    async def complete(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        self.auth.append(request.headers.get("Authorization", ""))
        if self.bump_after is not None and len(self.bodies) >= self.bump_after:
            self.version += 1
            self.bump_after = None
        prompts = body["prompt"] if isinstance(body["prompt"][0], list) else [body["prompt"]]
        choices = [{"index": i, "text": "2", "finish_reason": "stop"} for i in range(len(prompts))]
        return web.json_response({"choices": choices})


async def evaluate_against(server: Server, tasks: Path, out: Path):
    runner, url = await serve_app(server.app())
    try:
        # The evaluator's session carries the workers' API key (rollout.api_key): lm-eval's requests must too.
        async with aiohttp.ClientSession(headers={"Authorization": "Bearer worker-key"}) as session:
            backend = Backend(session, url, "policy")
            await backend.describe()
            await backend.choose_counter()
            with ResultCache(out / "cache.jsonl") as cache:
                task = load_benchmark("lm_eval:unit_qa", "evaluator/data", lm_eval_include_path=str(tasks))
                return await evaluate(task, backend, cache, out, WeightInfoProbe(backend, url), EvalOptions())
    finally:
        await runner.cleanup()


@pytest.mark.timeout(120)
async def test_an_lm_eval_task_is_scored_from_the_servers_answers_and_recorded_under_its_version(tmp_path, hf_settings):
    tasks = write_task(tmp_path)
    tokenizer = tmp_path / "tok"
    build_tokenizer(tokenizer)
    server = Server(str(tokenizer), version=7)
    result = await evaluate_against(server, tasks, tmp_path / "out")
    # "2" is right for "1 + 1", wrong for "2 + 2"; the prompts went as the served tokenizer's ids, greedy, capped.
    assert (result.benchmark, result.version, result.primary, result.score) == (
        "lm_eval:unit_qa",
        "7",
        "exact_match",
        0.5,
    )
    tok = AutoTokenizer.from_pretrained(tokenizer)
    # One prompt per request (lm-eval's batch of one), as token ids.
    assert sorted(p for b in server.bodies for p in b["prompt"]) == sorted(
        [tok("1 + 1 =")["input_ids"], tok("2 + 2 =")["input_ids"]]
    )
    assert all(b["model"] == "policy" and b["max_tokens"] == 4 and b["temperature"] == 0 for b in server.bodies)
    assert server.auth == ["Bearer worker-key"] * 2
    lines = [json.loads(x) for x in Path(result.cases_path).read_text().splitlines()]
    assert [(x["target"], x["filtered"], x["scores"]) for x in lines] == [
        ("2", ["2"], {"exact_match": 1.0}),
        ("4", ["2"], {"exact_match": 0.0}),
    ]
    assert json.loads(Path(result.summary_path).read_text())["metrics"]["exact_match"] == 0.5


@pytest.mark.timeout(120)
async def test_an_lm_eval_task_during_which_the_version_moved_is_not_recorded(tmp_path, hf_settings):
    tasks = write_task(tmp_path)
    tokenizer = tmp_path / "tok"
    build_tokenizer(tokenizer)
    with pytest.raises(VersionMoved, match="from 3 to 4"):
        await evaluate_against(Server(str(tokenizer), version=3, bump_after=1), tasks, tmp_path / "out")
    assert not list((tmp_path / "out").glob("*.summary.json"))
