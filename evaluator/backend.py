"""The evaluator's HTTP edge: one OpenAI-compatible endpoint (the router, a vLLM worker, or any other
server). `Backend` discovers the served model and its context length (GET /v1/models), counts a
prompt's tokens (`PromptCounter`: the served model's own tokenizer when its directory is readable
here, else vLLM's /tokenize route), and generates the samples of one case through /v1/completions or
/v1/chat/completions with max_tokens clamped to the context left after the prompt. Retries happen
only where trying again can help: transport errors and the answers common.http calls retryable
(408/425/429/5xx), waiting as its RetryPolicy says (exponential backoff with jitter, or Retry-After
when the server sends one); any other 4xx is permanent and raises `RequestError` with the server's
text at once. `wait_until_served` waits for a model to be served (the router answers /v1/models only
with a healthy worker behind it), logging the wait when it starts, every 30 s and when it ends, not
every attempt.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import aiohttp

from common.http import RetryPolicy, retryable_status
from evaluator.benchmark import Case

log = logging.getLogger(__name__)

_TRANSPORT_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError)
SERVED_POLL_S = 1.0
SERVED_LOG_S = 30.0


class RequestError(RuntimeError):
    """A request failed: a permanent 4xx or a malformed answer (`transient` False), or retries of a
    transient failure exhausted (`transient` True: the server may recover later)."""

    def __init__(self, message: str, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


@dataclass(frozen=True)
class ServedModel:
    id: str
    max_model_len: int
    root: str | None


@dataclass(frozen=True)
class Generation:
    """The samples of one case, as the server returned them."""

    texts: list[str]
    finish_reasons: list[str]
    prompt_tokens: int
    completion_tokens: int


class PromptCounter(Protocol):
    async def count(self, case: Case) -> int: ...


class LocalTokenizer:
    """Counts with the served model's HF tokenizer (loaded on first use, off the event loop)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._tok: Any = None
        # Counting runs in worker threads; transformers' lazy imports are not safe to race.
        self._lock = threading.Lock()

    def _load(self) -> Any:
        with self._lock:
            if self._tok is None:
                from transformers import AutoTokenizer

                self._tok = AutoTokenizer.from_pretrained(self.path)
            return self._tok

    def _count(self, case: Case) -> int:
        tok = self._load()
        if case.chat:
            # vLLM renders the chat template, then tokenizes the text without adding special tokens.
            text = tok.apply_chat_template(case.prompt_json(), add_generation_prompt=True, tokenize=False)
            return len(tok(text, add_special_tokens=False)["input_ids"])
        return len(tok(case.prompt_json())["input_ids"])

    async def count(self, case: Case) -> int:
        return await asyncio.to_thread(self._count, case)

    def __repr__(self) -> str:
        return f"tokenizer at {self.path}"


class RemoteTokenizer:
    """Counts with vLLM's POST /tokenize (the same tokenizer and chat template the server uses)."""

    def __init__(self, backend: Backend, url: str) -> None:
        self.backend, self.url = backend, url.rstrip("/")

    async def count(self, case: Case) -> int:
        body: dict[str, Any] = {"model": self.backend.model}
        if case.chat:
            body |= {"messages": case.prompt_json(), "add_generation_prompt": True}
        else:
            body["prompt"] = case.prompt_json()
        answer = await self.backend.post_json(self.url + "/tokenize", body)
        return int(answer["count"])

    def __repr__(self) -> str:
        return f"{self.url}/tokenize"


