"""Held-out arithmetic played with tools: `tool_arithmetic` asks exactly the problems the `arithmetic` benchmark
asks (`HeldOutArithmetic`: its data file, the training task's knobs, the held-out side of the split, the same
case order and exact verifier), each as one greedy multi-turn episode of the run's tools environment
(rollout/tools/env.py over `rollout.episode`: its tools and the python tool's limits, `max_turns` policy turns,
`max_tokens` tokens after the prompt, 0: up to the served context), played by `rollout.episode.run_episode`
as training plays them: token ids in and out through the endpoint's /inference/v1/generate (the router in verify
mode, the eval worker loaded with the version in pin mode, with the `Backend`'s bearer token), each turn at most
the data file's `max_tokens` (or evaluator.max_tokens), temperature 0, no top-k or top-p truncation. The first
prompt is templated as the RL prompts are (`chat`: the served tokenizer's chat template, else the plain text) and
observations are appended as their own turns, with the served model's tokenizer (the `Backend`'s local tokenizer
directory, else the served model's root; the evaluator needs one or the other readable).

It runs whole (`runs_whole`): episodes make several requests each, which the result cache does not key, so the
version is read before and after all of them (one chunk) and an evaluation during which it moved raises
VersionMoved; a discarded or interrupted evaluation is played again whole. The python tool's scratch
directories go under `<out dir>/tools/python/`. Metrics: `accuracy` (the verifier on the episode's answer turn;
0 when it ended without one: out of turns or tokens, or stopped at a tool limit, primary `accuracy/mean`),
`tool_call` (1 when the episode called a tool at least once), both with pass@1, and `turns` (policy turns per
episode: its mean and standard deviation only). Each line of the cases file holds one episode: its pieces in
order as text (`turns`: policy and env), why it ended, its reward, tool calls and errors, and the weight versions
that sampled its tokens.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

from common.config import EpisodeConfig
from evaluator.backend import RequestError
from evaluator.benchmark import BenchmarkError, Case, EvalOptions, SampleScore, summarize
from evaluator.benchmarks.arithmetic import DATA_FILE, HeldOutArithmetic
from rollout.chat import ChatTemplateMode, prompt_token_ids
from rollout.client import GENERATE_PATH, RolloutClient, RolloutError, Sample
from rollout.episode import Budget, Episode, run_episode
from rollout.tasks import Problem
from rollout.tools.env import ToolEnvironments

if TYPE_CHECKING:
    from evaluator.backend import Backend, ServedModel
    from evaluator.runner import EvalResult, Snapshot, VersionProbe

log = logging.getLogger(__name__)

_TRANSPORT_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError)
PROMPT_TOO_LONG = "prompt_too_long"


def tokenizer_dir(backend: Backend, served: ServedModel, benchmark: str) -> str:
    """The served model's tokenizer directory readable here: the backend's local tokenizer (--tokenizer, a
    version's own) or the served model's root; a BenchmarkError naming the fix when neither has one."""
    path = getattr(backend.counter, "path", None) or served.root
    if not path or not (Path(path) / "tokenizer_config.json").is_file():
        raise BenchmarkError(
            f"{benchmark}: playing episodes needs the served model's tokenizer directory here; {path!r} has no "
            "tokenizer_config.json (pass --tokenizer DIR to slipstream eval, or run the evaluator where the model "
            "directory is readable)"
        )
    return str(path)


@dataclass
class Played:
    """One case's episode (None when its prompt left no room in the context) and its prompt's token count."""

    case: Case
    problem: Problem
    prompt_tokens: int
    episode: Episode | None


class ToolArithmetic(HeldOutArithmetic):
    """The held-out arithmetic problems as greedy tool episodes (see the module docstring)."""

    name = "tool_arithmetic"
    primary = "accuracy/mean"
    runs_whole = True
    id_prefix = "arith-tool"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._tokenizers: dict[str, Any] = {}

    @property
    def episode_config(self) -> EpisodeConfig:
        """The run's rollout.episode, or its defaults (the calculator, 4 turns, up to the context)."""
        return self.episode if self.episode is not None else EpisodeConfig()

    def tokenizer(self, path: str) -> Any:
        """The served model's tokenizer at `path`, loaded once (blocking: call it off the event loop)."""
        if path not in self._tokenizers:
            from transformers import AutoTokenizer

            self._tokenizers[path] = AutoTokenizer.from_pretrained(path)
        return self._tokenizers[path]

    def check_options(self, options: EvalOptions) -> None:
        """The overrides an episode benchmark honours: limit and max_tokens (per turn); it is greedy, one episode
        per problem, so other sampling is refused."""
        greedy = options.samples in (None, 1) and options.temperature in (None, 0.0) and options.top_p in (None, 1.0)
        if not greedy:
            raise BenchmarkError(
                f"{self.name} plays one greedy episode per problem (temperature 0, top_p 1); samples = "
                f"{options.samples}, temperature = {options.temperature}, top_p = {options.top_p} cannot be "
                "honoured: leave --samples, --temperature and --top-p unset"
            )

    def budget(self, options: EvalOptions, max_model_len: int) -> Budget:
        """rollout.episode's turns and tokens within the served context, each turn at most the data file's
        max_tokens (or the evaluator's max_tokens)."""
        turn_tokens = options.max_tokens or self.spec.max_tokens
        if turn_tokens < 1:
            raise BenchmarkError(
                f"{self.name}: max_tokens = {turn_tokens} in {self.data_root / DATA_FILE} leaves a turn no token; "
                "give it at least 1 (or set evaluator.max_tokens)"
            )
        ep = self.episode_config
        return Budget(ep.max_turns, ep.max_tokens or max_model_len, turn_tokens, max_model_len)

    async def run(
        self,
        backend: Backend,
        out_dir: Path,
        probe: VersionProbe,
        options: EvalOptions,
        max_concurrent: int,
        expect: Snapshot | None,
    ) -> EvalResult:
        """Play every case's episode at the version `probe` reports now (which must equal `expect` when given),
        at most `max_concurrent` at once, as one chunk: VersionMoved if the served version changed by the end.
        Writes the runner's two files."""
        from evaluator.runner import EvalResult, VersionMoved, output_paths, write_atomic

        self.check_options(options)
        started = time.monotonic()
        served = backend.served or await backend.describe()
        tokenizer = await asyncio.to_thread(self.tokenizer, tokenizer_dir(backend, served, self.name))
        mode: ChatTemplateMode = "auto" if self.chat else "off"
        budget = self.budget(options, served.max_model_len)
        cases = self.cases()[: options.limit]
        problems = self.problems[: len(cases)]
        envs = ToolEnvironments.from_config(self.episode_config, self.task, out_dir)
        client = RolloutClient(backend.model, url=backend.url, session=backend.session, token=backend.token)
        start = await probe.read()
        version = start.version
        if not getattr(start, "settled", True) or (expect is not None and start != expect):
            raise VersionMoved(expect.version if expect is not None else version, version)
        log.info(
            "%s at version %s: %d episodes (tools %s, %d turns) against %s",
            self.name,
            version,
            len(cases),
            ", ".join(self.episode_config.tools),
            budget.max_turns,
            backend.url,
        )
        gate = asyncio.Semaphore(max_concurrent)

        async def turn(context: list[int], max_tokens: int, group: str) -> Sample:
            sample = await self.generate(client, backend, context, max_tokens, group)
            if sample.aborted:
                now = await probe.read()
                if now != start:
                    raise VersionMoved(version, now.version)
                raise RequestError(
                    f"{self.name}: a weight update aborted a generation at {backend.url}, yet the served version "
                    f"still reads {now.version}",
                    transient=True,
                )
            return sample

        async def play(case: Case, problem: Problem) -> Played:
            ids = prompt_token_ids(tokenizer, problem.prompt, mode)
            if len(ids) >= budget.max_model_len:  # run_episode's first turn would have no room
                log.warning(
                    "case %s: prompt of %d tokens leaves no room in max_model_len %d; scored as empty",
                    case.id,
                    len(ids),
                    budget.max_model_len,
                )
                return Played(case, problem, len(ids), None)

            async def generate(context: list[int], max_tokens: int) -> Sample:
                return await turn(context, max_tokens, f"eval:{self.name}:{case.id}")

            async with gate:
                episode = await run_episode(envs.new(), problem, generate, tokenizer, mode, budget, lambda _text: ids)
            return Played(case, problem, len(ids), episode)

        tasks = [asyncio.ensure_future(play(c, p)) for c, p in zip(cases, problems, strict=True)]
        try:
            played = await asyncio.gather(*tasks)
        except BaseException:
            # The first failure (a request that kept failing, the version moved) ends the evaluation: the other
            # episodes are cancelled and awaited, none left running against the endpoint.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        after = await probe.read()
        if after != start:
            raise VersionMoved(version, after.version)
        lines = [self.case_line(p, version) for p in played]
        metrics = summarize(
            [[SampleScore({k: line["scores"][k] for k in ("accuracy", "tool_call")})] for line in lines]
        )
        turns = [float(line["scores"]["turns"]) for line in lines]
        metrics["turns/mean"] = sum(turns) / len(turns)
        metrics["turns/std"] = math.sqrt(sum((t - metrics["turns/mean"]) ** 2 for t in turns) / len(turns))
        summary_path, cases_path = output_paths(out_dir, self.name, version)
        ep = self.episode_config
        result = EvalResult(
            benchmark=self.name,
            version=version,
            model=served.id,
            url=backend.url,
            primary=self.primary,
            score=metrics[self.primary],
            metrics=metrics,
            cases=len(lines),
            generated=len(lines),
            cached=0,
            prompt_too_long=sum(p.episode is None for p in played),
            seconds=time.monotonic() - started,
            summary_path=str(summary_path),
            cases_path=str(cases_path),
            options={k: v for k, v in asdict(options).items() if v is not None}
            | {
                "episode": {
                    "tools": list(ep.tools),
                    "max_turns": budget.max_turns,
                    "max_tokens": budget.max_tokens,
                    "turn_tokens": budget.turn_tokens,
                    "chat_template": mode,
                }
            },
        )
        write_atomic(cases_path, "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines))
        write_atomic(summary_path, json.dumps(asdict(result), indent=2) + "\n")
        log.info(
            "%s at version %s: %s = %.4f, tool_call/mean = %.4f, turns/mean = %.2f (%d episodes, %.1fs)",
            self.name,
            version,
            self.primary,
            result.score,
            metrics["tool_call/mean"],
            metrics["turns/mean"],
            len(lines),
            result.seconds,
        )
        return result

    async def generate(
        self, client: RolloutClient, backend: Backend, context: list[int], max_tokens: int, group: str
    ) -> Sample:
        """One greedy policy turn through /inference/v1/generate, retried as the backend's other requests are
        (transport errors and retryable statuses, `backend.retry`); a failure is a RequestError, transient when
        retrying could have helped, so the evaluator role treats it as it treats its other requests'."""
        attempt = 0
        while True:
            try:
                (sample,) = await client.generate(
                    context,
                    temperature=0.0,
                    top_k=0,
                    top_p=1.0,
                    max_tokens=max_tokens,
                    group=group,
                    timeout_s=backend.timeout.total,
                )
                return sample
            except RolloutError as exc:
                if not exc.transient:
                    hint = ""
                    if exc.status == 404:
                        hint = (
                            f"; {self.name} plays episodes through the token-in/token-out route {GENERATE_PATH}: "
                            "evaluate it against a Slipstream vLLM worker or the router"
                        )
                    raise RequestError(f"{self.name}: {exc}{hint}") from None
                reason = str(exc)
            except _TRANSPORT_ERRORS as exc:
                reason = f"{type(exc).__name__}: {exc}"
            if attempt >= backend.retry.max_retries:
                raise RequestError(
                    f"{self.name}: POST {backend.url}{GENERATE_PATH} failed after {attempt + 1} attempts; last: "
                    f"{reason}",
                    transient=True,
                )
            delay = backend.retry.delay(attempt, None)
            log.warning(
                "%s: POST %s%s failed (%s); retry %d in %.1fs",
                self.name,
                backend.url,
                GENERATE_PATH,
                reason,
                attempt + 1,
                delay,
            )
            await asyncio.sleep(delay)
            attempt += 1

    def case_line(self, played: Played, version: str) -> dict[str, Any]:
        """The cases file's line of one episode: its pieces in order as text, how it ended, its scores (a prompt
        that left no room is scored as no answer, with no turn)."""
        ep = played.episode
        line: dict[str, Any] = {
            "case": played.case.id,
            "version": version,
            "prompt": played.problem.prompt,
            "answer": played.problem.answer,
            "prompt_tokens": played.prompt_tokens,
        }
        if ep is None:
            return line | {
                "turns": [],
                "ended": PROMPT_TOO_LONG,
                "finish_reason": PROMPT_TOO_LONG,
                "reward": 0.0,
                "tool_calls": 0,
                "tool_errors": 0,
                "tool_s": 0.0,
                "versions": [],
                "scores": {"accuracy": 0.0, "tool_call": 0.0, "turns": 0},
                "cached": False,
            }
        return line | {
            "turns": [{"by": t.by, "text": t.text, "tokens": len(t.ids)} for t in ep.turns],
            "ended": ep.ended,
            "finish_reason": ep.sample.finish_reason,
            "reward": ep.reward,
            "tool_calls": ep.tool_calls,
            "tool_errors": ep.tool_errors,
            "tool_s": round(ep.tool_s, 6),
            "versions": sorted(set(ep.sample.versions)),
            "scores": {"accuracy": float(ep.reward), "tool_call": float(ep.tool_calls > 0), "turns": ep.policy_turns},
            "cached": False,
        }
