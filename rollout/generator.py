"""The generation side of the RL trainer process: one sample of one prompt through the router, rewarded
by the task (`SampleGenerator`, the genable the flow runtime drives on the generation controller's event
loop), and the record it yields (`Rollout`, with when it was generated: `GenTiming`, which the trainer
logs as the run's gen/* metrics). A request that finds no worker (all of them restarting) waits for
one, bounded by `rollout.startup_timeout_s`, instead of spending the flow's error budget."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from common.config import Config
from common.roles import RunContext
from rollout.chat import prompt_token_ids
from rollout.client import NoRouterError, RolloutClient, RolloutError, Sample
from rollout.flow.runtime import SampleRequest
from rollout.tasks import Problem, Task

# How often a generation request that found no worker (all restarting) tries again.
NO_WORKER_RETRY_S = 1.0


@dataclass(frozen=True)
class GenTiming:
    """When one sample was generated, on the monotonic clock (`time.monotonic()`) of the process that
    generated it; the trainer puts these on the flow's clock (`FlowRuntime.origin`) when it logs them."""

    dispatched: float
    """The flow runtime handed the sample to the controller (`SampleRequest.dispatched`)."""
    sent: float
    """The request that produced the sample went to the router: the moment the controller started the
    attempt (it calls the genable at once), or later if the attempt first waited for a worker."""
    done: float
    """The router's answer came back (the reward is computed after)."""
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
    """One sample of one prompt: the generation with its behaviour log-probs, its reward and its timing
    (None for rollouts not made by `SampleGenerator`); the flow runtime reads it as a `Trajectory`."""

    sample: Sample
    reward: float
    text: str
    timing: GenTiming | None = None

    @property
    def weight_versions(self) -> list[int]:
        return self.sample.versions


class SampleGenerator:
    """The genable: one sample of one prompt through the router, rewarded by the task.

    It lives on the controller's event loop (its HTTP session and Redis client are created there on
    first use). When no worker can serve (every worker restarting), it waits for one, bounded by
    `rollout.startup_timeout_s`, instead of burning the error budget.
    """

    def __init__(self, cfg: Config, ctx: RunContext, task: Task, tokenizer: Any) -> None:
        self.cfg, self.ctx, self.task, self.tokenizer = cfg, ctx, task, tokenizer
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
        problem = req.prompt
        ro = self.cfg.rollout
        prompt = self.encode(problem.prompt)
        deadline = time.monotonic() + ro.startup_timeout_s
        while True:
            sent, concurrency = time.monotonic(), self._in_flight
            try:
                (sample,) = await self._client.generate(
                    prompt,
                    temperature=ro.temperature,
                    top_k=ro.top_k,
                    top_p=ro.top_p,
                    max_tokens=ro.max_tokens,
                    group=f"{self.ctx.exp}:{req.prompt_id}",
                )
                break
            except (NoRouterError, RolloutError, aiohttp.ClientConnectionError) as exc:
                if not no_worker(exc) or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(NO_WORKER_RETRY_S)
        timing = GenTiming(req.dispatched, sent, time.monotonic(), concurrency)
        if sample.aborted:
            raise RolloutError(f"sample {req.prompt_id}/{req.index} was aborted by a weight update")
        text = self.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
        reward = await asyncio.to_thread(self.task.reward, problem, text)
        return Rollout(sample, reward, text, timing)

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
