"""Rendezvous: every process of an experiment finds the one Redis through the shared meet directory.

The first process to create the generation's lock file with O_EXCL is the leader: it starts
`redis-server` (loopback by default, a free port, a random password, an append-only file in the meet
dir) and writes `redis.json` atomically (mode 0600). Everyone else waits for that file and connects. A
file that points at a dead server (connection refused and, on the same host, a dead pid) starts the
next generation's election, so exactly one process replaces a dead Redis. The leader stops its server
when it exits; the server also dies with the leader (PR_SET_PDEATHSIG), so nothing outlives a run.

A server that dies under a live leader (killed, OOM) is started again by the leader at once, on the same
port with the same password, from its append-only file (common/redis_server.py: the server process).
Clients retry a lost connection for about REDIS_RETRY_S, so every role rides through the restart without
noticing more than a slow command (common/redis_client.py: the record in redis.json and its clients).
The TTL liveness keys every role keeps alive are common/heartbeat.py's.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import socket
import time
from pathlib import Path

import psutil
import redis
import redis.asyncio

from common.config import RendezvousConfig
from common.net import refuses
from common.redis_client import POLL_S, RedisInfo, RendezvousError, read_json
from common.redis_server import RedisServer

log = logging.getLogger(__name__)


def _lock_path(meet: Path, generation: int) -> Path:
    return meet / ("redis.lock" if generation == 1 else f"redis.lock.{generation}")


def _pid_dead(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


class Rendezvous:
    """Connects this process to the experiment's Redis, electing and starting it when needed."""

    def __init__(self, meet_dir: str | os.PathLike[str], cfg: RendezvousConfig | None = None) -> None:
        self.meet = Path(meet_dir)
        self.cfg = cfg or RendezvousConfig()
        self._info: RedisInfo | None = None
        self._server: RedisServer | None = None

    @property
    def is_leader(self) -> bool:
        return self._server is not None

    @property
    def info(self) -> RedisInfo | None:
        """Where the experiment's Redis is, once connected (the leader's follows its server's restarts)."""
        return self._server.info if self._server is not None else self._info

    # -- public ------------------------------------------------------------------------------

    def connect(self, timeout_s: float | None = None, elect: bool = True) -> redis.Redis:
        """Return a client of the experiment's Redis, starting it if this process wins the election
        (`elect=False`: never start it, only wait for one)."""
        self._prepare_meet_dir()
        deadline = time.monotonic() + (self.cfg.wait_timeout_s if timeout_s is None else timeout_s)
        generation = 1
        last_state = "no redis.json yet"
        while True:
            data = read_json(self.meet / "redis.json")
            if data is not None:
                info = RedisInfo(**data)
                state = self._probe(info)
                if state == "ok":
                    self._info = info
                    return info.client()
                last_state = f"redis.json generation {info.generation} points at a {state} server"
                if state == "dead":
                    generation = max(generation, info.generation + 1)
            if elect and (data is None or generation > data.get("generation", 0)):
                outcome = self._try_elect(generation)
                if outcome == "won":
                    assert self.info is not None
                    return self.info.client()
                if outcome == "failed":
                    generation += 1
                    continue
            if time.monotonic() > deadline:
                raise RendezvousError(
                    f"no Redis in meet dir {self.meet} after waiting: {last_state}. Is the leader still "
                    f"starting? Check {self.meet}/redis.log, or remove {self.meet} if the run is over."
                )
            time.sleep(POLL_S)

    def live_server(self) -> RedisInfo | None:
        """The experiment's Redis named in the meet dir if it answers (the run is alive), else None."""
        data = read_json(self.meet / "redis.json")
        if data is None:
            return None
        info = RedisInfo(**data)
        return info if self._probe(info) == "ok" else None

    def async_client(self) -> redis.asyncio.Redis:
        if self.info is None:
            raise RendezvousError("Rendezvous.async_client() called before connect()")
        return self.info.async_client()

    def close(self) -> None:
        """Stop the Redis server if this process started it (idempotent), once the other processes
        connected to it have gone or `leader_linger_s` has passed."""
        server, self._server = self._server, None
        if server is not None:
            self._info = server.info
            server.stop()

    # -- internals ---------------------------------------------------------------------------

    def _prepare_meet_dir(self) -> None:
        self.meet.mkdir(parents=True, exist_ok=True, mode=0o700)
        if self.meet.stat().st_uid == os.getuid():
            os.chmod(self.meet, 0o700)

    def _probe(self, info: RedisInfo) -> str:
        """'ok' if the server answers PING with our password, 'dead' if provably gone, else 'unreachable'."""
        if info.stopped:
            return "dead"
        try:
            with contextlib.closing(info.client(timeout_s=2.0, retry=False)) as client:
                client.ping()
            return "ok"
        except redis.AuthenticationError as exc:
            raise RendezvousError(
                f"the Redis at {info.host}:{info.port} named in {self.meet}/redis.json rejects its password "
                f"({exc}); another server took the port. Remove {self.meet}/redis.json to re-elect."
            ) from None
        except (redis.ConnectionError, redis.TimeoutError):
            pass
        if not refuses(info.host, info.port):
            return "unreachable"
        if info.hostname == socket.gethostname() and not _pid_dead(info.pid):
            return "unreachable"
        return "dead"

    def _try_elect(self, generation: int) -> str:
        """'won' (this process now runs Redis), 'failed' (that generation's leader died), or 'wait'."""
        lock = _lock_path(self.meet, generation)
        try:
            fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            owner = read_json(lock)
            if owner and owner["hostname"] == socket.gethostname() and _pid_dead(owner["pid"]):
                return "failed"
            return "wait"
        with os.fdopen(fd, "w") as fh:
            json.dump({"pid": os.getpid(), "hostname": socket.gethostname(), "ts": time.time()}, fh)
        server = RedisServer(self.meet, self.cfg)
        server.start(generation)
        self._server = server
        atexit.register(self.close)
        return "won"
