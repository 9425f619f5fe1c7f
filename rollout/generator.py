"""The generation side of the RL trainer process: one sample of one prompt, an episode of the run's environment
(rollout/episode.py: one turn of the task, or several with tools) played through the router
(`SampleGenerator`, the genable the flow runtime drives on the generation controller's event loop), and the
record it yields (`Rollout`, with when it was generated: `GenTiming`, which the trainer logs as the run's gen/*
metrics). A turn whose request finds no worker (all of them restarting, or its worker killed mid-episode) waits
for one, bounded by `rollout.startup_timeout_s`, and is sent again with the episode's tokens so far: the episode
goes on from that turn instead of spending the flow's error budget."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from common.config import Config
from common.roles import RunContext
from rollout.chat import prompt_token_ids
from rollout.client import NoRouterError, RolloutClient, RolloutError, Sample
from rollout.episode import Budget, Environments, TaskEnvironments, Turn, run_episode
from rollout.flow.runtime import SampleRequest
from rollout.tasks import Problem, Task

log = logging.getLogger(__name__)

# How often a generation request that found no worker (all restarting) tries again.
NO_WORKER_RETRY_S = 1.0


@dataclass(frozen=True)
class GenTiming:
    """When one sample was generated, on the monotonic clock (`time.monotonic()`) of the process that
    generated it; the trainer puts these on the flow's clock (`FlowRuntime.origin`) when it logs them."""

    dispatched: float
    """The flow runtime handed the sample to the controller (`SampleRequest.dispatched`)."""
    sent: float
    """The episode's first request went to the router: the moment the controller started the attempt (it calls
    the genable at once), or later if the attempt first waited for a worker."""
    done: float
    """The router's answer to its last turn came back (the reward is computed after)."""
    concurrency: int
    """Requests in flight at the controller when this one was sent, itself included."""

    @property
    def queue_s(self) -> float:
        """Dispatch to send: the wait for a controller slot (and for a worker, and any earlier failed
        attempts of the same request the controller retried)."""
        return self.sent - self.dispatched

    @property
    def generate_s(self) -> float:
        return self.done - self.sent


@dataclass
class Rollout:
    """One sample of one prompt: the episode's tokens with their behaviour log-probs (`sample`; its mask marks the
    environment's tokens), its reward, the text of the policy's last turn and its timing (None for rollouts not
    made by `SampleGenerator`); the flow runtime reads it as a `Trajectory`. The episode's costs default to one
    turn without tools (a Rollout pickled before they existed reads these)."""

    sample: Sample
    reward: float
    text: str
    timing: GenTiming | None = None
    turns: int = 1
    """Policy turns (generation requests that completed)."""
    tool_calls: int = 0
    tool_s: float = 0.0
    """Seconds the episode spent in the environment's steps between turns (its tools)."""
    pieces: list[Turn] | None = None
    """The episode's turns up to its last policy turn, each with the ids recorded when it came (a policy turn's
    as vLLM returned them, an observation's as appended): what trainer.rl.audit_tokens checks the batch against."""

    @property
    def env_tokens(self) -> int:
        """Tokens the environment appended (mask 0 in `sample`)."""
        return 0 if self.sample.mask is None else self.sample.mask.count(0)

    @property
    def weight_versions(self) -> list[int]:
        return self.sample.versions


