"""The worker fleet in Redis: each pool's hash of worker records and the liveness keys that say which are alive.

A rollout worker registers a `WorkerRecord` in its pool's hash (`keys.workers` for the train pool, which the
router and the weight publisher read; `keys.eval_workers` for the evaluator's own workers), JSON-encoded under
its id, and heartbeats `keys.worker_alive(id)`: a worker counts as alive only while that TTL key exists. This
module is the one place that encodes, decodes and reads those records, evicts a worker, records the version a
worker serves, and gives up on a call when its worker dies. It imports no torch, so the router and the
evaluator can use it. An entry that does not decode is not a worker: every reader skips it, with one warning
per value. Left out: the weight updates themselves (common/weights/workers.py drives a worker over HTTP).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass, replace
from typing import TypeVar

import redis.asyncio

from common.aio import cancel_and_join
from common.keys import Keys
from common.redis_client import text
from common.roles import announce

log = logging.getLogger(__name__)
T = TypeVar("T")

# How often a call on one worker checks that the worker still heartbeats.
LIVENESS_POLL_S = 0.5
_warned: set[str] = set()  # entries that did not decode, each warned about once per process


class WorkerError(RuntimeError):
    """A worker answered a weight-sync call with an error (or not at all), or died during it; names the call and
    the worker."""


@dataclass(frozen=True)
class WorkerRecord:
    """One entry of a pool hash: a worker as it registered itself, under its id."""

    id: str
    url: str
    """Base URL of its vLLM server, without a trailing slash."""
    model: str = ""
    """The served model name."""
    weight_version: int | None = None
    """The weight version it serves (None: the entry does not say)."""
    started_at: float = 0.0
    """When it registered (Unix seconds)."""

    def to_json(self) -> str:
        """The hash value (the id is the hash field, not part of the value)."""
        return json.dumps(
            {"url": self.url, "model": self.model, "weight_version": self.weight_version, "started_at": self.started_at}
        )

    @classmethod
    def from_json(cls, worker_id: str, raw: str) -> WorkerRecord:
        """Decode the hash value of `worker_id`; a bad value raises ValueError naming the worker."""
        try:
            data = json.loads(raw)
            url = data["url"]
        except (json.JSONDecodeError, TypeError, KeyError) as exc:
            raise ValueError(
                f"worker {worker_id!r}: value {raw[:200]!r} of the workers hash is not JSON with a 'url' "
                f"({exc}); a worker registers {{url, model, weight_version, started_at}}"
            ) from None
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"worker {worker_id!r}: url {url!r} must be an http:// or https:// URL")
        version = data.get("weight_version")
        return cls(
            worker_id,
            url.rstrip("/"),
            str(data.get("model", "")),
            None if version is None else int(version),
            float(data.get("started_at", 0.0)),
        )


def _decode(worker_id: str, raw: str) -> WorkerRecord | None:
    try:
        return WorkerRecord.from_json(worker_id, raw)
    except ValueError as exc:
        if str(exc) not in _warned:  # readers poll twice a second: once per bad value is enough
            _warned.add(str(exc))
            log.warning("ignoring worker: %s", exc)
        return None


async def register(client: redis.asyncio.Redis, registry: str, record: WorkerRecord) -> None:
    """Enter (or replace) a worker's record in the pool hash `registry`."""
    await client.hset(registry, record.id, record.to_json())


async def read_record(client: redis.asyncio.Redis, registry: str, worker_id: str) -> WorkerRecord | None:
    """One worker's record in the pool hash `registry`; None if it has none (never registered, or evicted)."""
    raw = await client.hget(registry, worker_id)
    return None if raw is None else _decode(worker_id, text(raw))


async def read_records(client: redis.asyncio.Redis, registry: str) -> dict[str, WorkerRecord]:
    """Every worker of the pool hash `registry`, alive or not, by id (sorted)."""
    entries = {text(k): text(v) for k, v in (await client.hgetall(registry)).items()}
    records = {i: _decode(i, entries[i]) for i in sorted(entries)}
    return {i: r for i, r in records.items() if r is not None}


async def time_to_live(client: redis.asyncio.Redis, keys: Keys, worker_ids: Iterable[str]) -> dict[str, float]:
    """Seconds each live worker's liveness key has left (math.inf for a key without a TTL); the workers without
    one (never heartbeat, or expired) are left out."""
    ids = list(worker_ids)
    if not ids:
        return {}
    async with client.pipeline(transaction=False) as pipe:
        for i in ids:
            pipe.pttl(keys.worker_alive(i))
        ttls_ms = await pipe.execute()
    # PTTL: -2 for no such key, -1 for a key without a TTL.
    return {i: math.inf if ms == -1 else ms / 1000 for i, ms in zip(ids, ttls_ms, strict=True) if ms != -2}


async def live_workers(client: redis.asyncio.Redis, keys: Keys, registry: str = "") -> dict[str, str]:
    """worker_id -> URL of the workers in the pool hash `registry` (default `keys.workers`) that are alive,
    sorted by id."""
    records = await read_records(client, registry or keys.workers)
    alive = await time_to_live(client, keys, records)
    return {i: r.url for i, r in records.items() if i in alive}


async def current_version(client: redis.asyncio.Redis, keys: Keys) -> int | None:
    """weights:current, the newest version every live train worker acknowledged; None before the first publish."""
    raw = await client.get(keys.weights_current)
    return None if raw is None else int(raw)


async def set_worker_version(client: redis.asyncio.Redis, registry: str, worker_id: str, version: int) -> None:
    """Record in the pool hash `registry` that the worker now serves `version` (a missing entry stays missing)."""
    record = await read_record(client, registry, worker_id)
    if record is not None:
        await register(client, registry, replace(record, weight_version=version))


async def evict(
    client: redis.asyncio.Redis, keys: Keys, worker_id: str, reason: str, registry: str = "", by: str = "trainer"
) -> None:
    """Remove a worker from its pool (the router stops routing to it; the worker exits and restarts).

    `registry` is the pool's hash (default `keys.workers`; the evaluator passes `keys.eval_workers`), `by` the
    role that evicts, as the event names it.
    """
    await client.hdel(registry or keys.workers, worker_id)
    await client.delete(keys.worker_alive(worker_id))
    await announce(client, keys, by, "worker evicted", worker=worker_id, reason=reason[:1000])
    log.error("evicted worker %s: %s", worker_id, reason)


async def while_alive(client: redis.asyncio.Redis, keys: Keys, worker_id: str, call: Awaitable[T]) -> T:
    """Await `call` (an update of one worker) unless the worker's liveness key vanishes first.

    A worker role that died (kill -9) can leave its vLLM server half shut down, taking requests and
    never answering them (/pause waits on a dead engine); without this a publish would hang for the
    whole update timeout. Raises WorkerError naming the worker; the call is cancelled.
    """
    task = asyncio.ensure_future(call)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=LIVENESS_POLL_S)
            if done:
                return task.result()
            if not await client.exists(keys.worker_alive(worker_id)):
                raise WorkerError(f"worker {worker_id} stopped heartbeating during the weight update (its role died)")
    finally:
        await cancel_and_join(task, LIVENESS_POLL_S * 10, f"the weight update of worker {worker_id}")
