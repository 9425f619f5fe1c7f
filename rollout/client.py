"""Async rollout client: token ids in, sampled token ids with behaviour log-probs and versions out.

Requests go to vLLM's token-in/token-out route (/inference/v1/generate) through the router, whose
URL is read from Redis (`keys.router(name)`), or straight to one worker's URL. Every returned
`Sample` carries the sampled token ids, the behaviour log-prob of every sampled token (processed,
i.e. after temperature, top-k and top-p, as the worker runs vLLM with `--logprobs-mode processed_logprobs`,
with the parameters they were sampled under), the
weight version that produced each token, and the finish reason ("stop", "length", or "abort" when a
weight update in abort mode cut it short), and, when the worker runs vLLM with
`--enable-return-routed-experts` (rollout.return_routed_experts), the experts every MoE layer chose at
every position. A response without a log-prob for every token is an error (`RolloutError`), never
zeros. Samples of one prompt group carry the same affinity header so the router keeps them on one
worker, where they share the prompt's prefix cache.
"""

from __future__ import annotations

import base64
import binascii
import io
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp
import numpy as np
import redis.asyncio

from common.http import WORKER_HEADER, retryable_status
from common.keys import Keys
from common.net import bearer
from common.redis_client import text

GENERATE_PATH = "/inference/v1/generate"
# How long a router URL read from Redis is used before it is read again (a failed request drops it at once):
# one read per request took a sixth of the rollout loop's time in a fully-async demo run.
ROUTER_URL_TTL_S = 2.0


class RolloutError(RuntimeError):
    """A generation response is unusable for RL (an HTTP error, or tokens without log-probs or versions).

    `status` is the HTTP status when the server answered with an error; `transient` (read by the
    GenerationController's retry logic) is true for the statuses worth retrying, the ones the router
    retries on too (common.http).
    """

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status

    @property
    def transient(self) -> bool:
        return self.status is not None and retryable_status(self.status)


class NoRouterError(RolloutError):
    """No router URL is published for this experiment."""


