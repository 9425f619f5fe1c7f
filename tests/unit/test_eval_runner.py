"""The evaluation runner over real HTTP against a fake OpenAI-compatible backend (an in-process aiohttp
server standing in for vLLM: /v1/models, /tokenize counting characters, completions and chat with `n`,
/weight_info, scripted failure statuses and a version bump after a given number of requests). It
checks: summary and per-case files, max_tokens clamping, retries only on transport errors and
408/425/429/5xx, permanent 4xx failing at once with the server's text, resuming an interrupted run
from the cache without regenerating finished cases, discarding a chunk whose version moved, a cached
answer never served for another prompt under the same case id, the `slipstream eval` command (with
--config / --run-dir building the benchmarks exactly as the evaluator role does, flags winning; with
--run-dir writing under the run dir and printing the score the run recorded for the version; --version
refusing, with the fix, a version it cannot load), and waiting for a served model with one log line per
wait, not per attempt. Loading a version into real vLLM is tested in test_eval_live.py."""

from __future__ import annotations

import asyncio
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from common.config import load_config, to_toml
from common.http import RetryPolicy
from common.keys import Keys
from common.metrics import MetricsWriter
from common.roles import RunContext
from common.runs.cli import main as slipstream_main
from evaluator.backend import Backend, RequestError
from evaluator.benchmark import Case, EvalOptions, Sampling, load_benchmark
from evaluator.cache import ResultCache, fingerprint
from evaluator.cli import build_parser, cli_plan, run_config, worker_setup
from evaluator.runner import VersionMoved, WeightInfoProbe, eval_plan, evaluate
from evaluator.watch_loop import Inputs, Watcher
from rollout.tasks.arithmetic import evaluate as arith_value

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "evaluator" / "data"
DEMO = ROOT / "configs" / "demo.toml"
FAST_RETRY = RetryPolicy(max_retries=4, backoff_s=0.01)


