"""What the evaluator reads of the running experiment in Redis, and how it waits for that to change: the router's
URL (`wait_for_router`), whether an eval-pool worker is there (`choose_mode`, for evaluator.pin = "auto"), the
version the train fleet serves (`FleetProbe`, verify mode's version probe), and `StreamWait`, the blocking read
of the experiment's streams that every wait of the evaluator for a publish or a worker is made of. The
experiment records those changes as stream entries (`weights:log` for a publish; `events` for a publish, a
worker registered, deregistered or evicted, a role up or down), so a wait is a blocking XREAD, bounded so that
a change no entry marks (a liveness key expiring) is still seen and shutdown stays prompt. Left out: what is
done once a version is there (evaluator/role.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import aiohttp
import redis.asyncio
from redis.typing import KeyT, StreamIdT

from common.keys import Keys
from common.redis_client import entries, text
from common.weights.fleet import current_version, live_workers
from evaluator.runner import Snapshot

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 5.0
# The router's URL key is the one thing waited for that no stream entry marks: it is polled at this period.
ROUTER_POLL_S = 0.5
# XREAD BLOCK stays below the Redis client's socket timeout (5 s), so a quiet stream is not an error; it also
# bounds how late a change no entry marks (a liveness key expiring) is seen, and how long shutdown waits.
BLOCK_S = 2.0


class EvaluatorError(RuntimeError):
    """The evaluator cannot run: no router, served model or eval worker within the wait; the message says which."""


class StreamWait:
    """Waits for the next entry of Redis streams with a blocking XREAD from where they stood at `start`.

    The caller starts it before it reads the state it waits on, reads, and then waits: an entry added after the
    read comes after the start, so it always wakes the wait (nothing is missed). A wake is a hint, not an answer:
    the caller reads its state again after every one, including a block that ended without an entry (BLOCK_S),
    which is how a change no entry marks (a liveness key expiring) is seen.
    """

    def __init__(self, client: redis.asyncio.Redis, *streams: str) -> None:
        self.client = client
        self.ids: dict[KeyT, StreamIdT] = dict.fromkeys(streams, "0-0")

    async def start(self) -> StreamWait:
        """Position at each stream's newest entry: only entries added from now on wake `wait`."""
        for key in self.ids:
            for entry_id, _ in entries(await self.client.xrevrange(key, count=1)):
                self.ids[key] = entry_id
        return self

    async def wait(self, timeout_s: float = BLOCK_S) -> None:
        """Return once an entry follows the position (which then moves past it), or after min(timeout_s,
        BLOCK_S) without one."""
        block_ms = max(1, int(min(timeout_s, BLOCK_S) * 1000))  # BLOCK 0 would wait forever
        reply = await self.client.xread(self.ids, block=block_ms)
        assert not isinstance(reply, dict), "our clients speak RESP2: [[stream, [(id, fields), ...]], ...] or None"
        for stream, got in reply or []:
            self.ids[text(stream)] = text(got[-1][0])


@dataclass(frozen=True)
class FleetSnapshot(Snapshot):
    settled: bool = True


class FleetProbe:
    """What the fleet serves: `weights:current` and each live worker's /weight_info."""

    def __init__(self, client: redis.asyncio.Redis, keys: Keys, session: aiohttp.ClientSession) -> None:
        self.client, self.keys, self.session = client, keys, session

    async def _served(self, url: str) -> str:
        try:
            async with self.session.get(
                url.rstrip("/") + "/weight_info", timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
            ) as r:
                if r.status != 200:
                    return f"unreadable (HTTP {r.status})"
                return str((await r.json())["weight_version"])
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as exc:
            return f"unreadable ({type(exc).__name__})"

    async def read(self) -> FleetSnapshot:
        version = await current_version(self.client, self.keys)
        current = "0" if version is None else str(version)
        workers = await live_workers(self.client, self.keys)
        served = await asyncio.gather(*(self._served(url) for url in workers.values()))
        detail = tuple(zip(workers, served, strict=True))
        settled = bool(detail) and all(v == current for v in served)
        return FleetSnapshot(current, detail, settled)


async def wait_for_router(client: redis.asyncio.Redis, keys: Keys, name: str, timeout_s: float) -> str:
    """The router's URL from Redis, waiting up to timeout_s for it to appear."""
    deadline = time.monotonic() + timeout_s
    key = keys.router(name)
    logged = False
    while True:
        url = await client.get(key)
        if url:
            return text(url)
        if time.monotonic() > deadline:
            raise EvaluatorError(
                f"no router {name!r} registered under Redis key {key} after {timeout_s:.0f}s; start the router role "
                "(or raise evaluator.router_wait_s)"
            )
        if not logged:
            log.info("waiting for router %r (Redis key %s, up to %.0fs)", name, key, timeout_s)
            logged = True
        # No stream says when this key appears: the router claims it (SET NX) after its role's "up" event,
        # and nothing is recorded after the claim. So this one wait polls.
        await asyncio.sleep(ROUTER_POLL_S)


async def starting_workers(client: redis.asyncio.Redis, keys: Keys) -> list[str]:
    """Instances of ROLE=vllm processes that are alive (role liveness key) but registered in neither pool yet."""
    prefix, suffix = keys.role_pattern("vllm").split("*")
    instances = [key[len(prefix) : -len(suffix)] async for key in client.scan_iter(match=keys.role_pattern("vllm"))]
    registered = set(await client.hkeys(keys.workers)) | set(await client.hkeys(keys.eval_workers))
    return sorted(i for i in instances if i not in registered)


async def choose_mode(client: redis.asyncio.Redis, keys: Keys, timeout_s: float) -> str:
    """evaluator.pin = "auto": "pin" if an eval-pool worker is live, "verify" once every started vLLM worker has
    registered in the train pool (or timeout_s has passed with some still starting); the choice is logged."""
    deadline = time.monotonic() + timeout_s
    logged = False
    # Woken by the events of a vLLM role coming up, a worker registering, or one going down.
    events = await StreamWait(client, keys.events).start()
    while True:
        # Starting workers first, the eval pool second: a worker that registers between the two reads
        # is then seen in the pool; in the other order it would be seen in neither.
        starting = await starting_workers(client, keys)
        pinned = await live_workers(client, keys, keys.eval_workers)
        if pinned:
            log.info(
                "evaluator.pin = auto: eval-pool worker(s) %s registered; pinning each version on one of them",
                sorted(pinned),
            )
            return "pin"
        if not starting:
            log.info(
                "evaluator.pin = auto: no eval-pool worker (every vLLM worker is in the train pool); verifying "
                "each version through the router"
            )
            return "verify"
        if time.monotonic() > deadline:
            log.warning(
                "evaluator.pin = auto: vLLM worker(s) %s still not registered after %.0fs and no eval-pool "
                "worker; verifying each version through the router",
                starting,
                timeout_s,
            )
            return "verify"
        if not logged:
            log.info(
                "evaluator.pin = auto: waiting for starting vLLM worker(s) %s to register (one may be an "
                "eval-pool worker)",
                starting,
            )
            logged = True
        await events.wait(deadline - time.monotonic())