@dataclass
class Sample:
    """One generated completion, with what an RL trainer needs to weigh it."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    routed_experts: np.ndarray | None = None
    """[len(prompt_token_ids) + len(token_ids) - 1, decoder layers, top_k] uint8 (uint16 past 256 experts):
    row i holds the experts each layer chose at position i, in the forward that took token i as input
    (so with partial rollouts, the weights that sampled token i + 1). Rows of dense layers are 0 (vLLM
    captures MoE layers only). None when the worker does not return routing."""
    temperature: float = 1.0
    """The temperature the tokens were sampled at (the behaviour log-probs are of the tempered distribution)."""
    top_k: int = 0
    """The top-k truncation they were sampled under (0: none)."""
    top_p: float = 1.0
    """The top-p (nucleus) truncation they were sampled under (1: none). A Sample pickled before these three
    fields existed reads back their defaults (the dataclass's class attributes)."""
    worker: str = ""
    """The id of the worker that generated it, as the router named it (common.http.WORKER_HEADER); "" when the
    answer did not come through a router, or the Sample was pickled before this field existed."""
    mask: list[int] | None = None
    """Aligned with token_ids in a multi-turn episode (rollout/episode.py): 1 where the policy sampled the token,
    0 where the environment appended it (a tool result), which is never trained and whose log-prob is a 0.0
    placeholder and version the one before it. None: every token was sampled (a single turn)."""

    @property
    def aborted(self) -> bool:
        """True when a weight update in abort mode ended the request early (the tokens are partial)."""
        return self.finish_reason == "abort"

    @property
    def oldest_version(self) -> int | None:
        return min(self.versions) if self.versions else None


def parse_choice(prompt: list[int], choice: dict) -> Sample:
    """A Sample from one choice of a /inference/v1/generate response; RolloutError if anything is missing."""
    tokens = choice.get("token_ids")
    if tokens is None:
        raise RolloutError(f"response choice has no token_ids: {str(choice)[:300]}")
    content = (choice.get("logprobs") or {}).get("content")
    if content is None or len(content) != len(tokens):
        raise RolloutError(
            f"response has {0 if content is None else len(content)} log-probs for {len(tokens)} tokens; the "
            "worker must return the behaviour log-prob of every sampled token (logprobs=0 in sampling_params)"
        )
    logprobs = []
    for i, (tok, entry) in enumerate(zip(tokens, content, strict=True)):
        if entry.get("token_id") != tok or entry.get("logprob") is None:
            raise RolloutError(f"log-prob entry {i} is for token {entry.get('token_id')}, not the sampled {tok}")
        logprobs.append(float(entry["logprob"]))
    versions: list[int | None] = [None] * len(tokens)
    for span in choice.get("weight_versions") or []:
        for i in range(span["start"], span["end"]):
            versions[i] = int(span["version"])
    if any(v is None for v in versions):
        raise RolloutError(
            f"response labels {sum(v is not None for v in versions)} of {len(tokens)} tokens with a weight version; "
            "the worker must set a version label at start (rollout.worker does)"
        )
    routed = choice.get("routed_experts")
    experts = None if routed is None else _routed_experts(routed, len(prompt) + len(tokens) - 1)
    return Sample(
        list(prompt),
        list(tokens),
        logprobs,
        [int(v) for v in versions if v is not None],
        str(choice.get("finish_reason")),
        experts,
    )


def _routed_experts(encoded: str, positions: int) -> np.ndarray:
    """The [positions, layers, top_k] array of a choice's `routed_experts` (base64 of .npy bytes)."""
    try:
        rows = np.load(io.BytesIO(base64.b64decode(encoded, validate=True)), allow_pickle=False)
    except (binascii.Error, ValueError, OSError) as exc:
        raise RolloutError(f"routed_experts is not base64 of a .npy array: {exc}") from exc
    if rows.ndim != 3 or rows.shape[0] != positions:
        raise RolloutError(
            f"routed_experts has shape {rows.shape}: {rows.shape[0] if rows.ndim else 0} rows for {positions} "
            "positions (prompt + completion - 1); the worker must return a row per position "
            "(routed_experts_prompt_start left at 0)"
        )
    return rows


class RolloutClient:
    """Generates through the experiment's router (or one fixed URL) with one aiohttp session."""

    def __init__(
        self,
        model: str,
        *,
        url: str | None = None,
        redis_client: redis.asyncio.Redis | None = None,
        keys: Keys | None = None,
        router_name: str = "default",
        affinity_header: str = "X-Slipstream-Group",
        session: aiohttp.ClientSession | None = None,
        token: str = "",
    ) -> None:
        """`token` is the bearer token of whatever `url` (or the router) is: router.auth_token."""
        if url is None and (redis_client is None or keys is None):
            raise ValueError("RolloutClient needs a url, or redis_client and keys to find the router")
        self.model, self._url = model, url.rstrip("/") if url else None
        self.redis, self.keys, self.router_name = redis_client, keys, router_name
        self._router: tuple[str, float] | None = None  # the router's URL as read from Redis, and when
        self.affinity_header = affinity_header
        self._session, self._own_session = session, session is None
        self.headers = bearer(token)

    async def __aenter__(self) -> RolloutClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

    async def base_url(self) -> str:
        """The fixed URL, or the router's URL as published in Redis: read again after ROUTER_URL_TTL_S, and
        at once after a request to it failed (a restarted router publishes a new one)."""
        if self._url is not None:
            return self._url
        if self._router is not None and time.monotonic() - self._router[1] < ROUTER_URL_TTL_S:
            return self._router[0]
        assert self.redis is not None and self.keys is not None
        url = await self.redis.get(self.keys.router(self.router_name))
        if not url:
            raise NoRouterError(
                f"no router URL at {self.keys.router(self.router_name)}; start one (ROLE=router slipstream run CFG)"
            )
        self._router = (text(url).rstrip("/"), time.monotonic())
        return self._router[0]

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        *,
        n: int = 1,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        max_tokens: int = 64,
        seed: int | None = None,
        group: str | None = None,
        ignore_eos: bool = False,
        stop_token_ids: Sequence[int] | None = None,
        timeout_s: float | None = None,
    ) -> list[Sample]:
        """Sample n completions of one prompt; `group` pins requests of one prompt group to one worker.

        Every parameter that shapes the sampling distribution is sent, the ones the trainer does not model
        at their neutral values: a parameter a request leaves out may take a default from the model's
        generation_config.json, which the trainer's log-probs would not reproduce. Each Sample records
        the temperature, top_k (0: off) and top_p it was drawn with."""
        params: dict = {
            "n": n,
            "temperature": temperature,
            "top_k": top_k,
            "top_p": top_p,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "max_tokens": max_tokens,
            "logprobs": 0,
            "ignore_eos": ignore_eos,
        }
        if seed is not None:
            params["seed"] = seed
        if stop_token_ids:
            params["stop_token_ids"] = list(stop_token_ids)
        body = {
            "model": self.model,
            "token_ids": list(prompt_token_ids),
            "sampling_params": params,
            "request_id": f"ss-{uuid.uuid4().hex}",
        }
        headers = {self.affinity_header: group, **self.headers} if group else dict(self.headers)
        if self._session is None:
            self._session = aiohttp.ClientSession()
        url = f"{await self.base_url()}{GENERATE_PATH}"
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        try:
            async with self._session.post(url, json=body, headers=headers, timeout=timeout) as r:
                if r.status != 200:
                    raise RolloutError(f"POST {url} -> HTTP {r.status}: {(await r.text())[:500]}", status=r.status)
                data = await r.json()
                worker = r.headers.get(WORKER_HEADER, "")
        except (aiohttp.ClientError, RolloutError):
            self._router = None  # the next request reads the router's URL again
            raise
        choices = sorted(data.get("choices") or [], key=lambda c: c["index"])
        if len(choices) != n:
            raise RolloutError(f"asked for {n} samples, got {len(choices)} choices")
        samples = [parse_choice(list(prompt_token_ids), c) for c in choices]
        for sample in samples:
            sample.temperature, sample.top_k, sample.top_p = temperature, top_k, top_p
            sample.worker = worker
        return samples