@dataclass
class Fake:
    max_model_len: int = 512
    version: int = 0
    statuses: list[int] = field(default_factory=list)  # answered (in order) before normal answers
    error_text: str = "max_tokens must be positive"
    bump_after: int | None = None  # move the version once this many generation requests were answered
    delay_s: float = 0.0
    generations: list[dict] = field(default_factory=list)
    calls: Counter = field(default_factory=Counter)
    url: str = ""

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        app.router.add_get("/weight_info", self.weight_info)
        return app

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "policy", "max_model_len": self.max_model_len, "root": None}]})

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        text = body.get("prompt") or "".join(m["content"] for m in body["messages"])
        return web.json_response({"count": len(text), "max_model_len": self.max_model_len})

    async def weight_info(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": str(self.version)})

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls[request.path] += 1
        if self.statuses:
            status = self.statuses.pop(0)
            return web.json_response({"error": {"message": self.error_text}}, status=status)
        await asyncio.sleep(self.delay_s)
        self.generations.append(body)
        if self.bump_after is not None and len(self.generations) >= self.bump_after:
            self.version += 1
            self.bump_after = None
        if "prompt" in body:
            text = str(arith_value(body["prompt"].removesuffix("=")))
            choices = [{"index": i, "text": text, "finish_reason": "stop"} for i in range(body["n"])]
        else:
            choices = [
                {"index": i, "message": {"role": "assistant", "content": "all lower text"}, "finish_reason": "stop"}
                for i in range(body["n"])
            ]
        return web.json_response({"choices": choices, "usage": {"prompt_tokens": 5, "completion_tokens": 2}})


@pytest.fixture
async def fake():
    state = Fake()
    runner = web.AppRunner(state.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    state.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    yield state
    await runner.cleanup()


async def run_eval(
    fake: Fake, out: Path, name: str = "arithmetic", options=None, chunk_cases: int = 64, max_concurrent: int = 8
):
    async with aiohttp.ClientSession() as session:
        backend = Backend(session, fake.url, retry=FAST_RETRY)
        await backend.describe()
        await backend.choose_counter()
        with ResultCache(out / "cache.jsonl") as cache:
            return await evaluate(
                load_benchmark(name, DATA),
                backend,
                cache,
                out,
                WeightInfoProbe(backend, fake.url),
                options or EvalOptions(limit=10),
                max_concurrent,
                chunk_cases,
            )


@pytest.mark.timeout(30)
async def test_eval_scores_every_case_and_writes_summary_and_per_case_jsonl(fake, tmp_path):
    result = await run_eval(fake, tmp_path)
    assert (result.version, result.score, result.cases, result.generated, result.cached) == ("0", 1.0, 10, 10, 0)
    summary = json.loads((tmp_path / "arithmetic.v0.summary.json").read_text())
    assert summary["metrics"]["accuracy/mean"] == 1.0 and summary["version"] == "0"
    lines = [json.loads(x) for x in (tmp_path / "arithmetic.v0.cases.jsonl").read_text().splitlines()]
    assert len(lines) == 10 and all(line["scores"] == [{"accuracy": 1.0}] for line in lines)
    assert lines[0]["prompt"] == load_benchmark("arithmetic", DATA).cases()[0].prompt
    assert fake.calls["/v1/completions"] == 10


@pytest.mark.timeout(30)
async def test_chat_cases_go_to_chat_completions_with_n_samples_and_report_pass_at_k(fake, tmp_path):
    result = await run_eval(fake, tmp_path, "ifeval", EvalOptions(limit=4, samples=2, temperature=1.0))
    assert fake.calls == Counter({"/v1/chat/completions": 4})
    assert all(g["n"] == 2 and g["messages"][0]["role"] == "user" and g["temperature"] == 1.0 for g in fake.generations)
    assert "prompt_strict/pass@2" in result.metrics and result.metrics["samples"] == 8


@pytest.mark.timeout(30)
async def test_max_tokens_is_clamped_to_the_context_left_after_the_prompt(fake, tmp_path):
    fake.max_model_len = 6  # arithmetic prompts are 4 to 6 characters, counted as tokens by the fake
    result = await run_eval(fake, tmp_path, options=EvalOptions(limit=20))
    prompts = [c.prompt for c in load_benchmark("arithmetic", DATA).cases()[:20]]
    assert all(g["max_tokens"] == 6 - len(g["prompt"]) for g in fake.generations)
    assert {g["max_tokens"] for g in fake.generations} == {1, 2}
    lines = [json.loads(x) for x in Path(result.cases_path).read_text().splitlines()]
    too_long = [line["prompt"] for line in lines if line["finish_reasons"] == ["prompt_too_long"]]
    assert too_long == [p for p in prompts if len(p) >= 6] and too_long  # never sent, scored as empty
    assert result.prompt_too_long == len(too_long) and len(fake.generations) + len(too_long) == 20
    assert result.metrics["accuracy/mean"] == (20 - len(too_long)) / 20


@pytest.mark.timeout(30)
async def test_transient_statuses_are_retried_and_the_eval_completes(fake, tmp_path):
    fake.statuses = [503, 429, 408, 500]
    result = await run_eval(fake, tmp_path, max_concurrent=1)
    assert result.score == 1.0
    assert fake.calls["/v1/completions"] == 10 + 4


@pytest.mark.timeout(30)
async def test_a_permanent_4xx_fails_at_once_with_the_server_text(fake, tmp_path):
    fake.statuses = [400] * 10
    with pytest.raises(RequestError, match="HTTP 400 \\(not retried\\).*max_tokens must be positive") as err:
        await run_eval(fake, tmp_path, max_concurrent=1)
    assert not err.value.transient
    assert fake.calls["/v1/completions"] == 1


@pytest.mark.timeout(30)
async def test_transport_errors_are_retried_then_reported_as_transient():
    async with aiohttp.ClientSession() as session:
        backend = Backend(session, "http://127.0.0.1:9", retry=RetryPolicy(max_retries=2, backoff_s=0.01))
        with pytest.raises(RequestError, match="failed after 3 attempts.*ClientConnector") as err:
            await backend.describe()
    assert err.value.transient


@pytest.mark.timeout(30)
async def test_an_interrupted_eval_resumes_from_its_cache_without_regenerating_finished_cases(fake, tmp_path):
    fake.delay_s = 0.05
    task = asyncio.create_task(run_eval(fake, tmp_path, options=EvalOptions(limit=20), chunk_cases=4, max_concurrent=4))
    while len(fake.generations) < 9:  # two chunks done, the third in flight
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    cached = len(ResultCache(tmp_path / "cache.jsonl").records)
    assert cached in (8, 12)  # whole chunks only
    first = fake.calls["/v1/completions"]  # counted on arrival: includes the abandoned in-flight chunk
    result = await run_eval(fake, tmp_path, options=EvalOptions(limit=20), chunk_cases=4)
    assert (result.cached, result.generated) == (cached, 20 - cached)
    assert fake.calls["/v1/completions"] - first == 20 - cached
    assert result.score == 1.0
    again = await run_eval(fake, tmp_path, options=EvalOptions(limit=20))
    assert again.generated == 0 and fake.calls["/v1/completions"] - first == 20 - cached


@pytest.mark.timeout(30)
async def test_a_chunk_during_which_the_version_moved_is_discarded(fake, tmp_path):
    fake.bump_after = 6  # a publish lands in the second chunk of 4
    with pytest.raises(VersionMoved, match="from 0 to 1"):
        await run_eval(fake, tmp_path, options=EvalOptions(limit=12), chunk_cases=4, max_concurrent=4)
    records = ResultCache(tmp_path / "cache.jsonl").records.values()
    assert len(records) == 4 and {r["version"] for r in records} == {"0"}
    result = await run_eval(fake, tmp_path, options=EvalOptions(limit=12), chunk_cases=4)
    assert (result.version, result.generated, result.cached) == ("1", 12, 0)  # a new version reuses nothing


def test_cache_drops_a_torn_last_line_and_keeps_appending(tmp_path):
    path = tmp_path / "cache.jsonl"
    with ResultCache(path) as cache:
        cache.put("a", {"texts": ["1"]})
    with path.open("a") as fh:
        fh.write('{"key": "b", "te')
    with ResultCache(path) as cache:
        assert set(cache.records) == {"a"}
        cache.put("c", {"texts": ["3"]})
    assert set(ResultCache(path).records) == {"a", "c"}


def test_a_cached_answer_is_never_served_for_another_prompt_under_the_same_case_id():
    # Case ids of older versions repeated across configs (arith-1000003-0 for 7+3= and for 15-4=): the key
    # holds the prompt, so an old cache entry can only be found by the very prompt it answered.
    sampling = Sampling(max_tokens=16)
    a, b = Case("arith-1000003-0", "7+3=", sampling), Case("arith-1000003-0", "15-4=", sampling)
    assert fingerprint("5", "policy", a) != fingerprint("5", "policy", b)
    assert fingerprint("5", "policy", a) == fingerprint("5", "policy", Case(a.id, "7+3=", sampling))


def role_cases(cfg) -> dict[str, list[Case]]:
    """The cases the evaluator role generates for each benchmark of `cfg` (its Watcher's benchmarks and options)."""
    ctx = RunContext(cfg, "evaluator", "t", Path(cfg.run.dir), Path(cfg.run.dir), "i0", None, Keys("t"))  # type: ignore[arg-type]
    watcher = Watcher(Inputs(ctx, None, eval_plan(cfg.evaluator, cfg.rollout.task), None, None))  # type: ignore[arg-type]
    return {b.name: watcher.options.apply(b.cases()) for b in watcher.benchmarks}


def test_eval_with_the_demo_config_builds_the_cases_the_evaluator_role_builds(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # evaluator.data_root is relative, for the command as for the role
    cfg = load_config(DEMO, [f"run.dir={tmp_path}"])
    expected = role_cases(cfg)
    args = build_parser().parse_args(["--url", "http://127.0.0.1:1", "--config", str(DEMO)])
    todo = cli_plan(args, run_config(args))
    got = {b.name: todo.options.apply(b.cases()) for b in todo.benchmarks}
    assert list(got) == ["arithmetic"] and got == expected
    assert (todo.max_concurrent, todo.chunk_cases) == (cfg.evaluator.max_concurrent, cfg.evaluator.chunk_cases)
    cases = got["arithmetic"]
    # The run's knobs (operands 0..6), not the data file's (0..20); greedy, the data file's max_tokens.
    assert len(cases) == 200 and max(int(v) for c in cases for v in re.findall(r"\d+", c.prompt)) == 6
    assert {c.sampling for c in cases} == {Sampling(temperature=0.0, max_tokens=16)}
    # Without the config the command takes the data file's own problems, which the demo never trained on.
    bare = build_parser().parse_args(["--url", "http://127.0.0.1:1", "--benchmark", "arithmetic"])
    assert [c.prompt for c in cli_plan(bare, None).benchmarks[0].cases()] != [c.prompt for c in cases]


def test_eval_flags_win_over_the_config_and_set_applies_to_it(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    argv = [
        "--url",
        "http://127.0.0.1:1",
        "--config",
        str(DEMO),
        "--set",
        "evaluator.max_tokens=8",
        "--limit",
        "5",
        "--temperature",
        "0.5",
        "--samples",
        "3",
        "--max-concurrent",
        "2",
    ]
    args = build_parser().parse_args(argv)
    todo = cli_plan(args, run_config(args))
    (cases,) = [todo.options.apply(b.cases()) for b in todo.benchmarks]
    assert len(cases) == 5 and todo.max_concurrent == 2
    assert {(c.sampling.temperature, c.sampling.max_tokens, c.samples) for c in cases} == {(0.5, 8, 3)}
    assert max(int(v) for c in cases for v in re.findall(r"\d+", c.prompt)) <= 6


@pytest.mark.timeout(60)
async def test_eval_run_dir_evaluates_its_config_and_a_missing_config_names_the_fix(
    fake, tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(ROOT)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.toml").write_text(to_toml(load_config(DEMO, [f"run.dir={run_dir}", "evaluator.limit=7"])))
    argv = ["eval", "--url", fake.url, "--run-dir", str(run_dir), "--out", str(tmp_path / "out"), "--max-retries", "1"]
    assert await asyncio.to_thread(slipstream_main, argv) == 0
    assert "arithmetic version=0 accuracy/mean=1.0000 cases=7 generated=7" in capsys.readouterr().out
    sent = [body["prompt"] for body in fake.generations]
    assert sent == [c.prompt for c in role_cases(load_config(run_dir / "config.toml"))["arithmetic"]]
    assert all(body["model"] == "policy" and body["max_tokens"] == 16 for body in fake.generations)
    rc = await asyncio.to_thread(slipstream_main, [*argv[:3], "--run-dir", str(tmp_path)])
    assert rc == 2 and f"--run-dir {tmp_path}: no config.toml there" in capsys.readouterr().err
    rc = await asyncio.to_thread(slipstream_main, ["eval", "--url", fake.url, "--set", "evaluator.limit=3"])
    assert rc == 2 and "needs a config to apply to; pass --config CONFIG or --run-dir" in capsys.readouterr().err
    rc = await asyncio.to_thread(slipstream_main, ["eval", "--url", fake.url])
    assert rc == 1 and "no benchmark to run: pass --benchmark NAME" in capsys.readouterr().err


@pytest.mark.timeout(60)
async def test_slipstream_eval_command_writes_results_and_a_second_run_is_all_cached(fake, tmp_path, capsys):
    argv = [
        "eval",
        "--url",
        fake.url,
        "--benchmark",
        "arithmetic",
        "--benchmark",
        "ifeval",
        "--limit",
        "3",
        "--out",
        str(tmp_path),
        "--max-retries",
        "1",
    ]
    assert await asyncio.to_thread(slipstream_main, argv) == 0
    out = capsys.readouterr().out
    assert "arithmetic version=0 accuracy/mean=1.0000 cases=3 generated=3" in out
    assert "ifeval version=0" in out
    assert await asyncio.to_thread(slipstream_main, argv) == 0
    assert "cases=3 generated=0 cached=3" in capsys.readouterr().out
    assert (tmp_path / "ifeval.v0.summary.json").is_file()
    fake.statuses = [404]
    rc = await asyncio.to_thread(slipstream_main, [*argv[:-4], "--limit", "4", "--out", str(tmp_path)])
    assert rc == 1 and "HTTP 404" in capsys.readouterr().err


def demo_run_dir(path: Path, *overrides: str) -> Path:
    """A run dir holding the demo's config.toml (as `slipstream launch` leaves it), nothing else."""
    path.mkdir()
    (path / "config.toml").write_text(to_toml(load_config(DEMO, [f"run.dir={path}", *overrides])))
    return path


@pytest.mark.timeout(60)
async def test_eval_of_a_run_dir_writes_under_it_and_prints_the_score_the_run_recorded(
    fake, tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(ROOT)
    run_dir = demo_run_dir(tmp_path / "run", "evaluator.limit=7")
    with MetricsWriter(run_dir, "demo", "evaluator") as metrics:  # what the run's evaluator recorded
        metrics.log_many(0, {"eval/arithmetic/accuracy/mean": 1.0, "eval/arithmetic/accuracy/std": 0.0})
        metrics.log_many(1, {"eval/arithmetic/accuracy/mean": 0.5})
    argv = ["eval", "--url", fake.url, "--run-dir", str(run_dir), "--max-retries", "1"]
    assert await asyncio.to_thread(slipstream_main, argv) == 0
    assert "version=0 accuracy/mean=1.0000 recorded 1.0000: same cases=7" in capsys.readouterr().out
    assert (run_dir / "eval-cli" / "arithmetic.v0.summary.json").is_file()
    fake.version = 1
    assert await asyncio.to_thread(slipstream_main, argv) == 0
    assert "version=1 accuracy/mean=1.0000 recorded 0.5000: DIFFERENT cases=7" in capsys.readouterr().out
    fake.version = 2  # a version the run recorded nothing for: the score alone
    assert await asyncio.to_thread(slipstream_main, argv) == 0
    assert "version=2 accuracy/mean=1.0000 cases=7" in capsys.readouterr().out


def test_eval_of_a_version_it_cannot_load_fails_naming_the_path_and_the_fix(tmp_path, capsys):
    run_dir = demo_run_dir(tmp_path / "run")
    weights = run_dir / "weights"

    def fails(*argv: str) -> str:
        assert slipstream_main(["eval", *argv]) == 2
        return capsys.readouterr().err

    err = fails("--url", "http://127.0.0.1:1", "--config", str(DEMO), "--version", "3")
    assert "--version 3 needs the run that published it: pass --run-dir RUN" in err
    err = fails("--run-dir", str(run_dir))
    assert "nothing to evaluate: pass --url URL of a server, or --run-dir RUN --version N" in err
    assert f"{weights} holds no published weight versions" in fails("--run-dir", str(run_dir), "--version", "0")
    for version in (2, 3, 50):
        (weights / f"v{version}").mkdir(parents=True)
    err = fails("--run-dir", str(run_dir), "--version", "0")
    assert f"{weights / 'v0'} does not exist: the run pruned it" in err
    assert "pick one of the kept versions 2, 3, 50, or raise rollout.keep_versions" in err
    assert "the run published versions up to 50" in fails("--run-dir", str(run_dir), "--version", "51")
    err = fails("--run-dir", str(run_dir), "--version", "3", "--weight-version", "x")
    assert "--weight-version x labels a server without /weight_info" in err


def test_a_server_started_for_a_run_is_set_up_as_its_evaluators_worker(tmp_path):
    """A server started for a run takes the config and environment of the worker its evaluator used."""
    run_dir = demo_run_dir(tmp_path / "run")
    path = run_dir / "config.toml"
    # The demo's evaluator pins its eval-pool worker (launch.roles.vllm_eval): that role's overrides and variables.
    cfg, env = worker_setup(path, [], load_config(path))
    assert cfg.rollout.pool == "eval" and env == {"SLIPSTREAM__rollout__pool": "eval", "VLLM_CPU_KVCACHE_SPACE": "1"}
    # Through the router (pin = "never"): a train worker's.
    overrides = ["evaluator.pin=never", "launch.roles.vllm.env.VLLM_CPU_OMP_THREADS_BIND=all"]
    cfg, env = worker_setup(path, overrides, load_config(path, overrides))
    assert cfg.rollout.pool == "train" and env["VLLM_CPU_OMP_THREADS_BIND"] == "all"
    # A run that launched no vLLM role (its workers were started by hand): the run's own config, nothing added.
    bare = load_config(path, ["launch.roles={}"])
    assert worker_setup(path, ["launch.roles={}"], bare) == (bare, {})


async def test_waiting_for_a_served_model_logs_the_wait_once_and_its_end_not_every_attempt(monkeypatch, caplog):
    import logging

    import evaluator.backend

    monkeypatch.setattr(evaluator.backend, "SERVED_POLL_S", 0.02)
    answers = {"unavailable": 20, "calls": 0}

    async def models(request: web.Request) -> web.Response:
        answers["calls"] += 1
        if answers["calls"] <= answers["unavailable"]:  # the router has no healthy worker yet
            return web.json_response({"error": "no healthy worker"}, status=503)
        return web.json_response({"data": [{"id": "policy", "max_model_len": 512, "root": None}]})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    caplog.set_level(logging.INFO, logger="evaluator.backend")
    try:
        async with aiohttp.ClientSession() as session:
            served = await Backend(session, url, "policy").wait_until_served(30)
            answers.update(unavailable=10**9, calls=0)
            with pytest.raises(RequestError, match=r"no model served at .* after 0s: .*HTTP 503") as failed:
                await Backend(session, url, "policy").wait_until_served(0.1)
    finally:
        await runner.cleanup()
    assert served.id == "policy" and failed.value.transient
    messages = [r.getMessage() for r in caplog.records]
    assert sum("waiting for a model served" in m for m in messages) == 2  # once per wait, not once per attempt
    assert sum(m.startswith("model 'policy' served at") for m in messages) == 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