class Backend:
    """One OpenAI-compatible endpoint and the ClientSession that talks to it."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        url: str,
        model: str | None = None,
        request_timeout_s: float = 600.0,
        retry: RetryPolicy | None = None,
        token: str = "",
    ) -> None:
        self.session, self.url = session, url.rstrip("/")
        self.model = model or ""
        self.timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        self.retry = retry or RetryPolicy()
        # The endpoint's own bearer token (the router's), sent over the session's (a worker's rollout.api_key).
        self.token = token
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.served: ServedModel | None = None
        self.counter: PromptCounter | None = None

    async def _request(self, method: str, url: str, body: Any = None, max_retries: int | None = None) -> Any:
        retries = self.retry.max_retries if max_retries is None else max_retries
        attempt = 0
        while True:
            retry_after = None
            try:
                async with self.session.request(
                    method, url, json=body, headers=self.headers, timeout=self.timeout
                ) as r:
                    text = await r.text()
                    if r.status == 200:
                        try:
                            return await r.json(content_type=None)
                        except ValueError:
                            raise RequestError(f"{method} {url} answered 200 with non-JSON: {text[:300]!r}") from None
                    if not retryable_status(r.status):
                        raise RequestError(f"{method} {url} -> HTTP {r.status} (not retried): {text[:1000]}")
                    reason = f"HTTP {r.status}: {text[:200]}"
                    retry_after = r.headers.get("Retry-After")
            except _TRANSPORT_ERRORS as exc:
                reason = f"{type(exc).__name__}: {exc}"
            if attempt >= retries:
                raise RequestError(
                    f"{method} {url} failed after {attempt + 1} attempts; last: {reason}", transient=True
                )
            delay = self.retry.delay(attempt, retry_after)
            log.warning("%s %s failed (%s); retry %d in %.1fs", method, url, reason, attempt + 1, delay)
            await asyncio.sleep(delay)
            attempt += 1

    async def get_json(self, url: str, max_retries: int | None = None) -> Any:
        return await self._request("GET", url, max_retries=max_retries)

    async def post_json(self, url: str, body: Any) -> Any:
        return await self._request("POST", url, body)

    async def describe(self, max_retries: int | None = None) -> ServedModel:
        """The served model (the one named, or the only one) and its max_model_len, from /v1/models."""
        listing = await self.get_json(self.url + "/v1/models", max_retries)
        cards = listing.get("data") or []
        ids = [c.get("id") for c in cards]
        if self.model:
            matches = [c for c in cards if c.get("id") == self.model]
            if not matches:
                raise RequestError(f"{self.url} does not serve model {self.model!r}; it serves {ids}; fix --model")
            card = matches[0]
        elif len(cards) == 1:
            card = cards[0]
        else:
            raise RequestError(f"{self.url} serves {len(cards)} models {ids}; choose one with --model")
        if not card.get("max_model_len"):
            raise RequestError(
                f"{self.url}/v1/models does not report max_model_len for {card.get('id')!r} (not a vLLM server?); "
                "the evaluator needs it to clamp max_tokens"
            )
        self.model = card["id"]
        self.served = ServedModel(card["id"], int(card["max_model_len"]), card.get("root"))
        return self.served

    async def wait_until_served(self, timeout_s: float) -> ServedModel:
        """describe() once a model is served, trying every second for up to timeout_s; a permanent error or the
        timeout raises RequestError. The wait is logged once, every 30 s while it lasts, and when it ends."""
        start = time.monotonic()
        next_log = start
        while True:
            try:
                served = await self.describe(max_retries=0)
            except RequestError as exc:
                waited = time.monotonic() - start
                if not exc.transient or waited > timeout_s:
                    raise RequestError(
                        f"no model served at {self.url} after {waited:.0f}s: {exc}", exc.transient
                    ) from None
                if time.monotonic() >= next_log:
                    log.info(
                        "waiting for a model served at %s (%.0fs so far, up to %.0fs; last: %s)",
                        self.url,
                        waited,
                        timeout_s,
                        exc,
                    )
                    next_log += SERVED_LOG_S
                await asyncio.sleep(SERVED_POLL_S)
                continue
            if next_log > start:
                log.info("model %r served at %s after %.0fs", served.id, self.url, time.monotonic() - start)
            return served

    async def choose_counter(self, tokenizer: str | None = None, tokenize_urls: tuple[str, ...] = ()) -> PromptCounter:
        """How prompt tokens are counted: an explicit tokenizer path, else the served model's directory if it
        is readable here, else /tokenize at this URL or one of `tokenize_urls` (the first that answers)."""
        assert self.served is not None, "describe() first"
        root = self.served.root
        if tokenizer:
            counter: PromptCounter = LocalTokenizer(tokenizer)
        elif root and (Path(root) / "tokenizer_config.json").is_file():
            counter = LocalTokenizer(root)
        else:
            counter = None  # type: ignore[assignment]
            tried = []
            for url in (self.url, *tokenize_urls):
                try:
                    await self.post_json(url.rstrip("/") + "/tokenize", {"model": self.model, "prompt": "1"})
                except RequestError as exc:
                    tried.append(f"{url}: {exc}")
                    continue
                counter = RemoteTokenizer(self, url)
                break
            if counter is None:
                raise RequestError(
                    "cannot count prompt tokens to clamp max_tokens: the served model's directory "
                    f"({root!r}) is not readable here and no /tokenize route answered ({'; '.join(tried)}); "
                    "pass --tokenizer DIR with the model's tokenizer"
                )
        log.info("counting prompt tokens with %r", counter)
        self.counter = counter
        return counter

    async def generate(self, case: Case, max_tokens: int) -> Generation:
        """All samples of a case in one request (n = samples)."""
        body: dict[str, Any] = {"model": self.model, "n": case.samples, **case.sampling.request_fields()}
        body["max_tokens"] = max_tokens
        if case.chat:
            body["messages"] = case.prompt_json()
            answer = await self.post_json(self.url + "/v1/chat/completions", body)
        else:
            body["prompt"] = case.prompt_json()
            answer = await self.post_json(self.url + "/v1/completions", body)
        try:
            choices = sorted(answer["choices"], key=lambda c: c["index"])
            texts = [(c["message"]["content"] or "") if case.chat else c["text"] for c in choices]
            reasons = [str(c.get("finish_reason")) for c in choices]
            usage = answer.get("usage") or {}
        except (KeyError, TypeError) as exc:
            raise RequestError(
                f"{self.url}: malformed answer for case {case.id!r} ({exc}): {str(answer)[:300]}"
            ) from None
        if len(texts) != case.samples:
            raise RequestError(f"{self.url}: asked for {case.samples} samples of case {case.id!r}, got {len(texts)}")
        return Generation(texts, reasons, int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0)))