class SampleGenerator:
    """The genable: one sample of one prompt through the router, rewarded by the task.

    It lives on the controller's event loop (its HTTP session and Redis client are created there on
    first use). When no worker can serve (every worker restarting), it waits for one, bounded by
    `rollout.startup_timeout_s`, instead of burning the error budget.
    """

    def __init__(
        self, cfg: Config, ctx: RunContext, task: Task, tokenizer: Any, envs: Environments | None = None
    ) -> None:
        """`envs`: the run's environments (rollout.episode); None plays the task's one-turn episodes."""
        self.cfg, self.ctx, self.task, self.tokenizer = cfg, ctx, task, tokenizer
        self.envs = envs if envs is not None else TaskEnvironments(task)
        self.budget = Budget.from_config(cfg, one_turn=isinstance(self.envs, TaskEnvironments))
        self._client: RolloutClient | None = None
        self._encoded: dict[str, list[int]] = {}
        # Calls running now. The controller runs every attempt through this, its only genable, and caps
        # them: these are its requests in flight (counted here so that the controller stays generic).
        self._in_flight = 0

    def encode(self, text: str) -> list[int]:
        """A prompt's token ids as the policy sees them (rollout.chat_template: `prompt_token_ids`)."""
        ids = self._encoded.get(text)
        if ids is None:
            ids = self._encoded[text] = prompt_token_ids(self.tokenizer, text, self.cfg.rollout.chat_template)
        return ids

    async def __call__(self, req: SampleRequest[Problem]) -> Rollout:
        self._in_flight += 1
        try:
            return await self._generate(req)
        finally:
            self._in_flight -= 1

    async def _generate(self, req: SampleRequest[Problem]) -> Rollout:
        if self._client is None:
            self._client = RolloutClient(
                self.cfg.rollout.served_model_name,
                redis_client=self.ctx.async_redis(),
                keys=self.ctx.keys,
                router_name=self.cfg.router.name,
                affinity_header=self.cfg.router.affinity_header,
                token=self.cfg.router.auth_token,
            )
        client, ro = self._client, self.cfg.rollout
        group = f"{self.ctx.exp}:{req.prompt_id}"  # every turn of every sample of a group: one worker's cache
        sent: float | None = None  # the first turn's request went out (after any wait for a worker)
        answered: float | None = None  # the last turn's answer came back
        concurrency = self._in_flight
        first = True

        async def turn(context: list[int], max_tokens: int) -> Sample:
            nonlocal sent, answered, first
            deadline = time.monotonic() + ro.startup_timeout_s
            resumed = False
            while True:
                if sent is None:
                    sent = time.monotonic()
                try:
                    (sample,) = await client.generate(
                        context,
                        temperature=ro.temperature,
                        top_k=ro.top_k,
                        top_p=ro.top_p,
                        max_tokens=max_tokens,
                        group=group,
                    )
                    break
                except (NoRouterError, RolloutError, aiohttp.ClientConnectionError) as exc:
                    if not no_worker(exc) or time.monotonic() > deadline:
                        raise
                    if first:
                        sent = None  # the first turn's wait for a worker is queueing: the sample is not sent yet
                    elif not resumed:
                        resumed = True
                        log.info(
                            "episode %d/%d: a later turn's worker failed (%s); the turn is sent again with the "
                            "episode's %d ids so far once a worker serves",
                            req.prompt_id,
                            req.index,
                            exc,
                            len(context),
                        )
                    await asyncio.sleep(NO_WORKER_RETRY_S)
            first, answered = False, time.monotonic()
            if sample.aborted:
                raise RolloutError(f"sample {req.prompt_id}/{req.index} was aborted by a weight update")
            return sample

        problem = req.prompt
        episode = await run_episode(
            self.envs.new(), problem, turn, self.tokenizer, ro.chat_template, self.budget, self.encode
        )
        assert sent is not None and answered is not None, "an episode sends at least one request"
        timing = GenTiming(req.dispatched, sent, answered, concurrency)
        return Rollout(
            episode.sample,
            episode.reward,
            episode.text,
            timing,
            turns=episode.policy_turns,
            tool_calls=episode.tool_calls,
            tool_s=episode.tool_s,
            pieces=episode.trained_turns(),
        )

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            if self._client.redis is not None:
                await self._client.redis.aclose()


def no_worker(exc: BaseException) -> bool:
    """True for failures that mean "no worker right now": no router, the router's 503 (no healthy
    worker) or 502 (the worker's connection failed), a refused connection to the router."""
    if isinstance(exc, (NoRouterError, aiohttp.ClientConnectionError)):
        return True
    return isinstance(exc, RolloutError) and exc.status in (502, 503)
