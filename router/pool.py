"""The worker pool: which vLLM workers exist and which of them may be routed to. `WorkerPool` is the
state (no I/O): it applies snapshots of the Redis workers hash plus their liveness keys, and health
verdicts, and keeps the tuple of routable workers that the hot path reads. `PoolSync` is the I/O
around it: it re-reads Redis every REFRESH_S and again right when a liveness key would expire, so a
worker whose heartbeat stopped disappears within its TTL; and it health-checks every worker with
GET /health on an interval, evicting a failing worker and re-admitting it once it passes. A worker
is routable only while its heartbeat lives and its last health check passed; a newly seen worker
is checked at once so it joins within a second."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Coroutine, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import redis
import redis.asyncio

from common.aio import cancel_and_join
from common.keys import Keys
from common.roles import announce
from common.weights.fleet import WorkerRecord, read_records, time_to_live

log = logging.getLogger(__name__)

# Redis keyspace notifications are off by default and a TTL expiry cannot be awaited otherwise, so
# the pool polls; twice a second keeps any change visible within one second.
REFRESH_S = 0.5
_EXPIRY_MARGIN_S = 0.01


@dataclass(eq=False)
class Worker:
    """A worker as the router sees it; compared by identity, since a re-registered worker is a new one."""

    record: WorkerRecord
    """Its entry in the workers hash, as last read (the weight version follows publishes)."""
    healthy: bool = False
    outstanding: int = 0
    requests: int = 0
    last_error: str = ""
    checked_at: float = 0.0
    gone: str = ""
    """Why the worker left the pool (empty while it is in it)."""
    attempts: set[asyncio.Task[Any]] = field(default_factory=set, repr=False)
    """The proxy's requests waiting on this worker's answer."""

    @property
    def id(self) -> str:
        return self.record.id

    @property
    def url(self) -> str:
        return self.record.url

    def abandon(self, reason: str) -> None:
        """The worker left the pool and its server does not answer: give up on the requests waiting for its
        answer (the proxy retries them elsewhere)."""
        self.gone = reason
        for task in list(self.attempts):
            task.cancel()

    def as_json(self) -> dict[str, object]:
        state = {
            "healthy": self.healthy,
            "outstanding": self.outstanding,
            "requests": self.requests,
            "last_error": self.last_error,
        }
        return asdict(self.record) | state


@dataclass(frozen=True)
class PoolChanges:
    """What one snapshot changed: workers that joined (not yet routable) and workers removed, with why."""

    added: tuple[Worker, ...] = ()
    removed: tuple[tuple[Worker, str], ...] = ()


class WorkerPool:
    """The known workers and the routable subset (`healthy`, rebuilt only when something changes)."""

    def __init__(self) -> None:
        self.workers: dict[str, Worker] = {}
        self.healthy: tuple[Worker, ...] = ()

    def _rebuild(self) -> None:
        # Sorted by id so round robin and tie-breaks do not depend on registration order.
        self.healthy = tuple(w for _, w in sorted(self.workers.items()) if w.healthy)

    def apply(self, records: Mapping[str, WorkerRecord], alive: set[str]) -> PoolChanges:
        """Make the pool match one snapshot: the registered workers and the ids whose liveness key exists."""
        added: list[Worker] = []
        removed: list[tuple[Worker, str]] = []
        for worker_id, worker in list(self.workers.items()):
            record = records.get(worker_id)
            if record is None:
                reason = "deregistered"
            elif worker_id not in alive:
                reason = "heartbeat expired"
            elif record.url != worker.url:
                reason = f"re-registered at {record.url}"
            else:
                worker.record = record
                continue
            del self.workers[worker_id]
            removed.append((worker, reason))
        for worker_id, record in records.items():
            if worker_id in alive and worker_id not in self.workers:
                worker = Worker(record)
                self.workers[worker_id] = worker
                added.append(worker)
        if added or removed:
            self._rebuild()
        return PoolChanges(tuple(added), tuple(removed))

    def set_health(self, worker: Worker, ok: bool, error: str = "") -> str | None:
        """Record a health verdict; returns "admitted" or "evicted" when routability changed, else None."""
        worker.checked_at = time.time()
        if error:
            worker.last_error = error
        if self.workers.get(worker.id) is not worker or worker.healthy == ok:
            return None  # removed meanwhile, or no change
        worker.healthy = ok
        self._rebuild()
        return "admitted" if ok else "evicted"


class PoolSync:
    """Keeps a WorkerPool in step with Redis and with the workers' own /health answers."""

    def __init__(
        self,
        pool: WorkerPool,
        client: redis.asyncio.Redis,
        keys: Keys,
        session: aiohttp.ClientSession,
        health_interval_s: float = 1.0,
        health_timeout_s: float = 1.0,
        refresh_s: float = REFRESH_S,
    ) -> None:
        self.pool, self.client, self.keys, self.session = pool, client, keys, session
        self.health_interval_s, self.refresh_s = health_interval_s, refresh_s
        self.health_timeout = aiohttp.ClientTimeout(total=health_timeout_s)
        self._tasks: set[asyncio.Task[None]] = set()
        self._redis_error = ""
        self._running = False
        self._expiry = math.inf  # loop time by which the soonest liveness key expires if not refreshed

    async def start(self) -> None:
        """Read Redis once and health-check what it lists (so a fresh router can route at once), then
        keep both going in the background."""
        await self.refresh()
        await asyncio.gather(*(self.check(w) for w in list(self.pool.workers.values())))
        self._running = True
        self._spawn(self._refresh_loop(), "pool refresh")
        self._spawn(self._health_loop(), "pool health checks")

    async def stop(self) -> None:
        self._running = False
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            await cancel_and_join(task, 5.0, f"router task {task.get_name()}")

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            # A dead background task would silently freeze the pool: say so loudly.
            log.error(
                "router task %r died; the worker pool is no longer updated", task.get_name(), exc_info=task.exception()
            )

    async def refresh(self) -> PoolChanges:
        """Apply one snapshot of the workers hash and their liveness keys."""
        records = await read_records(self.client, self.keys.workers)
        # Read the clock before asking: Redis measures each TTL after this instant, so asked + ttl is never later
        # than the key's expiry, however late the answer reaches this task (a loaded host, a stalled event loop).
        # An early estimate only costs another refresh; a late one kept a dead worker routable that much longer.
        asked = asyncio.get_running_loop().time()
        ttls = await time_to_live(self.client, self.keys, records)
        self._expiry = min((asked + ttl for ttl in ttls.values()), default=math.inf)
        alive = set(ttls)
        changes = self.pool.apply(records, alive)
        for worker in changes.added:
            log.info("worker %s at %s registered; admitted once GET /health passes", worker.id, worker.url)
            if self._running:  # check it now instead of at the next health round
                self._spawn(self.check(worker), f"health {worker.id}")
        for worker, reason in changes.removed:
            log.info("worker %s at %s removed: %s", worker.id, worker.url, reason)
            if worker.attempts:
                self._spawn(self._abandon_if_unreachable(worker, reason), f"abandon {worker.id}")
            await announce(self.client, self.keys, "router", "worker_removed", worker=worker.id, reason=reason)
        return changes

    async def _health(self, worker: Worker) -> tuple[bool, str]:
        """One GET /health of one worker, with the short health timeout: (ok, why not)."""
        try:
            async with self.session.get(worker.url + "/health", timeout=self.health_timeout) as resp:
                await resp.read()
                return resp.status == 200, "" if resp.status == 200 else f"GET /health answered {resp.status}"
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            return False, f"GET /health failed: {describe(exc)}"

    async def check(self, worker: Worker) -> None:
        """Health-check one worker; the verdict goes to the pool."""
        await self.verdict(worker, *(await self._health(worker)))

    async def _abandon_if_unreachable(self, worker: Worker, reason: str) -> None:
        """A removed worker with requests waiting on it: when its server fails a health check too (a killed
        worker role can leave a server that accepted requests and will never answer them), give them up so
        the proxy retries them elsewhere. A server that still answers keeps them: a heartbeat can lapse
        under load while the server is fine."""
        if worker.healthy:
            ok, error = await self._health(worker)
            if ok:
                return
        else:
            error = worker.last_error or "its last health check failed"
        waiting = len(worker.attempts)
        worker.abandon(f"{reason}; {error}")
        log.warning(
            "worker %s at %s removed and unreachable (%s): %d request(s) waiting on it go to another worker",
            worker.id,
            worker.url,
            worker.gone,
            waiting,
        )

    async def verdict(self, worker: Worker, ok: bool, error: str) -> None:
        """Apply a health verdict (from a check, or a refused connection seen by the proxy) and log changes."""
        change = self.pool.set_health(worker, ok, error)
        if change == "admitted":
            log.info("worker %s at %s admitted (%d routable)", worker.id, worker.url, len(self.pool.healthy))
        elif change == "evicted":
            log.warning(
                "worker %s at %s evicted: %s (%d routable)", worker.id, worker.url, error, len(self.pool.healthy)
            )
            with contextlib.suppress(redis.ConnectionError, redis.TimeoutError):  # the eviction itself is done
                await announce(self.client, self.keys, "router", "worker_evicted", worker=worker.id, reason=error)

    async def _refresh_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            # Also wake just after the soonest liveness key would expire unrefreshed, so a dead
            # worker leaves the pool within its heartbeat TTL rather than up to refresh_s later.
            until_expiry = self._expiry - loop.time() + _EXPIRY_MARGIN_S
            await asyncio.sleep(max(0.0, min(self.refresh_s, until_expiry)))
            try:
                await self.refresh()
            except redis.RedisError as exc:
                # Keep routing to the last known pool; the health checks still evict dead workers.
                self._expiry = math.inf  # retry at the normal period, not in a tight loop
                if not self._redis_error:
                    log.warning("cannot read the worker pool from Redis (%s); keeping the last known pool", exc)
                self._redis_error = str(exc)
                continue
            if self._redis_error:
                log.info("reading the worker pool from Redis again")
                self._redis_error = ""

    async def _health_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            await asyncio.gather(*(self.check(w) for w in list(self.pool.workers.values())))
            await asyncio.sleep(max(0.0, self.health_interval_s - (loop.time() - started)))


def describe(exc: BaseException) -> str:
    """A one-line description of a transport error (some aiohttp errors have an empty str())."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
