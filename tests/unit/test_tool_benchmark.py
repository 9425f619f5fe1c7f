"""The `tool_arithmetic` benchmark (evaluator/benchmarks/tool_arithmetic.py): held-out arithmetic played as greedy
multi-turn tool episodes through the token-in/token-out route, run whole by `evaluate`.

The policy is a scripted stand-in for vLLM: an aiohttp app on loopback answering /v1/models, /weight_info and
/inference/v1/generate with the token ids it is told to write (with a log-prob and weight version per token, as
rollout.client.parse_choice reads them, and honouring max_tokens), over the tiny kit's tokenizer. A stand-in,
because the real tiny model cannot be made to write a given tool call; the real-vLLM check is a launched run's.
Checked: a case that calls the calculator and answers with its result scores accuracy 1, tool_call 1 in 2 turns,
and a direct wrong answer 0, 0 in 1 turn; the requests are greedy, carry the worker's key, and each turn's prompt
is the one before it, its sampled ids and the observation's ids; the summary and cases files hold the metrics and
each episode's pieces; a version that moves mid-run raises VersionMoved and writes nothing; the same problems as
`arithmetic`; the plan takes rollout.episode; sampling overrides are refused, a missing tokenizer names the fix.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from transformers import AutoTokenizer

from common.config import EpisodeConfig, EvaluatorConfig
from evaluator.backend import Backend
from evaluator.benchmark import BenchmarkError, EvalOptions, load_benchmark
from evaluator.benchmarks.tool_arithmetic import ToolArithmetic
from evaluator.cache import ResultCache
from evaluator.runner import EvalResult, VersionMoved, WeightInfoProbe, eval_plan, evaluate
from rollout.tools.env import call_text
from tests.support.rl_routes import serve_app
from trainer.tinykit import build_tokenizer

DATA = Path(__file__).resolve().parents[2] / "evaluator" / "data"
RESPONSE = re.compile(r"<tool_response>\s*(.*?)\s*</tool_response>", re.S)


@dataclass
class ScriptedPolicy:
    """The stand-in for vLLM (module docstring). Per problem prompt it either calls the calculator on the
    prompt's expression and then answers with the tool's result ("call"), or answers `wrong` at once."""

    tokenizer_dir: str
    calls: set[str]
    wrong: str = "99"  # no sum or difference of two operands in 0..20
    root: str | None = None
    """The model directory /v1/models reports (None: the tokenizer's)."""
    version: int = 0
    bump_after: int | None = None
    bodies: list[dict] = field(default_factory=list)
    auth: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tok = AutoTokenizer.from_pretrained(self.tokenizer_dir)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/weight_info", self.weight_info)
        app.router.add_post("/inference/v1/generate", self.generate)
        return app

    async def models(self, request: web.Request) -> web.Response:
        root = self.tokenizer_dir if self.root is None else self.root
        return web.json_response({"data": [{"id": "policy", "max_model_len": 256, "root": root}]})

    async def weight_info(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": str(self.version)})

    def turn(self, context: str) -> str:
        """What the policy writes next, given everything so far as text."""
        results = RESPONSE.findall(context)
        if results:
            return results[-1]
        prompt = context.strip()
        if prompt in self.calls:
            return call_text("calculator", {"expression": prompt.removesuffix("=")})
        return self.wrong

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        self.auth.append(request.headers.get("Authorization", ""))
        context = self.tok.decode(body["token_ids"])
        ids = [*self.tok(self.turn(context), add_special_tokens=False)["input_ids"], self.tok.eos_token_id]
        limit = body["sampling_params"]["max_tokens"]
        finish = "length" if len(ids) > limit else "stop"
        ids = ids[:limit]
        choice: dict[str, Any] = {
            "index": 0,
            "token_ids": ids,
            "logprobs": {"content": [{"token_id": t, "logprob": -0.25} for t in ids]},
            "weight_versions": [{"start": 0, "end": len(ids), "version": self.version}],
            "finish_reason": finish,
        }
        if self.bump_after is not None and len(self.bodies) >= self.bump_after:
            self.version += 1
            self.bump_after = None
        return web.json_response({"choices": [choice]})


async def play(policy: ScriptedPolicy, out: Path, options: EvalOptions, episode: EpisodeConfig | None = None):
    runner, url = await serve_app(policy.app())
    try:
        # A pinned eval worker's requests carry the workers' key on the session (rollout.api_key).
        async with aiohttp.ClientSession(headers={"Authorization": "Bearer worker-key"}) as session:
            backend = Backend(session, url, "policy")
            await backend.describe()
            await backend.choose_counter()
            bench = load_benchmark("tool_arithmetic", DATA, episode=episode)
            with ResultCache(out / "cache.jsonl") as cache:
                return await evaluate(bench, backend, cache, out, WeightInfoProbe(backend, url), options)
    finally:
        await runner.cleanup()


@pytest.fixture
def tokenizer_dir(tmp_path: Path) -> str:
    path = tmp_path / "tok"
    build_tokenizer(path)
    return str(path)


def first_two() -> list[str]:
    """The prompts of the first two held-out problems (the cases `limit = 2` plays)."""
    return [p.prompt for p in load_benchmark("tool_arithmetic", DATA).problems[:2]]  # type: ignore[attr-defined]


# A calculator call is 27 tiny-kit tokens, more than the data file's 16 per answer: the turn budget is raised.
OPTIONS = EvalOptions(limit=2, max_tokens=48)


@pytest.mark.timeout(60)
async def test_a_calculator_call_then_the_right_answer_scores_1_and_a_direct_wrong_answer_scores_0(
    tmp_path, tokenizer_dir
):
    calls, direct = first_two()
    policy = ScriptedPolicy(tokenizer_dir, calls={calls}, version=5)
    result = await play(policy, tmp_path / "out", OPTIONS)
    assert isinstance(result, EvalResult)
    assert (result.benchmark, result.version, result.primary, result.cases) == (
        "tool_arithmetic",
        "5",
        "accuracy/mean",
        2,
    )
    lines = [json.loads(x) for x in Path(result.cases_path).read_text().splitlines()]
    called, answered = lines
    assert called["scores"] == {"accuracy": 1.0, "tool_call": 1.0, "turns": 2}
    assert [t["by"] for t in called["turns"]] == ["policy", "env", "policy"]
    assert called["turns"][0]["text"] == call_text("calculator", {"expression": calls.removesuffix("=")})
    assert called["turns"][1]["text"] == f"<tool_response>\n{called['answer']}\n</tool_response>"
    assert called["turns"][2]["text"] == called["answer"]
    assert (called["ended"], called["reward"], called["tool_calls"], called["tool_errors"], called["versions"]) == (
        "done",
        1.0,
        1,
        0,
        [5],
    )
    assert answered["prompt"] == direct and answered["answer"] != "99"
    assert answered["scores"] == {"accuracy": 0.0, "tool_call": 0.0, "turns": 1}
    assert [(t["by"], t["text"]) for t in answered["turns"]] == [("policy", "99")]
    metrics = json.loads(Path(result.summary_path).read_text())["metrics"]
    assert metrics["accuracy/mean"] == result.score == 0.5
    assert metrics["tool_call/mean"] == 0.5 and metrics["turns/mean"] == 1.5 and metrics["turns/std"] == 0.5
    assert "accuracy/pass@1" in metrics and not any(k.startswith("turns/pass@") for k in metrics)
    assert Path(result.summary_path).name == "tool_arithmetic.v5.summary.json"

    # Greedy, the worker's key, and each turn's prompt is the last one with the sampled ids and the observation's.
    params = [b["sampling_params"] for b in policy.bodies]
    assert all((p["temperature"], p["top_k"], p["top_p"], p["max_tokens"]) == (0.0, 0, 1.0, 48) for p in params)
    assert policy.auth == ["Bearer worker-key"] * 3
    tok = policy.tok
    prompt = tok(calls)["input_ids"]
    first, second = (b["token_ids"] for b in policy.bodies if b["token_ids"][: len(prompt)] == prompt)
    sampled = [*tok(called["turns"][0]["text"], add_special_tokens=False)["input_ids"], tok.eos_token_id]
    observation = tok(called["turns"][1]["text"], add_special_tokens=False)["input_ids"]
    assert first == prompt and second == first + sampled + observation


@pytest.mark.timeout(60)
async def test_the_run_s_max_turns_ends_an_episode_that_keeps_calling_and_scores_it_0(tmp_path, tokenizer_dir):
    calls, _ = first_two()
    policy = ScriptedPolicy(tokenizer_dir, calls={calls})
    result = await play(policy, tmp_path / "out", EvalOptions(limit=1, max_tokens=48), EpisodeConfig(max_turns=1))
    (line,) = [json.loads(x) for x in Path(result.cases_path).read_text().splitlines()]
    assert (line["ended"], line["scores"]) == ("max_turns", {"accuracy": 0.0, "tool_call": 1.0, "turns": 1})
    assert result.options["episode"]["max_turns"] == 1


@pytest.mark.timeout(60)
async def test_a_version_that_moves_mid_run_raises_version_moved_and_records_nothing(tmp_path, tokenizer_dir):
    calls, _ = first_two()
    policy = ScriptedPolicy(tokenizer_dir, calls={calls}, version=3, bump_after=1)
    with pytest.raises(VersionMoved, match="from 3 to 4"):
        await play(policy, tmp_path / "out", OPTIONS)
    assert not list((tmp_path / "out").glob("tool_arithmetic*"))


def test_it_asks_the_same_held_out_problems_as_arithmetic_under_its_own_ids():
    tool = load_benchmark("tool_arithmetic", DATA)
    plain = load_benchmark("arithmetic", DATA)
    assert [c.prompt for c in tool.cases()] == [c.prompt for c in plain.cases()]
    assert [c.context for c in tool.cases()] == [c.context for c in plain.cases()]
    assert tool.cases()[0].id.startswith("arith-tool-") and tool.runs_whole


def test_the_plan_hands_the_run_s_episode_section_to_the_benchmark():
    episode = EpisodeConfig(environment="tools", tools=["calculator", "python"], max_turns=3)
    plan = eval_plan(EvaluatorConfig(benchmarks=["tool_arithmetic", "arithmetic"]), None, False, episode)
    tool, plain = plan.benchmarks
    assert isinstance(tool, ToolArithmetic) and tool.episode_config is episode and plain.episode is episode
    (default,) = eval_plan(EvaluatorConfig(benchmarks=["tool_arithmetic"]), None).benchmarks
    assert isinstance(default, ToolArithmetic) and default.episode_config == EpisodeConfig()


async def test_sampling_overrides_are_refused_naming_the_flags(tmp_path):
    bench = load_benchmark("tool_arithmetic", DATA)
    for options in (EvalOptions(samples=4), EvalOptions(temperature=0.7), EvalOptions(top_p=0.9)):
        with pytest.raises(BenchmarkError, match="leave --samples, --temperature and --top-p unset"):
            await bench.run(None, tmp_path, None, options, 1, None)  # type: ignore[arg-type]


@pytest.mark.timeout(60)
async def test_a_tokenizer_not_readable_here_is_an_error_naming_the_fix(tmp_path, tokenizer_dir):
    policy = ScriptedPolicy(tokenizer_dir, calls=set(), root=str(tmp_path / "elsewhere"))
    runner, url = await serve_app(policy.app())
    try:
        async with aiohttp.ClientSession() as session:
            backend = Backend(session, url, "policy")
            await backend.describe()
            with pytest.raises(BenchmarkError, match="elsewhere.*has no tokenizer_config.json.*pass --tokenizer DIR"):
                await load_benchmark("tool_arithmetic", DATA).run(
                    backend, tmp_path, WeightInfoProbe(backend, url), EvalOptions(), 1, None
                )
    finally:
        await runner.cleanup()
