"""Driving one vLLM worker's weight-sync routes over HTTP: a whole update to a version (`apply_version`), the
version label alone, the label it serves, and `WorkerDriver`, the publisher's way to update one train-pool
worker (under its weight lock, given up on when it stops heartbeating, its new version recorded in the pool
hash, evicted when the update fails). No torch: the evaluator and the worker role import this too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import redis.asyncio
import redis.asyncio.lock
import redis.exceptions

from common.aio import cancel_and_join
from common.keys import Keys
from common.net import vllm_session
from common.weights.fleet import WorkerError, evict, set_worker_version, while_alive

log = logging.getLogger(__name__)

# A weight update of a large model can take minutes; a stuck worker is still bounded by this.
UPDATE_TIMEOUT_S = 600.0


@dataclass
class WorkerOutcome:
    """How one worker took one version."""

    worker_id: str
    url: str
    ok: bool
    pause_window_s: float = 0.0
    load_s: float = 0.0
    """The /update_weights call: reading and loading the tensors (and, when streamed, waiting for the write)."""
    error: str = ""


async def _call(
    session: aiohttp.ClientSession, method: str, url: str, json: Any = None, headers: Mapping[str, str] | None = None
) -> Any:
    timeout = aiohttp.ClientTimeout(total=UPDATE_TIMEOUT_S)
    try:
        async with session.request(method, url, json=json, headers=headers, timeout=timeout) as r:
            text = await r.text()
            if r.status != 200:
                raise WorkerError(f"{method} {url} -> HTTP {r.status}: {text[:500]}")
            return text
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise WorkerError(f"{method} {url} failed: {type(exc).__name__}: {exc}") from exc


# vLLM's answer to /finish_weight_update when no update is open (gpu_worker.finish_weight_update).
NO_UPDATE_OPEN = "without a matching start_weight_update"


async def end_cut_update(session: aiohttp.ClientSession, url: str) -> bool:
    """Close a weight update a publisher opened on the server at `url` (/start_weight_update) and never finished
    (it was cut off: its host partitioned, the worker evicted meanwhile); vLLM refuses a new update while one is
    open. The weights it leaves may be half-loaded: the caller loads a whole version next. True if one was open.

    When none is open, vLLM's route fails with an exception that uvicorn answers with a 500 and then drops the
    connection; the call asks for a connection of its own (`Connection: close`), or the caller's next call
    would take that dropped one from the pool and fail with a reset."""
    try:
        await _call(session, "POST", f"{url}/finish_weight_update", {}, {"Connection": "close"})
    except WorkerError as exc:
        if NO_UPDATE_OPEN in str(exc):
            return False
        raise
    log.warning("closed a weight update left open on %s by a publisher that was cut off", url)
    return True


async def label_version(session: aiohttp.ClientSession, url: str, version: int) -> None:
    """Set the version label vLLM attaches to tokens, without changing weights (version 0 at start)."""
    await _call(session, "POST", f"{url}/update_weight_version", {"new_version": str(version)})


async def apply_version(
    session: aiohttp.ClientSession,
    url: str,
    version: int,
    location: str,
    pause_mode: str,
    update_info: Mapping[str, Any] | None = None,
    timings: dict[str, float] | None = None,
) -> float:
    """Drive one worker through a whole update to `version`; the pause window in seconds.

    /pause?mode=..., /start_weight_update, /update_weights {update_info} (default: the committed version's
    directory `location`), /finish_weight_update {weight_version}, /reset_prefix_cache, /resume. `timings`,
    when given, receives the seconds each call took, by route name.

    On any failure the worker is resumed if possible (so it does not hang requests) and WorkerError
    is raised; the caller must evict it, since its weights may be half-updated.
    """
    info = dict(update_info) if update_info is not None else {"path": location}
    took = {} if timings is None else timings

    async def call(route: str, json: Any = None) -> None:
        t0 = time.perf_counter()
        await _call(session, "POST", f"{url}/{route}", json)
        took[route.split("?")[0]] = time.perf_counter() - t0

    await call(f"pause?mode={pause_mode}")
    paused_at = time.perf_counter()
    try:
        await call("start_weight_update")
        await call("update_weights", {"update_info": info})
        await call("finish_weight_update", {"weight_version": str(version)})
        # A prefix cached under the old weights would be reused for new requests (10 nats off).
        await call("reset_prefix_cache")
    except WorkerError:
        with contextlib.suppress(WorkerError):
            await _call(session, "POST", f"{url}/resume")
        raise
    await call("resume")
    return time.perf_counter() - paused_at


async def is_paused(session: aiohttp.ClientSession, url: str) -> bool:
    """Whether the server at `url` is paused (/pause without its /resume yet)."""
    return bool(json.loads(await _call(session, "GET", f"{url}/is_paused")).get("is_paused"))


async def resume(session: aiohttp.ClientSession, url: str) -> None:
    await _call(session, "POST", f"{url}/resume")


async def served_version(session: aiohttp.ClientSession, url: str) -> str | None:
    """The weight version label the worker reports on /weight_info."""
    return json.loads(await _call(session, "GET", f"{url}/weight_info"))["weight_version"]


# The weight lock's time to live, renewed every third of it while held: a holder that dies (a trainer
# SIGKILLed mid-publish) blocks its successor for at most this long, not for a whole UPDATE_TIMEOUT_S.
LOCK_TTL_S = 30.0


@contextlib.asynccontextmanager
async def weight_lock(
    client: redis.asyncio.Redis, keys: Keys, worker_id: str, ttl_s: float = LOCK_TTL_S, wait_s: float = UPDATE_TIMEOUT_S
) -> AsyncIterator[None]:
    """The lock around any change of one worker's weights: a publisher driving it and the worker catching
    up by itself never interleave their pause/update/resume calls on the same vLLM server.

    The lock lives `ttl_s` and a task renews it while the body runs, so an update may take as long as it
    needs and a dead holder's lock lapses within `ttl_s`. Waiting for it is bounded by `wait_s`.
    A lock lost while held (its renewal failed) raises LockError on the way out.
    """
    lock = client.lock(keys.worker_sync(worker_id), timeout=ttl_s, blocking_timeout=wait_s)
    if not await lock.acquire():
        raise redis.exceptions.LockError(
            f"worker {worker_id}'s weight lock {keys.worker_sync(worker_id)} was held by another updater for "
            f"{wait_s:.0f}s; a publisher or the worker's own catch-up is stuck"
        )
    renewal = asyncio.ensure_future(_renew(lock, ttl_s / 3))
    try:
        yield
    finally:
        await cancel_and_join(renewal, 5.0, f"the renewal of {keys.worker_sync(worker_id)}")
        await lock.release()  # LockNotOwnedError (a LockError) when it lapsed meanwhile


async def _renew(lock: redis.asyncio.lock.Lock, every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        await lock.reacquire()


class WorkerDriver:
    """Updates the workers of the train pool for a publisher: one HTTP session (with the workers' bearer token,
    opened at first use), the pool's Redis records, evictions by the trainer."""

    def __init__(
        self,
        client: redis.asyncio.Redis,
        keys: Keys,
        api_key: str = "",
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        self.client, self.keys, self.api_key = client, keys, api_key
        self._session = session
        self._own_session = session is None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = vllm_session(self.api_key)
        return self._session

    async def close(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

    async def update(
        self, worker_id: str, url: str, version: int, update_info: Mapping[str, Any], pause_mode: str
    ) -> WorkerOutcome:
        """Apply `version` (its /update_weights body `update_info`) to one worker under its weight lock and record
        it in the pool hash; a worker that fails or dies meanwhile is evicted. How it went."""
        took: dict[str, float] = {}
        try:
            async with weight_lock(self.client, self.keys, worker_id):
                update = apply_version(self.session(), url, version, update_info["path"], pause_mode, update_info, took)
                pause = await while_alive(self.client, self.keys, worker_id, update)
                await set_worker_version(self.client, self.keys.workers, worker_id, version)
        except (WorkerError, redis.exceptions.LockError) as exc:
            await evict(self.client, self.keys, worker_id, f"weight version {version}: {exc}")
            return WorkerOutcome(worker_id, url, False, error=str(exc))
        return WorkerOutcome(worker_id, url, True, pause_window_s=pause, load_s=took["update_weights"])

    async def record_version(self, worker_id: str, version: int) -> None:
        """Record in the pool hash, under the worker's weight lock, that it serves `version` (for a transport
        that loaded the version by other means than `update`)."""
        async with weight_lock(self.client, self.keys, worker_id):
            await set_worker_version(self.client, self.keys.workers, worker_id, version)
