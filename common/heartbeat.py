"""Liveness in Redis: a key with a TTL that a role (or a worker, or the router's name) keeps refreshing from
an asyncio task. The key's existence is the signal; a process that stops refreshing it is seen as dead
once the TTL runs out, so the TTL must cover at least two periods (one late beat is not a death)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import redis
import redis.asyncio

from common.aio import cancel_and_join
from common.redis_client import STOP_WRITE_S

log = logging.getLogger(__name__)


class Heartbeat:
    """Keeps one TTL key alive from an asyncio task; the key's existence is the liveness signal."""

    def __init__(
        self, client: redis.asyncio.Redis, key: str, value: str, period_s: float = 2.0, ttl_s: float = 10.0
    ) -> None:
        if ttl_s < 2 * period_s:
            raise ValueError(f"heartbeat ttl {ttl_s}s must be at least twice its period {period_s}s")
        self.client, self.key, self.value = client, key, value
        self.period_s, self.ttl_ms = period_s, int(ttl_s * 1000)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Set the key now (so liveness is visible at once), then refresh it every period."""
        await self.client.set(self.key, self.value, px=self.ttl_ms)
        self._task = asyncio.create_task(self._run(), name=f"heartbeat {self.key}")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            try:
                await self.client.set(self.key, self.value, px=self.ttl_ms)
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                # A Redis blip must not kill the role; if it lasts past the TTL, others see us as dead.
                log.warning("heartbeat %s failed: %s", self.key, exc)

    async def stop(self, delete: bool = True) -> None:
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_join(task, STOP_WRITE_S, f"heartbeat {self.key}")
        if delete:
            with contextlib.suppress(redis.ConnectionError, redis.TimeoutError, TimeoutError):
                async with asyncio.timeout(STOP_WRITE_S):
                    await self.client.delete(self.key)

    async def __aenter__(self) -> Heartbeat:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
