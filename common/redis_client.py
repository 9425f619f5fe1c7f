"""Reaching the experiment's Redis: the record the rendezvous leader writes to the meet dir's redis.json
(`RedisInfo`: where the server is, its password, who started it) and the clients made from it. Every client
retries a lost connection for about REDIS_RETRY_S, so a role rides through a restart of the server (see
common/redis_server.py); the asyncio clients keep their task's cancel (`CancelKeepingConnection`). Finding
the record, and starting the server when nobody has, is common/rendezvous.py's.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
import redis.asyncio
import redis.asyncio.retry
from redis.backoff import ExponentialBackoff
from redis.retry import Retry
from redis.typing import StreamRangeResponse

# The meet dir may be a shared filesystem where inotify sees nothing, so waiting for another
# process's file is a short poll; this is its period.
POLL_S = 0.05
# How long a client keeps retrying a lost connection (a restarted server is back well within it).
REDIS_RETRY_S = 8.0
# A stopping process's best-effort Redis writes (deregistering, its "down" event, deleting its liveness key)
# give up after this, each: when Redis went with the launcher that ran it, a stop must not wait out the retries.
STOP_WRITE_S = 2.0
_BACKOFF_CAP_S = 0.5
_RETRIES = int(REDIS_RETRY_S / _BACKOFF_CAP_S) + 5


def _backoff() -> ExponentialBackoff:
    return ExponentialBackoff(cap=_BACKOFF_CAP_S, base=0.02)


def text(reply: bytes | str) -> str:
    """A Redis reply as text: our clients decode replies (`decode_responses`), which redis-py's types cannot
    know, so they say bytes | str."""
    return reply.decode() if isinstance(reply, bytes) else reply


def entries(reply: StreamRangeResponse | None) -> list[tuple[str, dict[str, str]]]:
    """An XRANGE / XREVRANGE reply (or one stream's entries in an XREAD reply) as (id, fields) text."""
    return [(text(i or ""), {text(k): text(v) for k, v in (f or {}).items()}) for i, f in reply or []]


class RendezvousError(RuntimeError):
    """Redis could not be found or started; the message says what was tried and what to do."""


@dataclass(frozen=True)
class RedisInfo:
    """What redis.json holds: where the experiment's Redis is and who started it."""

    host: str
    port: int
    password: str
    pid: int
    hostname: str
    started_at: float
    generation: int
    stopped: bool = False

    def _options(self, timeout_s: float) -> dict[str, Any]:
        """Where the server is and how long to wait for it: the same for the sync and the async client."""
        return {
            "host": self.host,
            "port": self.port,
            "password": self.password,
            "socket_connect_timeout": timeout_s,
            "socket_timeout": timeout_s,
            "decode_responses": True,
        }

    def client(self, timeout_s: float = 5.0, retry: bool = True) -> redis.Redis:
        """A client that retries a lost connection for about REDIS_RETRY_S (`retry=False`: fails at once,
        for probes that ask whether the server is there)."""
        return redis.Redis(**self._options(timeout_s), retry=Retry(_backoff(), _RETRIES if retry else 0))

    def async_client(self, timeout_s: float = 5.0) -> redis.asyncio.Redis:
        """The asyncio twin of `client`, with the same retries, on connections that keep their task's cancel."""
        client = redis.asyncio.Redis(**self._options(timeout_s), retry=redis.asyncio.retry.Retry(_backoff(), _RETRIES))
        client.connection_pool.connection_class = CancelKeepingConnection  # the pool has made no connection yet
        return client


class CancelKeepingConnection(redis.asyncio.Connection):
    """A connection that does not lose its task's cancel. With a socket timeout, redis-py writes each command
    under `asyncio.wait_for`, and Python 3.11's wait_for drops a cancel that arrives as the write finishes
    (CPython gh-86296): the task then ran on as if never cancelled (a role that ignored its SIGTERM, a trainer
    rank that never ended; bench/RESULTS.md). A cancel asked for during the write that did not come out of it
    is raised here, after closing the connection, whose reply is then never read (as redis-py does for a
    cancel it lets through)."""

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        task = asyncio.current_task()
        asked = task.cancelling() if task is not None else 0
        await super().send_packed_command(command, check_health)
        if task is not None and task.cancelling() > asked:
            await self.disconnect(nowait=True)
            raise asyncio.CancelledError


def write_atomic(path: Path, text: str) -> None:
    """Replace `path` with `text` in one step, readable by its owner only (the meet dir's files hold the password)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def read_json(path: Path) -> dict | None:
    """A meet dir's JSON file, or None while it is absent or half-written."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError:
        return None  # a lock file being written right now; redis.json is always replaced atomically
